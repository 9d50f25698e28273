"""Robust aggregation, reducer checks and bans: the rule on its own, then attackers in a real averaging group
(hivemind DHTs and p2pd daemons on 127.0.0.1) that speak the protocol (tests/attacks.py)."""

import json
import math
import re
import sys
import time
from pathlib import Path

import hivemind
import pytest
import torch
from hivemind.p2p import PeerID
from hivemind.utils.mpfuture import MPFuture
from test_averaging import SHAPES, expected_first_round, onebit, relative_error, swarm
from test_swarm import TINY, bootstrap_with_hivemind_dht, join_args, join_flags, shared_weights, spawn, text_file  # noqa: F401 (fixtures)

from attacks import (
    DisputingOnePeer,
    DisputingPeer,
    FlippingReducer,
    LosingOnePeer,
    LyingReducer,
    TwoFacedReducer,
    UnsignedTwoFacedReducer,
    alie,
)
from tscale_p2p.cli import main
from tscale_p2p.config import TrainConfig
from tscale_p2p.data import load_corpus
from tscale_p2p.model import ModelConfig
from tscale_p2p.peers.averaging import SwarmAverager
from tscale_p2p.peers.ban_notes import BanNotes
from tscale_p2p.peers.codec import E8Codec, E8StagedReturnCodec, OneBitCodec
from tscale_p2p.peers.reputation import COLLUDING, CORROBORATED, EXCUSE_EVERY, Excused, PeerReputation
from tscale_p2p.peers.robust import centered_clip, coordinate_median, robust_aggregate
from tscale_p2p.trainer import Trainer

D = 8192


def honest_updates(count: int, seed: int, d: int = D, common_share: float = 1.0) -> list[torch.Tensor]:
    """Updates of peers training one model on their own data: a common direction (`common_share` times as long as
    their own noise) plus their own noise, 1-bit, as a reducer receives them. Cosines: about 0.33 at 1, 0.6 at 2."""
    generator = torch.Generator().manual_seed(seed)
    common = common_share * torch.randn(d, generator=generator)
    return [onebit(common + torch.randn(d, generator=generator)) for _ in range(count)]


def relative(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).norm() / want.norm())


# ---- the rule, in one process ----

@pytest.mark.parametrize("rows, columns", [(1, 1000), (2, 1000), (3, 1000), (4, 1000), (5, 1000), (8, 1000),
                                           (3, 200_000), (16, 40_000)])  # the last two: several blocks of columns
def test_the_coordinate_median_is_the_middle_value_or_the_mean_of_the_middle_two(rows, columns):
    parts = torch.randn(rows, columns, generator=torch.Generator().manual_seed(rows))
    assert torch.allclose(coordinate_median(parts), parts.quantile(0.5, dim=0), atol=1e-6)


def test_centered_clip_stops_where_the_clipped_pulls_balance():
    """Its defining property: at the result v, sum_i w_i clip_tau(x_i - v) is zero. Two far parts and three
    near ones, so that some pulls are clipped and some are not."""
    generator = torch.Generator().manual_seed(9)
    parts = torch.randn(5, D, generator=generator)
    parts[3:] += 8 * torch.randn(2, D, generator=generator)
    weights = torch.tensor([1.0, 2.0, 1.0, 3.0, 1.0], dtype=torch.float64)
    start = coordinate_median(parts)
    tau = 1.5 * float((parts - start).norm(dim=1).min())
    centre = centered_clip(parts - start, weights, start, tau)
    deviations = (parts - centre).double()
    norms = deviations.norm(dim=1)
    assert (norms > tau).any() and (norms < tau).any()
    pulls = (weights * torch.clamp(tau / norms, max=1.0)) @ deviations
    assert float(pulls.norm()) < 1e-4 * tau * float(weights.sum())

def test_clean_contributions_average_to_their_weighted_mean():
    parts = torch.stack(honest_updates(4, seed=0))
    tokens = torch.tensor([1000.0, 2000.0, 1500.0, 1800.0])
    result = robust_aggregate(parts, tokens)
    weights = tokens.clamp(max=1800.0)  # capped at the (high) median claim
    assert relative(result.aggregate, (weights @ parts) / weights.sum()) < 1e-5
    assert not result.flagged


@pytest.mark.parametrize("attack, verdict", [
    (lambda g: 90 * g, "far"),
    (lambda g: -10 * g, "far"),  # opposed too, and far: a strike
    # Within the far test's reach for a part claiming many tokens (five results' length), but against peers that
    # clearly agree: flipped, a strike too.
    (lambda g: -3 * g, "flipped"),
    (lambda g: -2 * g, "flipped"),
    (lambda g: -0.5 * g, "flipped"),
], ids=["scaled_x90", "sign_flip_x10", "sign_flip_x3", "sign_flip_x2", "sign_flip_x0.5"])
def test_an_attacking_contribution_is_flagged_and_left_out_whatever_weight_it_claims(attack, verdict):
    """Far and flipped parts earn a strike (peers/robust.py), among peers that agree as trained ones do (cosines
    of about 0.6; 0.27-0.98 measured)."""
    *honest, own = honest_updates(4, seed=1, common_share=2.0)
    for group in (honest, honest[:2]):  # 3 honest + 1, and 2 + 1
        parts = torch.stack([*group, attack(own)])
        tokens = torch.tensor([1000.0] * len(group) + [1e12])
        result = robust_aggregate(parts, tokens)
        assert getattr(result, verdict) == {len(group)} and result.flagged == {len(group)}
        assert relative(result.aggregate, torch.stack(group).mean(dim=0)) < 1e-5


def test_a_part_a_few_times_longer_than_the_others_is_left_out_without_a_strike():
    """Honest parts were seen up to 5.3x the median distance from the result (a fresh inner optimizer after a
    download): beyond 3x a part is left out, but only beyond 8x is it a strike. Claiming more tokens lets a part
    lie further along the result."""
    *honest, own = honest_updates(4, seed=1)
    for group in (honest, honest[:2]):
        parts = torch.stack([*group, 5 * own])
        result = robust_aggregate(parts, torch.full((len(group) + 1,), 1000.0))
        assert result.astray == {len(group)} and result.flagged == {len(group)}
        assert relative(result.aggregate, torch.stack(group).mean(dim=0)) < 1e-5
        tokens = torch.tensor([1000.0] * len(group) + [4000.0])
        assert not robust_aggregate(parts, tokens).flagged


