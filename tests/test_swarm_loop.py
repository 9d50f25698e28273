"""`SwarmPeer`'s loop in-process: give-up, drain, resync and the saved state, in milliseconds.

Real trainer, outer optimizer, round clock and checkpoints; the averager is a scripted `RoundAverager` (the
interface peers/swarm.py defines) whose rounds end as each test says, and the clock reads no DHT: the test sets
the other peers' progress. tests/test_swarm.py runs the same loop end to end over hivemind.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import re
import threading
import time

import pytest
import torch

from tscale_p2p.checkpoint import find_latest, resume_from
from tscale_p2p.config import TrainConfig
from tscale_p2p.data import load_corpus
from tscale_p2p.model import ModelConfig
from tscale_p2p.peers.averaging import RoundOutcome
from tscale_p2p.peers.outer import OuterOptimizer
from tscale_p2p.peers.progress import Progress, RoundClock
from tscale_p2p.peers.run_config import RunConfig
from tscale_p2p.peers.schedule import PAIR_PATIENCE
from tscale_p2p.peers.settings import OPENING_RESIDUAL_CARRY
from tscale_p2p.peers.status import LocalStatus
from tscale_p2p.peers.swarm import SwarmIdentity, SwarmPeer
from tscale_p2p.peers.swarm_state import SWARM_STATE_FILE, SwarmState, fingerprint, read_state_file
from tscale_p2p.tokenizer import tokenizer_id
from tscale_p2p.trainer import Trainer

H = 4
MATCHMAKING_S = 0.0  # a lone round is given up at the first step after it ends
LR, MOMENTUM = 1.0, 0.5


class QuietClock(RoundClock):
    """A `RoundClock` that publishes and reads nothing: the test tells it the others' progress (`observe`)."""

    def __init__(self, **opening) -> None:
        super().__init__(dht=None, run_id="loop", peer_id="me", inner_steps=H, **opening)

    def start(self) -> None:
        pass

    def stop(self) -> None:
        pass


class ScriptedRound:
    """A round in the background. `outcome` None: it finds no group until it is given up; else it is done once
    `done()` has been asked `polls` more times."""

    def __init__(self, outcome: RoundOutcome | None = None, polls: int = 0) -> None:
        self.outcome, self.polls = outcome, polls
        self.patience: list[float] = []  # what give_up_if_alone was asked with

    def done(self) -> bool:
        if self.outcome is None:
            return False
        self.polls -= 1
        return self.polls < 0

    def give_up_if_alone(self, after_s: float) -> bool:
        self.patience.append(after_s)
        if self.outcome is not None:
            return False
        self.outcome = RoundOutcome(None, 1, 0.0, 0, 0, 0.0, error="nobody else looking for a group")
        return True

    def result(self, timeout=None) -> RoundOutcome:
        assert self.outcome is not None, "result() of a round that can never end"
        return self.outcome


class ScriptedAverager:
    """A `RoundAverager` whose round k is `rounds(k, pseudo_gradient, metadata)` and whose state download is
    `donor()`. Shares nothing (the DHT is not there)."""

    client_mode, allow_state_sharing = False, False

    def __init__(self, rounds, donor=None, banned=None, caught=()) -> None:
        self.rounds, self.donor = rounds, donor
        self.banned = dict(banned or {})  # peer id -> why, as SwarmAverager.banned_peers()
        self.caught = set(caught)  # peers rejected once, not banned
        self.disputed: set[str] = set()  # as SwarmAverager.heed_partners_bans() was told
        self.heeded: list[dict[str, int]] = []  # each call's rounds_ago
        self.matchmaking_time, self.round_timeout = MATCHMAKING_S, 5.0
        self.state_sharing_priority = 0.0
        self.round_scheduled = False
        self.scheduled: list[tuple[float, int | None]] = []  # (seconds_to_start, group_size) of each schedule_round
        self.on_schedule = lambda: None
        self.started: list[tuple[list[torch.Tensor], dict]] = []  # (pseudo-gradient, metadata) of each round
        self.pair_partners: list = []  # each round's pair_partners
        self.residual_carries: list = []  # each round's residual_carry
        self.downloads = 0

    def schedule_round(self, seconds_to_start, tokens, metadata=None, group_size=None, pair_partners=None) -> None:
        assert tokens > 0
        self.round_scheduled = True
        self.scheduled.append((seconds_to_start, group_size))
        self.on_schedule()

    def cancel_scheduled_round(self) -> None:
        self.round_scheduled = False

    def start_round(self, pseudo_gradient, tokens, metadata=None, group_size=None, pair_partners=None,
                    residual_carry=None) -> ScriptedRound:
        assert tokens > 0
        self.round_scheduled = False
        self.started.append(([t.clone() for t in pseudo_gradient], metadata))
        self.pair_partners.append(pair_partners)
        self.residual_carries.append(residual_carry)
        return self.rounds(len(self.started), pseudo_gradient, metadata)

    def load_state_from_peers(self, wait=True, timeout=None, prefer=None, prefer_donors=()):
        """`donor()`, called in a thread of its own as the averager's process would download it."""
        self.downloads += 1
        download = concurrent.futures.Future()

        def run_donor() -> None:
            try:
                download.set_result(self.donor() if self.donor else None)
            except Exception as error:  # noqa: BLE001  (as the download's, in the future)
                download.set_exception(error)

        threading.Thread(target=run_donor, daemon=True).start()
        return download.result(timeout) if wait else download

    @property
    def banned_count(self) -> int:
        return len(self.banned)

    def banned_peers(self) -> dict[str, str]:
        return dict(self.banned)

    def caught_peers(self, disputed: bool = False) -> set[str]:
        return self.caught | set(self.banned) | (self.disputed if disputed else set())

    def heed_partners_bans(self, rounds_ago) -> None:
        self.heeded.append(dict(rounds_ago))
        self.disputed |= set(rounds_ago)

    def shutdown(self) -> None:
        pass


