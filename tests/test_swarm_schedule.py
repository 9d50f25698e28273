"""What the swarm's clock and round schedule decide in-process (no DHT, no processes): the learning-rate
schedule every peer follows, when a round's matchmaking begins, when it is given up, what happens to the run's
last steps and to a state downloaded to get back in step."""

from __future__ import annotations

import time

import pytest
import torch

from tscale_p2p.config import TrainConfig
from tscale_p2p.data import load_corpus
from tscale_p2p.model import ModelConfig
from tscale_p2p.peers.progress import Progress, RoundClock
from tscale_p2p.peers.schedule import (
    PAIR_PATIENCE, LastSteps, Resync, RoundSchedule, group_consensus, resync_plan,
)
from tscale_p2p.trainer import Trainer

H = 10


def clock_seeing(*others: Progress) -> RoundClock:
    clock = RoundClock(dht=None, run_id="schedule", peer_id="me", inner_steps=H)
    clock.observe(list(others))
    return clock


def test_fast_slow_and_late_peers_follow_one_schedule_set_by_the_swarms_progress():
    """Three peers in round 3 (they have ended 3 rounds): a fast one 8 steps in, a slow one 2 steps in, and one
    that has just downloaded the state. Each sees the others' published progress, and all stand at the same
    place in the schedule, 3 x H + the mean of their steps in the round, whatever their own step counters say."""
    now = time.time()
    fast, slow, joiner = Progress(3, 8, 0.0, now), Progress(3, 2, 0.0, now), Progress(3, 0, 0.0, now)
    places = [
        clock_seeing(slow, joiner).schedule_step(0, 3, 8),
        clock_seeing(fast, joiner).schedule_step(0, 3, 2),
        clock_seeing(fast, slow).schedule_step(0, 3, 0),
    ]
    assert places == [33, 33, 33]  # 30 + (8 + 2 + 0) / 3
    # A run started from a checkpoint at step 500 (--init-from) carries on that schedule.
    assert clock_seeing(slow, joiner).schedule_step(500, 3, 8) == 533
    # Alone, a peer's place is its own progress: H per round ended plus its steps in this one ...
    assert clock_seeing().schedule_step(0, 3, 4) == 34
    # ... and a round that lasts longer than H steps (the last average is late) holds the schedule at the round's
    # end instead of running ahead of the rounds the swarm has made.
    assert clock_seeing().schedule_step(0, 3, 25) == 40
    # A peer that finds most of the swarm a round ahead (it is late) stands at that round's end too.
    ahead = Progress(4, 1, 0.0, now)
    assert clock_seeing(ahead, ahead).schedule_step(0, 3, 1) == 40


def test_the_trainer_takes_its_learning_rate_from_the_schedule_step_when_one_is_set(corpus, tmp_path):
    cfg = TrainConfig(data=str(corpus), out=str(tmp_path / "run"), device="cpu", batch_size=2, steps=100,
                      warmup=10, lr=1e-2)
    trainer = Trainer(ModelConfig.from_dims("e32h2d1w32"), cfg, load_corpus(str(corpus)), torch.device("cpu"))
    assert trainer.local_step().lr == trainer.lr_at(0)  # a solo run: its own step
    trainer.schedule_step = 60
    stats = trainer.local_step()
    assert stats.lr == trainer.lr_at(60) != trainer.lr_at(1) and stats.step == 2  # the count itself is its own


def test_next_averaging_is_due_when_the_swarm_ends_the_round_not_after_this_peers_own_h_steps():
    """A slow peer 2 steps into a round of H = 10 (1 step/s) beside two fast ones 8 steps in (4 steps/s each):
    the swarm's 30 steps are 12 short at 9 steps/s, so the round ends in 1.3 s, not in the 8 s this peer alone
    would take for its remaining 8 steps (the dashboard's 'next avg' used to say the latter)."""
    now = time.time()
    schedule = RoundSchedule(clock_seeing(Progress(3, 8, 4.0, now), Progress(3, 8, 4.0, now)), matchmaking_time=5.0)
    assert schedule.seconds_to_round_end(3, 2, steps_per_s=1.0) == pytest.approx(12 / 9, rel=0.05)
    idle = RoundSchedule(clock_seeing(Progress(3, 8, 0.0, now)), matchmaking_time=5.0)
    assert idle.seconds_to_round_end(3, 2, steps_per_s=0.0) is None  # nobody trains: no estimate


