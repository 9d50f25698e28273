"""SwarmAverager on real hivemind DHTs and p2pd daemons over loopback: agreement, bad peers, a killed peer."""

import asyncio
import contextlib
import gc
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
import weakref
from pathlib import Path
from typing import AsyncIterator

import hivemind
from hivemind.p2p import P2PContext
from hivemind.proto import averaging_pb2
import pytest
import torch

from attacks import StallingPeer
from tscale_p2p.kernels.onebit import pack, unpack
from tscale_p2p.peers.averaging import SwarmAverager, keep_tasks_until_done
from tscale_p2p.peers.codec import BLOCK_SIZE, E8Codec, E8StagedReturnCodec, OneBitCodec, TopKCodec
from tscale_p2p.peers.records import IdentityKey

pytestmark = [pytest.mark.timeout(90), pytest.mark.slow]

SHAPES = [(96, 64), (1000,), (33, 40)]
# 2048 values per part: every peer reduces several parts, and parts do not line up with tensors.
AVERAGER_OPTIONS = dict(
    matchmaking_time=2.0, round_timeout=15.0, allreduce_timeout=15.0, next_chunk_timeout=5.0, part_size_bytes=256
)


def onebit(tensor: torch.Tensor) -> torch.Tensor:
    signs, scales = pack(tensor, BLOCK_SIZE)
    return unpack(signs, scales, tensor.numel(), BLOCK_SIZE).view(tensor.shape)


def capped(tokens: list[float]) -> list[float]:
    """The weights a reducer gives claimed token counts: none above the group's (high) median claim."""
    median = statistics.median_high(tokens)
    return [min(t, median) for t in tokens]


def weighted_mean(grads: list[list[torch.Tensor]], tokens: list[float]) -> list[torch.Tensor]:
    """What a reducer makes of honest, alike contributions: their mean, weighted by capped tokens (robust
    aggregation clips nothing among them)."""
    weights = capped(tokens)
    return [sum(w * g[i] for g, w in zip(grads, weights)) / sum(weights) for i in range(len(SHAPES))]


def expected_first_round(grads, tokens, like, codec=OneBitCodec(), others_reduce=False) -> list[torch.Tensor]:
    """Senders send the codec's form of their grads, except that each reducer takes its own part of its span
    exactly (with the sign code); the reducer sends back its return form of their weighted mean; no residuals
    yet in round one. Which peer reduced which values is the group's draw, so each block of 256 values is the
    one, among the peers' candidates (that peer exact), nearest to `like` (the average got) there; with
    `others_reduce`, peers whose parts are left out reduce spans too, where every part of `grads` is coded."""
    candidates = []
    for reducer in range(len(grads) + others_reduce):
        sent = [[g if index == reducer and codec.own_part_exact else codec.carried(g) for g in peer]
                for index, peer in enumerate(grads)]
        candidates.append([codec.return_trip.carried(mean) for mean in weighted_mean(sent, tokens)])
    expected = []
    for index, got in enumerate(like):
        options = [candidate[index].reshape(-1).split(256) for candidate in candidates]
        blocks = [min((option[b] for option in options), key=lambda block: float((block - got_block).norm()))
                  for b, got_block in enumerate(got.reshape(-1).split(256))]
        expected.append(torch.cat(blocks).view_as(got))
    return expected


def first_round_error(averaged, grads, tokens) -> float:
    """How far a first round's 1-bit average is from the one expected of these grads."""
    return relative_error(averaged, expected_first_round(grads, tokens, averaged))


def relative_error(got: list[torch.Tensor], want: list[torch.Tensor]) -> float:
    return float(torch.cat([(a - b).view(-1) for a, b in zip(got, want)]).norm() / torch.cat(
        [b.view(-1) for b in want]).norm())


def random_grads(seed: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=generator) * 1e-3 for shape in SHAPES]


@contextlib.contextmanager
def swarm(codecs: list[OneBitCodec], averager_type: type | list[type] = SwarmAverager, identities: bool = False,
          **overrides):
    """One DHT + averager (a SwarmAverager, or the type at its place in a list) per codec on 127.0.0.1, all shut
    down afterwards; with `identities`, each peer has a libp2p identity file and signs its spans with its key,
    as `join` peers do."""
    dhts, averagers = [], []
    with tempfile.TemporaryDirectory() as folder:
        try:
            keys = []
            for index, _ in enumerate(codecs):
                initial_peers = dhts[0].get_visible_maddrs() if dhts else None
                path = str(Path(folder) / f"peer{index}.key") if identities else None
                dhts.append(hivemind.DHT(start=True, initial_peers=initial_peers, identity_path=path))
                keys.append(IdentityKey(path) if identities else None)
            template = [torch.zeros(shape) for shape in SHAPES]
            types = averager_type if isinstance(averager_type, list) else [averager_type] * len(codecs)
            for dht, codec, kind, key in zip(dhts, codecs, types, keys):
                options = {**AVERAGER_OPTIONS, **overrides}
                averagers.append(kind(template, dht, prefix="test", codec=codec, identity=key, **options))
            yield averagers
        finally:
            for averager in averagers:
                averager.shutdown()
            for dht in dhts:
                dht.shutdown()