class NoMetrics:
    dht = None

    def publish(self, record) -> bool:
        return True

    def fetch(self) -> list:
        return []


def train_config(corpus, out, steps: int = 10_000) -> TrainConfig:
    return TrainConfig(data=str(corpus), out=str(out), device="cpu", batch_size=2, steps=steps, warmup=0, lr=1e-2,
                       save_every=0, eval_every=0, log_every=1000)


def make_peer(corpus, out, rounds, *, donor=None, max_steps=None, clock=None, trainer=None, banned=None,
              caught=(), opening_rounds=0, opening_inner_steps=1, opening_outer_lr=LR, outer_lr_peak=None,
              schedule_steps=10_000) -> SwarmPeer:
    cfg = train_config(corpus, out, schedule_steps)
    trainer = trainer or Trainer(ModelConfig.from_dims("e32h2d1w32"), cfg, load_corpus(str(corpus)), torch.device("cpu"))
    run = RunConfig.from_settings(cfg, trainer.model_cfg, tokenizer_id(trainer.corpus.tokenizer, trainer.corpus.vocab_size),
                                  inner_steps=H, outer_lr=LR, outer_momentum=MOMENTUM, opening_rounds=opening_rounds,
                                  opening_inner_steps=opening_inner_steps, opening_outer_lr=opening_outer_lr,
                                  outer_lr_peak=outer_lr_peak)
    return SwarmPeer(trainer, lambda template, source: ScriptedAverager(rounds, donor, banned, caught), NoMetrics(),
                     SwarmIdentity("me", "me", "loop", "cpu", relayed=False), LocalStatus(), run=run,
                     max_steps=max_steps, publish_every_s=60.0, clock=clock or QuietClock())


def averaged_with_group(average: list[torch.Tensor], metadata: list, polls: int = 0) -> ScriptedRound:
    peers = tuple(f"peer-{i}" for i in range(len(metadata)))
    return ScriptedRound(RoundOutcome(average, len(metadata), 1.0, 100, 100, 0.01, group_metadata=tuple(metadata),
                                      group_peers=peers), polls)


def replay(initial: dict, averages: list[dict], momentum: dict | None = None) -> OuterOptimizer:
    """The outer optimizer after `averages`, from `initial` weights (and outer `momentum`)."""
    outer = OuterOptimizer(initial, LR, MOMENTUM)
    if momentum is not None:
        state = outer.state_dict()
        state["optimizer"]["state"] = {i: {"momentum_buffer": m.clone()} for i, m in enumerate(momentum.values())}
        outer.load_state_dict(state)
    for average in averages:
        outer.step(average)
    return outer


def assert_same(first: dict, second: dict) -> None:
    assert first.keys() == second.keys()
    for name in first:
        torch.testing.assert_close(first[name], second[name], rtol=0, atol=1e-6, msg=name)


def test_a_lone_peer_gives_up_each_rounds_search_applies_its_own_update_and_keeps_its_last_steps(corpus, tmp_path,
                                                                                                   caplog):
    """Nobody else trains: each round looks for a group for twice the matchmaking time (here 0 s: at the next
    step) and the peer takes its outer step with its own pseudo-gradient, without ever waiting; the run ends 1
    step into round 4, too few steps to average, so they stay local."""
    rounds: list[ScriptedRound] = []
    peer = make_peer(corpus, tmp_path / "alone", lambda k, g, m: rounds.append(ScriptedRound()) or rounds[-1],
                     max_steps=3 * H + 1)
    initial = {n: w.clone() for n, w in peer.outer.weights.items()}
    with caplog.at_level(logging.INFO, logger="tscale_p2p"):
        peer.run()
    assert peer.trainer.step == 3 * H + 1 and peer.round == 3
    assert [r.patience for r in rounds] == [[2 * MATCHMAKING_S]] * 3
    own_updates = [dict(zip(peer.names, gradient)) for gradient, _ in peer.averager.started]
    assert_same(peer.outer.weights, replay(initial, own_updates).weights)
    records = peer.status.snapshot().averaging
    assert [(r.round, r.group_size) for r in records] == [(1, 1), (2, 1), (3, 1)]
    assert caplog.text.count("averaged with nobody (nobody else looking for a group)") == 3
    assert "run over after 1 steps of round 4, 1 in all by the swarm's peers: keeping them local" in caplog.text
    local = peer.trainer.snapshot()
    assert any(not torch.equal(local[n], peer.outer.weights[n]) for n in peer.names)  # the last step, kept local