def test_peers_whose_updates_barely_agree_are_not_taken_for_opposed():
    """Updates with cosines of about 0.1 with each other (less than measured between real peers): none is
    flagged, nor are the small updates of late joiners among them."""
    generator = torch.Generator().manual_seed(7)
    common = 0.35 * torch.randn(D, generator=generator)
    parts = [onebit(common + torch.randn(D, generator=generator)) for _ in range(5)]
    parts[4] = 0.02 * parts[4]
    for n in (3, 4, 5):
        assert not robust_aggregate(torch.stack(parts[:n]), torch.full((n,), 1000.0)).flagged


def test_an_honest_part_against_others_that_barely_agree_is_left_out_without_a_strike():
    """Where honest updates are mostly noise (a tiny model at a few inner steps measured cosines of -0.15 to
    +0.25), one of them pointing against the two others is left out, but earns no strike: two would ban it."""
    generator = torch.Generator().manual_seed(11)
    common = torch.randn(D, generator=generator)
    parts = [onebit(weight * common + torch.randn(D, generator=generator)) for weight in (0.5, 0.5, -0.4)]
    result = robust_aggregate(torch.stack(parts), torch.full((3,), 1000.0))  # cosines +0.14, and -0.10 with both
    assert result.opposed == {2} and not result.flipped and not result.far
    assert relative(result.aggregate, torch.stack(parts[:2]).mean(dim=0)) < 1e-5


def test_a_majority_pointing_against_the_rest_flags_nobody_as_opposed():
    """Two honest peers and two flippers (each its own update): from inside, either pair opposes the other."""
    *honest, own_a, own_b = honest_updates(4, seed=8)
    result = robust_aggregate(torch.stack([*honest, -3 * own_a, -3 * own_b]), torch.full((4,), 1000.0))
    assert not result.opposed and not result.flipped


@pytest.mark.parametrize("honest_count", [3, 14])
def test_a_little_is_enough_pair_is_flagged_as_colluding_and_left_out(honest_count):
    """Their shift stays inside every coordinate's honest range (a plain mean moves by a third of the honest
    mean's length in 3 + 2, a coordinate-wise median would too), but the two send one vector. (2 + 2 is not
    claimed: from inside, a pair and a pair look alike.)"""
    honest = honest_updates(honest_count, seed=2)
    attack = onebit(alie(honest))
    parts = torch.stack([*honest, attack, attack])
    honest_mean = torch.stack(honest).mean(dim=0)
    assert relative(parts.mean(dim=0), honest_mean) > 0.3 * 5 / len(parts)
    result = robust_aggregate(parts, torch.full((len(parts),), 1000.0))
    assert result.colluding == {honest_count, honest_count + 1} and not result.far
    assert relative(result.aggregate, honest_mean) < 1e-5


@pytest.mark.parametrize("honest_count", [1, 2])
def test_colluders_half_or_more_of_a_group_are_flagged_once_caught_before(honest_count):
    """2 + 2, or both colluders with one honest peer: from inside, a pair is the group's normal, so nothing is
    flagged; once this peer has caught them in an earlier round, they get no such benefit of the doubt."""
    honest = honest_updates(honest_count, seed=2)
    attack = onebit(alie(honest_updates(3, seed=3)))
    parts = torch.stack([*honest, attack, attack])
    tokens = torch.full((len(parts),), 1000.0)
    assert not robust_aggregate(parts, tokens).flagged
    colluders = frozenset({honest_count, honest_count + 1})
    assert not robust_aggregate(parts, tokens, caught=frozenset({honest_count})).flagged  # one caught: no
    result = robust_aggregate(parts, tokens, caught=colluders)
    assert result.colluding == colluders
    assert relative(result.aggregate, torch.stack(honest).mean(dim=0)) < 1e-5


def test_a_group_of_honest_peers_in_close_pairs_flags_nobody():
    """Where updates hardly differ (a model with little left to learn from a text of a few distinct windows),
    most peers have a near twin: that is the group's normal, not collusion (a pair among independent updates
    is: the test above, with 14 honest peers)."""
    generator = torch.Generator().manual_seed(9)
    common = torch.randn(D, generator=generator)
    twins = [common + torch.randn(D, generator=generator) for _ in range(8)]
    parts = torch.stack([onebit(twin + 0.05 * torch.randn(D, generator=generator)) for twin in twins for _ in (0, 1)])
    assert not robust_aggregate(parts, torch.full((16,), 1000.0)).flagged
    assert not robust_aggregate(parts, torch.full((16,), 1000.0), caught=frozenset({0, 1})).flagged  # the rest too


def test_honest_peers_first_round_updates_are_never_taken_for_colluders(text_file):
    """11 peers train a small model 20 steps from the same weights, each on its own draws of the data, and a
    reducer aggregates each tensor (hivemind's parts) as E8 words: nobody is flagged. (The norms' gains move
    alike on every peer, and their 64-value parts, coded, coincided between honest peers.)"""
    corpus = load_corpus(str(text_file))
    model = ModelConfig.from_dims("e64h2d2w128", vocab_size=corpus.vocab_size)
    start, updates = None, []
    for peer in range(11):
        cfg = TrainConfig(data=str(text_file), device="cpu", batch_size=8, eval_every=0, save_every=0, seed=peer)
        trainer = Trainer(model, cfg, corpus, torch.device("cpu"))
        start = start or trainer.snapshot()
        trainer.apply_outer_update(start)
        for _ in range(20):
            trainer.local_step()
        updates.append({name: start[name] - weights for name, weights in trainer.snapshot().items()})
    codec = E8Codec()
    for name in start:
        parts = torch.stack([codec.carried(update[name].reshape(-1)) for update in updates])
        assert not robust_aggregate(parts, torch.full((11,), 1000.0)).flagged, name


def test_late_joiners_small_updates_are_not_mistaken_for_attacks():
    """A peer a few steps into its round (just past a state download) sends a small update with few tokens;
    two of them deviate from the result alike (towards zero), which is not collusion."""
    honest = honest_updates(5, seed=3)
    parts = torch.stack([*honest[:3], 0.02 * honest[3], 0.01 * honest[4]])
    result = robust_aggregate(parts, torch.tensor([5000.0, 5000.0, 5000.0, 100.0, 50.0]))
    assert not result.flagged


