"""`SwarmAverager`: averages a pseudo-gradient with whoever is ready, at about one bit per value each way.

One round, seen from a peer (all of it in the averager's child process; packing overlaps matchmaking):

1. **Send, with error feedback.** The peer packs `pseudo_gradient + residual` with its codec (peers/codec.py: E8
   words or signs, and block scales) and keeps in `residual` what did not fit; the residual lives in shared memory so it
   survives from round to round across the process boundary. With `residual_carry < 1` only that share of
   it is carried into the next round (a damped residual: see the parameter).
2. **Reduce, robustly.** hivemind's butterfly all-reduce makes each peer the reducer of one span; its own part there
   never travels, so with a dense code (E8 words, signs) it is taken exactly. A reducer decodes every contribution
   and drops the sender for the round if it is not a well-formed message of the expected shape, is not finite, carries a
   non-positive weight, or has a norm above `max_norm_ratio` times the reducer's own part (times the sender's tokens
   over ours, at most `TOKEN_ALLOWANCE_CAP` or the group's median tokens over ours). What is left is not averaged
   but aggregated robustly (peers/robust.py: CenteredClip, token weights capped at the group's median,
   contributions opposed to most others', far from the group's or colluding left out). Senders check the averages
   they get back against the parts they sent (`_OneBitAllReduceRunner._exchange_with_reducer`): a span whose
   average could not come from an honest reducer (-50x the average, or its opposite) fails as a whole.
3. **Return, 1-bit too.** hivemind would send every sender `mean - its own part`, compressed again, which
   differs per sender. Instead the reducer packs the mean once and sends the same bytes to everyone: the
   return trip is ~1 bit per value as well, and every peer of the group decodes the very same average.
   Optionally (`reducer_error_feedback=True`) the reducer keeps what did not fit in a residual for that span
   and adds it next time; measured, that hurt convergence, so it is off by default (benchmarks/RESULTS.md).

4. **Agree on the spans.** Each peer then sends its groupmates a digest of every span's average it took, and
   drops a span a groupmate got otherwise (peers/span_agreement.py): a reducer that lies to some groupmates
   and tells others the truth loses its span on all of them alike, instead of splitting their weights. With an
   `identity`, a reducer signs its span's average; groupmates that hold two different signed averages of one
   span show each other, and ban its reducer.

A span whose reducer fails or sends something invalid contributes zero for that round (identically on every
peer of the group, through the digests), and the outcome says where (`RoundOutcome.lost`): each sender keeps its
update for it in its weights (peers/swarm.py), so the next round's update carries it, and its residual there is
what it was before the round; if the whole round fails, the sender's residual is rolled back. Either way nothing
a sender owes is lost, only delayed.

Groupmates whose parts or averages were refused are counted in a `PeerReputation` (peers/reputation.py); one
refused in two rounds is banned for the run: its parts are left out, its span's answers unused, and this peer
never leads it into a group, nor follows it from the second step after the ban (`_skipped_leader`; `banned_peers()`,
`banned_count`).

Usage: the asynchronous swarm loop (host process; `DelayedOuterStep` is in peers/outer.py)::

    names = list(trainer.snapshot())
    averager = SwarmAverager(list(trainer.snapshot().values()), dht, prefix=f"{run_id}_grad")
    rounds = DelayedOuterStep(OuterOptimizer(trainer.snapshot()))
    pending, own_previous = None, None
    while training:
        tokens = 0
        for _ in range(inner_steps):                 # one round of local work
            tokens += trainer.local_step().tokens
            if pending is not None and pending.done():  # the previous round's average: apply it at once
                outcome = pending.result()               # never raises for network trouble
                average = (dict(zip(names, outcome.averaged)) if outcome.averaged is not None
                           else own_previous)            # nobody to average with: go alone
                trainer.apply_outer_update(rounds.apply_average(trainer.snapshot(), average))
                pending = None                           # (the swarm loop also keeps `outcome.lost` values local)
        # (the swarm loop, peers/swarm.py, trains on until `pending` is done instead of ending the round here)
        # (the swarm loop also calls averager.schedule_round(...) matchmaking_time seconds before the round
        # ends, so that the group is formed by the time start_round hands over the pseudo-gradient)
        pseudo_gradient = rounds.finish_round(trainer.snapshot())
        pending = averager.start_round([pseudo_gradient[n] for n in names], tokens=tokens)
        own_previous = pseudo_gradient
    averager.shutdown(); dht.shutdown()

Register nothing by hand: importing this module imports peers/codec.py, which registers the codec with
hivemind before any averager process is forked.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import math
import multiprocessing as mp
import signal
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any, AsyncIterator, Awaitable, Callable, Collection, Mapping, Optional, Sequence

import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
from hivemind.averaging.allreduce import AllreduceException, AveragingMode
from hivemind.averaging.control import AveragingStage, StepControl
from hivemind.averaging.group_info import GroupInfo
from hivemind.averaging.partition import BannedException, TensorPartReducer
from hivemind.compression import CompressionInfo, TensorRole
from hivemind.dht import DHT
from hivemind.p2p import P2PContext, PeerID
from hivemind.proto import averaging_pb2, runtime_pb2
from hivemind.utils import get_dht_time
from hivemind.utils.asyncio import achain, aiter_with_timeout, as_aiter, attach_event_on_finished
from hivemind.utils.crypto import RSAPrivateKey
from hivemind.utils.mpfuture import MPFuture

from tscale_p2p.peers.codec import OneBitCodec, SwarmCodec, TopKCodec
from tscale_p2p.peers.hivemind_seam import (
    AllReduceRunnerBase,
    AveragerBase,
    cancel_step,
    outputs_registered,
    parts_sent_to,
)
from tscale_p2p.peers.network import ctrl_c_held_while_forking
from tscale_p2p.peers.reputation import COLLUDING, Excused, PeerReputation
from tscale_p2p.peers.robust import high_median, robust_aggregate
from tscale_p2p.peers.span_agreement import (
    NO_AVERAGE,
    REFUSED,
    DigestInboxes,
    EvidenceBooks,
    Proof,
    SpanSigner,
    believed,
    bound_key,
    copy_request,
    digest_message,
    disputed_spans,
    evidence_message,
    outvoted_reducers,
    recoverable_spans,
    signature_message,
    span_digest,
    took_another,
    verify_span,
)
from tscale_p2p.peers.state_download import StateCheck, download_checked_state

logger = logging.getLogger(__name__)

# A contribution from k times our tokens may have up to k times the norm bound, k at most this (or the group's
# median tokens over ours, where that is more): a peer just past a state download (few tokens, a tiny
# pseudo-gradient) keeps the group's average, while a peer claiming a huge token count still cannot send more than
# this times max_norm_ratio our norm, unless most of the group trained on as many more tokens than us.
TOKEN_ALLOWANCE_CAP = 10.0

FAR_FROM_THE_GROUP = "a part far from the group's"  # the robust rule's verdict that an honest peer out of step can earn
FAR_AND_AGAINST_THE_GROUP = "a part far from the group's, pointing against it"

# A reducer's average of a part may be at most this times the norm of what we sent for it (or our span's norm
# per value over the part's length, where that is more: `reference_norms`), times the median groupmate's tokens
# over ours where that is more: the robust aggregate lies among the honest contributions, so it is no longer than
# the longest of them, but one peer's update can be several times shorter than the others' at equal tokens (seen:
# 7.5x, on a tiny model a few steps into a round). A reducer sending -50x the average fails.
REPLY_NORM_RATIO = 10.0
# Our parts judge another reducer's average as over-long (a strike) only while our own span shows our update as long
# as the group's: its robust aggregate at most this many times our part there. Honest updates of one round agree in
# length within ~1.5x; a peer a few steps into a cold round's warm-up, at the group's tokens, was 13x short (seen:
# its one strike against its only honest partner of a 2 + 1 swarm ended their averaging for the run).
SHORT_UPDATE_RATIO = 3.0

# A reducer's average of a span is refused as pointing away from our part when their cosine is below minus this
# many standard deviations of the cosine of two unrelated vectors of the span's length (1/sqrt(n)). Not below
# zero: a 1-bit answer can carry none of our share (two contributors, the other weighing 3x: the signs of the
# average are all the other's), so an honest answer's cosine is then noise around zero, and half of them fell
# below it. Four deviations refuse such an honest answer about once in 30,000 spans; a reducer flipping an
# average that holds our share (cosine ~ -0.5 in a group of three) is far beyond them.
AGREEMENT_SIGMAS = 4.0

# How long a peer whose all-reduce has ended waits for its groupmates' span digests (peers/span_agreement.py).
# Honest groupmates end their all-reduces within moments of each other (each ends with the last reducer's answer);
# one still waiting on a slow reducer gets our digests all the same (they wait in its inbox) and drops what we
# lack, so a short wait costs little agreement. A long one costs time: the average is applied after it, and
# with a reducer that stalls some groupmates (a two-faced one, banned by some) 5 s here made every round late
# and cost +45% val loss in benchmarks/swarm_attacks.py.
SPAN_AGREEMENT_TIMEOUT_S = 1.0

# How long a peer that lost a span waits for a groupmate's signed copy of it (peers/span_agreement.py): a span's
# reply bytes, as many as its reducer's answer stream, from a peer that holds them in memory.
SPAN_COPY_TIMEOUT_S = 5.0

# An all-reduce whose own preparations (the pair rule, the pack) hold its first part longer than this, half the
# sender timeout after which groupmates drop a silent sender, says so: a round stalled that way in
# benchmarks/swarm_attacks.py (a lying_reducer:2+1 run, +13.7%) with no word in the logs of why. A stall without
# this line began before the all-reduce (in hivemind: the trigger, the tensors' lock).
SLOW_START_S = 5.0

# How long a peer in no forming group waits before it answers a groupmate's parts for a group it does not know
# with "not my group" (the groupmates then go on without it): the moments between its matchmaking's handing a group
# on and registering it, a few turns of its event loop. 1 s was too short with 16 peers on 2 cores (load 35): peers
# about to begin with their group answered so 105 times in 139 peer-rounds (benchmarks/swarm_rounds.py).
UNKNOWN_GROUP_GRACE_S = 3.0

# Longest an all-reduce waits for the pair rule the host has just sent (it travels on hivemind's control pipe,
# which the averager process reads between its tasks): milliseconds normally, seconds on a starved CPU.
PAIR_RULE_WAIT_S = 5.0
# How often a peer looking for a group re-reads the averagers declared in the DHT (`SwarmAverager.run_step`).
LEADERS_REFRESH_S = 1.0

_SENT, _RECEIVED, _VALUES_SENT, _VALUES_RECEIVED = 0, 1, 2, 3  # the averager's traffic counters


class InvalidContributionError(ValueError):
    """A tensor part from a peer that must not enter the average."""


class OverlongAverage(InvalidContributionError):
    """A reducer's average refused as far longer than our part of its span, where our tokens are evidence: a strike,
    unless our own span shows our update far shorter than the group's (`settle_overlong_refusals`)."""


class ShortPartRefusal(InvalidContributionError):
    """A reducer's average refused as far longer than our part of its span, where our part is no evidence against
    the reducer: we trained under half the group's median tokens. Early in a run the learning rate's warm-up makes
    an update grow faster than its steps (a peer a few steps into a cold first round found an honest average 69x its
    part, 6.6x short of the median's tokens, against a bound of 66x), so the span is lost to us but its reducer
    earns no strike; it is refused all the same, since such a peer is what a lying reducer aims at."""


@dataclass(frozen=True)
class RoundOutcome:
    """What one averaging round produced, as seen by this peer."""

    averaged: Optional[list[torch.Tensor]]  # the group's weighted mean; None: averaged with nobody
    group_size: int  # peers in the group, this one included (1 when alone)
    group_tokens: float  # sum of the tokens the group's peers declared (malformed declarations count 0; a
    # scheduled round declares the tokens its peer expected to have by the round's end)
    bytes_sent: int  # tensor bytes this peer put on the wire during the round (protobuf level)
    bytes_received: int
    seconds: float  # from start_round to the end of the all-reduce
    error: Optional[str] = None  # why the round failed, when it did
    group_metadata: tuple = ()  # what every group member (this one included) passed as start_round's `metadata`
    # groupmates lost to this peer in the round: senders whose contribution its span refused or that went
    # silent, and reducers that failed, timed out or answered invalid averages for its own parts, or whose span
    # a groupmate got another average of
    dropped_peers: int = 0
    # values (tensor elements) carried by those bytes, both trips: as a sender its parts of the other spans, as a
    # reducer its span's average, once per groupmate; bits per value of one trip = 8 * bytes / values
    values_sent: int = 0
    values_received: int = 0
    group_peers: tuple[str, ...] = ()  # peer ids of the group (this one included), as matchmaking formed it
    # values of `averaged` (flat, in its order) that no reducer averaged for this peer: zero there, and the
    # peer's own update for them is neither owed nor averaged, so the caller keeps it in its weights; None if none
    lost: Optional[torch.Tensor] = None