def test_leaving_waits_for_the_round_in_flight_and_applies_the_groups_average(corpus, tmp_path):
    """Stopped 2 steps after its round ended, while another peer still trains towards it: the round is not given
    up, the peer waits for it on leaving, applies the group's average and keeps its 2 local steps on top; the
    steps of the unfinished round are not averaged (a stop is not the run's end)."""
    clock = QuietClock()
    # the other peer has made its H steps of round 0 and still trains, slowly
    clock.observe([Progress(epoch=0, steps=H, steps_per_s=1e-3, time=time.time(), peer_id="other")])
    average, started = None, []

    def rounds(number, gradient, metadata):
        nonlocal average
        average = [0.5 * g for g in gradient]
        started.append(averaged_with_group(average, [metadata, metadata], polls=3))  # done only after the stop
        return started[-1]

    peer = make_peer(corpus, tmp_path / "leaving", rounds, clock=clock)
    initial = {n: w.clone() for n, w in peer.outer.weights.items()}
    peer.run(should_stop=lambda: peer.trainer.step >= H + 2)
    assert len(peer.averager.started) == 1 and peer.round == 1 and started[0].patience == []  # never given up
    assert_same(peer.outer.weights, replay(initial, [dict(zip(peer.names, average))]).weights)
    assert not peer.status.snapshot().averaging_in_flight
    record = peer.record()  # what the peer publishes: the round's traffic, when it last averaged
    assert (record.round, record.bytes_sent, record.bytes_received, record.dropped_peers) == (1, 100, 100, 0)
    assert record.last_averaging is not None and record.tokens_contributed > 0
    local = peer.trainer.snapshot()
    assert any(not torch.equal(local[n], peer.outer.weights[n]) for n in peer.names)


def test_values_no_reducer_averaged_keep_the_peers_progress_in_its_weights(corpus, tmp_path):
    """A round's average comes back with the first tensor lost (no reducer averaged it for us): the global weights
    take the group's average elsewhere and stay where they were there, and the peer keeps its progress on those
    values instead of dropping back to the global weights: there its weights are what its training made them,
    for the next round's update to carry (the averager owes nothing for them)."""
    at_round_end, at_stop = {}, {}

    def rounds(number, gradient, metadata):
        at_round_end.update(peer.trainer.snapshot())
        average = [torch.zeros_like(g) if i == 0 else 0.5 * g for i, g in enumerate(gradient)]
        lost = torch.cat([torch.full((g.numel(),), i == 0) for i, g in enumerate(gradient)])
        scripted = averaged_with_group(average, [metadata, metadata], polls=3)  # done only after the stop
        scripted.outcome = dataclasses.replace(scripted.outcome, lost=lost)
        return scripted

    def stop() -> bool:
        if peer.trainer.step >= H + 2:
            at_stop.update(peer.trainer.snapshot())
            return True
        return False

    peer = make_peer(corpus, tmp_path / "lost", rounds)
    initial = {n: w.clone() for n, w in peer.outer.weights.items()}
    peer.run(should_stop=stop)
    sent = dict(zip(peer.names, peer.averager.started[0][0]))
    average = {n: torch.zeros_like(g) if n == peer.names[0] else 0.5 * g for n, g in sent.items()}
    assert_same(peer.outer.weights, replay(initial, [average]).weights)
    first, *rest = peer.names
    assert torch.equal(peer.outer.weights[first], initial[first])
    local = peer.trainer.snapshot()
    torch.testing.assert_close(local[first], at_stop[first], rtol=0, atol=1e-6)  # its own progress, all of it
    for name in rest:  # the global weights plus the 2 steps since the round ended
        torch.testing.assert_close(local[name], peer.outer.weights[name] - (at_round_end[name] - at_stop[name]),
                                   rtol=0, atol=1e-6)