def test_an_honest_peer_further_out_makes_nobody_look_colluding():
    """Three honest updates, one of them (a peer out of step) twice as far from the others as they are from each
    other: the two others deviate from the result alike, but they are not close to each other."""
    a, b, c = honest_updates(3, seed=5)
    parts = torch.stack([a, b, b + 2 * (c - b)])
    assert not robust_aggregate(parts, torch.full((3,), 1000.0)).flagged


@pytest.mark.parametrize("knows", ["the honest updates", "its own last two"])
def test_a_single_a_little_is_enough_attacker_is_one_sided_and_left_out(knows):
    """Its shift stays inside every coordinate's honest range, but points one way in all of them: its part lies
    below the group's median in most of its values, and is flagged, a strike, in 3 + 1 and 2 + 1 (e8 words,
    join's default code)."""
    codec = E8Codec()
    updates = honest_updates(5, seed=4, d=4 * D, common_share=2.0)
    *honest, own, own_previous = [codec.carried(update) for update in updates]
    for group in (honest, honest[:2]):
        samples = group if knows == "the honest updates" else [own, own_previous]
        parts = torch.stack([*group, codec.carried(alie(samples))])
        result = robust_aggregate(parts, torch.full((len(parts),), 1000.0))
        assert result.one_sided == {len(group)} and result.flagged == {len(group)}
        assert relative(result.aggregate, torch.stack(group).mean(dim=0)) < 1e-5


@pytest.mark.parametrize("count", [3, 4, 8, 16])
def test_honest_parts_of_any_length_are_never_one_sided(count):
    """Honest peers' deviations from the median have no side, whichever peer trained longer or joined late."""
    generator = torch.Generator().manual_seed(count)
    lengths = torch.empty(count).uniform_(0.3, 4.0, generator=generator)
    for codec in (OneBitCodec(), E8Codec()):
        parts = torch.stack([codec.carried(length * update)
                             for length, update in zip(lengths, honest_updates(count, seed=count, d=4 * D))])
        assert not robust_aggregate(parts, torch.full((count,), 1000.0)).one_sided


def test_a_peer_is_banned_after_being_rejected_in_two_rounds():
    reputation = PeerReputation()
    assert reputation.record_round({"A": "far", "B": "far"}) == []
    assert reputation.record_round({"A": "an invalid average"}) == ["A"]
    assert reputation.record_round({"A": "far", "B": "far"}) == ["B"]  # a banned peer is not counted again
    assert reputation.banned == {"A": "an invalid average", "B": "far"}


def test_colluders_flagged_in_the_round_one_of_them_is_banned_for_it_are_banned_with_it():
    """A part is flagged as colluding only with another's: once one of the pair is banned for it, the other has no
    twin left to be caught with, so the ones flagged beside it in that round go too, and nobody else."""
    reputation = PeerReputation()
    assert reputation.record_round({"A": COLLUDING, "C": "far"}) == []
    assert reputation.record_round({"A": COLLUDING, "B": COLLUDING, "D": "far"}) == ["A", "B"]
    assert set(reputation.banned) == {"A", "B"} and reputation.strikes["D"] == 1
    assert reputation.record_round({"C": "an invalid average", "E": COLLUDING}) == ["C"]  # not banned for collusion
    assert "E" not in reputation.banned


def test_a_peer_out_of_step_is_excused_then_and_in_its_next_round_but_not_round_after_round():
    """An honest peer behind the group is excused in the round it is out of step and in its first one back (its
    resync's stale progress), again at a later resync; one that declares other weights every round is excused in
    its first three only, and in one of EXCUSE_EVERY rounds after: not enough to escape two strikes."""
    reputation = PeerReputation()
    assert reputation.excuse(["A", "B"], {"B"}) == Excused({"B"}, set())
    assert reputation.excuse(["A", "B"], set()) == Excused(set(), {"B"})  # back in step: the round after its resync
    assert [reputation.excuse(["A", "B"], set()) for _ in range(6)] == [Excused(set(), set())] * 6
    assert reputation.excuse(["B"], {"B"}) == Excused({"B"}, set())  # a later resync
    assert reputation.excuse(["B"], set()) == Excused(set(), {"B"})
    liar = PeerReputation()
    excused = [liar.excuse(["L"], {"L"}).out_of_step == {"L"} for _ in range(12)]
    assert excused[:3] == [True] * 3 and sum(excused) <= 3 + 12 // EXCUSE_EVERY
    assert excused[3:6].count(False) >= 2  # two rounds in which its flags strike: banned


# ---- attackers in a real averaging group ----

def grads_of_round(round_number: int, count: int) -> list[list[torch.Tensor]]:
    """Each peer's pseudo-gradient in a round: a direction common to the peers plus their own noise."""
    generator = torch.Generator().manual_seed(100 + round_number)
    common = [torch.randn(shape, generator=generator) * 1e-3 for shape in SHAPES]
    return [[c + torch.randn(c.shape, generator=generator) * 1e-3 for c in common] for _ in range(count)]


def flat(tensors) -> torch.Tensor:
    return torch.cat([t.reshape(-1) for t in tensors])


def play(averagers, grads, tokens, group_size, bases=None):
    """One round; `bases`: the metadata each peer declares (the base of its update, as `join` does)."""
    bases = bases or [None] * len(averagers)
    pending = [a.start_round(g, tokens=t, metadata=b, group_size=group_size)
               for a, g, t, b in zip(averagers, grads, tokens, bases)]
    return [p.result(timeout=40) for p in pending]


def peer(averager) -> str:
    return averager.peer_id.to_base58()


def assert_banned_by_all(honest, attackers):
    for averager in honest:
        assert set(averager.banned_peers()) == {peer(a) for a in attackers}
        assert averager.banned_count == len(attackers)


@pytest.mark.slow
@pytest.mark.timeout(90)
@pytest.mark.parametrize("attack, claimed", [(lambda g: -10 * g, 1e12), (lambda g: 90 * g, 1000.0)],
                         ids=["sign_flip_x10_claiming_1e12_tokens", "scaled_x90"])