def run_round(averagers, grads, tokens):
    pending = [a.start_round(g, tokens=t) for a, g, t in zip(averagers, grads, tokens)]
    return [p.result(timeout=40) for p in pending]


# TopKCodec's chunks are 4096 values: parts of 4096 (512 bytes at hivemind's 1/32 estimate), 8 values kept a chunk
# on the way out (4 levels) and 24 on the way back, so three senders' picks mostly fit and the trip is still lossy
CODEC_CASES = {"sign": (lambda: OneBitCodec(), 256), "e8": (lambda: E8Codec(), 256),
               "e8s": (lambda: E8StagedReturnCodec(), 256),
               "topk": (lambda: TopKCodec(k=8, return_k=24), 512)}


@pytest.mark.parametrize("codec_name", sorted(CODEC_CASES))
def test_three_peers_average_agree_and_error_feedback_keeps_the_books(codec_name):
    make_codec, part_size_bytes = CODEC_CASES[codec_name]
    grads, tokens = [random_grads(seed) for seed in range(3)], [1000.0, 2000.0, 3000.0]
    true_mean = torch.cat([m.view(-1) for m in weighted_mean(grads, tokens)])
    rounds = 3
    with swarm([make_codec() for _ in range(3)], reducer_error_feedback=True,
               part_size_bytes=part_size_bytes) as averagers:
        delivered, errors = torch.zeros_like(true_mean), []
        for round_number in range(rounds):
            outcomes = run_round(averagers, grads, tokens)
            for outcome in outcomes:
                assert outcome.error is None and outcome.group_size == 3 and outcome.group_tokens == 6000.0
                assert outcome.dropped_peers == 0
                assert outcome.bytes_sent > 0 and outcome.bytes_received > 0
                for got, want in zip(outcome.averaged, outcomes[0].averaged):
                    assert torch.equal(got, want)  # every peer decodes the very same average
            # Both trips counted: as a sender (n-1)/n of the model, as a reducer its span once per groupmate, so
            # the group sends 2(n-1) models' worth of values in all, whatever the spans, and receives them all.
            assert sum(o.values_sent for o in outcomes) == sum(o.values_received for o in outcomes) == 4 * true_mean.numel()
            if round_number == 0:
                expected = expected_first_round(grads, tokens, outcomes[0].averaged, make_codec())
                assert relative_error(outcomes[0].averaged, expected) < 1e-2
            delivered += torch.cat([t.view(-1) for t in outcomes[0].averaged])
            target = true_mean * (round_number + 1)
            errors.append(float((delivered - target).norm() / target.norm()))
        states = [a.error_feedback_state() for a in averagers]
    # Nothing is lost, only delayed: what was delivered, plus what reducers still owe, plus the weighted
    # residuals senders still owe, is exactly the sum of the true means (same pseudo-gradients each round).
    owed_by_reducers = sum(state["reducer"] for state in states)
    owed_by_senders = sum(w * state["sender"] for w, state in zip(capped(tokens), states)) / sum(capped(tokens))
    books = delivered + owed_by_reducers + owed_by_senders
    assert float((books - rounds * true_mean).norm() / (rounds * true_mean).norm()) < 1e-4
    # ... and what is owed grows slower than what is delivered (without error feedback the relative error
    # of the sum would stay at the first round's).
    assert errors[0] > errors[1] > errors[2], errors


def test_a_client_mode_peer_contributes_and_gets_the_same_average():
    """A peer behind NAT (client-mode DHT: it accepts no connections) only sends; the others reduce for it."""
    grads, tokens = [random_grads(seed) for seed in range(3)], [1000.0, 2000.0, 3000.0]
    dhts, averagers = [], []
    try:
        dhts.append(hivemind.DHT(start=True))
        for client_mode in (False, True):
            dhts.append(hivemind.DHT(start=True, initial_peers=dhts[0].get_visible_maddrs(), client_mode=client_mode))
        template = [torch.zeros(shape) for shape in SHAPES]
        averagers = [SwarmAverager(template, dht, prefix="test", **AVERAGER_OPTIONS) for dht in dhts]
        assert averagers[2].client_mode
        outcomes = run_round(averagers, grads, tokens)
    finally:
        for averager in averagers:
            averager.shutdown()
        for dht in dhts:
            dht.shutdown()
    assert [o.group_size for o in outcomes] == [3, 3, 3]
    for outcome in outcomes[1:]:
        for got, want in zip(outcome.averaged, outcomes[0].averaged):
            assert torch.equal(got, want)
    assert first_round_error(outcomes[0].averaged, grads, tokens) < 1e-2


class NaNScales(OneBitCodec):
    """Sends (and answers with) a NaN scale."""

    def _encode(self, x):
        signs, scales = super()._encode(x)
        return signs, torch.full_like(scales, float("nan"))


class WrongShape(OneBitCodec):
    """Sends (and answers with) well-formed parts that have one value too many."""

    def compress(self, tensor, info, allow_inplace=False):
        return super().compress(torch.zeros(tensor.numel() + 1), info)