def test_matchmaking_begins_one_window_before_the_rounds_end_and_expects_every_live_peer():
    now = time.time()
    schedule = RoundSchedule(clock_seeing(Progress(3, 4, 1.0, now)), matchmaking_time=2.0)
    # 20 steps to make, 4 + 4 made, 2 steps/s together: 6 s to go, then 1.5 s; a short round (2 s in all) never
    assert schedule.matchmaking_lead(3, 4, steps_per_s=1.0, round_s=10.0) is None
    assert schedule.matchmaking_lead(3, 13, steps_per_s=1.0, round_s=10.0) == pytest.approx(1.5, rel=0.05)
    assert schedule.matchmaking_lead(3, 13, steps_per_s=1.0, round_s=0.4) is None
    # The group expected: both live peers, once rounds last two record periods; else the window gathers them.
    assert schedule.group_size(round_s=2.0) == 2 and schedule.group_size(round_s=1.9) is None
    assert RoundSchedule(clock_seeing(), matchmaking_time=2.0).group_size(round_s=60.0) is None  # alone


def test_a_first_rounds_group_waits_one_record_period_past_its_expected_end_for_a_peer_that_started_later():
    """Peers started together read each other's first records up to a period apart: a leader closing its first group
    at its own estimate of the round's end left out a peer whose round ended a quarter second later (it then averaged
    out of step). Later rounds do not wait: a group that never completes would wait the extra period every round."""
    now = time.time()
    clock = clock_seeing(Progress(3, 4, 1.0, now))
    clock.update(3, 13, 1.0)
    schedule = RoundSchedule(clock, matchmaking_time=2.0)
    lead = schedule.matchmaking_lead(3, 13, steps_per_s=1.0, round_s=10.0)
    assert clock.every_s > 0 and schedule.group_deadline(3, lead) == pytest.approx(lead + clock.every_s)
    assert schedule.group_deadline(4, lead) == pytest.approx(lead)


def test_a_peer_that_stops_before_the_rounds_end_says_its_group_begins_a_wait_after_it_stops():
    """A leader's group begins, full or not, once the time its leader said has passed; the round's end moves later as
    peers run out of steps. So a peer out of its own steps before the round's expected end says the end of its wait
    for it (leaving in 1 s, waiting up to 30 s: 31 s), not the end it expects; one that trains to the end says that
    end."""
    clock = clock_seeing(Progress(3, 4, 1.0, time.time()))
    clock.update(3, 13, 1.0)  # not its first round, which would wait a record period more
    schedule = RoundSchedule(clock, matchmaking_time=2.0)
    assert schedule.group_deadline(4, 1.5, leaves_in_s=1.0, wait_s=30.0) == pytest.approx(31.0)
    assert schedule.group_deadline(4, 1.5, leaves_in_s=0.0, wait_s=30.0) == pytest.approx(30.0)  # out of steps now
    assert schedule.group_deadline(4, 1.5, leaves_in_s=2.0, wait_s=30.0) == pytest.approx(1.5)
    assert schedule.group_deadline(4, 1.5, leaves_in_s=None, wait_s=30.0) == pytest.approx(1.5)


def test_a_banned_peers_records_neither_hold_a_round_back_nor_count_in_its_group():
    """Its groups refuse a banned peer, so a round that expected it would wait out the window every time."""
    now = time.time()
    honest, banned = Progress(3, 4, 1.0, now, "honest"), Progress(3, 0, 0.0, now, "banned")
    clock = clock_seeing(honest, banned)
    schedule = RoundSchedule(clock, matchmaking_time=2.0)
    assert schedule.group_size(round_s=10.0) == 3 and not clock.round_done(3, 16)
    clock.leave_out(["banned"])
    assert schedule.group_size(round_s=10.0) == 2 and clock.round_done(3, 16)  # 16 + 4 steps: H each
    clock.observe([honest, banned])  # its next records are left out too
    assert schedule.group_size(round_s=10.0) == 2