def test_a_sender_attack_is_left_out_of_every_span_and_banned(attack, claimed):
    """3 honest peers + 1 attacker: every honest peer gets the honest-only average in round one, bans the attacker
    after its second round, and averages without it from then on."""
    with swarm([OneBitCodec() for _ in range(4)], residual_carry=None) as averagers:
        honest, attacker = averagers[:3], averagers[3]
        for round_number in range(3):
            grads = grads_of_round(round_number, 4)
            bad = [attack(g) for g in grads[3]]
            group = averagers if round_number < 2 else honest
            outcomes = play(group, grads[:3] + [bad], [1000.0] * 3 + [claimed], group_size=len(group))[:3]
            want = expected_first_round(grads[:3], [1000.0] * 3, outcomes[0].averaged, others_reduce=True)
            for outcome in outcomes:
                assert outcome.group_size == len(group)
                assert relative_error(outcome.averaged, want) < 1e-2
                assert torch.equal(flat(outcome.averaged), flat(outcomes[0].averaged))
            if round_number == 1:
                assert_banned_by_all(honest, [attacker])
        # banned: it finds no group with the honest peers (they refuse it as a leader and as a follower)
        attacker.round_timeout = 4.0
        alone = play([attacker], [bad], [claimed], group_size=None)[0]
        assert alone.averaged is None


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_a_peer_rejected_here_once_and_banned_by_a_pair_partner_is_banned_here_too():
    """Two witnesses make a ban: a partner's ban note and a strike of this peer's own, whichever comes first. The
    third honest peer, with one strike and no note, has not banned the attacker yet."""
    # (a long window: the leader begins once all four have joined, and a loaded machine may take seconds to)
    with swarm([OneBitCodec() for _ in range(4)], residual_carry=None, matchmaking_time=6.0) as averagers:
        (struck_then_told, told_then_struck, struck_only), attacker = averagers[:3], averagers[3]
        told_then_struck.heed_partners_bans({peer(attacker): 0})
        grads = grads_of_round(0, 4)
        play(averagers, grads[:3] + [[-10 * g for g in grads[3]]], [1000.0] * 4, group_size=4)
        wait_for(lambda: told_then_struck.banned_count == 1)
        assert struck_then_told.banned_count == 0 and peer(attacker) in struck_then_told.caught_peers()
        struck_then_told.heed_partners_bans({peer(attacker): 0})
        wait_for(lambda: struck_then_told.banned_count == 1)
        for averager in (struck_then_told, told_then_struck):
            assert averager.banned_peers() == {peer(attacker): CORROBORATED}
        assert struck_only.banned_count == 0 and peer(attacker) in struck_only.caught_peers()


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_a_far_update_from_a_peer_out_of_step_is_left_out_but_earns_no_strike():
    """A peer that declares other global weights than the group's (an honest peer before its resync) sends an
    update measured against them, which may lie far from the others': left out of the average, no strike. Nor is
    its first update back on the group's base (a resync keeps the progress made on the old weights). The same
    update declaring the group's base from the start is banned after two rounds (test above)."""
    group_base, other_base = {"round": 3, "weights": "cd19"}, {"round": 1, "weights": "883f"}
    with swarm([OneBitCodec() for _ in range(4)], residual_carry=None) as averagers:
        honest, late = averagers[:3], averagers[3]
        for round_number, late_base in enumerate([other_base, other_base, group_base]):
            grads = grads_of_round(round_number, 4)
            far = [-10 * g for g in grads[3]]
            outcomes = play(averagers, grads[:3] + [far], [1000.0] * 4, group_size=4,
                            bases=[group_base] * 3 + [late_base])[:3]
            want = expected_first_round(grads[:3], [1000.0] * 3, outcomes[0].averaged, others_reduce=True)
            for outcome in outcomes:
                assert outcome.group_size == 4 and relative_error(outcome.averaged, want) < 1e-2
        assert all(not averager.caught_peers() for averager in honest)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_flipped_update_declared_on_other_weights_round_after_round_is_banned():
    """A peer may declare any base: one that never declares the group's is excused only in its first rounds
    (`PeerReputation.excuse`), then its -10x updates strike as anyone's. The honest peers' averages stay theirs."""
    with swarm([OneBitCodec() for _ in range(4)], residual_carry=None) as averagers:
        honest, attacker = averagers[:3], averagers[3]
        bases = [{"round": 3, "weights": "cd19"}] * 3 + [{"round": 1, "weights": "883f"}]
        for round_number in range(6):
            grads = grads_of_round(round_number, 4)
            flipped = [-10 * g for g in grads[3]]
            outcomes = play(averagers, grads[:3] + [flipped], [1000.0] * 4, group_size=4, bases=bases)[:3]
            if round_number < 3:
                assert all(averager.banned_count == 0 for averager in honest)
                want = expected_first_round(grads[:3], [1000.0] * 3, outcomes[0].averaged, others_reduce=True)
                assert all(relative_error(outcome.averaged, want) < 1e-2 for outcome in outcomes)
        assert_banned_by_all(honest, [attacker])