class HugeNorm(OneBitCodec):
    """Sends (and answers with) well-formed, finite parts a million times larger than anyone else's."""

    def _encode(self, x):
        signs, scales = super()._encode(x)
        return signs, scales * 1e6


def test_peers_sending_nan_wrong_shapes_or_absurd_norms_are_dropped():
    codecs = [OneBitCodec(), OneBitCodec(), NaNScales(), WrongShape(), HugeNorm()]
    grads = [random_grads(seed) for seed in range(len(codecs))]
    tokens = [1000.0, 3000.0, 1000.0, 1000.0, 1000.0]
    # ~17 parts of 512 values: a few per peer; senders carry half their residual into the next round
    with swarm(codecs, part_size_bytes=64, residual_carry=0.5) as averagers:
        pending = [a.start_round(g, tokens=t) for a, g, t in zip(averagers, grads, tokens)]
        first, second = [p.result(timeout=40) for p in pending[:2]]  # the bad peers' fate does not matter
        first_state = averagers[0].error_feedback_state()
    for outcome in (first, second):
        assert outcome.error is None and outcome.group_size == len(codecs)
        assert outcome.dropped_peers == 3  # NaNScales, WrongShape, HugeNorm: refused as senders and as reducers
        assert all(bool(torch.isfinite(t).all()) for t in outcome.averaged)
    for a, b in zip(first.averaged, second.averaged):
        assert torch.equal(a, b)
    got = torch.cat([t.view(-1) for t in first.averaged])
    want = torch.cat([t.view(-1) for t in expected_first_round(grads[:2], tokens[:2], first.averaged)])
    # Spans reduced by an honest peer hold the honest-only average; the answers of the bad peers for the
    # spans they reduced are refused on receipt, so those stay zero. Nothing else may appear.
    reduced = got != 0
    assert 0.2 < float(reduced.float().mean()) < 0.6
    assert float((got[reduced] - want[reduced]).norm() / want[reduced].norm()) < 1e-2
    # What no honest reducer averaged is reported lost (the peer keeps its update there in its weights) and
    # owes nothing in error feedback, as before the round; nothing is owed of its own part of the span it reduced
    # (taken exactly), and elsewhere half of what the 1-bit message could not carry.
    assert torch.equal(first.lost, ~reduced) and torch.equal(second.lost, ~reduced)
    mine = torch.cat([g.view(-1) for g in grads[0]])
    owed = first_state["sender"]
    torch.testing.assert_close(owed[~reduced], torch.zeros_like(owed[~reduced]), rtol=0, atol=1e-9)
    sent = torch.cat([onebit(g).view(-1) for g in grads[0]])
    own = reduced & (owed == 0)
    assert 0.1 < float(own.float().mean()) < 0.35  # its span: a fifth of the values
    torch.testing.assert_close(owed[reduced & ~own], 0.5 * (mine - sent)[reduced & ~own], rtol=0, atol=1e-9)


def test_a_round_may_carry_more_of_its_residual_than_the_averager_does():
    """`start_round(residual_carry=...)` sets that round's share of the residual carried on (join's opening
    rounds carry all of it), in place of the averager's damped share; an out-of-range share is refused."""
    grads, tokens, carries = [random_grads(seed) for seed in range(2)], [1000.0, 1000.0], (1.0, None)
    with swarm([OneBitCodec(), OneBitCodec()], part_size_bytes=64, residual_carry=0.5) as averagers:
        with pytest.raises(ValueError, match="residual_carry must be in \\[0, 1\\], got 1.5"):
            averagers[0].start_round(grads[0], tokens=1000.0, residual_carry=1.5)
        pending = [a.start_round(g, tokens=t, residual_carry=c) for a, g, t, c in zip(averagers, grads, tokens, carries)]
        outcomes = [p.result(timeout=40) for p in pending]
        owed = [a.error_feedback_state()["sender"] for a in averagers]
    for outcome, grad, peer_owes, share in zip(outcomes, grads, owed, (1.0, 0.5)):
        assert outcome.error is None and outcome.group_size == 2
        mine = torch.cat([g.view(-1) for g in grad])
        sent = torch.cat([onebit(g).view(-1) for g in grad])
        sent_coded = peer_owes != 0  # its own span was taken exactly and owes nothing
        assert 0.3 < float(sent_coded.float().mean()) < 0.7
        torch.testing.assert_close(peer_owes[sent_coded], share * (mine - sent)[sent_coded], rtol=0, atol=1e-9)


def test_a_peer_on_another_codec_is_dropped_as_sender_and_as_reducer():
    """E8 words and signs take the same bytes: a sign-coded part must not pass for E8 words (or the reverse)."""
    grads, tokens = [random_grads(seed) for seed in range(3)], [1000.0, 1000.0, 1000.0]
    with swarm([E8Codec(), E8Codec(), OneBitCodec()], part_size_bytes=64) as averagers:
        pending = [a.start_round(g, tokens=t) for a, g, t in zip(averagers, grads, tokens)]
        first, second = [p.result(timeout=40) for p in pending[:2]]
    for outcome in (first, second):
        assert outcome.error is None and outcome.group_size == 3 and outcome.dropped_peers == 1
    for a, b in zip(first.averaged, second.averaged):
        assert torch.equal(a, b)
    got = torch.cat([t.view(-1) for t in first.averaged])
    want = torch.cat([t.view(-1) for t in expected_first_round(grads[:2], tokens[:2], first.averaged, E8Codec())])
    reduced = got != 0  # the sign peer's span: its answer refused, so zero
    assert 0.4 < float(reduced.float().mean()) < 0.9
    assert float((got[reduced] - want[reduced]).norm() / want[reduced].norm()) < 1e-2