def test_with_three_live_peers_a_pair_is_taken_only_with_a_peer_averaged_with_before():
    """A pair has no majority: with three or more live a round waits for a larger group, unless its partner is
    one this peer has averaged with (and not caught since), or it has gone PAIR_PATIENCE rounds without any."""
    now = time.time()
    three = RoundSchedule(clock_seeing(Progress(3, 4, 1.0, now, "b"), Progress(3, 4, 1.0, now, "c")), 2.0)
    assert three.pair_partners(set(), set(), rounds_alone=0) == frozenset()
    assert three.pair_partners({"b", "c"}, {"c"}, rounds_alone=PAIR_PATIENCE - 1) == {"b"}
    assert three.pair_partners({"b"}, set(), rounds_alone=PAIR_PATIENCE) is None
    two = RoundSchedule(clock_seeing(Progress(3, 4, 1.0, now, "b")), 2.0)
    assert two.pair_partners(set(), set(), rounds_alone=0) is None  # a pair is all there is


def test_peers_seen_live_before_training_count_until_the_first_average():
    """Peers started together (`join --min-peers`) publish their round clocks' first records as they start: a
    peer's first round may be formed before its clock has read any. The peers `join` saw live before training
    count meanwhile, so that round takes no pair with a stranger (an attacker paired so poisoned a 3 + 1 swarm,
    benchmarks/RESULTS.md); once this peer has averaged, its clock tells."""
    blind = RoundSchedule(clock_seeing(), 2.0)
    blind.clock.update(0, 1, 1.0)
    assert blind.pair_partners(set(), set(), rounds_alone=0) is None
    blind.clock.live_at_start = 4
    assert blind.pair_partners(set(), set(), rounds_alone=0) == frozenset()
    blind.clock.update(1, 0, 1.0)  # its first round is over, averaged with b
    assert blind.pair_partners({"b"}, set(), rounds_alone=0) is None  # the clock sees one peer: a pair is all
    assert blind.pair_partners(set(), set(), rounds_alone=PAIR_PATIENCE) is None


def test_a_first_round_counts_the_peers_seen_live_before_training_though_their_records_are_not_read_yet():
    """4 peers started together, one a second later than the others: in their first round the early ones had not
    read its progress record yet, ended the round at 3 x H steps and began their group without it (it then averaged
    out of step and downloaded the state). The peers `join` saw live before training count in that round; from
    the next one the records alone tell."""
    now = time.time()
    clock = clock_seeing(Progress(0, 10, 1.0, now, "b"), Progress(0, 10, 1.0, now, "c"))
    clock.live_at_start = 4
    clock.update(0, 10, 1.0)
    schedule = RoundSchedule(clock, matchmaking_time=2.0)
    assert not schedule.round_ends(0, 10) and schedule.group_size(round_s=10.0) == 4  # 30 steps of 4 x H = 40
    assert schedule.round_ends(0, 20)
    clock.update(1, 0, 1.0)
    clock.observe([Progress(1, 10, 1.0, now, "b"), Progress(1, 10, 1.0, now, "c")])
    assert schedule.round_ends(1, 10) and schedule.group_size(round_s=10.0) == 3


def test_a_first_round_expects_every_peer_seen_live_before_training_though_it_confirmed_its_states_donor():
    """The donor of a joiner's state counts as confirmed, and then at most NEWCOMERS unconfirmed peers are expected
    on top: 4 of a swarm of 5 started together, whose first group began without the fifth."""
    now = time.time()
    clock = clock_seeing(*(Progress(0, 10, 1.0, now, peer) for peer in "bcde"))
    clock.confirm(["b"])
    clock.update(0, 10, 1.0)
    schedule = RoundSchedule(clock, matchmaking_time=2.0)
    assert schedule.group_size(round_s=10.0) == 4  # 1 + 1 confirmed + 2 newcomers
    clock.live_at_start = 5
    assert schedule.group_size(round_s=10.0) == 5
    clock.update(1, 0, 1.0)
    assert schedule.group_size(round_s=10.0) == 4  # from its second round the records alone tell


def test_a_peer_is_alone_only_once_no_other_peer_has_been_seen_for_a_records_lifetime(monkeypatch):
    """An opening round a peer alone takes at once, unaveraged (peers/swarm.py): a DHT read that comes back empty
    once must not make a peer of a swarm take one so, out of step with its group."""
    clock = clock_seeing()
    clock.update(0, 1, 1.0)
    assert clock.alone()  # a founder nobody has joined
    clock.observe([Progress(0, 1, 1.0, time.time(), "b")])
    assert not clock.alone()
    clock.observe([])  # a read that found nothing
    assert not clock.alone()
    later = time.time() + 3 * clock.every_s + 6  # the last record seen has expired by then
    monkeypatch.setattr(time, "time", lambda: later)
    assert clock.alone()
    clock.live_at_start = 2  # in its first round, the peers join saw live before training count
    assert not clock.alone()