@pytest.mark.slow
@pytest.mark.timeout(90)
@pytest.mark.parametrize("scale, banned", [(-1, True), (-10, True), (10, False)], ids=["flipped", "far_flipped", "far"])
def test_a_peer_caught_before_is_struck_out_of_step_for_what_no_honest_peer_out_of_step_sends(scale, banned):
    """Struck once in step, the same kind of update declared on other weights the next round: pointing against the
    others' agreeing parts, or far and against the group's result, it is the second strike (exempt, an ALIE attacker
    that one banning peer's refusals kept out of step every other round was never struck by the others again);
    merely far from the group's, as an honest update on other weights can be, it is not."""
    group_base, other_base = {"round": 3, "weights": "cd19"}, {"round": 1, "weights": "883f"}
    with swarm([OneBitCodec() for _ in range(4)], residual_carry=None) as averagers:
        honest, attacker = averagers[:3], averagers[3]
        for round_number, attacker_base in enumerate([group_base, other_base]):
            generator = torch.Generator().manual_seed(round_number)
            common = [torch.randn(shape, generator=generator) * 1e-3 for shape in SHAPES]
            grads = [[c + 0.2 * torch.randn(c.shape, generator=generator) * 1e-3 for c in common] for _ in range(4)]
            bad = [scale * g for g in grads[3]]
            play(averagers, grads[:3] + [bad], [1000.0] * 4, group_size=4, bases=[group_base] * 3 + [attacker_base])
        if banned:
            assert_banned_by_all(honest, [attacker])
        else:
            assert all(averager.banned_count == 0 and peer(attacker) in averager.caught_peers() for averager in honest)
            # Caught, not banned: no pair with it even where any pair would do (fewer than three live, say).
            grads = grads_of_round(2, 4)
            pending = [a.start_round(g, tokens=1000.0) for a, g in ((honest[0], grads[0]), (attacker, grads[3]))]
            refusing, refused = [p.result(timeout=40) for p in pending]
            assert refusing.averaged is None and refusing.error
            assert refused.group_size == 2  # it got its pair's average: the refusing peer took part


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_a_reducer_answering_minus_50x_loses_its_span_and_is_banned():
    """The honest peers refuse its span's average (they keep theirs for the next round) and never apply it;
    the rest of their average is the group's. Nobody is left stuck: after the ban they average on without it."""
    kinds = [SwarmAverager] * 3 + [LyingReducer]
    with swarm([OneBitCodec() for _ in range(4)], averager_type=kinds) as averagers:
        honest, liar = averagers[:3], averagers[3]
        for round_number in range(2):
            grads = grads_of_round(round_number, 4)
            outcomes = play(averagers, grads, [1000.0] * 4, group_size=4)[:3]
            for outcome in outcomes:
                got = flat(outcome.averaged)
                assert outcome.dropped_peers == 1 and bool(torch.isfinite(got).all())
                lost = got == 0
                assert 0.1 < float(lost.float().mean()) < 0.5  # the liar's span, about a quarter
                if round_number == 0:
                    want = flat(expected_first_round(grads, [1000.0] * 4, outcome.averaged))
                    assert relative(got[~lost], want[~lost]) < 1e-2
        assert_banned_by_all(honest, [liar])
        grads = grads_of_round(2, 3)
        for outcome in play(honest, grads, [1000.0] * 3, group_size=3):
            assert outcome.group_size == 3 and outcome.dropped_peers == 0 and bool((flat(outcome.averaged) != 0).any())


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_a_peer_a_few_steps_into_its_round_refuses_a_50x_answer_too():
    """Just past a state download a peer's part is small next to the group's average, and too small to judge
    an answer's direction by; the bound scaled by its tokens still refuses a reducer's 50x answer."""
    kinds = [SwarmAverager] * 3 + [LyingReducer]
    tokens = [100.0, 1000.0, 1000.0, 1000.0]
    with swarm([OneBitCodec() for _ in range(4)], averager_type=kinds) as averagers:
        grads = grads_of_round(0, 4)
        grads[0] = [g * 0.1 for g in grads[0]]
        for outcome in play(averagers, grads, tokens, group_size=4)[:3]:
            got = flat(outcome.averaged)
            assert outcome.dropped_peers == 1 and bool(torch.isfinite(got).all())
            assert 0.1 < float((got == 0).float().mean()) < 0.5  # the liar's span, refused


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_a_joiner_one_step_into_its_first_round_takes_the_parts_of_peers_that_trained_whole_rounds():
    """A joiner's first update, a step or two past its state download, can be 1,300 times shorter than those of
    the peers whose round it joined late, which trained on 200 times its tokens (seen): no yardstick for their
    norms. Their parts are taken and nobody is struck (a joiner struck a run's founder so)."""
    tokens = [1e3, 2e5, 2e5]
    with swarm([OneBitCodec() for _ in range(3)]) as averagers:
        grads = grads_of_round(0, 3)
        grads[0] = [g / 1700 for g in grads[0]]
        for outcome in play(averagers, grads, tokens, group_size=3):
            assert outcome.group_size == 3 and outcome.dropped_peers == 0
        assert all(not averager.caught_peers(disputed=True) for averager in averagers)


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_a_peer_whose_update_is_near_zero_in_one_part_takes_the_honest_average_of_it():
    """A peer 1-2 steps into its round can have an update some 50x shorter than the group's in one part (rows of
    an embedding it has barely touched) and a normal one elsewhere in the span. Its part is no reference for the
    average's length there: the honest average is taken, as reducer and as sender, with no strike either way.
    (Two peers: parts split at tensor starts, so whichever span peer 0 checks, one whole part of it is near zero.)"""
    with swarm([OneBitCodec() for _ in range(2)]) as averagers:
        grads = grads_of_round(0, 2)
        quiet = [g.clone() for g in grads[0]]
        quiet[0].view(-1)[:2048] /= 50  # the first part of span 0
        quiet[1] /= 50  # the (1000,) tensor: a whole part of span 1
        grads[0] = quiet
        outcomes = play(averagers, grads, [1000.0, 1000.0], group_size=2)
        want = expected_first_round(grads, [1000.0, 1000.0], outcomes[0].averaged)
        for outcome in outcomes:
            assert outcome.group_size == 2 and outcome.dropped_peers == 0
            assert relative_error(outcome.averaged, want) < 1e-2
        assert torch.equal(flat(outcomes[0].averaged), flat(outcomes[1].averaged))
        assert all(not averager.caught_peers(disputed=True) for averager in averagers)


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_a_reducer_answering_minus_the_average_loses_its_span_without_a_strike():
    """An average of the right length pointing away from every sender's part is refused (its span stays zero),
    but earns no strike: a peer out of step with the group can honestly point away from a sender's part."""
    kinds = [SwarmAverager] * 3 + [FlippingReducer]
    with swarm([OneBitCodec() for _ in range(4)], averager_type=kinds) as averagers:
        honest = averagers[:3]
        for round_number in range(2):
            grads = grads_of_round(round_number, 4)
            for outcome in play(averagers, grads, [1000.0] * 4, group_size=4)[:3]:
                assert outcome.dropped_peers == 1
                assert 0.1 < float((flat(outcome.averaged) == 0).float().mean()) < 0.5  # the liar's span
        assert all(averager.banned_count == 0 for averager in honest)


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_a_reducer_telling_peers_different_averages_loses_its_span_on_every_honest_peer_and_is_banned():
    """The truth to one groupmate, 50x it to the others: those it lied to refuse its span and ban it, and the one
    it told the truth drops the span too once their digests differ from its own, so all three apply the very
    same average; most of the group refused what it took, so it bans the liar as well."""
    kinds = [SwarmAverager] * 3 + [TwoFacedReducer]
    with swarm([OneBitCodec() for _ in range(4)], averager_type=kinds) as averagers:
        honest, liar = averagers[:3], averagers[3]
        for round_number in range(2):
            outcomes = play(averagers, grads_of_round(round_number, 4), [1000.0] * 4, group_size=4)[:3]
            got = [flat(o.averaged) for o in outcomes]
            assert all(torch.equal(g, got[0]) for g in got) and bool(torch.isfinite(got[0]).all())
            assert 0.1 < float((got[0] == 0).float().mean()) < 0.5  # the liar's span, about a quarter
            assert all(o.dropped_peers == 1 for o in outcomes)
        assert_banned_by_all(honest, [liar])