class _TaskKeeper:
    """An event loop's task factory that holds every task until it is done.

    asyncio holds running tasks only by weak reference. When a step is cancelled, hivemind 1.1.12's `_step` drops
    its matchmaking task, which is then still awaiting a DHT reply in a `finally` (an MPFuture: hivemind finds it
    by weak reference too). Nothing outside the task holds it, so a garbage collection destroys it while pending
    ("Task was destroyed but it is pending!"), and its `async with lock_looking_for_group` never exits: every later
    round of that peer waits for the lock, finds no group, and the peer trains alone for good. In
    tests/test_swarm.py's outage test under two CPU hogs, that happened in 2 of 4 runs, each time after that
    message. hivemind has no hook for it, hence this factory.

    It also takes the exception of a task that failed because a groupmate's connection broke (the peer left or
    died): hivemind 1.1.12 writes each outgoing stream in a task of its own (`P2P._iterate_protobuf_stream_handler`)
    and, when the reader stops early, cancels it without looking at it, so asyncio logged "Task exception was never
    retrieved" with a ConnectionResetError traceback on every peer that had been streaming to the one that left.
    That is a normal event in a swarm; the round's own outcome already says what was lost.
    """

    def __init__(self) -> None:
        self.pending: set[asyncio.Task] = set()

    def __call__(self, loop: asyncio.AbstractEventLoop, coro, **kwargs) -> asyncio.Task:
        return self.hold(asyncio.Task(coro, loop=loop, **kwargs))

    def hold(self, task: asyncio.Task) -> asyncio.Task:
        self.pending.add(task)
        task.add_done_callback(self._done)
        return task

    def _done(self, task: asyncio.Task) -> None:
        self.pending.discard(task)
        if not task.cancelled() and isinstance(task.exception(), _PEER_GONE):  # exception(): it is retrieved now
            logger.debug("a stream to a peer that left broke: %r", task.exception())


_PEER_GONE = (ConnectionError, asyncio.IncompleteReadError)  # a groupmate's connection closed under us


def keep_tasks_until_done(loop: asyncio.AbstractEventLoop) -> None:
    """Make `loop` hold every task until it is done (see `_TaskKeeper`): those it creates from now on, and those
    pending now (e.g. hivemind's periodic declaration for state downloads)."""
    if isinstance(loop.get_task_factory(), _TaskKeeper):
        return
    keeper = _TaskKeeper()
    loop.set_task_factory(keeper)
    for task in asyncio.all_tasks(loop):
        keeper.hold(task)


class PendingRound:
    """A round running in the background; `result()` waits for it. Returned by `SwarmAverager.start_round`."""

    def __init__(self, averager: "SwarmAverager", control: StepControl, traffic_before: tuple[int, ...]):
        self._averager, self._control, self._traffic_before = averager, control, traffic_before
        self._started = time.perf_counter()
        self._gave_up = False
        self._outcome: Optional[RoundOutcome] = None

    def done(self) -> bool:
        return self._control.done()

    def give_up_if_alone(self, after_s: float) -> bool:
        """Cancel the round if it has been looking for a group for `after_s` seconds since it started (nobody to
        average with); `result()` then reports it as averaged alone. True if it was cancelled. Never while a group
        is forming with this peer in it (`SwarmAverager.in_a_forming_group`)."""
        if self._control.done() or self._control.stage != AveragingStage.LOOKING_FOR_GROUP:
            return False
        if time.perf_counter() - self._started < after_s:
            return False
        if self._averager.in_a_forming_group():
            return False  # asked again at the next step: the group begins, or its leader gives up on it
        self._gave_up = cancel_step(self._control)
        return self._gave_up

    def result(self, timeout: Optional[float] = None) -> RoundOutcome:
        """Wait for the round (at most `timeout` s; TimeoutError after that). Never raises for network failures."""
        if self._outcome is None:
            averaged, group_size, group_tokens, error, metadata, peers, lost = None, 1, 0.0, None, (), (), None
            try:
                gathered = self._control.result(timeout=timeout)
            except Exception as e:
                if not self._control.done():
                    raise  # our wait timed out; the round goes on
                # nobody to average with, or the all-reduce failed: the caller goes alone
                error = "nobody else looking for a group" if self._gave_up else f"{type(e).__name__}: {e}"
            else:
                averaged = self._averager._read_result()
                group_size = len(gathered)
                group_tokens = sum(_declared_tokens(info) for info in gathered.values())
                metadata = tuple(_declared_metadata(info) for info in gathered.values())
                peers = tuple(str(peer) for peer in gathered)
                lost = self._averager.lost_values()
            sent, received, values_sent, values_received = self._averager._traffic.tolist()
            dropped = int(self._averager._round_dropped.item())
            self._outcome = RoundOutcome(
                averaged=averaged,
                group_size=group_size,
                group_tokens=group_tokens,
                bytes_sent=sent - self._traffic_before[_SENT],
                bytes_received=received - self._traffic_before[_RECEIVED],
                values_sent=values_sent - self._traffic_before[_VALUES_SENT],
                values_received=values_received - self._traffic_before[_VALUES_RECEIVED],
                seconds=time.perf_counter() - self._started,
                error=error,
                group_metadata=metadata,
                dropped_peers=dropped,
                group_peers=peers,
                lost=lost,
            )
            self._averager._pending = None
        return self._outcome


def _check_tokens(tokens: float) -> None:
    if not (math.isfinite(tokens) and tokens > 0):
        raise ValueError(f"tokens must be a positive number, got {tokens}")


def _declared_tokens(gathered: Any) -> float:
    """The tokens a groupmate declared in its gathered metadata; 0 for anything malformed (it is remote data)."""
    try:
        tokens = float(gathered["tokens"])
    except (TypeError, KeyError, ValueError):
        return 0.0
    return tokens if math.isfinite(tokens) and tokens > 0 else 0.0


def _declared_key(gathered: Any) -> Any:
    """The span key a groupmate declared (None if absent); remote data: see `bound_key`."""
    return gathered.get("key") if isinstance(gathered, dict) else None


def _declared_metadata(gathered: Any) -> Any:
    """The `metadata` a groupmate passed to start_round (None if absent); remote data: the caller validates it."""
    return gathered.get("metadata") if isinstance(gathered, dict) else None


def _out_of_step(peer_ids: Sequence[PeerID], declared: Sequence[Any]) -> frozenset:
    """Groupmates whose declared `metadata` (the base of their update, for the swarm) is not the one most of the
    group declared; all of them when no metadata has a strict majority. Their update is measured against other
    weights, so it may honestly lie far from the group's: the robust rule still leaves it out, but that is no
    strike (`_OneBitAllReduceRunner._strikes`). A liar declaring an odd base is excused so for a few rounds at most
    (`PeerReputation.excuse`), and never by the robust rule."""
    keys = [repr(_declared_metadata(item)) for item in declared]
    majority, count = Counter(keys).most_common(1)[0] if keys else (None, 0)
    if 2 * count <= len(keys):
        return frozenset(peer_ids)
    return frozenset(peer for peer, key in zip(peer_ids, keys) if key != majority)