def test_a_peer_with_far_fewer_tokens_keeps_the_groups_average():
    """Just after a state download a peer may be a few steps into its round while the others are at its end:
    its pseudo-gradient is ~200x smaller. Norm bounds scale with tokens, so nobody is dropped."""
    tokens = [100.0, 5000.0]
    grads = [[g * 0.005 for g in random_grads(0)], random_grads(1)]
    with swarm([OneBitCodec(), OneBitCodec()]) as averagers:
        outcomes = run_round(averagers, grads, tokens)
    for outcome in outcomes:
        assert outcome.error is None and outcome.group_size == 2 and outcome.dropped_peers == 0
    for got, want in zip(*(outcome.averaged for outcome in outcomes)):
        assert torch.equal(got, want)
    assert first_round_error(outcomes[0].averaged, grads, tokens) < 1e-2


def test_a_peer_far_short_of_the_groups_tokens_refuses_a_long_average_but_strikes_nobody():
    """In a cold first round's learning-rate warm-up an update grows faster than its steps, so a peer a few steps
    in can find an honest average longer than the token allowance admits. It refuses that span (its part is what a
    lying reducer would aim at) but does not take the honest reducers for liars, and the others average as usual."""
    tokens = [100.0, 5000.0, 5000.0]
    # the others' parts 2000x ours: within a part's bound (100 x the 50x token allowance), while their average,
    # ~1400x our part, is over the average's (10 x 50)
    grads = [[g * 5e-4 for g in random_grads(0)], random_grads(1), random_grads(2)]
    with swarm([OneBitCodec()] * 3) as averagers:
        outcomes = run_round(averagers, grads, tokens)
        short, caught = outcomes[0], [averager.caught_peers() for averager in averagers]
    assert short.error is None and short.group_size == 3 and short.dropped_peers == 2  # both other spans refused
    assert caught == [set(), set(), set()]
    for got, want in zip(outcomes[1].averaged, outcomes[2].averaged):
        assert torch.equal(got, want)


def test_a_peer_whose_update_is_far_shorter_than_its_spans_aggregate_strikes_no_reducer_for_a_long_average():
    """At the group's tokens, a peer a few steps into a cold round's warm-up can have an update 13x shorter than
    the others'. Its own span shows that (its robust aggregate far longer than its part), so the honest averages it
    refuses as over-long earn their reducers no strike; a peer whose update is as long as its span's aggregate
    still strikes (the -50x reducer of tests/test_robust.py)."""
    tokens = [1000.0] * 3
    # the others' parts 30x ours: within a part's bound (100x), their average ~20x ours, over the average's (10x)
    grads = [[g / 30 for g in random_grads(0)], random_grads(1), random_grads(2)]
    with swarm([OneBitCodec()] * 3) as averagers:
        outcomes = run_round(averagers, grads, tokens)
        caught = [averager.caught_peers() for averager in averagers]
    assert outcomes[0].error is None and outcomes[0].dropped_peers == 2  # both other spans refused
    assert caught == [set(), set(), set()]


def test_a_pair_with_a_peer_outside_pair_partners_is_refused_without_stalling_the_other():
    """`pair_partners` names whom a round averages with in a group of two. The refusing peer takes no average
    (nothing is owed for it) but still takes part, so a partner that accepts the pair gets their average
    instead of waiting out the chunk timeout for parts that never come; once named, the pair is taken. A round scheduled while any pair
    would do follows the rule it is started with (the clock may have seen more peers meanwhile)."""
    grads, tokens = [random_grads(0), random_grads(1)], [1000.0, 1000.0]
    with swarm([OneBitCodec(), OneBitCodec()], round_timeout=6.0, next_chunk_timeout=30.0) as (wary, trusting):
        wary.schedule_round(0.5, tokens=1000.0, pair_partners=None)
        refused = wary.start_round(grads[0], tokens=1000.0, pair_partners=())
        taken = trusting.start_round(grads[1], tokens=1000.0).result(timeout=40)
        # the refuser's parts and answers all came (a silent peer would have been dropped after the timeout)
        assert taken.error is None and taken.group_size == 2 and taken.dropped_peers == 0
        assert first_round_error(taken.averaged, grads, tokens) < 1e-2
        outcome = refused.result(timeout=40)
        assert outcome.averaged is None and outcome.error  # refused, then no group left to find
        assert float(wary.error_feedback_state()["sender"].norm()) < 1e-6  # nothing owed for the refused round
        ids = [str(a.peer_id) for a in (wary, trusting)]
        met = [a.start_round(g, tokens=t, pair_partners=ids) for a, g, t in zip((wary, trusting), grads, tokens)]
        outcomes = [p.result(timeout=40) for p in met]
    for outcome in outcomes:
        assert outcome.error is None and outcome.group_size == 2
    for got, want in zip(*(outcome.averaged for outcome in outcomes)):
        assert torch.equal(got, want)