class _LeaderSkipReporting(SwarmAverager):
    """An honest averager that says whether its matchmaking would pass over a leader."""

    def skips_leader(self, leader: str) -> bool:
        future = MPFuture()
        self.run_in_averager_process("_report_skip", future=future, leader=leader)
        return future.result(timeout=10)

    async def _report_skip(self, future: MPFuture, leader: str) -> None:
        future.set_result(self._skipped_leader(PeerID.from_base58(leader)))


_LeaderSkipReporting.__name__ = "SwarmAverager"  # hivemind names a peer's RPC handlers after its class


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_an_unsigned_two_faced_reducer_costs_nothing_and_is_no_pair_partner_of_the_peer_it_told_the_truth():
    """2 honest peers + a reducer that lies to one of them and signs only the truth: the peer lied to takes the
    other's signed copy, so both apply the group's true average. The peer told the truth holds no evidence against
    the reducer (no strike, no ban), but its span was disputed, so it is not trusted in a pair. The peer lied to
    has only caught the reducer and still follows it (a group of three it leads is where it earns its second
    strike), so in the next step the peer told the truth follows it too; from the step after, while it averages in
    pairs only with partners, it follows no group the reducer leads: the peer lied to, which has banned the reducer
    by then, would never join it, and the pair it stays would be refused."""
    kinds = [_LeaderSkipReporting] * 2 + [UnsignedTwoFacedReducer]
    with swarm([OneBitCodec() for _ in range(3)], averager_type=kinds, identities=True) as averagers:
        honest, liar = averagers[:2], averagers[2]
        grads = grads_of_round(0, 3)
        outcomes = play(averagers, grads, [1000.0] * 3, group_size=3)[:2]
        got = [flat(o.averaged) for o in outcomes]
        assert torch.equal(got[0], got[1])
        assert relative(got[0], flat(expected_first_round(grads, [1000.0] * 3, outcomes[0].averaged))) < 1e-2
        told_the_truth = min(honest, key=lambda averager: str(averager.peer_id))  # tests/attacks.py's choice
        lied_to = max(honest, key=lambda averager: str(averager.peer_id))
        assert peer(liar) not in told_the_truth.caught_peers()
        assert peer(liar) in told_the_truth.caught_peers(disputed=True)
        assert peer(liar) in lied_to.caught_peers()
        assert not told_the_truth.banned_peers()
        assert not told_the_truth.skips_leader(peer(liar))  # a round that takes any pair follows anyone
        for step_after_the_dispute in (1, 2):
            for averager, partner in ((told_the_truth, lied_to), (lied_to, told_the_truth)):
                averager.schedule_round(30.0, tokens=1000.0, pair_partners=[peer(partner)])
            assert told_the_truth.skips_leader(peer(liar)) == (step_after_the_dispute == 2)
            assert not told_the_truth.skips_leader(peer(lied_to))
            assert not lied_to.skips_leader(peer(liar))
            for averager in honest:
                averager.cancel_scheduled_round()


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_the_peer_an_unsigned_two_faced_reducer_lied_to_skips_it_at_once_after_banning_it():
    """The peer it lied to bans it after two rounds; the peer told the truth has held it disputed since the first,
    and skips it as a leader while its pairs are for partners. So the peer lied to skips it at once too, instead of
    following it for one more step, as it would a leader it just banned: it would be left in a pair with it."""
    kinds = [_LeaderSkipReporting] * 2 + [UnsignedTwoFacedReducer]
    with swarm([OneBitCodec() for _ in range(3)], averager_type=kinds, identities=True) as averagers:
        honest, liar = averagers[:2], averagers[2]
        for round_number in range(2):
            play(averagers, grads_of_round(round_number, 3), [1000.0] * 3, group_size=3)
        told_the_truth = min(honest, key=lambda averager: str(averager.peer_id))  # tests/attacks.py's choice
        lied_to = max(honest, key=lambda averager: str(averager.peer_id))
        assert set(lied_to.banned_peers()) == {peer(liar)} and not told_the_truth.banned_peers()
        for averager, partner in ((told_the_truth, lied_to), (lied_to, told_the_truth)):
            averager.schedule_round(30.0, tokens=1000.0, pair_partners=[peer(partner)])
        assert told_the_truth.skips_leader(peer(liar)) and lied_to.skips_leader(peer(liar))
        for averager in honest:
            averager.cancel_scheduled_round()


@pytest.mark.slow
@pytest.mark.timeout(90)
@pytest.mark.parametrize("liar_kind, codec", [(TwoFacedReducer, OneBitCodec), (LyingReducer, OneBitCodec),
                                               (LyingReducer, E8StagedReturnCodec)],
                         ids=["two_faced", "minus_50x_to_both", "minus_50x_to_both_in_e8_stages"])