def test_leaving_with_a_round_nobody_averaged_after_a_group_keeps_the_groups_global_weights(corpus, tmp_path, caplog):
    """Round 1 averaged with another peer, which has stopped; the run ends with round 2, which finds nobody. No
    outer step on this peer's update alone: its global weights stay the group's of round 1 (which the other peer
    holds), and round 2's steps stay local, the next round counting from the global weights."""
    clock = QuietClock()
    clock.observe([Progress(epoch=0, steps=H, steps_per_s=0.0, time=time.time(), peer_id="other")])
    first_average = []

    def rounds(number, gradient, metadata):
        if number > 1:
            return ScriptedRound()  # nobody: given up once it has looked for a group long enough
        first_average.extend(0.5 * t for t in gradient)
        return averaged_with_group(first_average, [metadata, metadata])

    peer = make_peer(corpus, tmp_path / "left", rounds, max_steps=2 * H, clock=clock)
    initial = {n: w.clone() for n, w in peer.outer.weights.items()}
    with caplog.at_level(logging.INFO, logger="tscale_p2p"):
        peer.run()
    assert len(peer.averager.started) == 2 and peer.round == 1
    assert_same(peer.outer.weights, replay(initial, [dict(zip(peer.names, first_average))]).weights)
    last_round = dict(zip(peer.names, peer.averager.started[1][0]))
    assert_same(peer.trainer.snapshot(), {n: w - last_round[n] for n, w in peer.outer.weights.items()})
    assert_same(peer.rounds.round_start, peer.outer.weights)
    assert f"round 2's steps stay local (nobody averaged them as this peer left): global weights of round 1, " \
           f"weights {peer.weights_fingerprint()}" in caplog.text
    assert "continuing alone" not in caplog.text


def test_the_outer_lr_falls_with_the_inner_one_where_the_run_says_so(corpus, tmp_path):
    """A run with `outer_lr_peak`: each round's outer step takes the outer lr that the inner lr's schedule gives
    where the swarm ended that round, as every peer in step computes it."""
    peer = make_peer(corpus, tmp_path / "falling", lambda k, g, m: averaged_with_group([t.clone() for t in g], [m, m]),
                     max_steps=2 * H + 1, outer_lr_peak=2 * LR, schedule_steps=4 * H)
    initial = {n: w.clone() for n, w in peer.outer.weights.items()}
    peer.run()
    assert peer.round == 2
    expected = OuterOptimizer(initial, LR, MOMENTUM)
    for number, (gradient, _) in enumerate(peer.averager.started, start=1):
        inner_lr_ratio = peer.trainer.lr_at(number * H) / peer.trainer.cfg.lr
        assert inner_lr_ratio < 0.9  # the schedule has begun to fall: the outer lr is not the peak's
        expected.set_lr(peer.run_config.outer_lr_at(inner_lr_ratio))
        expected.step(dict(zip(peer.names, gradient)))
    assert_same(peer.outer.weights, expected.weights)


def test_each_round_says_how_many_steps_into_the_next_one_its_average_was_applied(corpus, tmp_path, caplog):
    """The steps a peer trains on the previous global weights while its round averages are what a slow round
    costs: the round's line says how many. Here each average is done 3 steps into the next round."""
    peer = make_peer(corpus, tmp_path / "late", lambda k, g, m: averaged_with_group([t.clone() for t in g], [m, m],
                                                                                   polls=2), max_steps=2 * H)
    with caplog.at_level(logging.INFO, logger="tscale_p2p"):
        peer.run()
    assert re.search(r"round 1: averaged with 1 peer\(s\) in .* KiB, applied 3 steps into round 2, weights \w+\n",
                     caplog.text), caplog.text


def test_opening_rounds_are_short_waited_for_and_applied_without_momentum(corpus, tmp_path, caplog):
    """A run with two opening rounds of 2 steps: each ends after 2 steps, its average (done only at the third
    poll) is applied before the next step, at the run's opening lr and without outer momentum; the rounds after
    them are H steps long and asynchronous, at the outer lr with momentum, and the learning-rate schedule counts the
    opening rounds' steps. The residual going into an opening round is carried whole; the others as the averager
    carries it."""
    clock = QuietClock(opening_rounds=2, opening_inner_steps=2)

    def partner_done_with(epoch: int) -> None:  # another peer online, as fast as this one
        clock.observe([Progress(epoch=epoch, steps=clock.round_steps(epoch), steps_per_s=0.0, time=time.time(),
                                peer_id="other")])

    def rounds(number, gradient, metadata):
        if number < 3:
            partner_done_with(number)
        else:  # it leaves as round 3 ends
            clock.observe([])
        return averaged_with_group([0.5 * t for t in gradient], [metadata, metadata], polls=2)

    partner_done_with(0)
    peer = make_peer(corpus, tmp_path / "opening", rounds, max_steps=2 + 2 + H + 1, clock=clock, opening_rounds=2,
                     opening_inner_steps=2, opening_outer_lr=1.5 * LR)
    initial = {n: w.clone() for n, w in peer.outer.weights.items()}
    with caplog.at_level(logging.INFO, logger="tscale_p2p"):
        peer.run()
    assert peer.round == 3 and peer.trainer.step == 2 + 2 + H + 1
    for number in (1, 2):
        assert re.search(rf"round {number}: averaged with 1 peer\(s\) in .* applied 0 steps into round {number + 1}",
                         caplog.text), caplog.text
    averages = [dict(zip(peer.names, [0.5 * t for t in gradient])) for gradient, _ in peer.averager.started]
    expected = OuterOptimizer(initial, LR, MOMENTUM, plain_lr=1.5 * LR)
    for number, average in enumerate(averages):
        expected.step(average, plain=number < 2)
    assert_same(peer.outer.weights, expected.weights)
    assert peer.clock.schedule_step(0, 3, 0) == 2 + 2 + H  # round 3 begins at step 8 of the schedule
    assert peer.averager.residual_carries == [OPENING_RESIDUAL_CARRY, None, None]