def test_a_round_scheduled_ahead_averages_one_all_reduce_after_it_starts():
    """Matchmaking runs while the last steps train: once every peer hands over its pseudo-gradient (with its
    exact token count, not the estimate it scheduled with), the average comes without another matchmaking
    window. Meanwhile the residuals can be read without waiting, and a cancelled schedule leaves no trace."""
    grads, tokens = [random_grads(seed) for seed in range(3)], [1000.0, 2000.0, 3000.0]
    matchmaking_time = AVERAGER_OPTIONS["matchmaking_time"]
    with swarm([OneBitCodec() for _ in range(3)]) as averagers:
        for averager in averagers:
            averager.schedule_round(matchmaking_time, tokens=500.0, metadata="base")
        started = time.monotonic()
        assert float(averagers[0].error_feedback_state()["sender"].norm()) == 0.0
        assert time.monotonic() - started < 1.0  # a scheduled round has taken nothing yet
        time.sleep(matchmaking_time + 0.5)  # the last steps of the round train meanwhile
        pending = [a.start_round(g, tokens=t, metadata="base") for a, g, t in zip(averagers, grads, tokens)]
        outcomes = [p.result(timeout=40) for p in pending]
        for outcome in outcomes:
            assert outcome.error is None and outcome.group_size == 3 and outcome.dropped_peers == 0
            assert outcome.group_metadata == ("base",) * 3
            assert outcome.seconds < matchmaking_time, outcome.seconds  # no second matchmaking window
            assert torch.equal(outcome.averaged[0], outcomes[0].averaged[0])
        assert first_round_error(outcomes[0].averaged, grads, tokens) < 1e-2

        averagers[0].schedule_round(matchmaking_time, tokens=500.0)
        averagers[0].cancel_scheduled_round()
        averagers[0].round_timeout = 3.0
        alone = averagers[0].average(random_grads(5), tokens=100.0)
        assert alone.averaged is None and alone.group_size == 1
        averagers[1].schedule_round(matchmaking_time, tokens=1.0)
        with pytest.raises(RuntimeError):  # one round at a time
            averagers[1].schedule_round(matchmaking_time, tokens=1.0)
        averagers[1].cancel_scheduled_round()


def test_a_round_that_expects_its_whole_group_averages_as_soon_as_everyone_is_in():
    """hivemind's leader waits out the matchmaking window unless it knows the group's size; told the peers to
    expect, the round averages as soon as they have all joined, with the same result."""
    grads, tokens = [random_grads(seed) for seed in range(3)], [1000.0, 2000.0, 3000.0]
    matchmaking_time = 6.0
    with swarm([OneBitCodec() for _ in range(3)], matchmaking_time=matchmaking_time) as averagers:
        pending = [a.start_round(g, tokens=t, group_size=3) for a, g, t in zip(averagers, grads, tokens)]
        outcomes = [p.result(timeout=40) for p in pending]
        for outcome in outcomes:
            assert outcome.error is None and outcome.group_size == 3 and outcome.dropped_peers == 0
            assert torch.equal(outcome.averaged[0], outcomes[0].averaged[0])
        early = max(outcome.seconds for outcome in outcomes)
        assert first_round_error(outcomes[0].averaged, grads, tokens) < 1e-2
        waited = averagers[0].start_round(grads[0], tokens=1.0)  # no size given: the whole window, as before
        others = [a.start_round(g, tokens=1.0) for a, g in zip(averagers[1:], grads[1:])]
        waited_s = waited.result(timeout=40).seconds
        assert waited_s >= matchmaking_time * 0.9 and early < waited_s, (early, waited_s)
        for other in others:
            other.result(timeout=40)
        with pytest.raises(ValueError):
            averagers[0].start_round(grads[0], tokens=1.0, group_size=0)

        # A peer the others did not expect (a joiner their clocks have not seen yet) is refused by the full
        # group and gets no average this round; the group's own average is unaffected by it.
        for averager in averagers:
            averager.round_timeout = 8.0
        pending = [a.start_round(g, tokens=1.0, group_size=2) for a, g in zip(averagers, grads)]
        outcomes = sorted((p.result(timeout=40) for p in pending), key=lambda o: o.group_size)
        assert [o.group_size for o in outcomes] == [1, 2, 2]
        assert outcomes[0].averaged is None
        assert all(o.error is None for o in outcomes[1:])
        assert torch.equal(outcomes[1].averaged[0], outcomes[2].averaged[0])