class SwarmAverager(AveragerBase):
    """Averages a pseudo-gradient with the peers that are ready, 1-bit each way with error feedback.

    :param template: tensors with the shapes to average (e.g. the model's parameters); only shapes are used
    :param dht: a running `hivemind.DHT`
    :param prefix: DHT key prefix for matchmaking, namespaced by run (no dots)
    :param matchmaking_time: how long a round waits to gather peers before averaging with those present
    :param round_timeout: a round that has found no group after this many seconds gives up (caller goes alone)
    :param allreduce_timeout: bound on the all-reduce itself once a group is formed
    :param next_chunk_timeout: a peer silent for this long during the all-reduce is dropped from the round
    :param target_group_size: None (default) puts the whole swarm in one group: hivemind marks splitting into
      groups as incorrect for this use, so only set it when it is at least the swarm size (a round's
      `group_size` overrides it for that round)
    :param codec: the codec of both trips (peers/codec.py: `OneBitCodec`, the default here, `E8Codec`, join's
      default, or `TopKCodec`); its settings travel on the wire, and a part in any other format or with other
      settings is refused
    :param max_norm_ratio: a contribution whose part norm exceeds this multiple of the reducer's own is dropped
      (times the sender's tokens over ours, where it trained on more, at most `TOKEN_ALLOWANCE_CAP` or the
      group's median tokens over ours)
    :param residual_carry: sender error feedback: the share of what this peer's 1-bit message could not carry
      that it adds to its next round's (1.0: plain error feedback; None: nothing kept). 0.5 ended level with
      no feedback from a cold start, where full feedback cost 1-3 points of validation loss, and ahead of both
      later in a run (benchmarks/RESULTS.md). Where no reducer averaged, the residual is left as before the
      round (the update stays in the peer's weights: `RoundOutcome.lost`). `start_round` may set another share
      for one round.
    :param reducer_error_feedback: full error feedback for the averages this peer sends back for its span. Off by
      default: on a small DiLoCo problem it cost +22% validation loss, while sender-only feedback with a plain
      1-bit return trip stayed within 1% of uncompressed averaging (benchmarks/RESULTS.md)
    :param state_source: called (in this process) when a joiner downloads state: returns (metadata, tensors);
      state sharing is on exactly when this is given
    :param state_check: what a state downloaded by `load_state_from_peers` must be; with it, the download takes
      the base most signed offers announce and checks what it receives (peers/state_download.py)
    :param identity: the private key this peer's id is the hash of (`join` passes its libp2p identity key): it
      vouches for a span key that signs this peer's span's averages, so groupmates can prove to each other that a
      reducer lied (peers/span_agreement.py). Without it this peer's spans are unsigned, and checked as before.
    :param kwargs: passed to `hivemind.averaging.DecentralizedAverager` (e.g. client_mode, bandwidth)
    """

    def __init__(
        self,
        template: Sequence[torch.Tensor],
        dht: DHT,
        *,
        prefix: str,
        matchmaking_time: float = 5.0,
        round_timeout: float = 30.0,
        allreduce_timeout: float = 60.0,
        next_chunk_timeout: float = 10.0,
        request_timeout: Optional[float] = None,
        target_group_size: Optional[int] = None,
        codec: Optional[SwarmCodec] = None,
        max_norm_ratio: float = 100.0,
        residual_carry: Optional[float] = 1.0,
        reducer_error_feedback: bool = False,
        state_source: Optional[Callable[[], tuple[Any, Sequence[torch.Tensor]]]] = None,
        state_check: Optional[StateCheck] = None,
        identity: Optional[RSAPrivateKey] = None,
        start: bool = True,
        **kwargs,
    ):
        if kwargs.get("auxiliary"):
            raise ValueError("auxiliary averagers are not supported: every peer contributes a pseudo-gradient")
        self.codec = codec or OneBitCodec()
        if not isinstance(self.codec, (OneBitCodec, TopKCodec)):
            raise TypeError(f"codec must be a OneBitCodec (or E8Codec) or a TopKCodec, got {type(self.codec).__name__}")
        part_size_bytes = kwargs.pop("part_size_bytes", 2**17)
        if (part_size_bytes * 8) % self.codec.unit:  # parts must hold whole blocks or chunks (see OneBitCodec)
            raise ValueError(f"part_size_bytes={part_size_bytes} does not hold a whole number of codec units")
        self.round_timeout, self.max_norm_ratio = round_timeout, max_norm_ratio
        self.matchmaking_time = matchmaking_time
        if residual_carry is not None and not 0.0 <= residual_carry <= 1.0:
            raise ValueError(f"residual_carry must be in [0, 1] or None, got {residual_carry}")
        self.residual_carry, self.reducer_error_feedback = residual_carry, reducer_error_feedback
        self._state_source, self._state_check = state_source, state_check
        self._span_signer = SpanSigner.of(identity) if identity is not None else None

        sizes = [t.numel() for t in template]
        self._flat = torch.zeros(sum(sizes)).share_memory_()  # pseudo-gradient in, average out
        self._sender_residual = torch.zeros_like(self._flat).share_memory_()
        # The share of the residual the round in flight carries into the next (`start_round`'s residual_carry)
        self._round_carry = torch.zeros(()).share_memory_()
        self._reducer_residual = torch.zeros_like(self._flat).share_memory_()
        self._traffic = torch.zeros(4, dtype=torch.int64).share_memory_()  # bytes, values (sent, received)
        self._round_dropped = torch.zeros((), dtype=torch.int64).share_memory_()  # of the last all-reduce attempt
        self._lost_ranges: list[tuple[int, int]] = []  # [start, end) of the last all-reduce nobody averaged
        self._reputation = PeerReputation()  # lives in the averager process (a copy is forked there)
        self._banned_count = torch.zeros((), dtype=torch.int64).share_memory_()  # its bans, for the host to read
        self._target_group_size = target_group_size
        self._round_group_size = torch.zeros((), dtype=torch.int64).share_memory_()  # the next step's; 0: none
        self._pair_partners: Optional[frozenset[str]] = None  # averager process: the round's `pair_partners`
        # Averager process: steps begun, and the step in which each peer was first disputed, and banned, here. A
        # leader marked in this step or the last is still followed (`_skipped_leader`).
        self._steps_begun = 0
        self._disputed_in_step: dict[str, float] = {}
        self._banned_in_step: dict[str, float] = {}
        # ... and the reducers of spans this peer refused while a groupmate took them, with the step of the first
        # such round: that groupmate holds the reducer disputed from then.
        self._disputed_by_groupmates_in_step: dict[str, float] = {}
        # ... and the peers a pair partner banned (`heed_partners_bans`), with the step of the first such ban.
        self._partners_banned_in_step: dict[str, float] = {}
        # How many pair rules the host has sent, and (averager process) which one it holds: an all-reduce waits
        # for the latest before it decides (the rule travels on the control pipe, the trigger does not).
        self._pair_rules_sent = torch.zeros((), dtype=torch.int64).share_memory_()
        self._pair_rule_held = 0
        tensors = [view.view(t.shape) for view, t in zip(self._flat.split(sizes), template)]
        self._pending: Optional[PendingRound] = None
        self._scheduled: Optional[_ScheduledRound] = None  # matchmaking started ahead of the round's end
        self._outgoing: Optional[asyncio.Future] = None  # averager process: this round's packed pseudo-gradient
        self._step_in_progress: Optional[StepControl] = None  # averager process: the step run_step runs
        self._step_finished = mp.Event()  # the averager process is done with the buffers of the last round
        self._step_finished.set()
        self._digest_inboxes = DigestInboxes()  # used in the averager process only
        self._evidence_books = EvidenceBooks()  # likewise
        self._proofs: dict[str, Proof] = {}  # likewise: liar (base58) -> the proof we hold against it
        self._shown: set[tuple[str, str]] = set()  # likewise: (liar, peer) pairs whose proof that peer has seen

        request_timeout = request_timeout if request_timeout is not None else min(3.0, matchmaking_time / 2)
        client_mode = kwargs.get("client_mode")
        client_mode = dht.client_mode if client_mode is None else client_mode
        kwargs.setdefault("allow_state_sharing", state_source is not None and not client_mode)
        super().__init__(
            tensors,
            dht,
            start=False,
            prefix=prefix,
            target_group_size=target_group_size,
            min_matchmaking_time=matchmaking_time,
            request_timeout=request_timeout,
            allreduce_timeout=allreduce_timeout,
            next_chunk_timeout=next_chunk_timeout,
            compression=self.codec,
            part_size_bytes=part_size_bytes,
            tensor_infos=[
                CompressionInfo.from_tensor(t, key=i, role=TensorRole.GRADIENT) for i, t in enumerate(tensors)
            ],
            **kwargs,
        )
        if start:
            self.run_in_background(await_ready=True)

    def run_in_background(self, await_ready: bool = True, timeout: float | None = None) -> None:
        """Start the averager process. hivemind's version makes *this* process ignore SIGINT for good (so
        Ctrl+C stops working, here and in every program it starts later) and fails off the main thread;
        the averager process ignores SIGINT itself instead (`run`)."""
        with ctrl_c_held_while_forking():
            self.start()
        if await_ready:
            self.wait_until_ready(timeout)

    def run(self) -> None:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl+C belongs to the host process, which shuts us down
        super().run()

    # ---- host process: the swarm loop's API ----

    def schedule_round(
        self, seconds_to_start: float, tokens: float, metadata: Any = None, group_size: Optional[int] = None,
        pair_partners: Optional[Collection[str]] = None,
    ) -> None:
        """Begin matchmaking for a round that `start_round` will begin in about `seconds_to_start` seconds.

        Call it `matchmaking_time` seconds ahead: the group is then formed while the last steps train, and the
        average arrives one all-reduce after `start_round` instead of a whole matchmaking window later
        (hivemind.Optimizer schedules its rounds the same way). `tokens` is the expected weight (`start_round`
        sets the exact one); `metadata` reaches the group now, so `start_round` must pass the same; `group_size`
        and `pair_partners` as in `start_round`. Raises RuntimeError while a round is pending or already scheduled.
        """
        if self._pending is not None or self._scheduled is not None:
            raise RuntimeError("a round is already pending or scheduled")
        _check_tokens(tokens)
        self._wait_for_last_step()
        self._step_finished.clear()
        wait_s = max(0.0, seconds_to_start)
        try:
            self._set_round_rules(group_size, pair_partners)
            control = self.step(
                gather=self._gather(tokens, metadata), weight=float(tokens),
                scheduled_time=get_dht_time() + wait_s, timeout=wait_s + self.round_timeout,
                require_trigger=True, wait=False,
            )
        except BaseException:
            self._step_finished.set()
            raise
        self._scheduled = _ScheduledRound(control, metadata, tuple(self._traffic.tolist()))

    @property
    def round_scheduled(self) -> bool:
        """Whether `schedule_round` has begun a round that `start_round` has not started yet."""
        return self._scheduled is not None

    def cancel_scheduled_round(self) -> None:
        """Give up a round scheduled by `schedule_round` that has not started (e.g. training paused or stopped)."""
        scheduled, self._scheduled = self._scheduled, None
        if scheduled is not None:
            cancel_step(scheduled.control)

    def start_round(
        self,
        pseudo_gradient: Sequence[torch.Tensor],
        tokens: float,
        metadata: Any = None,
        group_size: Optional[int] = None,
        pair_partners: Optional[Collection[str]] = None,
        residual_carry: Optional[float] = None,
    ) -> PendingRound:
        """Begin averaging `pseudo_gradient` (weights at round start minus weights now) in the background.

        `tokens` (> 0) is this peer's weight; `metadata` (small, msgpack-able) reaches every groupmate in
        `RoundOutcome.group_metadata`. `group_size`: the peers expected in this round (e.g. those the round
        clock sees training); the all-reduce then begins as soon as that many have joined, instead of when the
        matchmaking window closes (a peer beyond it is refused by the full group and gets no average).
        `pair_partners`: the peers (base58 ids) this peer averages with in a group of two; a pair with anyone else is
        refused (this peer takes part but keeps nothing) and the round looks for another group (None: any pair is taken,
        but with a peer this one has caught). In a pair neither contribution is a majority, so the robust rules cannot
        tell which of the two lies. Uses the round `schedule_round` prepared, if any, with the size it was scheduled
        with and these `pair_partners` (it is dropped, and a round begins from scratch, when it has failed meanwhile or
        was scheduled with other metadata). `residual_carry`: this round's share of its residual carried into the
        next, in place of the averager's (ignored without error feedback). The tensors are copied, so training may
        continue at once. Raises ValueError for a pseudo-gradient that is not finite or does not match the template
        (cancelling a scheduled round), and RuntimeError while the previous round is still pending.
        """
        if self._pending is not None:
            raise RuntimeError("the previous round is still pending: call result() on it first")
        carry = self.residual_carry if residual_carry is None else residual_carry
        try:
            if carry is not None and not 0.0 <= carry <= 1.0:
                raise ValueError(f"residual_carry must be in [0, 1], got {residual_carry}")
            self._check_contribution(pseudo_gradient, tokens)
        except ValueError:
            self.cancel_scheduled_round()
            raise
        scheduled, self._scheduled = self._scheduled, None
        if scheduled is not None and (scheduled.control.done() or scheduled.metadata != metadata):
            # Said, because a group formed for it meanwhile would wait for us in vain (a suspect in rounds that
            # stalled for the whole chunk timeout, one peer never sending, its trainer at full speed).
            logger.info("dropping the round scheduled for this update (%s): looking for a group afresh",
                        "it ended" if scheduled.control.done() else "it was for other global weights")
            cancel_step(scheduled.control)  # nobody to average with by now, or another base: start afresh
            scheduled = None
        if scheduled is None:
            self._wait_for_last_step()
            self._step_finished.clear()
        self._round_dropped.zero_()  # a round that finds nobody must not report the last one's losses
        self._round_carry.fill_(carry or 0.0)  # read in the averager process once this round's all-reduce ends
        try:
            with self.get_tensors() as buffers:  # the averager process reads them only once triggered
                for buffer, tensor in zip(buffers, pseudo_gradient):
                    buffer.copy_(tensor.detach())
            if scheduled is None:
                traffic_before = tuple(self._traffic.tolist())
                self._set_round_rules(group_size, pair_partners)
                control = self.step(
                    gather=self._gather(tokens, metadata), weight=float(tokens),
                    timeout=self.round_timeout, wait=False,
                )
            else:
                control, traffic_before = scheduled.control, scheduled.traffic_before
                control.weight = float(tokens)
                # The clock may see more peers than when the round was scheduled. The group may be formed
                # already: leaving it would stall its other members, so today's rule goes to the all-reduce.
                self._send_pair_partners(pair_partners)
                control.allow_allreduce()
        except BaseException:
            if scheduled is not None:
                cancel_step(scheduled.control)
            self._step_finished.set()
            raise
        self._pending = PendingRound(self, control, traffic_before)
        return self._pending

    def _gather(self, tokens: float, metadata: Any) -> dict:
        """What this peer declares to its group: its weight, the caller's metadata, its span key if any."""
        key = self._span_signer.declaration if self._span_signer is not None else None
        return dict(tokens=float(tokens), metadata=metadata, key=key)

    def _check_contribution(self, pseudo_gradient: Sequence[torch.Tensor], tokens: float) -> None:
        _check_tokens(tokens)
        if len(pseudo_gradient) != len(self.averaged_tensors):
            raise ValueError(f"expected {len(self.averaged_tensors)} tensors, got {len(pseudo_gradient)}")
        for tensor, buffer in zip(pseudo_gradient, self.averaged_tensors):
            if tensor.shape != buffer.shape:
                raise ValueError(f"pseudo-gradient shape {tuple(tensor.shape)} != {tuple(buffer.shape)}")
            if not bool(torch.isfinite(tensor).all()):
                raise ValueError("pseudo-gradient has non-finite values; refusing to send it")

    def average(self, pseudo_gradient: Sequence[torch.Tensor], tokens: float) -> RoundOutcome:
        """`start_round(...).result()`: one blocking round."""
        return self.start_round(pseudo_gradient, tokens).result()

    def traffic(self) -> tuple[int, int]:
        """Total (bytes sent, bytes received) of tensor data in all rounds so far."""
        sent, received = self._traffic[:2].tolist()
        return int(sent), int(received)

    def residual_norm(self) -> float:
        """L2 norm of what this peer still owes the swarm (error feedback); a health metric."""
        return float(self._sender_residual.norm())

    def error_feedback_state(self) -> dict[str, torch.Tensor]:
        """Copies of both residuals (flat fp32), e.g. for a checkpoint. Waits for a round in flight to end."""
        self._wait_for_last_step()
        with self.get_tensors():
            return dict(sender=self._sender_residual.clone(), reducer=self._reducer_residual.clone())

    def load_error_feedback_state(self, state: dict[str, torch.Tensor]) -> None:
        """Restore residuals saved by `error_feedback_state` (same template)."""
        self._wait_for_last_step()
        with self.get_tensors():
            for name, residual in (("sender", self._sender_residual), ("reducer", self._reducer_residual)):
                if state[name].shape != residual.shape:
                    raise ValueError(f"{name} residual shape {tuple(state[name].shape)} != {tuple(residual.shape)}")
                residual.copy_(state[name])

    def load_state_from_peers(self, wait: bool = True, timeout: Optional[float] = None,
                              prefer: Optional[tuple[int, str]] = None, prefer_donors: Collection[str] = ()):
        """hivemind's, checked (`state_check`); with `prefer`, the state of that (round, fingerprint) whenever some
        peer offers it, whatever most offers say, or the later one most of `prefer_donors` (the peers that declared
        it, base58) offer (peers/state_download.py)."""
        future = MPFuture()
        self.run_in_averager_process("download_state", future=future, timeout=timeout, prefer=prefer,
                                     prefer_donors=frozenset(prefer_donors))
        return future.result(timeout=timeout) if wait else future

    def heed_partners_bans(self, rounds_ago: Mapping[str, int]) -> None:
        """A pair partner has banned the peers of `rounds_ago` (base58; peers/ban_notes.py), the first of them that
        many rounds ago (0: in the round applied last): ban those this peer has rejected in a round of its own
        (`PeerReputation.corroborate`), and hold the others disputed, as the pair rules read it
        (`caught_peers(disputed=True)`, the leaders a round skips while its pairs are for partners). Call it
        before the next round begins: a leader banned or disputed here is followed for one more step from the
        first ban among this peer and its partners (`_skipped_leader`).

        A partner's word alone is no ban, since a partner may lie. But an "A Little Is Enough" peer's parts lie
        close to the honest ones, and the robust rule may flag them once here and twice at the others: they banned
        it, this peer did not, and their groups no longer took it, so the groups it led or joined with this peer
        were pairs this peer refused, round after round, its averages arriving rounds late (val loss 2.02 against
        1.89, benchmarks/swarm_attacks.py)."""
        self.run_in_averager_process("_heed_partners_bans", rounds_ago=dict(rounds_ago))

    async def _heed_partners_bans(self, rounds_ago: dict[str, int]) -> None:
        reputation, noted = self._reputation, self._partners_banned_in_step
        for peer, ago in rounds_ago.items():  # this step is the one after the round applied last
            noted[peer] = min(noted.get(peer, math.inf), self._steps_begun - ago)
            for marks in (self._banned_in_step, self._disputed_in_step):
                if peer in marks:  # the partner leaves it as a leader no later than that step says
                    marks[peer] = min(marks[peer], noted[peer])
        self._corroborate(rounds_ago)
        for peer in sorted(rounds_ago.keys() - reputation.disputed):
            if peer not in reputation.banned:
                logger.info("holding %s disputed: a pair partner of ours has banned it", peer)
            self._disputed_in_step[peer] = noted[peer]
        reputation.disputed |= rounds_ago.keys()

    def _corroborate(self, peer_ids: Collection[str]) -> None:
        """Ban those of `peer_ids` that a pair partner banned and this peer rejected in a round of its own."""
        noted = self._partners_banned_in_step
        banned = [peer for peer in sorted(noted.keys() & set(peer_ids)) if self._reputation.corroborate(peer)]
        if banned:
            self._count_bans(since=noted)  # in step with the partner's ban

    def banned_peers(self) -> dict[str, str]:
        """Peers this one has banned for the run (peer id -> the reason it was last rejected for)."""
        future = MPFuture()
        self.run_in_averager_process("_banned_peers", future=future)
        return future.result()

    def caught_peers(self, disputed: bool = False) -> set[str]:
        """Peers this one has rejected in some round of the run, or banned (their votes on the group's base are
        not counted: peers/swarm.py); with `disputed`, also reducers whose span a groupmate got another average
        of (`PeerReputation.disputed`)."""
        future = MPFuture()
        self.run_in_averager_process("_caught_peers", future=future, disputed=disputed)
        return future.result()

    @property
    def banned_count(self) -> int:
        """How many peers this one has banned for the run."""
        return int(self._banned_count)

    def get_current_state(self):
        if self._state_source is None:
            raise RuntimeError("this averager has no state_source to share")
        return self._state_source()

    def _set_round_rules(self, group_size: Optional[int], pair_partners: Optional[Collection[str]]) -> None:
        if group_size is not None and group_size < 1:
            raise ValueError(f"group_size must be at least 1, got {group_size}")
        self._round_group_size.fill_(group_size or 0)  # read by the averager process as the step begins
        self._send_pair_partners(pair_partners)

    def _send_pair_partners(self, pair_partners: Optional[Collection[str]]) -> None:
        version = int(self._pair_rules_sent) + 1
        self._pair_rules_sent.fill_(version)
        partners = None if pair_partners is None else frozenset(pair_partners)
        self.run_in_averager_process("_set_pair_partners", partners=partners, version=version)

    def _wait_for_last_step(self) -> None:
        # A round's result is out before the averager process is done with it: a round that failed still rolls
        # its residual back afterwards. A scheduled round touches nothing before start_round triggers it, and
        # the round before it had finished when it was scheduled.
        if self._scheduled is not None:
            return
        timeout = self.round_timeout + (self.allreduce_timeout or 0.0)
        if not self._step_finished.wait(timeout=timeout):
            raise RuntimeError("the averager process has not finished the last round; is it alive?")

    def _read_result(self) -> list[torch.Tensor]:
        with self.get_tensors() as buffers:
            return [buffer.clone() for buffer in buffers]

    # ---- averager process ----

    async def run_step(self, *, step: StepControl, future_for_init):
        keep_tasks_until_done(asyncio.get_running_loop())  # before hivemind creates this step's tasks
        self._step_in_progress = step
        # Pack while matchmaking runs, as soon as the host has handed over the tensors (the trigger): for a big
        # model on a CPU the pack takes seconds, and groupmates drop a sender that stays silent for
        # next_chunk_timeout once the all-reduce has begun.
        self._outgoing = asyncio.ensure_future(self._pack_once_triggered(step))
        # hivemind's leader starts the all-reduce early only when its group reaches target_group_size; with the
        # swarm's size unknown it would always wait out the matchmaking window. It has no per-step setting.
        self.set_target_group_size(int(self._round_group_size) or self._target_group_size)
        self._steps_begun += 1
        self.skip_leaders(self._skipped_leader)
        refresher = asyncio.ensure_future(self._refresh_leaders_while_looking(step))
        try:
            await super().run_step(step=step, future_for_init=future_for_init)
        finally:
            refresher.cancel()
            outgoing, self._outgoing = self._outgoing, None
            if outgoing is not None:  # no all-reduce delivered (e.g. nobody to average with): nothing sent
                if not step.triggered:
                    outgoing.cancel()  # still waiting for the trigger, so nothing was packed
                await asyncio.wait([outgoing])
                if not outgoing.cancelled() and outgoing.exception() is None:
                    self._undo_error_feedback(outgoing.result())
            self._step_in_progress = None
            self._step_finished.set()  # after the undo, which reads the pseudo-gradient buffers

    async def _refresh_leaders_while_looking(self, step: StepControl) -> None:
        # hivemind re-reads the declared averagers only while the earliest it knows declares a time past the latest
        # others' less 3 s, as if all declared about the same horizon. Peers out of steps declare far and unequal
        # ones (`RoundSchedule.group_deadline`): the one leading the others stopped reading, never saw a peer still
        # training that began looking later with an earlier time, and began its group without it at its own time.
        while True:
            await asyncio.sleep(LEADERS_REFRESH_S)
            if step.stage == AveragingStage.LOOKING_FOR_GROUP:
                self.refresh_potential_leaders()

    def _skipped_leader(self, leader: PeerID) -> bool:
        """Leaders this peer does not follow: those it banned, and, while it averages in a pair only with its
        partners (`start_round`'s `pair_partners`), those it holds disputed. A groupmate refused or got otherwise
        the average such a reducer sent, so that groupmate has likely banned it, and then never joins its group:
        the group stays a pair this peer refuses, and its search for another cost the round seconds while every
        trainer ran on (seen: an unsigned two-faced reducer's pair refused again and again, a round of 250 steps).

        But the peers that hold the same evidence seldom act on it in the same step: one refusal is no ban, and
        one groupmate may ban a peer a round before the others. So a leader first disputed or banned in this step
        or the last is still followed: the groupmates a step behind still follow it, and a peer that skipped it
        then missed the group they formed with it, averaged alone and downloaded the swarm's state a round later
        (seen for an unsigned two-faced reducer the peer was told the truth by, and for an "A Little Is Enough"
        peer banned a round early, whose three honest groupmates then downloaded the state in turn). In that group
        a banned leader's parts are left out and its span's answers unused, as a banned follower's. The step counts
        from the first ban among this peer and its pair partners (`heed_partners_bans`: their notes give the round
        of each ban), so that they leave the leader in the same step (seen: a peer that banned an "A Little Is
        Enough" peer on its own second strike a round after its partners, followed it in that step of grace into a
        refused pair and a state download; and two that banned it at once on a partner's note skipped the group
        that partner still followed). A peer just banned here whose span a groupmate took when this peer refused
        it in an earlier step is skipped at once: that groupmate has held it disputed since, and skips it now (the
        peer an unsigned two-faced reducer lied to, following it, was left in a pair with it, which it refused).
        As a follower such a peer can still join our group, and a peer only caught is still followed: a group of
        three it leads is where the robust rule strikes it again (skipping those too left a 2 + 1 sign flip's
        honest peers each leading a group the attacker alone joined, no second strike, and 2.51 val loss)."""
        peer = leader.to_base58()
        if self._is_banned(leader) and not self._followed_though_banned(peer):
            return True
        return (self._pair_partners is not None and peer in self._reputation.disputed
                and not self._marked_lately(self._disputed_in_step, peer))

    def _followed_though_banned(self, peer: str) -> bool:
        """Whether `peer`, banned here, is still followed as a leader (`_skipped_leader`): banned in this step or the
        last, and not skipped now by a groupmate that has held it disputed since an earlier step."""
        marks = self._disputed_by_groupmates_in_step
        skipped_by_groupmates = (self._pair_partners is not None and peer in marks
                                 and not self._marked_lately(marks, peer))
        return self._marked_lately(self._banned_in_step, peer) and not skipped_by_groupmates

    def _marked_lately(self, marks: dict[str, float], peer: str) -> bool:
        """Whether `marks` (peer -> the step it was marked in) has `peer` marked in this step or the last."""
        return marks.get(peer, -math.inf) >= self._steps_begun - 1

    async def _set_pair_partners(self, partners: Optional[frozenset[str]], version: int) -> None:
        self._pair_partners, self._pair_rule_held = partners, version

    async def _latest_pair_rule(self) -> Optional[frozenset[str]]:
        """This round's `pair_partners`, once the control pipe has delivered the latest one the host sent."""
        deadline = time.monotonic() + PAIR_RULE_WAIT_S
        while self._pair_rule_held < int(self._pair_rules_sent) and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        return self._pair_partners

    async def _refused_pair(self, group_info: GroupInfo) -> Optional[str]:
        """Why this peer takes no average from this group (see `start_round`'s `pair_partners`), or None.

        A refused pair is still averaged, and its result thrown away: the other member may not refuse (it may
        have averaged with this peer before), and a peer that waited for parts that never came would stall its
        round for the whole chunk timeout while its trainer runs on (measured: rounds of 20 s, whose oversized
        updates the outer step then overshot). Taking part costs the refusing peer nothing it keeps.

        A peer this one has caught is refused whatever the rule: where any pair would do (fewer than three live, or
        a long spell without an average), its update and its span's answer would otherwise go in unopposed."""
        if len(group_info.peer_ids) != 2:
            return None
        partners = await self._latest_pair_rule()
        other = next(peer for peer in group_info.peer_ids if peer != self.peer_id)
        if other.to_base58() in self._reputation.caught:
            why = "a peer caught sending or answering what no honest peer would"
        elif partners is None or other.to_base58() in partners:
            return None
        else:
            why = "a peer not averaged with yet, or one disputed, while three or more peers train"
        logger.info("not averaging in a pair with %s, %s: looking for a larger group", other, why)
        return f"a pair with {other}, {why}"

    def in_a_forming_group(self) -> bool:
        """Whether matchmaking has this peer in a group that has not begun: a leader accepted it, or it leads
        followers. A round cancelled then leaves them waiting for its parts until their sender timeout, should the
        group begin with it (the leader has not seen it leave): a stalled round, seen at a run's end, where a
        peer the clock showed alone gave its round up as its one partner's pair formed."""
        future = MPFuture()
        self.run_in_averager_process("_in_a_forming_group", future=future)
        return future.result()

    def lost_values(self) -> Optional[torch.Tensor]:
        """Of the last all-reduce this peer took part in: a flat mask of the values nobody averaged for it
        (`RoundOutcome.lost`), or None if none. Asked of the averager process: a mask kept there in shared memory
        would cost a byte a parameter for good."""
        future = MPFuture()
        self.run_in_averager_process("_lost_ranges_of_last_round", future=future)
        ranges = future.result()
        if not ranges:
            return None
        lost = torch.zeros(self._flat.numel(), dtype=torch.bool)
        for start, end in ranges:
            lost[start:end] = True
        return lost

    async def _lost_ranges_of_last_round(self, future: MPFuture) -> None:
        future.set_result(list(self._lost_ranges))

    async def _in_a_forming_group(self, future: MPFuture) -> None:
        future.set_result(self.matchmaking_holds_a_group())

    async def _banned_peers(self, future: MPFuture) -> None:
        future.set_result(dict(self._reputation.banned))

    async def _caught_peers(self, future: MPFuture, disputed: bool) -> None:
        future.set_result(self._reputation.caught | (self._reputation.disputed if disputed else set()))

    def _record_rejections(self, runner: "_OneBitAllReduceRunner") -> None:
        runner.settle_overlong_refusals()  # (done already unless the all-reduce failed)
        for peer, why in runner.excused_flags.items():
            logger.info("no strike for %s this round (%s): its update was made on other global weights, out of step "
                        "or just back in step", peer, why)
        rejected = {peer.to_base58(): why for peer, why in runner.rejected.items()}
        if rejected:
            self._reputation.record_round(rejected)
            self._count_bans()
            self._corroborate(rejected)

    def _count_bans(self, since: Optional[Mapping[str, float]] = None) -> None:
        """Tell the host how many peers this one has banned, and note the step of each new ban (a leader is
        followed one more step, `_skipped_leader`): this one, or the step `since` gives."""
        for peer in self._reputation.banned.keys() - self._banned_in_step.keys():
            self._banned_in_step[peer] = (since or {}).get(peer, self._steps_begun)
        self._banned_count.fill_(len(self._reputation.banned))

    def _excused(self, peer_ids: Sequence[PeerID], out_of_step: frozenset) -> Excused:
        """The groupmates excused some strikes this round (`PeerReputation.excuse`), as PeerIDs."""
        groupmates = {peer.to_base58(): peer for peer in peer_ids if peer != self.peer_id}
        excused = self._reputation.excuse(groupmates, {peer.to_base58() for peer in out_of_step})
        return Excused(*({groupmates[peer] for peer in group} for group in excused))

    def _caught_among(self, peer_ids: Sequence[PeerID]) -> frozenset[PeerID]:
        caught = self._reputation.caught
        return frozenset(peer for peer in peer_ids if peer.to_base58() in caught)

    def _is_banned(self, peer_id: PeerID) -> bool:
        return self._reputation.is_banned(peer_id.to_base58())

    async def rpc_join_group(
        self, request: averaging_pb2.JoinRequest, context: P2PContext
    ) -> AsyncIterator[averaging_pb2.MessageFromLeader]:
        """hivemind's, except that a peer this one has banned is refused (it then asks another leader)."""
        if self._is_banned(context.remote_id):
            yield averaging_pb2.MessageFromLeader(code=averaging_pb2.PROTOCOL_VIOLATION)
            return
        async for response in super().rpc_join_group(request, context):
            yield response

    async def download_state(self, future: MPFuture, timeout: Optional[float] = None,
                             prefer: Optional[tuple[int, str]] = None, prefer_donors: frozenset = frozenset()):
        keep_tasks_until_done(asyncio.get_running_loop())  # a joining peer's first call, before any step
        if self._state_check is None:
            return await super().download_state(future, timeout=timeout)
        try:
            future.set_result(await download_checked_state(self, self._state_check, prefer, prefer_donors))
        except BaseException as error:
            if not future.done():
                future.set_exception(error)
            raise

    async def _pack_once_triggered(self, step: StepControl) -> torch.Tensor:
        # super().run_step attaches the trigger before its first await, so it is there when this task first runs.
        await step.wait_for_trigger()
        return await asyncio.get_running_loop().run_in_executor(None, self._pack_with_error_feedback)

    async def run_allreduce(
        self, tensors: Sequence[torch.Tensor], group_info: GroupInfo, group_id: Optional[bytes] = None, **kwargs
    ):
        """Replace `tensors` (this peer's pseudo-gradient) by the group's 1-bit average, or raise and change nothing."""
        group_id = group_info.group_id if group_id is None else group_id
        began = time.monotonic()
        refused = await self._refused_pair(group_info)
        ruled = time.monotonic()
        if self._outgoing is None:  # hivemind retries after a failed attempt, which rolled the residual back
            self._outgoing = asyncio.get_running_loop().run_in_executor(None, self._pack_with_error_feedback)
        sent = await self._outgoing
        packed = time.monotonic()
        if packed - began > SLOW_START_S:
            logger.info("this all-reduce sends its first part %.1f s late: %.1f s waiting for the pair rule, %.1f s "
                        "for the pack", packed - began, ruled - began, packed - ruled)
        declared = self._declared(group_info)
        declarations = [_declared_key(item) for item in declared]
        keys = [bound_key(item, peer) for peer, item in zip(group_info.peer_ids, declarations)]
        self._show_proofs(group_info.peer_ids)
        self._digest_inboxes.open(group_id, group_info.peer_ids)  # a groupmate may end its all-reduce before us
        try:
            runner = self._make_runner(
                group_tokens=[_declared_tokens(item) for item in declared],
                excused=self._excused(group_info.peer_ids, _out_of_step(group_info.peer_ids, declared)),
                banned=frozenset(peer for peer in group_info.peer_ids if self._is_banned(peer)),
                caught=self._caught_among(group_info.peer_ids),
                p2p=self.p2p,
                servicer_type=type(self),
                prefix=self.prefix,
                tensors=self._split(sent),
                group_id=group_id,
                ordered_peer_ids=group_info.peer_ids,
                codec=self.codec,
                reducer_residual=self._reducer_residual if self.reducer_error_feedback else None,
                max_norm_ratio=self.max_norm_ratio,
                traffic=self._traffic,
                signer=self._span_signer,
                reducer_keys=keys,
                **kwargs,
            )
            if self.codec.own_part_exact:
                self._send_own_parts_exactly(sent, runner.parts_for_local_averaging)
            self.register_runner(group_id, runner)
            disputed: dict[PeerID, list[tuple[int, int]]] = {}
            try:
                averaged = [tensor async for tensor in runner]
                runner.settle_overlong_refusals()
                self._evidence_books.keep(group_id, group_info.peer_ids, declarations, runner.signed_copies,
                                          runner.signed_replies)
                disputed, recovered = await self._agree_on_spans(runner, group_id, sent)
                if refused:
                    raise AllreduceException(f"not taking the average of {refused}")
            finally:
                self._round_dropped.fill_(len(runner.dropped_peers | set(disputed)))
                self._record_rejections(runner)
        except BaseException:
            self._outgoing = None
            self._undo_error_feedback(sent)
            raise
        finally:
            self._digest_inboxes.close(group_id)
        self._outgoing = None
        average = torch.cat([tensor.reshape(-1) for tensor in averaged])
        recovered_ranges = set()
        for index, answers in recovered.items():
            for (start, end), answer in zip(runner.span_ranges(index), answers):
                average[start:end] = answer.reshape(-1)
                recovered_ranges.add((start, end))
        lost_spans = [*(span for span in runner.lost_spans if span not in recovered_ranges),
                      *(span for spans in disputed.values() for span in spans)]
        for start, end in lost_spans:
            average[start:end] = 0  # a disputed span falls back as a failed one does
        self._lost_ranges = lost_spans
        if self.residual_carry is not None:
            self._settle_residual(sent, lost_spans)
        for tensor, part in zip(tensors, self._split(average)):
            tensor.copy_(part)

    async def _agree_on_spans(
        self, runner: "_OneBitAllReduceRunner", group_id: bytes, sent: torch.Tensor
    ) -> tuple[dict[PeerID, list[tuple[int, int]]], dict[int, list[torch.Tensor]]]:
        """Exchange span digests with the groupmates (peers/span_agreement.py); return the spans we took an
        average of that a groupmate got otherwise (reducer -> its span's [start, end) ranges, to drop) and the
        averages of spans we lost but fetched a signed copy of (reducer index -> its parts' averages), and count
        a reducer most of the group refused or got other bytes from among those caught this round."""
        peers, mine = runner.ordered_peer_ids, runner.reply_digests
        others = [peer for peer in peers if peer != runner.peer_id]
        message = digest_message(group_id, mine)
        for peer in others:
            if runner.modes[peers.index(peer)] != AveragingMode.CLIENT:  # a client-mode peer takes no calls
                asyncio.ensure_future(self._send_digests(peer, message))
        # Everyone's digests count, a banned peer's too: groupmates that have not banned it count them, and
        # agreement needs the same digests on every peer. Not awaited: senders that went silent (gone, likely).
        alive = [peer for peer in others if peer in runner.banned or peer not in runner.dropped_peers]
        reported = await self._digest_inboxes.wait(group_id, [] if self.client_mode else alive, SPAN_AGREEMENT_TIMEOUT_S)
        self._show_evidence(runner, group_id, reported)
        received = believed(mine, reported)
        recoverable = recoverable_spans(peers, {runner.peer_id: mine, **received},
                                        [key is not None for key in runner.reducer_keys])
        dropped = {}
        for index in sorted(disputed_spans(mine, received)):
            if mine[index] == REFUSED and any(digests[index] not in (NO_AVERAGE, REFUSED)
                                              for digests in received.values()):
                self._disputed_by_groupmates_in_step.setdefault(peers[index].to_base58(), self._steps_begun)
            if mine[index] in (NO_AVERAGE, REFUSED):
                continue  # lost here already
            if any(took_another(mine[index], digests[index]) for digests in received.values()):
                # Its reducer may have lied. (A lost span, counted too, made honest reducers no pair partners of
                # each other.)
                reducer = peers[index].to_base58()
                if reducer not in self._reputation.disputed:
                    self._disputed_in_step[reducer] = self._steps_begun
                self._reputation.disputed.add(reducer)
            if index not in recoverable:  # (else those that lost it fetch our copy)
                logger.info("dropping %s's span this round: a groupmate got another average of it", peers[index])
                dropped[peers[index]] = runner.span_ranges(index)
        voters = {peer: digests for peer, digests in received.items() if peer not in runner.banned}
        for index in outvoted_reducers(peers, runner.peer_id, mine, voters):
            runner.refuse_reducer(peers[index], "an average most of its group refused or got otherwise")
        recovered = {}
        for index, digest in recoverable.items():
            if mine[index] in (NO_AVERAGE, REFUSED):
                holders = [peer for peer, digests in received.items() if digests[index] == digest
                           and runner.modes[peers.index(peer)] != AveragingMode.CLIENT]  # (it takes no calls)
                answers = await self._fetch_signed_copy(runner, group_id, index, digest, holders, sent)
                if answers is not None:
                    recovered[index] = answers
        return dropped, recovered

    async def _fetch_signed_copy(self, runner: "_OneBitAllReduceRunner", group_id: bytes, index: int, digest: bytes,
                                 holders: Sequence[PeerID], sent: torch.Tensor) -> Optional[list[torch.Tensor]]:
        """The averages of reducer `index`'s span from the first of `holders` whose copy its reducer signed and
        that passes our checks of a reducer's answer; None where none does in time. The reducer is asked last:
        it may be the one that denied us its answer."""
        reducer = runner.ordered_peer_ids[index]
        for holder in sorted(holders, key=lambda peer: peer == reducer):
            try:
                buffers, signature = await asyncio.wait_for(
                    self._read_signed_copy(holder, group_id, index, len(runner.span_ranges(index))),
                    SPAN_COPY_TIMEOUT_S)
                if span_digest(buffers) != digest or not verify_span(
                        runner.reducer_keys[index], group_id, index, digest, signature):
                    raise InvalidContributionError("not the average its reducer signed")
                answers = await asyncio.get_running_loop().run_in_executor(
                    None, runner.relayed_span, index, buffers, sent)
            except Exception as e:  # noqa: BLE001  (a groupmate's bytes, or it left: try the next one)
                logger.info("no copy of %s's span from %s: %r", reducer, holder, e)
                continue
            logger.info("took %s's span from %s's signed copy", reducer, holder)
            return answers
        return None

    async def _read_signed_copy(self, holder: PeerID, group_id: bytes, index: int,
                                parts: int) -> tuple[list[bytes], bytes]:
        """A groupmate's copy of a span (`EvidenceBooks.relayed`): its parts' reply bytes and the signature after."""
        stub = type(self).get_stub(self.p2p, holder, namespace=self.prefix)
        buffers, signature = [], b""
        async for message in await stub.rpc_span_copy(copy_request(group_id, index)):
            self._traffic[_RECEIVED] += message.ByteSize()
            if len(buffers) == parts:
                signature = message.tensor_part.buffer
                break
            buffers.append(message.tensor_part.buffer)
        return buffers, signature

    def _show_evidence(self, runner: "_OneBitAllReduceRunner", group_id: bytes,
                       reported: dict[PeerID, Sequence[bytes]]) -> None:
        """Send each groupmate that reports another average of a span than ours our signed copy of it (in the
        background): if it holds a signed copy too, one of them proves its reducer a liar (`rpc_span_evidence`)."""
        mine = runner.reply_digests
        for peer, digests in reported.items():
            shown = {index: copy for index, copy in runner.signed_copies.items()
                     if took_another(mine[index], digests[index])}
            if shown:
                asyncio.ensure_future(self._call(peer, "rpc_span_evidence", evidence_message(group_id, shown)))

    async def _send_digests(self, peer: PeerID, message: averaging_pb2.AveragingData) -> None:
        await self._call(peer, "rpc_span_digests", message)

    async def _call(self, peer: PeerID, rpc: str, message: averaging_pb2.AveragingData) -> None:
        try:
            stub = type(self).get_stub(self.p2p, peer, namespace=self.prefix)
            await getattr(stub, rpc)(message, timeout=SPAN_AGREEMENT_TIMEOUT_S)
        except Exception as e:  # noqa: BLE001  (it left, or is slow: it then falls back on what it saw)
            logger.debug("could not send %s to %s: %r", rpc, peer, e)

    async def rpc_span_copy(
        self, request: averaging_pb2.AveragingData, context: P2PContext
    ) -> AsyncIterator[averaging_pb2.AveragingData]:
        """Our signed copy of a span a groupmate lost (peers/span_agreement.py), part by part, then its signature."""
        for message in self._evidence_books.relayed(context.remote_id, request):
            self._traffic[_SENT] += message.ByteSize()
            yield message

    async def rpc_span_evidence(
        self, request: averaging_pb2.AveragingData, context: P2PContext
    ) -> averaging_pb2.AveragingData:
        """A groupmate's signed copies of spans we got other averages of: a reducer that signed both is banned."""
        for proof in self._evidence_books.equivocators(context.remote_id, request):
            self._convict(proof)
        return averaging_pb2.AveragingData()

    async def rpc_span_proof(
        self, request: averaging_pb2.AveragingData, context: P2PContext
    ) -> averaging_pb2.AveragingData:
        """A proof a groupmate holds that some peer signed two different averages of its span (checked here)."""
        proof = Proof.read(request)
        if proof is not None:
            self._convict(proof)
        return averaging_pb2.AveragingData()

    def _convict(self, proof: Proof) -> None:
        liar = proof.liar()
        if liar is None or liar == self.peer_id.to_base58() or liar in self._proofs:
            return
        self._proofs[liar] = proof
        self._reputation.convict(liar, "signed two different averages of its span")
        self._count_bans()

    def _show_proofs(self, peers: Sequence[PeerID]) -> None:
        """Show each groupmate, once, the proofs we hold against others (in the background): a peer that was not
        in the group where a reducer lied then bans it too, instead of averaging on with it as a partner."""
        for peer in peers:
            if peer == self.peer_id:
                continue
            for liar, proof in self._proofs.items():
                if liar != peer.to_base58() and (liar, peer.to_base58()) not in self._shown:
                    self._shown.add((liar, peer.to_base58()))
                    asyncio.ensure_future(self._call(peer, "rpc_span_proof", proof.message()))

    async def rpc_span_digests(
        self, request: averaging_pb2.AveragingData, context: P2PContext
    ) -> averaging_pb2.AveragingData:
        """A groupmate's digests of the spans of an all-reduce we are in (peers/span_agreement.py)."""
        self._digest_inboxes.deliver(context.remote_id, request)
        return averaging_pb2.AveragingData()

    def _make_runner(self, **kwargs) -> "_OneBitAllReduceRunner":
        """The all-reduce of one attempt (tests make attacking peers by overriding it)."""
        return _OneBitAllReduceRunner(**kwargs)

    async def rpc_aggregate_part(
        self, stream: AsyncIterator[averaging_pb2.AveragingData], context: P2PContext
    ) -> AsyncIterator[averaging_pb2.AveragingData]:
        """A groupmate's parts for the span this peer reduces: handed to this round's runner once it exists.

        Replaces hivemind 1.1.12's handler for one reason: that one waits for the runner by awaiting the group's
        shared future itself, so when a groupmate dies while its parts wait there (its stream closes and the
        handler is cancelled) the shared future is cancelled with it. This peer's all-reduce then fails to
        start, and the survivors of the round retry it from matchmaking (tests/test_averaging.py's killed-peer
        test: they finished 12.4 s after the death, against its bound of 10 s). Here each waiting groupmate
        awaits a shield of the future, so its death cancels only its own wait.
        """
        first = await anext(stream)
        runner_future = await self.runner_future(first.group_id, self._may_join_a_group, UNKNOWN_GROUP_GRACE_S)
        if runner_future is None:
            yield averaging_pb2.AveragingData(code=averaging_pb2.BAD_GROUP_ID)
            return
        runner = await asyncio.shield(runner_future)
        async for reply in runner.rpc_aggregate_part(achain(as_aiter(first), stream), context):
            yield reply

    def _may_join_a_group(self) -> bool:
        """Whether this peer's round may yet begin an all-reduce in a group it has not registered: matchmaking
        holds a group (a leader accepted it, it leads followers, or it has assembled one) or has found one that
        awaits the trigger."""
        step = self._step_in_progress
        return step is not None and (step.stage == AveragingStage.AWAITING_TRIGGER or self.matchmaking_holds_a_group())

    def _declared(self, group_info: GroupInfo) -> list[Any]:
        """What each groupmate declared when the group formed (remote data: None where it does not decode)."""
        declared = []
        for blob in group_info.gathered:
            try:
                _, _, user_gathered = self.serializer.loads(blob)  # hivemind's (bandwidth, mode, user data)
                declared.append(self.serializer.loads(user_gathered))
            except Exception:  # noqa: BLE001  (anything a hostile groupmate could make the decoder raise)
                declared.append(None)
        return declared

    def _pack_with_error_feedback(self) -> torch.Tensor:
        """What this peer sends (flat): the codec's form of `tensor + residual`, decoded; the residual keeps the
        difference.

        Packed per tensor, so blocks (chunks) start where hivemind's parts start (see OneBitCodec) and the codec
        sends these values exactly.
        """
        sent = torch.empty_like(self._flat)
        tensors = self.averaged_tensors  # start_round wrote them; no round, no writer, until this one ends
        for tensor, residual, out in zip(tensors, self._split(self._sender_residual), self._split(sent)):
            out.copy_(self.codec.carried(tensor, residual.view(-1) if self.residual_carry is not None else None))
        return sent

    def _send_own_parts_exactly(self, sent: torch.Tensor, own_parts: Sequence[torch.Tensor]) -> None:
        """Our own parts of the span we reduce never travel, so they need no code: each becomes what we owe
        there in full (`sent + residual` with error feedback, the pseudo-gradient without), and the residual
        owes nothing for it. `own_parts` are views of `sent`, so the bookkeeping (`sent + residual` = what we
        owed before packing) stays exact for the rollback and for lost spans. Measured: closer to the one
        process than coding them too in all 15 paired runs, by 0.04-1.25 points (benchmarks/RESULTS.md)."""
        for part in own_parts:
            start, end = part.storage_offset(), part.storage_offset() + part.numel()
            if self.residual_carry is None:
                sent[start:end] = self._flat[start:end]
            else:
                sent[start:end] += self._sender_residual[start:end]
                self._sender_residual[start:end] = 0

    def _settle_residual(self, sent: torch.Tensor, lost_spans: Sequence[tuple[int, int]]) -> None:
        """After a delivered round: where no reducer averaged, the residual is what it was before this round (the
        round's update there stays in the peer's weights: `RoundOutcome.lost`); the rest of it by the round's
        `residual_carry`."""
        lost = [(start, end, self._sender_residual[start:end] + sent[start:end] - self._flat[start:end])
                for start, end in lost_spans]
        carry = float(self._round_carry)
        if carry != 1.0:
            self._sender_residual.mul_(carry)
        for start, end, owed in lost:
            self._sender_residual[start:end] = owed

    def _undo_error_feedback(self, sent: torch.Tensor) -> None:
        # The round failed, so nothing was sent: restore the residual to its value before packing.
        if self.residual_carry is not None:
            self._sender_residual.add_(sent).sub_(self._flat)

    def _split(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Views of a flat buffer shaped like the averaged tensors."""
        shapes = [t.shape for t in self.averaged_tensors]
        return [view.view(shape) for view, shape in zip(flat.split([s.numel() for s in shapes]), shapes)]


@dataclass(frozen=True)
class _ScheduledRound:
    """A round whose matchmaking `schedule_round` began before its tensors were ready."""

    control: StepControl
    metadata: Any
    traffic_before: tuple[int, ...]  # the averager's traffic counters when it was scheduled


class _RobustPartReducer(TensorPartReducer):
    """hivemind's reducer of one span, with the robust rule (peers/robust.py) instead of a running weighted sum.

    A part's contributions are kept until every live sender's is in, then aggregated together (in a worker
    thread: the event loop keeps streaming meanwhile). `flagged` collects the senders the rule flagged, by index;
    `caught` (set by the runner) names those the rule judges without the benefit of the doubt.
    """

    def __init__(self, part_shapes: Sequence[torch.Size], num_senders: int):
        self._contributions: dict[int, tuple[torch.Tensor, float]] = {}
        self._finishing = False
        self.flagged: dict[int, str] = {}  # sender index -> why (the first reason it was flagged for)
        self.caught: frozenset[int] = frozenset()  # senders this peer rejected in an earlier round, by index
        super().__init__(part_shapes, num_senders)

    def reset_accumulators(self) -> None:
        self._contributions = {}
        super().reset_accumulators()

    async def accumulate_part(
        self, sender_index: int, part_index: int, tensor_part: torch.Tensor, weight: float = 1.0
    ) -> torch.Tensor:
        """Keep this sender's contribution to the part, wait for the others', then return the part's aggregate."""
        self.num_parts_received[sender_index] += 1
        while part_index > self.current_part_index:  # earlier parts are still being aggregated
            await asyncio.wait({self.current_part_future, asyncio.create_task(self.finished.wait())},
                               return_when=asyncio.FIRST_COMPLETED)
            if self.finished.is_set():
                raise AllreduceException("the reducer finished before this part was aggregated")
        if self.sender_failed_after[sender_index] != float("inf"):
            raise BannedException(f"sender {sender_index} was dropped")
        part_future = self.current_part_future
        self._contributions[sender_index] = (tensor_part, weight)
        self.current_part_accumulated_from += 1
        self.check_current_part_finished()
        return await part_future

    def check_current_part_finished(self) -> None:
        if self.current_part_accumulated_from == self.num_current_senders and not self._finishing:
            self._finishing = True
            asyncio.ensure_future(self._finish_part(self.current_part_future, self._contributions))

    async def _finish_part(self, part_future: asyncio.Future, contributions: dict) -> None:
        shape = self.part_shapes[self.current_part_index]
        try:
            aggregate = await asyncio.get_running_loop().run_in_executor(None, self._aggregate, contributions, shape)
        except Exception as e:  # noqa: BLE001  (handed to every sender waiting for this part)
            aggregate = e
        if self.finished.is_set():
            return
        if isinstance(aggregate, Exception):
            part_future.set_exception(aggregate)
        else:
            part_future.set_result(aggregate)
        self._finishing = False
        self.reset_accumulators()

    def _aggregate(self, contributions: dict[int, tuple[torch.Tensor, float]], shape: torch.Size) -> torch.Tensor:
        if not contributions:  # every sender failed: nobody is waiting for this part
            return torch.zeros(shape)
        senders = sorted(contributions)
        parts = torch.stack([contributions[i][0].reshape(-1).float() for i in senders])
        tokens = torch.tensor([contributions[i][1] for i in senders], dtype=torch.float64)
        result = robust_aggregate(parts, tokens, frozenset(k for k, i in enumerate(senders) if i in self.caught))
        for k in result.far:  # against the group's result too, it is no honest update on other weights either
            against = float(torch.dot(parts[k], result.aggregate.reshape(-1).float())) < 0
            self.flagged.setdefault(senders[k], FAR_AND_AGAINST_THE_GROUP if against else FAR_FROM_THE_GROUP)
        for k in result.colluding:
            self.flagged.setdefault(senders[k], COLLUDING)
        for k in result.flipped:
            self.flagged.setdefault(senders[k], "a part pointing against the others' agreeing ones")
        for k in result.one_sided:
            self.flagged.setdefault(senders[k], "a part to one side of the group's median in most of its values")
        return result.aggregate.reshape(shape)


class _OneBitAllReduceRunner(AllReduceRunnerBase):
    """hivemind's butterfly all-reduce with validated inputs, robust aggregation and one shared 1-bit answer per part.

    Outputs are the averaged values themselves (hivemind's runner yields deltas); a failed reducer's span is
    zero, and `lost_spans` says where. Peers in `banned` take no part in our average: their parts are left out of
    our span (but answered) and their spans' answers are not used (lost), though they get our parts. `rejected`
    says who sent or answered something refused this round, and why. Senders in `caught` (rejected by this peer
    in an earlier round) are judged by the robust rule without the benefit of the doubt it gives a half or more of
    a group (`robust_aggregate`'s `caught`).
    `tensors` must be views of one flat buffer: a part's storage offset is then its position in the model, which
    locates lost spans and indexes the reducer residual (None: no reducer error feedback) whichever span this
    peer reduces in a round.
    """

    part_reducer_type: type = _RobustPartReducer  # (benchmarks compare it with hivemind's weighted mean)

    def __init__(
        self,
        *,
        codec: SwarmCodec,
        reducer_residual: Optional[torch.Tensor],
        max_norm_ratio: float,
        group_tokens: Sequence[float],
        traffic: torch.Tensor,
        banned: frozenset = frozenset(),
        caught: frozenset = frozenset(),
        excused: Optional[Excused] = None,
        signer: Optional[SpanSigner] = None,
        reducer_keys: Optional[Sequence[Optional[Ed25519PublicKey]]] = None,
        **kwargs,
    ):
        super().__init__(**kwargs)
        self.signer = signer  # signs our span's digest (peers/span_agreement.py); None: we send no signature
        self.reducer_keys = list(reducer_keys) if reducer_keys is not None else [None] * len(self.ordered_peer_ids)
        self.codec, self.reducer_residual, self.max_norm_ratio, self.traffic = (
            codec, reducer_residual, max_norm_ratio, traffic
        )
        self.excused, self.caught_senders = excused or Excused(set(), set()), caught
        self.median_tokens = high_median(torch.tensor(list(group_tokens) or [self.weight], dtype=torch.float64))
        hivemind_reducer, self.tensor_part_reducer = self.tensor_part_reducer, self.part_reducer_type(
            tuple(part.shape for part in self.parts_for_local_averaging), len(self.sender_peer_ids)
        )
        hivemind_reducer.finished.set()  # never used: finished, so that it does not report missing parts
        if isinstance(self.tensor_part_reducer, _RobustPartReducer):
            self.tensor_part_reducer.caught = frozenset(
                i for i, peer in enumerate(self.sender_peer_ids) if peer in caught)
        self.banned = frozenset(banned) & set(self.ordered_peer_ids) - {self.peer_id}
        for peer_id in self.banned & set(self.sender_peer_ids):
            self.banned_senders.add(peer_id)
            self.tensor_part_reducer.on_sender_failed(self.sender_peer_ids.index(peer_id))
        self._invalid: dict[PeerID, str] = {}  # groupmates whose parts or averages were refused, and why
        self._overlong: dict[PeerID, str] = {}  # reducers refused as over-long, until `settle_overlong_refusals`
        self._own_span_squares = [0.0, 0.0]  # sums of squares: our parts of the span we reduce, their aggregates
        self._own_norms = reference_norms(self.parts_for_local_averaging)
        self._replies: dict[int, asyncio.Future] = {}  # part index -> (message, decoded), shared by all senders
        self._compressing: set[int] = set()  # parts whose reply is being made
        self._sent_parts: dict[int, list[tuple[torch.Size, float]]] = {}  # peer index -> (shape, norm) we sent
        self.lost_spans: list[tuple[int, int]] = []  # [start, end) in the flat vector of parts nobody averaged
        self._failed_reducers: set[PeerID] = set()
        # per reducer (in ordered_peer_ids' order): the digest of the average we took of its span, for the
        # group to compare (peers/span_agreement.py); REFUSED where we refused it (or banned its reducer),
        # NO_AVERAGE where we took none for another reason
        self.reply_digests: list[bytes] = [NO_AVERAGE] * len(self.ordered_peer_ids)
        # per reducer index: (digest, signature) of the bytes it sent us with a valid signature, taken or refused
        self.signed_copies: dict[int, tuple[bytes, bytes]] = {}
        # per reducer index: the reply bytes (part by part) of the signed averages we took, to relay to groupmates
        self.signed_replies: dict[int, list[bytes]] = {}
        self._signature: Optional[asyncio.Future] = None  # ours, of our span's digest
        # where each reducer's parts lie in the flat vector (taken now: the container forgets its parts when done)
        self._span_ranges = [
            [(part.storage_offset(), part.storage_offset() + part.numel())
             for part in parts_sent_to(self.tensor_part_container, index)]
            for index in range(len(self.ordered_peer_ids))
        ]

    @property
    def dropped_peers(self) -> set[PeerID]:
        """Groupmates lost so far: senders our span dropped (invalid, silent) and reducers that failed us."""
        return (self.banned_senders | self._failed_reducers) - {self.peer_id}

    @property
    def _flagged(self) -> dict[PeerID, str]:
        """Senders whose parts the robust rule flagged on our span this round, and why."""
        flags = getattr(self.tensor_part_reducer, "flagged", {})
        return {self.sender_peer_ids[i]: why for i, why in flags.items()}

    @property
    def excused_flags(self) -> dict[PeerID, str]:
        """Groupmates whose parts the robust rule flagged this round without a strike (`_strikes`), and why."""
        return {peer: why for peer, why in self._flagged.items()
                if peer not in self.banned and not self._strikes(peer, why)}

    @property
    def rejected(self) -> dict[PeerID, str]:
        """Groupmates caught this round (banned ones aside): parts refused, parts flagged by the robust rule
        (unless their sender was out of step: `_strikes`), and reducers whose averages failed our check. Network
        trouble is not in it."""
        flagged = {peer: why for peer, why in self._flagged.items() if self._strikes(peer, why)}
        caught = {**flagged, **self._invalid}
        return {peer: why for peer, why in caught.items() if peer not in self.banned | {self.peer_id}}

    def settle_overlong_refusals(self) -> None:
        """Once our own span is reduced, before the span digests go out: the averages refused as over-long
        (`OverlongAverage`) count against their reducers (`rejected`) only if our own span shows our update as long as
        the group's (its aggregate at most `SHORT_UPDATE_RATIO` times our parts; so where we reduce nothing). Else
        our parts were no evidence: those spans are lost to us as a `ShortPartRefusal`'s are (`NO_AVERAGE`), with
        no strike and no vote against their reducers. Idempotent."""
        ours, aggregate = self._own_span_squares
        evidence = aggregate <= SHORT_UPDATE_RATIO ** 2 * ours
        for peer_id, why in self._overlong.items():
            if evidence:
                self._invalid.setdefault(peer_id, why)
            else:
                self.reply_digests[self.ordered_peer_ids.index(peer_id)] = NO_AVERAGE
        self._overlong.clear()

    def _strikes(self, sender: PeerID, why: str) -> bool:
        """Whether a part the robust rule flagged counts against its sender. An excused sender's update out of step
        (`PeerReputation.excuse`) is measured against other weights and may honestly lie far from the group's: no
        strike. Its other flags (one-sided, flipped, colluding, far and pointing against the group's result) are no
        such accident from a peer caught before: an ALIE attacker that one banning peer's refusals kept out of step
        every other round was never struck by the others again, nor a -10x flipper out of step after its first
        strike. Just back in step, a peer not caught before is excused a far part (its resync's stale progress)."""
        if sender in self.excused.out_of_step:
            return sender in self.caught_senders and why != FAR_FROM_THE_GROUP
        if sender in self.excused.back_in_step:
            return sender in self.caught_senders or why not in (FAR_FROM_THE_GROUP, FAR_AND_AGAINST_THE_GROUP)
        return True

    # -- reducer side --

    async def accumulate_parts_streaming(self, stream: AsyncIterator[averaging_pb2.AveragingData], sender_index: int):
        loop = asyncio.get_running_loop()
        sender = self.sender_peer_ids[sender_index]
        part_index, weight = 0, None
        if sender in self.banned:
            async for reply in self._answer_banned_sender(stream):
                yield reply
            return
        try:
            async for message in stream:
                self.traffic[_RECEIVED] += message.ByteSize()
                self.traffic[_VALUES_RECEIVED] += math.prod(message.tensor_part.size)
                if weight is None:  # hivemind repeats the weight in every message; the first one counts
                    weight = message.weight
                    if not (math.isfinite(weight) and weight > 0):
                        raise InvalidContributionError(f"weight {weight}")
                part = await loop.run_in_executor(None, self._decode_contribution, message.tensor_part, part_index,
                                                  weight)
                try:
                    averaged = await self.tensor_part_reducer.accumulate_part(sender_index, part_index, part, weight)
                except BannedException:
                    break  # dropped in the background (silent for too long)
                reply, _ = await asyncio.shield(self._reply_for(part_index, averaged))
                yield self._answer(reply)
                part_index += 1
            if part_index == self.tensor_part_reducer.num_parts:
                yield await self._signature_message()
        except InvalidContributionError as e:
            logger.warning("dropping %s from this round: part %d is invalid (%s)", sender, part_index, e)
            self._invalid.setdefault(sender, f"an invalid part ({e})")
            raise
        finally:
            if part_index != self.tensor_part_reducer.num_parts:
                await self.ban_sender(sender)

    async def _answer_banned_sender(self, stream: AsyncIterator[averaging_pb2.AveragingData]):
        """A banned sender's parts stay out of the aggregate, but each is answered with the span's average of the
        others: a groupmate that gets no answer from us waits for its reducer timeout, and so do those waiting for
        its own span, and it would lack the bytes the group compares (peers/span_agreement.py)."""
        part_index = 0
        async for _ in stream:
            if part_index >= self.tensor_part_reducer.num_parts:
                break
            reply, _ = await asyncio.wait_for(asyncio.shield(self._reply_slot(part_index)), self.reducer_timeout)
            yield self._answer(reply)
            part_index += 1
        if part_index == self.tensor_part_reducer.num_parts:
            yield await self._signature_message()

    async def _signature_message(self) -> averaging_pb2.AveragingData:
        """The message after a sender's last answer: our signature of the span's digest, made once (empty bytes
        without a span key). Every part's answer exists by then: the sender got them all."""
        message = signature_message(await self._span_signature())
        self.traffic[_SENT] += message.ByteSize()
        return message

    def _span_signature(self) -> Awaitable[bytes]:
        """Our signature of our span's digest, made once for every sender (shielded, as `_reply_slot`)."""
        if self._signature is None:
            self._signature = asyncio.ensure_future(self._sign_span())
        return asyncio.shield(self._signature)

    async def _sign_span(self) -> bytes:
        replies = [await asyncio.shield(self._reply_slot(i)) for i in range(self.tensor_part_reducer.num_parts)]
        if self.signer is None:
            return b""
        digest = span_digest(message.buffer for message, _ in replies)
        return self.signer.sign(self.group_id, self.ordered_peer_ids.index(self.peer_id), digest)

    def _answer(self, reply: runtime_pb2.Tensor) -> averaging_pb2.AveragingData:
        self.traffic[_SENT] += reply.ByteSize()
        self.traffic[_VALUES_SENT] += math.prod(reply.size)
        return averaging_pb2.AveragingData(code=averaging_pb2.AVERAGED_PART, tensor_part=reply)

    def _norm_bound(self, own: float, tokens: float) -> float:
        """The largest norm accepted for a part from `tokens` tokens, ours being `own`."""
        if self.weight <= 0:
            return self.max_norm_ratio * own
        # A joiner a step into its first round trained on 1/200 of the tokens of the peers whose round it joined
        # late, with an update 1,300 times shorter: capped at 10, it refused (and struck) the run's founder.
        cap = max(TOKEN_ALLOWANCE_CAP, self.median_tokens / self.weight)
        return self.max_norm_ratio * min(cap, max(1.0, tokens / self.weight)) * own

    def _decode_contribution(self, serialized: runtime_pb2.Tensor, part_index: int, weight: float) -> torch.Tensor:
        if part_index >= len(self.parts_for_local_averaging):
            raise InvalidContributionError("more parts than this span has")
        expected = self.parts_for_local_averaging[part_index]
        part = _decode_part(self.codec, serialized, expected.shape)
        norm, own = float(part.norm()), self._own_norms[part_index]
        if own > 0 and norm > self._norm_bound(own, weight):
            raise InvalidContributionError(f"norm {norm:.3g} from {weight:.3g} tokens is over the bound for this "
                                           f"peer's {own:.3g} from {self.weight:.3g}")
        return part

    def _reply_slot(self, part_index: int) -> asyncio.Future:
        """The future of the one message every sender gets for this part, (message, decoded). Shared: await it
        shielded, or one sender's cancelled stream cancels it for all."""
        if part_index not in self._replies:
            self._replies[part_index] = asyncio.get_running_loop().create_future()
        return self._replies[part_index]

    def _reply_for(self, part_index: int, averaged: torch.Tensor) -> asyncio.Future:
        """`_reply_slot`, compressed from `averaged` by whichever sender brings the part's aggregate first."""
        slot = self._reply_slot(part_index)
        if part_index not in self._compressing:
            self._compressing.add(part_index)
            compressed = asyncio.get_running_loop().run_in_executor(None, self._compress_reduced, part_index, averaged)
            compressed.add_done_callback(functools.partial(_settle, slot))
        return slot

    def _compress_reduced(self, part_index: int, averaged: torch.Tensor) -> tuple[runtime_pb2.Tensor, torch.Tensor]:
        if not bool(torch.isfinite(averaged).all()):
            raise AllreduceException(f"the average of part {part_index} overflowed")
        codec = self.codec.return_trip
        if self.reducer_residual is None:
            message = codec.compress(averaged, info=None)
            return message, codec.extract(message)
        start = self.parts_for_local_averaging[part_index].storage_offset()
        residual = self.reducer_residual[start : start + averaged.numel()]
        target = averaged.reshape(-1) + residual
        message = codec.compress(target.view(averaged.shape), info=None)
        decoded = codec.extract(message)
        torch.sub(target, decoded.reshape(-1), out=residual)
        if not bool(torch.isfinite(residual).all()):
            residual.zero_()  # never let one overflow poison this span for all later rounds
            raise AllreduceException(f"the average of part {part_index} overflowed")
        return message, decoded

    # -- sender side --

    async def communicate_with_peer(self, peer_id: PeerID):
        peer_index = self.ordered_peer_ids.index(peer_id)
        try:
            if peer_id == self.peer_id:
                await self._reduce_own_parts(peer_index)
            elif peer_id in self.banned:
                self.reply_digests[peer_index] = REFUSED
                await self._feed_banned_reducer(peer_id, peer_index)
                raise AllreduceException(f"{peer_id} is banned")
            else:
                await self._exchange_with_reducer(peer_id, peer_index)
        except BaseException as e:
            if isinstance(e, Exception):
                logger.info("no average from %s for its span this round: %r", peer_id, e)
                self._failed_reducers.add(peer_id)
            # The parts this reducer never answered stay zero in the result; remember where they are.
            container = self.tensor_part_container
            self.lost_spans.extend(self.span_ranges(peer_index)[outputs_registered(container, peer_index):])
            container.register_failed_reducer(peer_index)
            raise

    def refuse_reducer(self, peer_id: PeerID, why: str) -> None:
        """Count `peer_id` among the groupmates caught this round (`rejected`), as a reducer."""
        self._invalid.setdefault(peer_id, why)

    def span_ranges(self, peer_index: int) -> list[tuple[int, int]]:
        """The [start, end) ranges, in the flat vector, of the parts of the span `peer_index` reduces."""
        return self._span_ranges[peer_index]

    async def _feed_banned_reducer(self, peer_id: PeerID, peer_index: int) -> None:
        """Send a banned reducer our parts anyway, in the background, and never use its answers: left waiting for
        them it would hold up every groupmate that still takes its span, until its sender timeout."""
        outgoing = self._count_outgoing(peer_index)
        first = await anext(outgoing)  # the container's parts are taken now, before the round ends and frees them

        async def feed() -> None:
            try:
                stream = await self.peer_stub(peer_id).rpc_aggregate_part(achain(as_aiter(first), outgoing))
                async for _ in aiter_with_timeout(stream, self.reducer_timeout):
                    pass
            except Exception as e:  # noqa: BLE001  (whatever it does, its span is lost to us already)
                logger.debug("feeding banned reducer %s: %r", peer_id, e)

        asyncio.ensure_future(feed())

    async def _reduce_own_parts(self, peer_index: int) -> None:
        sender_index = self.sender_peer_ids.index(self.peer_id)
        buffers = []
        for part_index, part in enumerate(self.parts_for_local_averaging):
            averaged = await self.tensor_part_reducer.accumulate_part(sender_index, part_index, part, self.weight)
            self._own_span_squares[0] += float(part.float().square().sum())
            self._own_span_squares[1] += float(averaged.float().square().sum())
            message, decoded = await asyncio.shield(self._reply_for(part_index, averaged))
            buffers.append(message.buffer)
            self.tensor_part_container.register_processed_part(peer_index, part_index, decoded)
        digest = self.reply_digests[peer_index] = span_digest(buffers)
        if self.signer is not None:
            self.signed_copies[peer_index] = (digest, await self._span_signature())
            self.signed_replies[peer_index] = buffers

    async def _exchange_with_reducer(self, peer_id: PeerID, peer_index: int) -> None:
        loop = asyncio.get_running_loop()
        done_sending = asyncio.Event()
        outgoing = attach_event_on_finished(self._count_outgoing(peer_index), done_sending)
        stream = await self.peer_stub(peer_id).rpc_aggregate_part(outgoing)
        if self.should_delay_results(self.peer_id):
            await done_sending.wait()
        sent_parts = parts_sent_to(self.tensor_part_container, peer_index)
        floors = reference_norms(sent_parts)
        expected = self.tensor_part_container.num_parts_by_peer[peer_index]
        answers, buffers, signature = [], [], None  # the decoded averages, the bytes they came in, its signature
        refusal: Optional[InvalidContributionError] = None
        try:
            async for message in self._answers(stream, peer_id):
                self.traffic[_RECEIVED] += message.ByteSize()
                if message.code == averaging_pb2.BAD_GROUP_ID:
                    # Its join never completed (`SwarmAverager.rpc_aggregate_part`), or it is done with this group
                    # (it woke from a stall after the group gave it up): its parts will not come either, so our
                    # span goes on without them now, not after the sender timeout.
                    await self.ban_sender(peer_id)
                    raise AllreduceException(f"{peer_id} is not in this all-reduce (its join never completed, or "
                                             "it is done with the group)")
                if message.code != averaging_pb2.AVERAGED_PART:
                    raise AllreduceException(f"{peer_id} sent {averaging_pb2.MessageCode.Name(message.code)}")
                if len(buffers) == expected:  # after the last part: the reducer's signature of its span
                    signature = message.tensor_part.buffer
                    break
                self.traffic[_VALUES_RECEIVED] += math.prod(message.tensor_part.size)
                buffers.append(message.tensor_part.buffer)
                if refusal is not None:
                    continue  # refused already; its bytes and signature may still prove a lie
                # A reply always follows the part it answers, so that part's shape is already recorded.
                part_index = len(answers)
                shape, sent_norm = self._sent_parts[peer_index][part_index]
                averaged = await loop.run_in_executor(None, _decode_part, self.codec.return_trip,
                                                      message.tensor_part, shape)
                try:
                    self._check_reply_norm(averaged, max(sent_norm, floors[part_index]))
                except InvalidContributionError as e:
                    refusal = e
                    continue
                answers.append(averaged)
            digest, key = span_digest(buffers), self.reducer_keys[peer_index]
            if signature is not None and verify_span(key, self.group_id, peer_index, digest, signature):
                self.signed_copies[peer_index] = (digest, signature)
            elif refusal is None and key is not None and signature is not None:
                refusal = InvalidContributionError("its signature does not match")
            if refusal is None and key is not None and signature is None and len(buffers) == expected:
                raise AllreduceException(f"{peer_id} sent no signature of its span")
        finally:
            if isinstance(refusal, ShortPartRefusal):  # lost to us, and no evidence against its reducer
                self.reply_digests[peer_index] = NO_AVERAGE
            elif refusal is not None:  # whatever ended the stream, a refused average counts against its reducer
                refused = self._overlong if isinstance(refusal, OverlongAverage) else self._invalid
                refused.setdefault(peer_id, f"an invalid average ({refusal})")
                self.reply_digests[peer_index] = REFUSED
        if refusal is not None:
            raise refusal
        if len(answers) != expected:
            raise AllreduceException(f"{peer_id} answered {len(answers)} parts instead of all")
        if self._points_away(answers, sent_parts):
            # No strike against the reducer: a peer whose global weights are out of step with the group's (until
            # its resync) can send an update the group's average points away from.
            raise AllreduceException(f"{peer_id}'s average points away from our part of its span")
        for part_index, averaged in enumerate(answers):  # only now: a span refused above is lost as a whole
            self.tensor_part_container.register_processed_part(peer_index, part_index, averaged)
        self.reply_digests[peer_index] = digest
        if peer_index in self.signed_copies:
            self.signed_replies[peer_index] = buffers

    async def _answers(self, stream: AsyncIterator[averaging_pb2.AveragingData],
                       peer_id: PeerID) -> AsyncIterator[averaging_pb2.AveragingData]:
        """A reducer's answers, each within the reducer timeout; but one that has not begun sending us its own parts
        within our sender timeout is given up then: its averager has not begun this all-reduce (stalled), so its
        answers will not come either, and waiting the reducer timeout (twice as long) for them only lengthened the
        round that every groupmate's trainer ran on through (a stall of 20 s: 300 steps, an oversized update)."""
        answers = aiter_with_timeout(stream, self.reducer_timeout)
        first = asyncio.ensure_future(anext(answers))
        if self.sender_timeout is not None and self._expects_parts_from(peer_id):
            await asyncio.wait({first}, timeout=self.sender_timeout)
            if not first.done() and peer_id not in self.active_senders:
                first.cancel()
                raise TimeoutError(f"it sent us none of its parts in {self.sender_timeout:g} s")
        try:
            yield await first
        except StopAsyncIteration:
            return
        async for message in answers:
            yield message

    def _expects_parts_from(self, peer_id: PeerID) -> bool:
        """Whether `peer_id` sends us parts this round: we reduce a span, and it is a sender."""
        own_span = self.tensor_part_container.num_parts_by_peer[self.ordered_peer_ids.index(self.peer_id)]
        return own_span > 0 and peer_id in self.sender_peer_ids

    def _points_away(self, answers: Sequence[torch.Tensor], sent_parts: Sequence[torch.Tensor]) -> bool:
        """Whether a span's averages point away from our parts of it, over the whole span (a part can be a few
        values, whose dot product is noise): an honest aggregate has our share in it, and independent updates are
        nearly orthogonal in high dimension."""
        agreement = sum(float(a.reshape(-1) @ s.reshape(-1)) for a, s in zip(answers, sent_parts))
        sent_squared = sum(float(s.norm()) ** 2 for s in sent_parts)
        answer_squared = sum(float(a.norm()) ** 2 for a in answers)
        span = sum(s.numel() for s in sent_parts)
        noise = AGREEMENT_SIGMAS * math.sqrt(sent_squared * answer_squared / max(span, 1))
        return agreement < -noise and self._own_parts_are_evidence

    def relayed_span(self, peer_index: int, buffers: Sequence[bytes], sent: torch.Tensor) -> list[torch.Tensor]:
        """The averages in a groupmate's copy of reducer `peer_index`'s span (`buffers`, its signature checked by
        the caller), checked as that reducer's own answers would be; `sent` is our flat pseudo-gradient as sent.
        Raises InvalidContributionError where they fail."""
        ranges = self.span_ranges(peer_index)
        if len(buffers) != len(ranges):
            raise InvalidContributionError(f"{len(buffers)} parts instead of {len(ranges)}")
        codec = self.codec.return_trip
        ours = [sent[start:end] for start, end in ranges]
        answers = []
        for buffer, part, floor in zip(buffers, ours, reference_norms(ours)):
            message = runtime_pb2.Tensor(buffer=buffer, size=list(part.shape), dtype="float32",
                                         compression=codec.compression_type)
            averaged = _decode_part(codec, message, part.shape)
            self._check_reply_norm(averaged, floor)
            answers.append(averaged)
        if self._points_away(answers, ours):
            raise InvalidContributionError("its averages point away from our parts of the span")
        return answers

    @property
    def _own_parts_are_evidence(self) -> bool:
        """Whether our parts of a span can judge a reducer's average of it: we trained at least half the group's
        median tokens. A peer a few steps into its round has an update too short (in the warm-up, shorter than its
        tokens say) to tell an honest average from a lie."""
        return self.weight >= self.median_tokens / 2

    def _check_reply_norm(self, averaged: torch.Tensor, reference: float) -> None:
        """Refuse an average that cannot be the robust aggregate of a group that includes our part: one longer
        than REPLY_NORM_RATIO times `reference` (our part's norm, or `reference_norms`' where that is more), times
        the median groupmate's tokens over ours where that is more.

        The token allowance is what lets a peer just past a state download, a few steps into its round, accept
        the group's average of whole rounds. A looser bound for such a peer (the contributions' `max_norm_ratio`)
        let a reducer's 50x answer through to exactly the peers that had just resynced after its last lie. Such a
        peer, under half the median's tokens, refuses with a `ShortPartRefusal`: the span is lost, with no strike.
        """
        if reference == 0:
            return
        allowance = max(1.0, self.median_tokens / self.weight) if self.weight > 0 else 1.0
        norm = float(averaged.norm())
        if norm > REPLY_NORM_RATIO * allowance * reference:
            raise (OverlongAverage if self._own_parts_are_evidence else ShortPartRefusal)(
                f"average norm {norm:.3g} is over {REPLY_NORM_RATIO:g} x {allowance:.3g} x our part's {reference:.3g}")

    async def _count_outgoing(self, peer_index: int) -> AsyncIterator[averaging_pb2.AveragingData]:
        sent = self._sent_parts.setdefault(peer_index, [])
        async for message in self.input_messages_for(peer_index):
            sent.append((torch.Size(message.tensor_part.size), self.codec.norm(message.tensor_part)))
            self.traffic[_SENT] += message.ByteSize()
            self.traffic[_VALUES_SENT] += math.prod(message.tensor_part.size)
            yield message


def reference_norms(parts: Sequence[torch.Tensor]) -> list[float]:
    """What our own parts of a span say about how long the group's are: each part's norm, or the norm it would
    have at the span's norm per value, where that is more. A part where our update is nearly zero says little (a
    peer a step or two into its round, in embedding rows it has barely touched: 36x shorter than the group's
    average was seen), so bounds scaled by it would refuse honest parts and averages."""
    squares = [float(part.norm()) ** 2 for part in parts]
    per_value = sum(squares) / max(sum(part.numel() for part in parts), 1)
    return [max(math.sqrt(square), math.sqrt(per_value * part.numel())) for square, part in zip(squares, parts)]


def _settle(slot: asyncio.Future, done: asyncio.Future) -> None:
    """Hand `done`'s outcome to `slot` (asyncio has no public way to chain two futures)."""
    if slot.done():
        return
    if done.cancelled():
        slot.cancel()
    elif done.exception() is not None:
        slot.set_exception(done.exception())
    else:
        slot.set_result(done.result())


def _decode_part(codec: SwarmCodec, serialized: runtime_pb2.Tensor, shape: torch.Size) -> torch.Tensor:
    """Decode a part from another peer, or raise InvalidContributionError: anything else may be hostile."""
    if serialized.compression != codec.compression_type:
        raise InvalidContributionError(f"compression type {serialized.compression} is not {codec!r}'s")
    if serialized.dtype != "float32":
        raise InvalidContributionError(f"dtype {serialized.dtype!r} is not float32")
    if torch.Size(serialized.size) != shape:
        raise InvalidContributionError(f"shape {tuple(serialized.size)} != expected {tuple(shape)}")
    try:
        codec.check_settings(serialized)  # this swarm's block size, or chunk, k and levels
        return codec.extract(serialized)  # checks that the bytes fit the shape and the scales are finite
    except ValueError as e:
        raise InvalidContributionError(str(e)) from e