def test_a_peer_alone_takes_its_opening_rounds_as_they_are_without_looking_for_a_group(corpus, tmp_path, caplog):
    """A founder nobody has joined yet: its opening rounds are not offered to the swarm (each would wait out a
    search for a group before the next step) and each is taken as it is, the global weights becoming the round's
    end (the opening lr makes up for a code's shortening of an average, which its own update never had); the
    H-step round after them looks for a group as any round does."""
    rounds: list[ScriptedRound] = []
    peer = make_peer(corpus, tmp_path / "founder", lambda k, g, m: rounds.append(ScriptedRound()) or rounds[-1],
                     max_steps=2 + 2 + H, clock=QuietClock(opening_rounds=2, opening_inner_steps=2),
                     opening_rounds=2, opening_inner_steps=2, opening_outer_lr=1.5 * LR)
    weights_at_round_end = []
    finish_round = peer.rounds.finish_round
    peer.rounds.finish_round = lambda now: weights_at_round_end.append(
        {n: now[n].clone() for n in peer.names}) or finish_round(now)
    with caplog.at_level(logging.INFO, logger="tscale_p2p"):
        peer.run()
    assert peer.round == 3 and len(peer.averager.started) == 1 and len(rounds) == 1
    assert caplog.text.count("averaged with nobody (nobody else online)") == 2
    assert [r.patience for r in rounds] == [[2 * MATCHMAKING_S]]  # the H-step round, as a lone peer's round
    expected = OuterOptimizer(weights_at_round_end[1], LR, MOMENTUM)
    expected.step(dict(zip(peer.names, peer.averager.started[0][0])))
    assert_same(peer.outer.weights, expected.weights)


def test_the_runs_last_steps_are_averaged_when_the_swarm_made_h_steps_in_the_round(corpus, tmp_path):
    """The run ends 2 steps into round 2, of which the other peer, stopped, has made 2H - 3 steps: together they
    made more than H, so the peer ends the round with its 2 steps, averages them and leaves with the global
    weights as its own."""
    clock = QuietClock()
    clock.observe([Progress(epoch=0, steps=H, steps_per_s=0.0, time=time.time(), peer_id="other")])

    def rounds(number, gradient, metadata):
        if number == 1:
            clock.observe([Progress(epoch=1, steps=2 * H - 3, steps_per_s=0.0, time=time.time(), peer_id="other")])
        return averaged_with_group([t.clone() for t in gradient], [metadata, metadata])

    peer = make_peer(corpus, tmp_path / "last", rounds, max_steps=H + 2, clock=clock)
    peer.run()
    assert len(peer.averager.started) == 2 and peer.round == 2
    assert_same(peer.trainer.snapshot(), peer.outer.weights)  # nothing left unaveraged


def test_a_peer_out_of_steps_looks_for_the_last_group_at_once_and_declares_a_start_past_the_rounds_end(corpus,
                                                                                                         tmp_path):
    """The run is over 2 steps into round 2 while the other peer still trains, 2.5 s from the round's end at its
    pace: the peer looks for the round's group at once (not only within a matchmaking window of that end),
    expecting both peers, and declares its wait's end (the averaging timeout, 5 s) as the round's start, so a
    group it leads does not begin before the round ends without a peer still on its way. The other peer then
    ends the round, and the last steps are averaged."""
    clock = QuietClock()
    clock.observe([Progress(epoch=0, steps=H, steps_per_s=0.0, time=time.time(), peer_id="other")])

    def rounds(number, gradient, metadata):
        if number == 1:  # round 2: the other has made 1 step of the 2H - 2 it needs, at 2 steps a second
            clock.observe([Progress(epoch=1, steps=1, steps_per_s=2.0, time=time.time(), peer_id="other")])
        return averaged_with_group([t.clone() for t in gradient], [metadata, metadata])

    peer = make_peer(corpus, tmp_path / "last", rounds, max_steps=H + 2, clock=clock)
    peer.averager.on_schedule = lambda: clock.observe(  # the other ends the round
        [Progress(epoch=2, steps=0, steps_per_s=0.0, time=time.time(), peer_id="other")])
    peer.run()
    assert len(peer.averager.scheduled) == 1
    seconds_to_start, group_size = peer.averager.scheduled[0]
    assert seconds_to_start > 4.0 and group_size == 2
    assert len(peer.averager.started) == 2 and peer.round == 2
    assert_same(peer.trainer.snapshot(), peer.outer.weights)