DOOMED_PEER = textwrap.dedent(
    """
    import pathlib, sys, time
    import hivemind, torch
    from tscale_p2p.peers.averaging import SwarmAverager
    from tscale_p2p.peers.codec import OneBitCodec

    class StallsOnSecondPart(OneBitCodec):
        calls = 0

        def compress(self, tensor, info, allow_inplace=False):
            StallsOnSecondPart.calls += 1
            if StallsOnSecondPart.calls == 2:
                pathlib.Path(sys.argv[1]).touch()  # mid-round: one part sent, the next one never will be
                time.sleep(600)
            return super().compress(tensor, info, allow_inplace)

    shapes, options, initial_peers = eval(sys.argv[2]), eval(sys.argv[3]), sys.argv[4:]
    dht = hivemind.DHT(start=True, initial_peers=initial_peers)
    averager = SwarmAverager([torch.zeros(s) for s in shapes], dht, prefix="test",
                             codec=StallsOnSecondPart(), **options)
    print("ready", flush=True)
    averager.start_round([torch.randn(s) * 1e-3 for s in shapes], tokens=1000.0).result()
    """
)


class SlowToStart(SwarmAverager):
    """Starts its part of the all-reduce 1.5 s after its group formed (a busy CPU): groupmates' first parts wait
    for it."""

    async def run_allreduce(self, *args, **kwargs):
        await asyncio.sleep(1.5)
        return await super().run_allreduce(*args, **kwargs)


SlowToStart.__name__ = "SwarmAverager"  # hivemind names a peer's RPC handlers after its class


def test_a_peer_killed_mid_round_does_not_stall_the_others(tmp_path):
    """The doomed peer dies after sending its first parts, which the survivors, not started yet, hold unread: the
    round still completes once, without a retry (hivemind 1.1.12 let the dead stream cancel the survivors' own
    all-reduce, and they matched up again)."""
    marker = tmp_path / "stalled"
    grads, tokens = [random_grads(seed) for seed in range(2)], [1000.0, 1000.0]
    with swarm([OneBitCodec(), OneBitCodec()], averager_type=SlowToStart) as averagers:
        maddrs = [str(m) for m in averagers[0].dht.get_visible_maddrs()]
        doomed = subprocess.Popen(
            [sys.executable, "-c", DOOMED_PEER, str(marker), repr(SHAPES), repr(AVERAGER_OPTIONS), *maddrs],
            stdout=subprocess.PIPE, text=True, start_new_session=True,  # its own process group: DHT, p2pd, averager
        )
        try:
            assert doomed.stdout.readline().strip() == "ready"
            pending = [a.start_round(g, tokens=t) for a, g, t in zip(averagers, grads, tokens)]
            deadline = time.monotonic() + 30
            while not marker.exists():
                assert time.monotonic() < deadline, "the doomed peer never joined the round"
                time.sleep(0.05)
            time.sleep(0.5)  # its first parts reach the survivors, which have not started yet
            os.killpg(doomed.pid, signal.SIGKILL)
            killed_at = time.monotonic()
            outcomes = [p.result(timeout=30) for p in pending]
            waited = time.monotonic() - killed_at
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(doomed.pid, signal.SIGKILL)
            doomed.wait()
        # Survivors give up on the dead peer after next_chunk_timeout per phase, not later.
        assert waited < 4 * AVERAGER_OPTIONS["next_chunk_timeout"] + 2, waited
        for outcome in outcomes:
            assert outcome.group_size == 3 and outcome.error is None
            assert all(bool(torch.isfinite(t).all()) for t in outcome.averaged)
        # A survivor that had everything it needed from the dead peer before it died lost nobody; the other
        # lost its contribution (or its answers) and counts it. Under load a survivor may also give up on the
        # other survivor's answer, which came only after that one had waited out the dead peer: lost too.
        dropped = [o.dropped_peers for o in outcomes]
        assert max(dropped) >= 1 and max(dropped) <= 2, dropped
        # The next round goes on without the dead peer.
        outcomes = run_round(averagers, grads, tokens)
        assert [o.group_size for o in outcomes] == [2, 2]
        assert [o.dropped_peers for o in outcomes] == [0, 0]  # counted per round, not summed
        for a, b in zip(outcomes[0].averaged, outcomes[1].averaged):
            assert torch.equal(a, b)


def test_a_groupmate_that_never_begins_its_all_reduce_is_given_up_after_the_sender_timeout(tmp_path):
    """Its span is not waited for until the reducer timeout (here longer than its hang): the others finish their
    round while it still hangs, without its part or its span, on the same average. Their trainers run on through
    every second of the round: a stalled round of 20 s was an update of 300 steps."""
    woke = tmp_path / "woke"
    # (hivemind names a peer's RPC handlers after its class)
    hangs = type("SwarmAverager", (StallingPeer,), dict(stall_round=1, stall_s=25.0, woke=str(woke)))
    grads, tokens = [random_grads(seed) for seed in range(3)], [1000.0] * 3
    with swarm([OneBitCodec()] * 3, averager_type=[SwarmAverager, SwarmAverager, hangs], reducer_timeout=60.0,
               allreduce_timeout=60.0) as averagers:
        pending = [a.start_round(g, tokens=t) for a, g, t in zip(averagers, grads, tokens)]
        outcomes = [p.result(timeout=40) for p in pending[:2]]
        assert not woke.exists()
        for outcome in outcomes:
            assert outcome.group_size == 3 and outcome.dropped_peers == 1 and outcome.error is None
            assert all(bool(torch.isfinite(t).all()) for t in outcome.averaged)
        for a, b in zip(outcomes[0].averaged, outcomes[1].averaged):
            assert torch.equal(a, b)