def test_a_peer_that_has_just_averaged_with_others_is_not_alone_whatever_its_clock_has_read():
    """Under load a peer's first DHT reads can lag its first rounds: one that had averaged its first opening
    round with two peers, but read no record yet, took its second as alone and fell out of step with them."""
    clock = clock_seeing()
    clock.update(1, 3, 1.0)  # past its first round: `live_at_start` no longer counts
    assert clock.alone()
    clock.confirm(["me", ""])  # neither itself nor an unknown donor is another peer
    assert clock.alone()
    clock.confirm(["b", "c"])  # the group of its last round
    assert not clock.alone()


def test_a_round_is_given_up_after_two_windows_only_when_nobody_else_trains_towards_it():
    now = time.time()
    assert RoundSchedule(clock_seeing(), matchmaking_time=1.5).give_up_after(4) == 3.0
    assert RoundSchedule(clock_seeing(Progress(4, 2, 0.0, now)), 1.5).give_up_after(4) == 3.0  # it has stopped
    assert RoundSchedule(clock_seeing(Progress(3, 9, 2.0, now)), 1.5).give_up_after(4) is None  # on its way
    assert RoundSchedule(clock_seeing(Progress(4, 2, 2.0, now)), 1.5).give_up_after(4) is None


def test_the_runs_last_steps_wait_for_the_swarm_then_are_averaged_or_kept_local():
    now = time.time()
    training = RoundSchedule(clock_seeing(Progress(3, 3, 2.0, now)), matchmaking_time=1.0)
    assert training.last_steps(3, 2, now, timed_out=False) is LastSteps.WAIT
    assert training.last_steps(3, 2, now, timed_out=True) is LastSteps.AVERAGE  # waited the averaging timeout
    stopped = RoundSchedule(clock_seeing(Progress(3, 7, 0.0, now)), matchmaking_time=1.0)
    assert stopped.last_steps(3, 2, now, timed_out=False) is LastSteps.KEEP_LOCAL  # 9 of the H = 10 steps
    assert stopped.last_steps(3, 3, now, timed_out=False) is LastSteps.AVERAGE
    done = RoundSchedule(clock_seeing(Progress(3, 12, 0.0, now)), matchmaking_time=1.0)
    assert done.last_steps(3, 8, now, timed_out=False) is LastSteps.AVERAGE  # the swarm ended the round
    assert RoundSchedule(clock_seeing(), 1.0).last_steps(3, 4, now, timed_out=False) is LastSteps.KEEP_LOCAL


def test_group_consensus_is_the_majority_base_and_the_same_for_every_member():
    base = lambda r, w: {"round": r, "weights": w}  # noqa: E731
    assert group_consensus([base(4, "bb"), base(4, "bb"), base(4, "aa")]) == (4, "bb")
    assert group_consensus([base(3, "aa"), base(4, "bb")]) == (4, "bb")  # a joiner one round behind yields
    assert group_consensus([base(4, "bb"), base(4, "aa")]) == (4, "aa")
    assert group_consensus([base(4, "bb"), None, {"round": "4", "weights": "aa"}]) == (4, "bb")
    assert group_consensus([None, {}]) is None


def test_a_downloaded_state_is_adopted_stepped_or_refused_by_where_it_stands_against_the_groups_base():
    group = (4, "bb")
    assert resync_plan(group, {"round": 5, "weights": "cc"}) is Resync.ADOPT  # it has applied the round
    assert resync_plan(group, {"round": 4, "weights": "bb"}) is Resync.ADOPT_AND_STEP  # not yet
    assert resync_plan(group, {"round": 4, "weights": "aa"}) is Resync.STAY  # another history
    assert resync_plan(group, {"round": 3, "weights": "bb"}) is Resync.STAY  # behind
    assert resync_plan(group, None) is Resync.STAY and resync_plan(group, {"round": "5"}) is Resync.STAY