class RecordingClock(QuietClock):
    """A `QuietClock` that keeps every progress record this peer made (what `RoundClock` would publish)."""

    def __init__(self, **opening) -> None:
        super().__init__(**opening)
        self.records: list[Progress] = []

    def update(self, epoch: int, steps: int, steps_per_s: float) -> None:
        super().update(epoch, steps, steps_per_s)
        self.records.append(self._mine)


def test_a_peer_waiting_for_the_swarms_round_end_keeps_its_progress_record_fresh(corpus, tmp_path):
    """The run is over 2 steps into round 2 while the other peer trains on, about a second from the round's end:
    the peer waits for it without training, and its record says so (no steps per second) with a time that moves on
    while it waits. A record keeps the time it was made, and others count a peer whose record is a record's lifetime
    old as gone: made once, it let the others' group of the run's last round begin without this peer."""
    clock = RecordingClock()
    clock.observe([Progress(epoch=0, steps=H, steps_per_s=0.0, time=time.time(), peer_id="other")])

    def rounds(number, gradient, metadata):
        if number == 1:  # round 2: the other makes its 2H - 3 steps at 5 a second
            clock.observe([Progress(epoch=1, steps=0, steps_per_s=5.0, time=time.time(), peer_id="other")])
        return averaged_with_group([t.clone() for t in gradient], [metadata, metadata])

    peer = make_peer(corpus, tmp_path / "wait", rounds, max_steps=H + 2, clock=clock)
    peer.run()
    waiting = [r.time for r in clock.records if (r.epoch, r.steps, r.steps_per_s) == (1, 2, 0.0)]
    assert max(waiting) - min(waiting) >= 0.5
    assert len(peer.averager.started) == 2 and peer.round == 2  # then the last steps were averaged


def test_a_peer_waiting_for_an_opening_rounds_average_keeps_its_progress_record_fresh(corpus, tmp_path):
    """An opening round is waited for before the next step. While its average is on its way (a second here) the
    peer's record is made anew, as it was when the round ended: made once, it would expire during a long wait, and
    the others' next group would expect one peer fewer."""
    clock = RecordingClock(opening_rounds=1, opening_inner_steps=2)
    clock.observe([Progress(epoch=0, steps=2, steps_per_s=0.0, time=time.time(), peer_id="other")])

    def rounds(number, gradient, metadata):  # done at the eleventh poll: a second or more of 0.1 s waits
        return averaged_with_group([t.clone() for t in gradient], [metadata, metadata], polls=10)

    peer = make_peer(corpus, tmp_path / "opening-wait", rounds, max_steps=2, clock=clock, opening_rounds=1,
                     opening_inner_steps=2)
    peer.run()
    assert peer.round == 1
    waiting = [r.time for r in clock.records if (r.epoch, r.steps) == (0, 2)]
    assert max(waiting) - min(waiting) >= 0.5