def test_a_reducer_signing_two_different_averages_is_proven_a_liar_and_banned_by_both(liar_kind, codec):
    """2 honest peers + a reducer that signs its lies. Two-faced (the truth to one): in a group of three the peer
    told the truth cannot tell the liar from the groupmate that refused its average; signed spans settle it:
    each shows the other the average the reducer signed to it, both ban the reducer after one round, and nothing
    is lost: the peer it lied to takes the other's signed copy of the truth. -50x to both: both refuse it; its
    own digests say it took its span, and it would serve a signed copy of the true average that passes every
    check, but a reducer's word alone recovers nothing (it reached one groupmate in time and not the other, and
    the two parted): both drop its span. Either way the two apply the same average."""
    kinds = [SwarmAverager] * 2 + [liar_kind]
    with swarm([codec() for _ in range(3)], averager_type=kinds, identities=True) as averagers:
        honest, liar = averagers[:2], averagers[2]
        grads = grads_of_round(0, 3)
        outcomes = play(averagers, grads, [1000.0] * 3, group_size=3)[:2]
        got = [flat(o.averaged) for o in outcomes]
        assert torch.equal(got[0], got[1]) and bool(torch.isfinite(got[0]).all())
        if liar_kind is TwoFacedReducer:
            assert relative(got[0], flat(expected_first_round(grads, [1000.0] * 3, outcomes[0].averaged))) < 1e-2
        else:
            assert 0.15 < float((got[0] == 0).float().mean()) < 0.55  # the liar's span, about a third
        wait_for(lambda: all(a.banned_count for a in honest))  # the evidence goes out after the digests
        assert_banned_by_all(honest, [liar])
        assert all("signed two different averages" in a.banned_peers()[peer(liar)] for a in honest)


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_a_peer_follows_a_leader_it_banned_for_one_more_step_then_never():
    """Groupmates holding the same evidence may ban a peer a round apart: the one that bans first still follows
    the peer's group in the next step, as the others still do, and skips it from the step after (it was left
    alone else, a round behind the others)."""
    kinds = [_LeaderSkipReporting] * 2 + [TwoFacedReducer]
    with swarm([OneBitCodec() for _ in range(3)], averager_type=kinds, identities=True) as averagers:
        honest, liar = averagers[:2], averagers[2]
        play(averagers, grads_of_round(0, 3), [1000.0] * 3, group_size=3)
        wait_for(lambda: all(averager.banned_count == 1 for averager in honest))
        for step_after_the_ban in (1, 2):
            for averager in honest:
                averager.schedule_round(30.0, tokens=1000.0)  # any pair: no pair rule to skip it by
            for averager in honest:
                assert averager.skips_leader(peer(liar)) == (step_after_the_ban == 2)
                assert not averager.skips_leader(peer(next(a for a in honest if a is not averager)))
            for averager in honest:
                averager.cancel_scheduled_round()


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_a_leader_is_followed_one_step_from_the_first_ban_among_a_peer_and_its_partners():
    """A peer that banned the liar in the round its partner's note dates a round earlier leaves it as a leader at
    once, as that partner does; a peer without such a note follows it one more step (a step of grace of its own
    left the late one in a refused pair with the leader its partners had left, and a state download)."""
    kinds = [_LeaderSkipReporting] * 2 + [TwoFacedReducer]
    with swarm([OneBitCodec() for _ in range(3)], averager_type=kinds, identities=True) as averagers:
        (late, alone), liar = averagers[:2], averagers[2]
        play(averagers, grads_of_round(0, 3), [1000.0] * 3, group_size=3)
        wait_for(lambda: late.banned_count == 1 and alone.banned_count == 1)
        late.heed_partners_bans({peer(liar): 1})  # a partner, banned it a round before
        for averager in (late, alone):
            averager.schedule_round(30.0, tokens=1000.0)
        assert late.skips_leader(peer(liar)) and not alone.skips_leader(peer(liar))
        for averager in (late, alone):
            averager.cancel_scheduled_round()


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_a_peer_banning_on_a_partners_note_of_this_round_follows_the_leader_one_more_step_as_the_partner_does():
    """The partner banned the attacker in the round applied last, and follows it one more step. A peer that bans
    it on that note and a strike of its own follows it that step too, and skips it from the step after (skipping
    it at once left the partner in a pair with it, refused, and a state download)."""
    kinds = [_LeaderSkipReporting] * 3 + [SwarmAverager]
    # (a long window: the leader begins once all four have joined, and a loaded machine may take seconds to)
    with swarm([OneBitCodec() for _ in range(4)], averager_type=kinds, residual_carry=None,
               matchmaking_time=6.0) as averagers:
        honest, attacker = averagers[:3], averagers[3]
        grads = grads_of_round(0, 4)
        play(averagers, grads[:3] + [[-10 * g for g in grads[3]]], [1000.0] * 4, group_size=4)
        told, partner = honest[0], honest[1]
        wait_for(lambda: peer(attacker) in told.caught_peers())
        told.heed_partners_bans({peer(attacker): 0})
        wait_for(lambda: told.banned_count == 1)
        assert told.banned_peers() == {peer(attacker): CORROBORATED}
        for step_after_the_note in (1, 2):
            told.schedule_round(30.0, tokens=1000.0, pair_partners=[peer(partner)])
            assert told.skips_leader(peer(attacker)) == (step_after_the_note == 2)
            assert not told.skips_leader(peer(partner))
            told.cancel_scheduled_round()


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_a_peer_that_was_not_there_bans_a_proven_liar_once_it_meets_a_witness():
    """A two-faced reducer caught in a group of three: the witnesses show the proof to the first groupmate they
    meet that was not there, and it bans the liar too, without ever meeting it."""
    kinds = [SwarmAverager] * 3 + [TwoFacedReducer]
    with swarm([OneBitCodec() for _ in range(4)], averager_type=kinds, identities=True) as averagers:
        witness, other, newcomer, liar = averagers
        play([witness, other, liar], grads_of_round(0, 3), [1000.0] * 3, group_size=3)
        wait_for(lambda: witness.banned_count == 1)
        assert newcomer.banned_count == 0
        play([witness, newcomer], grads_of_round(1, 2), [1000.0] * 2, group_size=2)
        wait_for(lambda: newcomer.banned_count == 1)
        assert "signed two different averages" in newcomer.banned_peers()[peer(liar)]


def wait_for(condition, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.2)


@pytest.mark.slow
@pytest.mark.timeout(90)
@pytest.mark.parametrize("disputers, lost", [([DisputingPeer], 0), ([DisputingOnePeer], 1),
                                              ([DisputingOnePeer] * 2, 1)], ids=["all_spans", "one_span", "a_pair"])
def test_groupmates_disputing_spans_cost_at_most_one_span_and_frame_nobody(disputers, lost):
    """A groupmate claiming it got other averages of every span is not believed; one disputing a single span makes
    every honest peer drop that span alike, and so does a pair (3 + 2) disputing the same span. Either way the
    honest peers apply the same average, and the honest reducer of that span is struck by nobody: fewer than
    half of its group claim to have refused it."""
    count = 3 + len(disputers)
    # (a long window: the leader begins once all of them have joined, and a loaded machine may take seconds to)
    with swarm([OneBitCodec() for _ in range(count)], averager_type=[SwarmAverager] * 3 + disputers,
               part_size_bytes=64, matchmaking_time=6.0) as averagers:
        for round_number in range(2):  # two rounds: two strikes would ban
            grads = grads_of_round(round_number, count)
            outcomes = play(averagers, grads, [1000.0] * count, group_size=count)[:3]
            got = [flat(o.averaged) for o in outcomes]
            assert all(torch.equal(g, got[0]) for g in got)
            assert all(o.dropped_peers == lost for o in outcomes)
            kept = got[0] != 0
            assert (0.05 < float((~kept).float().mean()) < 0.5) if lost else bool(kept.all())
            if round_number == 0:  # (later rounds carry the error feedback)
                want = flat(expected_first_round(grads, [1000.0] * count, outcomes[0].averaged))
                assert relative(got[0][kept], want[kept]) < 1e-2
        assert all(averager.banned_count == 0 for averager in averagers[:3])