class LosingLeader(SwarmAverager):
    """Honest, but as a leader its word that the group begins never reaches one follower (the stream ends first),
    as a race in hivemind's matchmaking leaves it: the leader counts that follower in the group, while the
    follower, with no answer, goes on looking for another."""

    lost_one = False

    async def rpc_join_group(self, request: averaging_pb2.JoinRequest,
                             context: P2PContext) -> AsyncIterator[averaging_pb2.MessageFromLeader]:
        async for response in super().rpc_join_group(request, context):
            if response.code == averaging_pb2.BEGIN_ALLREDUCE and not self.lost_one:
                self.lost_one = True
                return
            yield response


LosingLeader.__name__ = "SwarmAverager"


def test_a_groupmate_whose_join_never_completed_is_given_up_when_it_says_so():
    """It answers the group's parts with "not my group" once it sees it is in no forming group, and its groupmates
    go on without it at once, not after the sender timeout (here longer than they are waited for): a round stalled
    that way for the whole 10 s in benchmarks/swarm_attacks.py while every trainer ran on."""
    grads, tokens = [random_grads(seed) for seed in range(3)], [1000.0] * 3
    with swarm([OneBitCodec()] * 3, averager_type=LosingLeader, next_chunk_timeout=60.0, reducer_timeout=120.0,
               allreduce_timeout=120.0) as averagers:
        pending = [a.start_round(g, tokens=t, group_size=3) for a, g, t in zip(averagers, grads, tokens)]
        outcomes = [p.result(timeout=40) for p in pending]
    left_out = [outcome for outcome in outcomes if outcome.averaged is None]
    assert len(left_out) == 1  # it found nobody else
    averaged = [outcome for outcome in outcomes if outcome.averaged is not None]
    for outcome in averaged:
        assert outcome.group_size == 3 and outcome.dropped_peers == 1 and outcome.error is None
        assert all(bool(torch.isfinite(t).all()) for t in outcome.averaged)
    for a, b in zip(averaged[0].averaged, averaged[1].averaged):
        assert torch.equal(a, b)


def test_a_peer_alone_gets_no_average_within_the_round_timeout():
    with swarm([OneBitCodec()]) as (averager,):
        averager.round_timeout = 3.0
        started = time.monotonic()
        outcome = averager.average(random_grads(0), tokens=100.0)
        assert outcome.averaged is None and outcome.group_size == 1 and outcome.error
        assert time.monotonic() - started < 8
        # Nothing was sent, so nothing is owed: the packing done during matchmaking was rolled back (up to
        # float rounding; not rolled back it would be ~0.6 x the pseudo-gradient's norm of ~0.09).
        assert float(averager.error_feedback_state()["sender"].norm()) < 1e-6
        # A leaving peer gives up sooner, and says why in words (its log line must not read like a crash).
        pending = averager.start_round(random_grads(1), tokens=100.0)
        assert not pending.give_up_if_alone(after_s=60.0)
        time.sleep(0.5)
        assert pending.give_up_if_alone(after_s=0.4)
        outcome = pending.result(timeout=10)
        assert outcome.averaged is None and outcome.error == "nobody else looking for a group"


@pytest.mark.timeout(90)
def test_a_round_in_a_forming_group_is_not_given_up():
    """Two peers looking for a group of three: once one leads the other, neither gives its round up however long it
    has looked (cancelled, it would leave the other waiting for its parts), and the group begins as the leader's
    matchmaking time ends, with both."""
    with swarm([OneBitCodec(), OneBitCodec()], matchmaking_time=6.0) as averagers:
        pending = [a.start_round(random_grads(i), tokens=100.0, group_size=3) for i, a in enumerate(averagers)]
        deadline = time.monotonic() + 30
        while not all(a.in_a_forming_group() for a in averagers):
            assert time.monotonic() < deadline, "no group formed"
            time.sleep(0.05)
        assert not any(p.give_up_if_alone(after_s=0.0) for p in pending)
        for outcome in [p.result(timeout=40) for p in pending]:
            assert outcome.averaged is not None and outcome.group_size == 2 and outcome.dropped_peers == 0


def test_a_peer_disputed_on_a_partners_word_is_neither_caught_nor_banned():
    """A partner's ban (peers/ban_notes.py) of a peer this one never rejected keeps pairs from forming; it is not
    evidence of our own."""
    noted = "QmXZxD93YBoPnzWwrQc1s2sNSiu47kWZSRG31bNxbk68e4"
    with swarm([OneBitCodec()]) as (averager,):
        averager.heed_partners_bans({noted: 0})
        assert averager.caught_peers(disputed=True) == {noted}
        assert averager.caught_peers() == set() and averager.banned_count == 0