@pytest.mark.parametrize("donor_applied_the_round", [False, True])
def test_a_peer_out_of_step_with_its_group_downloads_the_state_and_declares_the_groups_base_next(
        corpus, tmp_path, caplog, donor_applied_the_round):
    """Two of the three peers of round 1 declare other global weights than ours: the peer downloads the swarm's
    state, brings it to where the group is after the round's average (the donor may have applied it already, or
    not yet), and its next round is formed on those weights."""
    generator = torch.Generator().manual_seed(1)
    theirs_before: dict[str, torch.Tensor] = {}
    average: dict[str, torch.Tensor] = {}

    def rounds(number, gradient, metadata):
        if number > 1:
            return ScriptedRound()  # given up: irrelevant here
        average.update(zip(peer.names, [0.5 * g for g in gradient]))
        theirs = {"round": 0, "weights": fingerprint(list(theirs_before.values()))}
        return averaged_with_group(list(average.values()), [metadata, theirs, theirs])

    def donor():  # a download that takes a second, the peer waiting for it without training
        time.sleep(1.0)
        weights, momentum = dict(theirs_before), {n: 0.1 * torch.ones_like(w) for n, w in theirs_before.items()}
        if donor_applied_the_round:
            after = replay(weights, [average], momentum)
            weights = after.weights
            momentum = {n: after.state_dict()["optimizer"]["state"][i]["momentum_buffer"] for i, n in enumerate(peer.names)}
        state = SwarmState(peer.run_hash, 1 if donor_applied_the_round else 0, 0, 0, weights, momentum, donor="peer-1")
        return state.to_wire()

    clock = RecordingClock()
    peer = make_peer(corpus, tmp_path / "resync", rounds, donor=donor, max_steps=2 * H + 1, clock=clock)
    theirs_before.update({n: w + 0.01 * torch.randn(w.shape, generator=generator) for n, w in peer.outer.weights.items()})
    with caplog.at_level(logging.INFO, logger="tscale_p2p"):
        peer.run()
    expected = replay(theirs_before, [average], {n: 0.1 * torch.ones_like(w) for n, w in theirs_before.items()})
    expected_base = {"round": 1, "weights": fingerprint(list(expected.weights.values()))}
    assert peer.averager.downloads == 1
    assert "differ from the group's (round 0" in caplog.text
    assert f"back in step with the swarm at round 1, weights {expected_base['weights']}" in caplog.text
    assert peer.averager.started[1][1] == expected_base  # round 2 is formed on the group's weights
    # while it downloaded, its last record (as round 1 ended) was made anew, as it was, for a second
    times_by_place: dict[tuple[int, int], list[float]] = {}
    for record in clock.records:
        if record.steps > 0:  # not the record it leaves with (no steps)
            times_by_place.setdefault((record.epoch, record.steps), []).append(record.time)
    assert max(max(times) - min(times) for times in times_by_place.values()) >= 0.5


@pytest.mark.parametrize("caught", ["nobody", "banned", "rejected_once"])
def test_a_groupmate_caught_lying_does_not_vote_on_the_groups_base(corpus, tmp_path, caught):
    """Two of four declare our base, two another one, which wins the tie: the peer resyncs onto it, unless one of
    those two is a peer it banned or has rejected in some round (its parts or answers were refused; its vote must
    not pull the peer onto weights it may have poisoned, as an attacker paired with an honest peer in a swarm's
    first round can)."""
    def rounds(number, gradient, metadata):
        if number > 1:
            return ScriptedRound()
        theirs = {"round": 0, "weights": "0" * 12}  # the smaller fingerprint: it wins a tie
        return averaged_with_group([0.5 * g for g in gradient], [metadata, metadata, theirs, theirs])

    peer = make_peer(corpus, tmp_path / "vote", rounds, max_steps=2 * H + 1,
                     banned={"peer-3": "a part far from the group's"} if caught == "banned" else None,
                     caught={"peer-3"} if caught == "rejected_once" else ())
    peer.run()
    assert peer.averager.downloads == (1 if caught == "nobody" else 0)


def test_with_three_live_peers_pairs_are_taken_only_with_peers_averaged_with_and_caught_ones_are_left_out(
        corpus, tmp_path):
    """Two others are live, so a pair holds no majority: the first round takes a pair with nobody, the next ones
    with the peers of the round that averaged (less one caught there: the round dropped it, and one out of step:
    its part was left out unchecked), and after PAIR_PATIENCE rounds in a row without an average, with anyone."""
    clock = QuietClock()
    now = time.time()
    clock.observe([Progress(0, 0, 0.0, now, "peer-1"), Progress(0, 0, 0.0, now, "peer-2")])  # live, idle

    def rounds(number, gradient, metadata):
        if number > 1:
            return ScriptedRound()  # nobody else looking: given up
        out_of_step = {"round": 7, "weights": "0123456789ab"}
        averaged = averaged_with_group([0.5 * g for g in gradient], [metadata, metadata, metadata, out_of_step])
        averaged.outcome = dataclasses.replace(averaged.outcome, dropped_peers=1)
        return averaged

    expected = [frozenset(), *[{"peer-0", "peer-1"}] * PAIR_PATIENCE, None]
    peer = make_peer(corpus, tmp_path / "pairs", rounds, max_steps=len(expected) * 3 * H, clock=clock,
                     caught={"peer-2"})
    peer.run()
    assert peer.averager.pair_partners[:len(expected)] == expected


def test_a_peer_that_a_pair_partner_banned_is_no_pair_partner_and_is_held_disputed(corpus, tmp_path):
    """Bans told by the others (peers/ban_notes.py) count from pair partners only, not from a peer never averaged
    with, nor from a partner this peer has caught; the averager hears how many rounds ago a partner banned each."""
    clock = QuietClock()
    now = time.time()
    clock.observe([Progress(0, 0, 0.0, now, "peer-1"), Progress(0, 0, 0.0, now, "peer-2")])  # live, idle

    def rounds(number, gradient, metadata):
        if number > 1:
            return ScriptedRound()
        return averaged_with_group([0.5 * g for g in gradient], [metadata] * 4)

    peer = make_peer(corpus, tmp_path / "notes", rounds, max_steps=2 * 3 * H, clock=clock, caught={"peer-2"})
    peer.ban_notes.observe({"peer-1": {"peer-3": 0}, "stranger": {"peer-0": 0}, "peer-2": {"peer-1": 0},
                            "peer-0": {"me": 0, "peer-3": 1}})
    peer.run()
    assert peer.averager.pair_partners[1] == {"peer-0", "peer-1"}
    assert peer.averager.disputed == {"peer-3"}
    assert peer.averager.heeded[0] == {"peer-3": 1}  # before round 2: banned in round 0, the first of two notes