@pytest.mark.slow
@pytest.mark.timeout(90)
@pytest.mark.parametrize("signed", [False, True], ids=["unsigned", "signed"])
def test_a_groupmate_that_lost_a_span_leaves_its_reducer_trusted(signed):
    """A groupmate reporting one span lost (its reducer timed out for it, say) makes no reducer a suspect: the
    honest peers keep one another as pair partners. (Counted as a dispute, an attacker that lost one honest
    reducer's span left the two honest peers of a 2 + 1 swarm refusing each other's pairs.)"""
    with swarm([OneBitCodec() for _ in range(4)], averager_type=[SwarmAverager] * 3 + [LosingOnePeer],
               part_size_bytes=64, identities=signed, matchmaking_time=6.0,
               next_chunk_timeout=15.0) as averagers:  # all four, and no span of theirs lost, under load
        honest = averagers[:3]
        outcomes = play(averagers, grads_of_round(0, 4), [1000.0] * 4, group_size=4)[:3]
        assert all(o.group_size == 4 for o in outcomes)
        got = [flat(o.averaged) for o in outcomes]
        assert all(torch.equal(g, got[0]) for g in got)
        for averager in honest:
            assert not {peer(a) for a in honest} & averager.caught_peers(disputed=True)


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_a_colluding_a_little_is_enough_pair_is_left_out_and_banned():
    """3 honest + 2 colluders sending mean - std of the honest updates (the attack knows them): every honest
    reducer flags the pair, the honest peers get the honest-only average of the spans they reduce, and ban both.
    (A colluder's own span is its to bias within what the senders' reply checks accept. Smaller parts: each of
    the 5 peers reduces some, and only a reducer sees the contributions.)"""
    with swarm([OneBitCodec() for _ in range(5)], residual_carry=None, part_size_bytes=64) as averagers:
        honest, colluders = averagers[:3], averagers[3:]
        for round_number in range(2):
            grads = grads_of_round(round_number, 3)
            shifted = [alie(parts) for parts in zip(*grads)]
            outcomes = play(averagers, grads + [shifted, shifted], [1000.0] * 5, group_size=5)[:3]
            got = flat(outcomes[0].averaged)
            want = flat(expected_first_round(grads, [1000.0] * 3, outcomes[0].averaged))
            close = (got - want).view(-1, 8).norm(dim=1) <= 1e-3 * want.view(-1, 8).norm(dim=1)
            honest_only = close.repeat_interleave(8)  # (8 values at a time: spans end on block boundaries)
            assert float(honest_only.float().mean()) > 0.5  # the 3 honest reducers' spans, 3/5 of the values
            assert relative(got[honest_only], want[honest_only]) < 1e-2
            for outcome in outcomes:
                assert bool(torch.isfinite(flat(outcome.averaged)).all())
                assert torch.equal(flat(outcome.averaged), got)
        assert_banned_by_all(honest, colluders)


# ---- end to end: `tscale-peer join` processes ----

@pytest.mark.slow
@pytest.mark.timeout(180)
def test_join_swarm_with_a_sign_flipping_attacker_trains_on_and_bans_it(spawn, tmp_path, text_file, monkeypatch,
                                                                          capsys):
    """3 honest `join`s and one whose averager sends -10x its update claiming 10^12 tokens (tests/attacks.py):
    the honest peers learn as if it were not there, ban it, and `peers --json` shows their bans, which each also
    tells in its signed ban note (peers/ban_notes.py)."""
    bootstrap = bootstrap_with_hivemind_dht(spawn)
    common = ["--initial-peers", bootstrap, "--run-id", "attacked", "--min-peers", "4", *TINY, "--steps", "60",
              "--inner-steps", "5", "--matchmaking-time", "2", "--averaging-timeout", "20"]
    honest = [spawn(name, *join_args(name, text_file, "--name", name, *common)) for name in ("a", "b", "c")]
    monkeypatch.setenv("TSCALE_ATTACK", "heavy_sign_flip")
    attacker = spawn("x", sys.executable, str(Path(__file__).with_name("attacks.py")),
                     *join_flags("x", text_file, "--name", "x", *common))
    attacker_id = attacker.wait_for(r"peer id (\w+)", timeout=60)[0].group(1)
    honest_ids = [peer.wait_for(r"peer id (\w+)", timeout=60)[0].group(1) for peer in honest]
    for peer in honest:
        peer.wait_for(rf"banning {attacker_id} for the rest of the run", timeout=90)
    # Each peer publishes its metrics and its ban note every few seconds, a busy one (resyncing, say) later: ask
    # until all three show their ban, then check that nobody else was banned.
    reader = hivemind.DHT(initial_peers=[bootstrap], client_mode=True, start=True)
    notes = BanNotes(reader, "attacked", "reader")
    try:
        deadline = time.monotonic() + 60
        while True:
            capsys.readouterr()
            assert main(["peers", "--initial-peers", bootstrap, "--run-id", "attacked", "--json"]) == 0
            records = {record["name"]: record for record in json.loads(capsys.readouterr().out)}
            banned = [records[name]["banned_peers"] if name in records else 0 for name in "abc"]
            notes.exchange([], round_number=0)
            told = [set(notes.noted_by([peer_id])) for peer_id in honest_ids]
            if (min(banned) >= 1 and all(told)) or time.monotonic() > deadline:
                break
            time.sleep(2)
    finally:
        reader.shutdown()
    assert banned == [1, 1, 1]
    assert told == [{attacker_id}] * 3
    for peer in honest:
        assert peer.wait(90) == 0, peer.summary()
        losses = [float(v) for v in re.findall(r"step \d+  round \d+  loss (\S+)", peer.output())]
        assert all(math.isfinite(v) for v in losses) and losses[-1] < 0.7 * losses[0], losses
        assert all(bool(torch.isfinite(t).all()) for t in shared_weights(tmp_path / peer.log.stem))
        assert "Traceback" not in peer.output()
