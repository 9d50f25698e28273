"""`SwarmPeer`: the join loop. Trains H local steps, averages the pseudo-gradient in the background while
the next round trains, and applies the outer update as soon as the average arrives, keeping the local
progress made meanwhile.

The loop talks to the trainer only through `local_step()`, `snapshot()` and `apply_outer_update()`, and to
the network only through a `RoundAverager` (`SwarmAverager`, peers/averaging.py), the round clock
(`RoundClock`, peers/progress.py) and its `SwarmReport` (status, log lines, metrics: peers/swarm_report.py). When to end, schedule, give up or resync a round is
decided by `RoundSchedule` (peers/schedule.py); the outer step and the correction for the local progress are
`OuterOptimizer` and `DelayedOuterStep` (peers/outer.py); the outer state a joiner downloads and a checkpoint
keeps is a `SwarmState` (peers/swarm_state.py).

The trainer never waits for the network: a round ends when the swarm has made H steps per peer (`RoundClock`,
peers/progress.py: all peers end it at about the same moment, so they meet in one group) *and* once the
previous round's average has arrived and been applied (checked after every step); while it has not, training
simply goes on, so a slow round makes the next one longer instead of idling the device. Matchmaking begins one
matchmaking window before the clock expects the round to end (`SwarmAverager.schedule_round`), so the group is
formed by then and the average arrives one all-reduce later (in the first round, a group still short of a peer waits
for it one of the clock's record periods more: `RoundSchedule.group_deadline`). Each round expects the peers the
clock sees in it, so its all-reduce starts as soon as they have all joined rather than when the window closes. A
round that finds nobody, or fails, is applied with this peer's own pseudo-gradient: a lonely peer simply continues
alone.

Staying in sync: every peer tells its group which global weights its update is based on (outer round and a
fingerprint). Peers that averaged in different groups (or alone), or a joiner whose download was one round
old, end up with different global weights, and averaging pseudo-gradients can never remove such an offset.
So a peer whose base differs from the one most of its group shares downloads the swarm's state again (rare,
hence cheap) and keeps its local progress on top of it.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Collection, Mapping, Optional, Protocol, Sequence

import torch

from tscale_p2p.peers.averaging import RoundOutcome
from tscale_p2p.peers.ban_notes import BanNotes
from tscale_p2p.peers.metrics import PeerRecord, SwarmMetrics
from tscale_p2p.peers.outer import DelayedOuterStep, OuterOptimizer
from tscale_p2p.peers.progress import RoundClock
from tscale_p2p.peers.run_config import RunConfig, SignedRun
from tscale_p2p.peers.schedule import (
    Base,
    LastSteps,
    Resync,
    RoundSchedule,
    declared_base,
    group_consensus,
    resync_plan,
)
from tscale_p2p.peers.settings import OPENING_RESIDUAL_CARRY
from tscale_p2p.peers.state_download import StateCheck, announce_state
from tscale_p2p.peers.status import LocalStatus
from tscale_p2p.peers.swarm_report import SwarmReport
from tscale_p2p.peers.swarm_state import SWARM_STATE_FILE, SwarmState, fingerprint, read_state_file
from tscale_p2p.trainer import Trainer
from tscale_p2p.tokenizer import BPETokenizer, to_wire

log = logging.getLogger(__name__)

RESYNC_TIMEOUT_S = 60.0


class PendingAverage(Protocol):
    """A round averaging in the background (`averaging.PendingRound` is the real one)."""

    def done(self) -> bool: ...

    def give_up_if_alone(self, after_s: float) -> bool: ...

    def result(self, timeout: Optional[float] = None) -> RoundOutcome: ...


class RoundAverager(Protocol):
    """What the loop uses of its averager (`averaging.SwarmAverager` is the real one; see its docstrings)."""

    matchmaking_time: float
    round_timeout: float
    client_mode: bool
    allow_state_sharing: bool
    state_sharing_priority: float
    banned_count: int
    round_scheduled: bool

    def schedule_round(self, seconds_to_start: float, tokens: float, metadata: Any = None,
                       group_size: Optional[int] = None, pair_partners: Optional[Collection[str]] = None) -> None: ...

    def cancel_scheduled_round(self) -> None: ...

    def start_round(self, pseudo_gradient: Sequence[torch.Tensor], tokens: float, metadata: Any = None,
                    group_size: Optional[int] = None, pair_partners: Optional[Collection[str]] = None,
                    residual_carry: Optional[float] = None) -> PendingAverage: ...

    def load_state_from_peers(self, wait: bool = True, timeout: Optional[float] = None,
                              prefer: Optional[Base] = None, prefer_donors: Collection[str] = ()): ...

    def banned_peers(self) -> dict[str, str]: ...

    def caught_peers(self, disputed: bool = False) -> set[str]: ...

    def heed_partners_bans(self, rounds_ago: Mapping[str, int]) -> None: ...

    def shutdown(self) -> None: ...


@dataclass(frozen=True)
class SwarmIdentity:
    """Who this peer is in the swarm (for metrics and status)."""

    peer_id: str
    name: str
    run_id: str
    device: str
    relayed: bool
    visible_maddrs: tuple[str, ...] = ()


@dataclass(frozen=True)
class _NotOffered:
    """A round this peer did not offer to the swarm (a `PendingAverage`): averaged with nobody, at once."""

    why: str

    def done(self) -> bool:
        return True

    def give_up_if_alone(self, after_s: float) -> bool:
        return False

    def result(self, timeout: Optional[float] = None) -> RoundOutcome:
        return RoundOutcome(averaged=None, group_size=1, group_tokens=0.0, bytes_sent=0, bytes_received=0,
                            seconds=0.0, error=self.why)


@dataclass
class _InFlight:
    """A round whose average has not been applied yet."""

    number: int
    pending: PendingAverage
    pseudo_gradient: dict[str, torch.Tensor]
    base: Base


class SwarmPeer:
    """Runs the rounds of one peer until `max_steps`, the run's last step, or a stop request.

    `averager_factory(template, state_source)` makes its `RoundAverager`; `clock` is the round clock (by default
    a `RoundClock` on the metrics' DHT)."""

    def __init__(
        self,
        trainer: Trainer,
        averager_factory: Callable[[list[torch.Tensor], Callable], RoundAverager],
        metrics: SwarmMetrics,
        identity: SwarmIdentity,
        status: LocalStatus,
        *,
        run: RunConfig,
        signed_run: SignedRun | None = None,  # the founder-signed config this peer re-publishes
        max_steps: int | None = None,
        publish_every_s: float = 5.0,
        clock: RoundClock | None = None,
    ) -> None:
        self.trainer, self.metrics, self.identity, self.status = trainer, metrics, identity, status
        self.run_config, self.run_hash = run, run.hash
        self.max_steps, self.publish_every_s = max_steps, publish_every_s
        tokenizer = trainer.corpus.tokenizer
        self._tokenizer_wire = to_wire(tokenizer) if isinstance(tokenizer, BPETokenizer) else None
        self.names = [name for name, _ in trainer.model.named_parameters()]
        weights = trainer.snapshot()
        self.outer = OuterOptimizer({n: weights[n] for n in self.names}, run.outer_lr, run.outer_momentum,
                                    plain_lr=run.opening_outer_lr)
        self.rounds = DelayedOuterStep(self.outer)
        self.round = 0  # outer steps applied
        # The run's step at round 0 (a run started --init-from a trained checkpoint does not start at 0): with the
        # round it sets the swarm's place in the learning-rate schedule (`RoundClock.schedule_step`). Part of the
        # outer state, so a joiner adopts it.
        self.schedule_origin = trainer.step
        self._state_lock = threading.Lock()  # guards outer state + round for get_current_state's thread
        self._fingerprint = self.weights_fingerprint()  # of the global weights, refreshed when they change
        self.state_check = StateCheck.of(identity.run_id, run, list(self.outer.weights.values()))
        self.averager: RoundAverager = averager_factory(list(self.outer.weights.values()), self.shared_state)
        self.ban_notes = BanNotes(metrics.dht, identity.run_id, identity.peer_id)
        self.report = SwarmReport(
            status, metrics, identity, trainer.precision, sum(w.numel() for w in self.outer.weights.values()),
            banned_count=lambda: self.averager.banned_count, announce_state=self.announce_state,
            share_bans=self.share_bans,
            signed_run=signed_run, publish_every_s=publish_every_s,
        )
        self._tokens_in_round = 0
        self._in_flight: _InFlight | None = None
        self._averaged_with: set[str] = set()  # in-step peers of rounds that averaged (pair partners, less the caught)
        self._rounds_alone = 0  # rounds in a row this peer has averaged with nobody
        self.clock = clock or RoundClock(metrics.dht, identity.run_id, identity.peer_id, run.inner_steps,
                                         opening_rounds=run.opening_rounds, opening_inner_steps=run.opening_inner_steps)
        self.schedule = RoundSchedule(self.clock, self.averager.matchmaking_time)
        self.training_s = self.wall_s = 0.0  # for the busy fraction while training
        self.drain_s = 0.0  # waiting for the round in flight when leaving

    # ---- state shared with joiners (called from hivemind's background thread) ----

    def state(self) -> SwarmState:
        """A copy of this peer's outer state: the global weights, the outer momentum, round and step."""
        with self._state_lock:
            outer = self.outer.state_dict()  # a copy
            step, round_number, origin, weights = self.trainer.step, self.round, self.schedule_origin, self._fingerprint
        buffers = outer["optimizer"]["state"]
        momentum = {name: buffers.get(i, {}).get("momentum_buffer") for i, name in enumerate(self.names)}
        return SwarmState(
            run_hash=self.run_hash, round=round_number, step=step, schedule_origin=origin,
            weights={n: outer["weights"][n] for n in self.names},
            momentum={n: torch.zeros_like(outer["weights"][n]) if m is None else m for n, m in momentum.items()},
            tokenizer=self._tokenizer_wire, fingerprint=weights,
        )

    def shared_state(self) -> tuple[dict, list[torch.Tensor]]:
        """(metadata, tensors) a joiner downloads (`SwarmState.to_wire`); called from hivemind's thread."""
        return self.state().to_wire()

    def adopt_state(self, metadata: object, tensors: list[torch.Tensor]) -> bool:
        """Take a downloaded (or saved) state as our own and train from its global weights; False (and a
        warning) if it does not fit this run. Call before training starts."""
        if not self._load_state(metadata, tensors):
            return False
        with self._state_lock:
            self.trainer.step = max(self.trainer.step, int(metadata.get("step", 0)))
        self._restart_round_from_global_weights()
        self.status.update(round=self.round, step=self.trainer.step)
        return True

    def _load_state(self, metadata: object, tensors: list[torch.Tensor]) -> bool:
        """Validate a state and make its global weights, momentum and round ours (the trainer is not touched)."""
        problem = self.state_check.problem(metadata, tensors)
        if problem is not None:
            log.warning("ignoring the downloaded state: %s", problem)
            return False
        state = SwarmState.from_wire(metadata, tensors, self.names)
        optimizer = self.outer.state_dict()["optimizer"]
        optimizer["state"] = {i: {"momentum_buffer": state.momentum[n]} for i, n in enumerate(self.names)}
        with self._state_lock:
            self.outer.load_state_dict({"weights": state.weights, "optimizer": optimizer})
            self.round, self.schedule_origin = state.round, state.schedule_origin
            self._fingerprint = self.weights_fingerprint()
        self.clock.confirm([state.donor])  # the peer the majority's state came from
        return True

    def _restart_round_from_global_weights(self) -> None:
        """Drop local progress: the trainer and the current round start again from the global weights."""
        self.trainer.apply_outer_update(self.rounds.restart_round())
        self._advertise_state()

    def _advertise_state(self) -> None:
        # Joiners download the state most peers offer (peers/state_download.py); the priority is hivemind's own.
        if not self.averager.client_mode:
            self.averager.state_sharing_priority = float(self.round)
            self.announce_state(wait=False)  # at once: a downloader must not find our offer a round old

    def announce_state(self, wait: bool = True) -> None:
        """Offer our state (its round and fingerprint) in a signed DHT record, if we share it (the metrics thread
        re-announces it every few seconds while the swarm loop runs)."""
        if self.averager.client_mode or not self.averager.allow_state_sharing:
            return
        with self._state_lock:
            round_number, weights = self.round, self._fingerprint
        announce_state(self.metrics.dht, self.identity.run_id, self.run_hash, round_number, weights, wait=wait)

    # ---- on disk, beside the trainer's checkpoints ----

    def save(self) -> Path:
        """The trainer's checkpoint with the outer state in it (`SWARM_STATE_FILE`), in one atomic write."""
        return self.trainer.save(self.trainer.cfg.out, extra_files={SWARM_STATE_FILE: self.state().write})

    def load_saved_state(self) -> bool:
        """Adopt the outer state saved in the checkpoint the trainer resumed from, if it has one that fits this
        run."""
        if self.trainer.resumed_from is None or not (self.trainer.resumed_from / SWARM_STATE_FILE).exists():
            return False
        try:
            metadata, tensors = read_state_file(self.trainer.resumed_from / SWARM_STATE_FILE)
        except ValueError as error:
            log.warning("ignoring the saved swarm state: %s", error)
            return False
        metadata["step"] = self.trainer.step  # the trainer's own checkpoint knows its step best
        return self.adopt_state(metadata, tensors)

    # ---- the loop ----

    def run(self, should_stop: Callable[[], bool] = lambda: False) -> None:
        """Train rounds until done, `should_stop()` or `status.stop_requested`; leaves the last round applied."""
        self.report.start()
        self.clock.start()
        session_steps, steps_in_round = 0, 0
        window_tokens, window_steps, window_start = 0, 0, time.perf_counter()
        loop_start = round_start = time.perf_counter()
        loop_end = None  # the training loop's end; what follows is leaving
        try:
            while not (should_stop() or self._should_stop(session_steps, steps_in_round)):
                if self.status.paused.is_set():  # the averager keeps serving state meanwhile
                    self.averager.cancel_scheduled_round()  # a group must not wait for a paused peer
                    time.sleep(0.1)
                    continue
                self.trainer.schedule_step = self._schedule_step(steps_in_round)
                step_start = time.perf_counter()
                stats = self.trainer.local_step()
                self.training_s += time.perf_counter() - step_start
                session_steps += 1
                steps_in_round += 1
                self._tokens_in_round += stats.tokens
                self.report.tokens_contributed += stats.tokens
                window_tokens += stats.tokens
                window_steps += 1
                if self._in_flight is not None and (self._in_flight.pending.done() or self._give_up_round_if_alone()):
                    self._apply_in_flight(steps_late=steps_in_round)  # at once: each step on stale weights costs loss
                # A round ends when the swarm has made H steps per peer, or later if the previous average is
                # still on its way: the trainer never waits for the network, a slow round just lasts longer.
                epoch = self.round + (self._in_flight is not None)
                steps_per_s = steps_in_round / (time.perf_counter() - round_start)
                self.clock.update(epoch, steps_in_round, steps_per_s)
                if self._in_flight is None and self.schedule.round_ends(epoch, steps_in_round):
                    self._end_round(time.perf_counter() - round_start)
                    if self._in_flight is not None and self._is_opening(self._in_flight):
                        self._drain(steps_late=0)  # an opening round is synchronous: wait for it
                    steps_in_round, round_start = 0, time.perf_counter()
                elif self._in_flight is None and not self.averager.round_scheduled:
                    steps_left = None if self.max_steps is None else self.max_steps - session_steps
                    self._maybe_schedule_round(epoch, steps_in_round, steps_per_s, time.perf_counter() - round_start,
                                               steps_left)
                cfg = self.trainer.cfg
                if cfg.save_every and stats.step % cfg.save_every == 0:
                    self.save()
                if cfg.eval_every and stats.step % cfg.eval_every == 0:
                    log.info("step %d  val loss %.4f (local weights)", stats.step, self.trainer.evaluate().loss)
                log_line = stats.step % cfg.log_every == 0
                elapsed = time.perf_counter() - window_start
                if elapsed >= 1.0 or log_line or session_steps == 1:
                    self.trainer.synchronize()
                    elapsed = time.perf_counter() - window_start
                    self._report(stats.loss.item(), window_tokens / elapsed, elapsed / window_steps, steps_in_round, log_line)
                    window_tokens, window_steps, window_start = 0, 0, time.perf_counter()
            loop_end = time.perf_counter()
            if steps_in_round and not (should_stop() or self.status.stop_requested.is_set()):
                self._drain()
                if self._wait_for_the_swarms_round_end(steps_in_round, round_start):
                    # the run is over: average its last steps too (they would be lost otherwise)
                    self._end_round(time.perf_counter() - round_start)
        finally:
            self.averager.cancel_scheduled_round()  # left before the round ended (stopped): nothing to average
            loop_end = loop_end or time.perf_counter()
            # No more steps from us (others must not wait for them); the clock keeps telling us who still trains
            # while the round in flight settles.
            self.clock.update(self.round + (self._in_flight is not None), 0, 0.0)
            self._drain()
            self.clock.stop()
            self.wall_s, self.drain_s = loop_end - loop_start, time.perf_counter() - loop_end
            self.report.stop()

    def shutdown(self) -> None:
        self.averager.shutdown()

    def _wait_for_the_swarms_round_end(self, steps_in_round: int, round_start: float) -> bool:
        """The run is over in the middle of a round: wait, without training, for `RoundSchedule.last_steps` to say
        whether to average the last steps (True) or keep them local (False), at most the averaging timeout;
        meanwhile look for the round's group from the start, saying the wait's end as its start (see
        `RoundSchedule.group_deadline`: a peer that began only at the round's end found the group formed without it,
        and one that said the end it expected led groups that began without a peer still training)."""
        epoch = self.round
        deadline = time.monotonic() + self.averager.round_timeout
        if not self.clock.others_idle(epoch):
            log.info("run over after %d steps of round %d: waiting up to %.0f s for the swarm's round end to average "
                     "them", steps_in_round, epoch + 1, self.averager.round_timeout)
        while True:
            # No steps we no longer make for others to count on, and the record made now, not once: others count a
            # peer whose record is a record's lifetime old (8 s) as gone, so their group expected one peer fewer, was
            # full without this one and began (the run's last round left a peer out in half the real-swarm runs).
            self.clock.update(epoch, steps_in_round, 0.0)
            timed_out = time.monotonic() > deadline or self.status.stop_requested.is_set()
            verdict = self.schedule.last_steps(epoch, steps_in_round, time.time(), timed_out)
            if verdict is not LastSteps.WAIT:
                break
            if not self.averager.round_scheduled:
                seconds_to_end = self.clock.seconds_to_round_end(epoch, steps_in_round, 0.0)
                self.averager.schedule_round(
                    self.schedule.group_deadline(epoch, seconds_to_end, leaves_in_s=0.0,
                                                 wait_s=max(0.0, deadline - time.monotonic())),
                    tokens=self._tokens_in_round,
                    metadata=self._base_metadata(), pair_partners=self._pair_partners(),
                    # every live peer, however short the round: it no longer trains, so it cannot drift a round ahead
                    group_size=self.schedule.group_size(time.perf_counter() - round_start, synchronous=True),
                )
            time.sleep(0.2)
        if verdict is LastSteps.KEEP_LOCAL:
            log.info("run over after %d steps of round %d, %d in all by the swarm's peers: keeping them local",
                     steps_in_round, epoch + 1, self.clock.collective_steps(epoch, steps_in_round, time.time()))
        return verdict is LastSteps.AVERAGE

    def _should_stop(self, session_steps: int, steps_in_round: int) -> bool:
        """Stop requested, --max-steps local steps made, or the swarm's schedule at the run's last step (not this
        peer's own count: a fast peer would leave while the others still train at a high learning rate)."""
        if self.status.stop_requested.is_set():
            return True
        if self.max_steps is not None and session_steps >= self.max_steps:
            return True
        return self._schedule_step(steps_in_round) >= self.trainer.cfg.steps

    def _schedule_step(self, steps_in_round: int) -> int:
        """The swarm's place in the learning-rate schedule now (see `RoundClock.schedule_step`): the same for
        every peer in step with the swarm, however fast each trains or whenever it joined."""
        epoch = self.round + (self._in_flight is not None)
        return self.clock.schedule_step(self.schedule_origin, epoch, steps_in_round)

    def _maybe_schedule_round(self, epoch: int, steps_in_round: int, steps_per_s: float, round_s: float,
                              steps_left: int | None) -> None:
        """Begin matchmaking now if `RoundSchedule.matchmaking_lead` says so (`steps_left`: this peer's own, if it
        stops after --max-steps)."""
        seconds = self.schedule.matchmaking_lead(epoch, steps_in_round, steps_per_s, round_s)
        if seconds is None:
            return
        leaves_in_s = None if steps_left is None else steps_left / steps_per_s
        training_s = seconds if leaves_in_s is None else min(seconds, leaves_in_s)
        expected_tokens = self._tokens_in_round * (1 + training_s * steps_per_s / steps_in_round)
        self.averager.schedule_round(
            self.schedule.group_deadline(epoch, seconds, leaves_in_s, wait_s=self.averager.round_timeout),
            tokens=expected_tokens, metadata=self._base_metadata(),
            group_size=self.schedule.group_size(round_s + seconds), pair_partners=self._pair_partners(),
        )

    def _base(self) -> Base:
        """The global weights this round's update is based on."""
        return self.round, self._fingerprint

    def _base_metadata(self) -> dict:
        """`_base()` as the group reads it (see `group_consensus`)."""
        round_number, weights = self._base()
        return {"round": round_number, "weights": weights}

    def _end_round(self, round_s: float) -> None:
        """Start averaging this round's update, `round_s` seconds long (the previous round's average is applied
        by now)."""
        pseudo_gradient = self.rounds.finish_round(self.trainer.snapshot())
        tokens, self._tokens_in_round = self._tokens_in_round, 0
        base = self._base()
        opening = self.clock.is_opening(self.round)
        try:
            if opening and self.clock.alone():
                # An opening round waits for its average, and a peer alone would wait out its search for a group
                # (two matchmaking windows) every round: a founder alone sat 10 s idle every 10 steps.
                self.averager.cancel_scheduled_round()
                pending: PendingAverage = _NotOffered("nobody else online")
            else:
                pending = self.averager.start_round(
                    [pseudo_gradient[n] for n in self.names], tokens=tokens, metadata=self._base_metadata(),
                    group_size=self.schedule.group_size(round_s, synchronous=opening),
                    pair_partners=self._pair_partners(),
                    # into an opening round, 10 steps on, what the code could not carry is still fresh: all of it
                    residual_carry=OPENING_RESIDUAL_CARRY if self.clock.is_opening(self.round + 1) else None,
                )
        except ValueError as error:  # a non-finite local update: never share it, rewind to the global weights
            log.error("round %d: not averaging a bad local update (%s); back to the global weights", self.round + 1, error)
            self._restart_round_from_global_weights()
            return
        self._in_flight = _InFlight(self.round + 1, pending, pseudo_gradient, base)
        self.status.update(averaging_in_flight=True)

    def _apply_in_flight(self, steps_late: int | None = None) -> None:
        """Outer step with the average of the round in flight (waiting for it if needed; our own update if we
        averaged alone), keeping the local progress made since this round began (`steps_late` steps; None when
        leaving)."""
        flight, self._in_flight = self._in_flight, None
        outcome = flight.pending.result()
        if outcome.averaged is None and steps_late is None and self._averaged_with and self._rounds_alone == 0:
            self._keep_last_round_local(flight, outcome)
            return
        alone = outcome.averaged is None
        average = flight.pseudo_gradient if alone else dict(zip(self.names, outcome.averaged))
        kept_local = self._not_averaged(flight, outcome)
        with self._state_lock:
            self._follow_the_schedule()
            # An opening round's plain lr makes up for a code's shortening of the average (`RunConfig.
            # opening_outer_lr`); our own update alone was never coded, so it is taken as it is (lr 1: the global
            # weights become the round's end), not pushed half an update past it each round.
            weights = self.rounds.apply_average(self.trainer.snapshot(), average, momentum_rounds=self.round,
                                                plain=self._is_opening(flight), plain_lr=1.0 if alone else None,
                                                kept_local=kept_local)
            self.round += 1
            self._fingerprint = self.weights_fingerprint()
        self.trainer.apply_outer_update(weights)
        self._advertise_state()
        self.report.round(flight.number, outcome, self._fingerprint, steps_late)
        self.report.share_bans_soon()  # ours from this round, and the others' before the next round's pair rule
        self._rounds_alone = self._rounds_alone + 1 if alone else 0
        if outcome.averaged is not None and not outcome.dropped_peers:
            self.clock.confirm(outcome.group_peers)  # they really averaged with us: their progress counts fully
        if outcome.averaged is not None:
            # Only groupmates in step with us: a part declared on other weights is left out without a strike, so
            # such a peer was never checked (an attacker out of step in its first group became a partner so).
            self._averaged_with.update(peer for peer, metadata in zip(outcome.group_peers, outcome.group_metadata)
                                       if declared_base(metadata) == flight.base)
        self._forget_banned()
        consensus, declarers = self._group_consensus(outcome) if outcome.averaged is not None else (None, set())
        if consensus is not None and consensus != flight.base:
            self._resync(flight, consensus, declarers, average)

    def _follow_the_schedule(self) -> None:
        """The outer lr for round `self.round`'s step (`RunConfig.outer_lr_at`), from the inner lr where the swarm
        ended that round: every peer in step computes the same."""
        if self.run_config.outer_lr_peak is not None:
            inner_lr = self.trainer.lr_at(self.schedule_origin + self.clock.steps_before(self.round + 1))
            self.outer.set_lr(self.run_config.outer_lr_at(inner_lr / self.trainer.cfg.lr))

    def _not_averaged(self, flight: _InFlight, outcome: RoundOutcome) -> dict[str, torch.Tensor] | None:
        """The part of the round's update that no reducer averaged for us (`RoundOutcome.lost`), to keep in our
        weights: owing it to a later round instead left those values at the global weights for a round or two,
        early in a run where a liar's span was lost twice (benchmarks/RESULTS.md)."""
        if outcome.lost is None:
            return None
        masks = outcome.lost.split([flight.pseudo_gradient[name].numel() for name in self.names])
        return {name: flight.pseudo_gradient[name] * mask.view_as(flight.pseudo_gradient[name])
                for name, mask in zip(self.names, masks)}

    def _keep_last_round_local(self, flight: _InFlight, outcome: RoundOutcome) -> None:
        """Leaving with a round nobody averaged, the round before averaged with a group: no outer step on our
        update alone, which would leave this peer on global weights no other peer holds (a lone step of one peer's
        noisy update, momentum and all, with nothing after it to average it out: 0.35-5.9% worse val loss than
        its group's in the runs that ended so, benchmarks/RESULTS.md). The global weights stay the group's; the
        round's steps stay local, as the run's last steps do when the swarm made fewer than H
        (`LastSteps.KEEP_LOCAL`)."""
        self.rounds.restart_round()
        self.report.round(flight.number, outcome, self._fingerprint)
        log.info("round %d's steps stay local (nobody averaged them as this peer left): global weights of round %d, "
                 "weights %s", flight.number, self.round, self._fingerprint)

    def _pair_partners(self) -> frozenset[str] | None:
        """Whom this round averages with in a group of two (`RoundSchedule.pair_partners`): not a peer that a
        partner has banned either (peers/ban_notes.py), which the averager then bans or holds disputed."""
        self._forget_banned()  # a ban that came after the last round (a proof, say) must not count as a live peer
        untrusted = self.averager.caught_peers(disputed=True)
        noted = self.ban_notes.noted_by(self._averaged_with - untrusted)
        if noted:  # each round, with how many rounds ago a partner first banned each peer
            self.averager.heed_partners_bans({peer: max(0, self.round - first) for peer, first in noted.items()})
        return self.schedule.pair_partners(self._averaged_with, untrusted | set(noted), self._rounds_alone)

    def share_bans(self) -> None:
        """Publish whom this peer has banned, and read whom the others have (peers/ban_notes.py); called from the
        metrics thread."""
        self.ban_notes.exchange(self.averager.banned_peers() if self.averager.banned_count else (), self.round)

    def _forget_banned(self) -> None:
        """Leave the peers this one has banned out of the round clock."""
        if self.averager.banned_count:
            self.clock.leave_out(self.averager.banned_peers())

    def _group_consensus(self, outcome: RoundOutcome) -> tuple[Base | None, set[str]]:
        """The base most of the group declared, and the peers that declared it, peers this one has caught
        (rejected in some round, or banned) left out: their parts or answers were refused, and their votes must
        not pull this peer onto weights they may have poisoned (in a tie of two against two, they did: an
        attacker paired with an honest peer in the swarm's first round outvoted the others' clean weights)."""
        caught = self.averager.caught_peers()
        voters = [(peer, metadata) for peer, metadata in zip(outcome.group_peers, outcome.group_metadata)
                  if peer not in caught]
        consensus = group_consensus([metadata for _, metadata in voters])
        return consensus, {peer for peer, metadata in voters if declared_base(metadata) == consensus}

    def _resync(self, flight: _InFlight, consensus: Base, declarers: set[str], average: dict) -> None:
        """Our round was formed on other global weights than most of the group's (`consensus`, declared by
        `declarers`): download the swarm's state, bring it to where the group is after this round's average, and
        keep our local progress on top."""
        log.warning(
            "round %d: our global weights (round %d, %s) differ from the group's (round %d, %s); downloading the "
            "swarm's state", flight.number, *flight.base, *consensus,
        )
        if not self.averager.client_mode:
            self.averager.state_sharing_priority = -1.0  # nobody should download our state meanwhile
        try:
            download = self.averager.load_state_from_peers(wait=False, timeout=RESYNC_TIMEOUT_S, prefer=consensus,
                                                           prefer_donors=declarers)
            self._wait_here(download.done, timeout_s=RESYNC_TIMEOUT_S)
            state = download.result(timeout=1.0)
        except Exception as error:  # a timeout, or the averager shutting down: try again next round
            log.debug("state download failed: %r", error)
            state = None
        metadata = state[0] if state is not None else None
        plan = resync_plan(consensus, metadata)
        if plan is Resync.STAY:
            log.warning("round %d: no peer shared the group's state (got round %s); staying out of step for now",
                        flight.number, metadata.get("round") if isinstance(metadata, dict) else None)
            self._advertise_state()
            return
        if not self._load_state(*state):
            self._advertise_state()
            return
        progress = self.rounds.local_progress(self.trainer.snapshot())
        with self._state_lock:
            if plan is Resync.ADOPT_AND_STEP:  # the donor had not applied this round's average yet
                self._follow_the_schedule()
                self.outer.step(average, momentum_rounds=self.round, plain=self._is_opening(flight))
                self.round += 1
                self._fingerprint = self.weights_fingerprint()
            self.rounds.restart_round()
        self.trainer.apply_outer_update({n: w - progress[n] for n, w in self.rounds.round_start.items()})
        self._advertise_state()
        self.status.update(round=self.round)
        log.info("round %d: back in step with the swarm at round %d, weights %s", flight.number, self.round,
                 self._fingerprint)

    def weights_fingerprint(self) -> str:
        """A short digest of the global weights (`state_download.fingerprint`): peers that applied the same
        rounds print the same one."""
        return fingerprint(list(self.outer.weights.values()))

    def _drain(self, steps_late: int | None = None) -> None:
        """Wait for the round in flight (see `_settle_in_flight`) and apply its average (`steps_late` as in
        `_apply_in_flight`)."""
        if self._in_flight is not None:
            self._settle_in_flight()
            self._apply_in_flight(steps_late)

    def _is_opening(self, flight: _InFlight) -> bool:
        """Whether `flight` is one of the run's opening rounds: waited for, and applied without outer momentum."""
        return self.clock.is_opening(flight.number - 1)

    def _settle_in_flight(self) -> None:
        """Leaving: wait for the round in flight (see `_give_up_round_if_alone`). Others still finishing their last
        steps of the round are waited for (within the averaging timeout), to average with them."""
        if self._in_flight is None:
            return
        self._wait_here(lambda: self._in_flight.pending.done() or self._give_up_round_if_alone())

    def _wait_here(self, done: Callable[[], bool], timeout_s: float = float("inf")) -> None:
        """Wait, without training, until `done()` or `timeout_s`, making the progress record anew meanwhile: others
        count a peer whose record is a record's lifetime old (8 s) as gone, and their next group would expect one
        peer fewer."""
        deadline = time.monotonic() + timeout_s
        while not done() and time.monotonic() < deadline:
            self.clock.refresh()
            time.sleep(0.1)

    def _give_up_round_if_alone(self) -> bool:
        """Cancel the round in flight if `RoundSchedule.give_up_after` says it has looked for a group long enough
        while nobody else trains towards it: `result()` then reports it as averaged alone, and this peer's own
        update is applied. True if it was cancelled."""
        patience = self.schedule.give_up_after(self.round + 1)
        return patience is not None and self._in_flight.pending.give_up_if_alone(after_s=patience)

    # ---- reporting ----

    def _report(self, loss: float, tokens_per_s: float, step_s: float, steps_in_round: int, log_line: bool) -> None:
        self.report.step(
            step=self.trainer.step, round_number=self.round, loss=loss, tokens_per_s=tokens_per_s,
            device=self.trainer.device, seconds_to_next_averaging=self._seconds_to_next_averaging(steps_in_round, step_s),
            in_flight=self._in_flight is not None, log_line=log_line,
        )

    def _seconds_to_next_averaging(self, steps_in_round: int, step_s: float) -> float | None:
        """When this round ends at the swarm's pace (`RoundSchedule.seconds_to_round_end`)."""
        epoch = self.round + (self._in_flight is not None)
        return self.schedule.seconds_to_round_end(epoch, steps_in_round, 1.0 / step_s if step_s > 0 else 0.0)

    def record(self) -> PeerRecord:
        """This peer's metrics record (`SwarmReport.record`)."""
        return self.report.record()