def test_bad_local_input_is_refused_before_anything_is_sent():
    with swarm([OneBitCodec()]) as (averager,):
        grads = random_grads(0)
        with pytest.raises(ValueError):
            averager.start_round(grads, tokens=0)
        with pytest.raises(ValueError):
            averager.start_round([torch.full(shape, float("nan")) for shape in SHAPES], tokens=1.0)
        with pytest.raises(ValueError):
            averager.start_round(grads[:2], tokens=1.0)


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # the destroyed task, unkept
def test_a_task_nobody_holds_is_kept_until_its_reply_arrives():
    """A cancelled hivemind step leaves its matchmaking task holding the matchmaking lock and awaiting a DHT reply
    that hivemind finds by weak reference only. Garbage collection destroyed such a task mid-wait, the lock stayed
    taken, and the peer never found a group again. The averager's loop holds its tasks until they are done."""

    async def scenario(keep: bool) -> tuple[bool, list[str]]:
        """(the lock is free again once the reply arrives, what the loop reported)"""
        loop, reported = asyncio.get_running_loop(), []
        loop.set_exception_handler(lambda _, context: reported.append(context["message"]))
        if keep:
            keep_tasks_until_done(loop)
        lock, replies = asyncio.Lock(), weakref.WeakValueDictionary()

        class Reply:  # as an MPFuture: awaited by its task, found by whoever answers through a weak registry
            def __init__(self) -> None:
                self.arrived = asyncio.Event()

        async def wait_for_the_reply_holding_the_lock() -> None:
            async with lock:
                try:
                    reply = replies["dht"] = Reply()
                    await reply.arrived.wait()
                finally:
                    await asyncio.sleep(0)  # hivemind's clean-up awaits too

        loop.create_task(wait_for_the_reply_holding_the_lock())  # nobody keeps it: the cancelled step's task
        await asyncio.sleep(0)
        gc.collect()
        if "dht" in replies:
            replies["dht"].arrived.set()
        try:
            await asyncio.wait_for(lock.acquire(), timeout=2)
        except asyncio.TimeoutError:
            return False, reported
        return True, reported

    assert asyncio.run(scenario(keep=True)) == (True, [])
    freed, reported = asyncio.run(scenario(keep=False))  # what the keeper prevents
    assert not freed and "Task was destroyed but it is pending!" in reported


def test_a_stream_broken_by_a_peer_that_left_logs_no_unretrieved_task_exception():
    """hivemind opens an outgoing stream as a writing task plus a reader generator that cancels the task when it
    ends. A caller that gives up before it reads (a round cancelled or failed meanwhile) never starts the reader,
    so nothing looks at the task: once the peer at the other end had left, asyncio logged "Task exception was never
    retrieved" with a ConnectionResetError traceback. The averager's loop takes such exceptions itself."""

    async def scenario(keep: bool) -> list[str]:
        loop, reported = asyncio.get_running_loop(), []
        loop.set_exception_handler(lambda _, context: reported.append(context["message"]))
        if keep:
            keep_tasks_until_done(loop)

        async def write_to_a_peer_that_left() -> None:
            raise ConnectionResetError(104, "Connection reset by peer")

        async def open_stream():  # as P2P._iterate_protobuf_stream_handler
            writing = loop.create_task(write_to_a_peer_that_left())

            async def read():
                try:
                    yield None
                finally:
                    writing.cancel()

            return read()

        stream = await open_stream()
        await asyncio.sleep(0.01)  # the write fails: the peer is gone
        del stream  # the caller gives up before reading
        gc.collect()
        await asyncio.sleep(0)
        return reported

    assert asyncio.run(scenario(keep=True)) == []
    assert "Task exception was never retrieved" in asyncio.run(scenario(keep=False))  # what the keeper prevents


def test_a_topk_sender_with_other_settings_is_dropped_and_the_others_average():
    """A peer packing more values a chunk than the swarm's codec keeps (more bytes, more influence) is refused as a
    sender and as a reducer; the two honest peers still agree on their average."""
    make_codec, part_size_bytes = CODEC_CASES["topk"]
    codecs = [make_codec(), make_codec(), TopKCodec(k=64, return_k=64)]
    grads = [random_grads(seed) for seed in range(3)]
    with swarm(codecs, part_size_bytes=part_size_bytes) as averagers:
        pending = [a.start_round(g, tokens=1000.0) for a, g in zip(averagers, grads)]
        first, second = [p.result(timeout=40) for p in pending[:2]]
    for outcome in (first, second):
        assert outcome.error is None and outcome.group_size == 3 and outcome.dropped_peers == 1
        assert all(bool(torch.isfinite(t).all()) for t in outcome.averaged)
    for a, b in zip(first.averaged, second.averaged):
        assert torch.equal(a, b)
    got = torch.cat([t.view(-1) for t in first.averaged])
    want = torch.cat([t.view(-1) for t in expected_first_round(grads[:2], [1000.0] * 2, first.averaged, make_codec())])
    reduced = got != 0  # the spans the honest peers reduced; the other peer's answers are refused
    assert int(reduced.sum()) >= 5  # some answer got through (a short chunk keeps as few as 6)
    assert float((got[reduced] - want[reduced]).norm() / want[reduced].norm()) < 1e-2