def test_bans_are_exchanged_each_round_not_only_with_the_record(corpus, tmp_path):
    """Each applied round asks for the peers' bans at once (ours from that round, a partner's before the next pair
    rule), not at the next record, here a minute away: a ban on a partner's note and a strike of our own
    (peers/ban_notes.py) waited for it while its peer followed the attacker into refused pairs."""
    peer = make_peer(corpus, tmp_path / "bans", lambda k, g, m: averaged_with_group([t.clone() for t in g], [m, m]),
                     max_steps=3 * H + 1)
    asked = []
    peer.report.share_bans_soon = lambda: asked.append(peer.round)
    peer.run()
    assert asked == [1, 2, 3]


def test_the_report_exchanges_bans_when_asked_without_waiting_for_the_next_record(corpus, tmp_path):
    report = make_peer(corpus, tmp_path / "asked", lambda k, g, m: ScriptedRound()).report  # records a minute apart
    exchanged = []
    report.share_bans = lambda: exchanged.append(time.monotonic())
    report.start()
    try:
        wait_until(lambda: len(exchanged) == 1)  # the first record's
        report.share_bans_soon()
        wait_until(lambda: len(exchanged) == 2)
    finally:
        report.stop()


def wait_until(condition, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_a_peer_that_cannot_download_the_groups_state_stays_out_of_step_and_shares_its_own_again(
        corpus, tmp_path, caplog):
    def rounds(number, gradient, metadata):
        if number > 1:
            return ScriptedRound()
        other = [{"round": 0, "weights": "0123456789ab"}] * 2
        return averaged_with_group([t.clone() for t in gradient], [metadata, *other])

    peer = make_peer(corpus, tmp_path / "stay", rounds, max_steps=H + 1)
    with caplog.at_level(logging.INFO, logger="tscale_p2p"):
        peer.run()
    assert peer.averager.downloads == 1 and peer.round == 1
    assert "no peer shared the group's state (got round None); staying out of step for now" in caplog.text
    assert peer.averager.state_sharing_priority == 1.0  # offered again, at its own round


def test_the_swarm_state_is_saved_inside_the_step_checkpoint_and_a_restarted_peer_continues_from_it(corpus, tmp_path):
    """The outer state (global weights, momentum, round, schedule origin) is a file of the step checkpoint,
    written and verified with it; a peer restarted from that checkpoint adopts it, and its wire form is the one
    a joiner and `fetch` read."""
    peer = make_peer(corpus, tmp_path / "run", lambda k, g, m: averaged_with_group([0.5 * t for t in g], [m, m]),
                     max_steps=2 * H + 1)
    peer.run()
    path = peer.save()
    assert path == find_latest(tmp_path / "run") and (path / SWARM_STATE_FILE).exists()
    saved = SwarmState.from_wire(*read_state_file(path / SWARM_STATE_FILE), names=peer.names)
    own = peer.state()
    assert (saved.round, saved.step, saved.fingerprint) == (2, 2 * H + 1, peer.weights_fingerprint())
    assert_same(saved.weights, own.weights)
    assert_same(saved.momentum, own.momentum)
    assert peer.state_check.problem(*own.to_wire()) is None  # what a joiner accepts

    cfg = train_config(corpus, tmp_path / "run")
    trainer = Trainer(ModelConfig.from_dims("e32h2d1w32"), cfg, load_corpus(str(corpus)), torch.device("cpu"))
    trainer.restore(resume_from(tmp_path / "run"))
    restarted = make_peer(corpus, tmp_path / "run", lambda k, g, m: ScriptedRound(), trainer=trainer)
    assert restarted.load_saved_state()
    assert (restarted.round, restarted.weights_fingerprint(), restarted.trainer.step) == (2, saved.fingerprint, 2 * H + 1)
    assert_same(restarted.state().momentum, own.momentum)
    assert_same(restarted.trainer.snapshot(), own.weights)  # a restart trains on from the global weights

    # Damaged on disk: the whole checkpoint is refused (its manifest lists the file), never half of it adopted.
    (path / SWARM_STATE_FILE).write_bytes(b"not a state")
    assert find_latest(tmp_path / "run") != path
