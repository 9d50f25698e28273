"""`RoundClock`: every peer of the swarm ends its round at about the same moment, whatever its speed.

A round used to end after H local steps. Peers of different speed (or the same speed with different
start-up delays) then reached the averaging at different times, split into several matchmaking groups, and
peers that averaged in different groups applied different averages: their global weights drifted apart.

hivemind.Optimizer's `ProgressTracker` solves the same problem for its collective batch: each peer
publishes its progress in the DHT, and all of them begin averaging when the swarm's *collective* progress
reaches the target. `RoundClock` does the same for DiLoCo rounds: a round is `H` local steps per live peer
on average, i.e. it ends once the steps made in it by all peers of the same round number add up to
`n_peers x H`. Each peer extrapolates the others' last published numbers (steps, steps/s, time) to now, so
all of them reach that sum at about the same moment: a fast peer makes more than H steps, a slow one fewer,
and they meet in one group (the average is weighted by tokens, so each step counts the same).

Round numbers ("epochs") are the rounds a peer has ended, which is the same for peers that share the
swarm's global weights. A peer that sees most of the others in a later epoch is late: it ends its round now.
A minority ahead counts as having made its H steps. What other peers publish is untrusted: records are signed
by their peer's key and bounded (peers/records.py), malformed ones are ignored, extrapolations are clamped, and a
peer (or a few) that claims to be ahead can make the others' rounds shorter by no more than its own share, so it
cannot make every round end at once.

Signing stops forged and overwritten records, not a stranger who makes up many keys. So once a peer has
averaged with others (`confirm`: peers it met in a group, or downloaded the state from), a record of any other,
unconfirmed peer counts as having made no fewer steps than this peer and no more than H: such peers can neither
hold a round back (50 fake records of zero progress used to stretch rounds ~20x) nor end it early, only an honest
newcomer's real pace between those bounds counts; and only confirmed peers being ahead can make it "late".
The extrapolation uses each peer's clock (`time.time()`, as hivemind's DHT does); clock skew between
machines only shifts the estimate by the skew times the peer's step rate.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from dataclasses import dataclass
from typing import Iterable

import pydantic
from hivemind import DHT

from tscale_p2p.peers.records import ProtectedKey, RecordModel, protect, read_signed, signer_for, store_signed

log = logging.getLogger(__name__)

NEWCOMERS = 2  # unconfirmed peers a round's group expects beyond the confirmed ones (see `live_peers`)


@dataclass(frozen=True)
class Progress:
    """One peer's position in the current round."""

    epoch: int  # rounds this peer has ended
    steps: int  # local steps made in the current round
    steps_per_s: float
    time: float  # unix time of these numbers
    peer_id: str = ""  # whose (the signer of its DHT record)


class ProgressRecord(RecordModel):
    """`Progress` as published: bounded numbers (a swarm makes fewer than 2**40 rounds or steps)."""

    epoch: int = pydantic.Field(ge=0, lt=2**40)
    steps: int = pydantic.Field(ge=0, lt=2**40)
    steps_per_s: float = pydantic.Field(ge=0.0, le=1e9)
    time: float = pydantic.Field(ge=0.0, le=2.0**40)


def progress_key(run_id: str) -> str:
    return f"{run_id}_progress"


def progress_record(run_id: str) -> ProtectedKey:
    """The progress records' DHT key: one signed record per peer, each living a few publishing periods."""
    return ProtectedKey(progress_key(run_id), ProgressRecord, max_ttl_s=60.0, max_bytes=256)


class RoundClock:
    """Publishes this peer's progress every `every_s` seconds and decides when its round ends.

    The training loop calls `update()` after each step and `round_done()` to ask whether to end the round;
    both are cheap (no network): a background thread does the DHT reads and writes.
    """

    def __init__(self, dht: DHT, run_id: str, peer_id: str, inner_steps: int, every_s: float = 1.0,
                 opening_rounds: int = 0, opening_inner_steps: int = 1) -> None:
        self.dht, self.record, self.peer_id = dht, progress_record(run_id), peer_id
        self.inner_steps, self.every_s = inner_steps, every_s
        self.opening_rounds, self.opening_inner_steps = opening_rounds, opening_inner_steps
        self._mine: Progress | None = None
        self._others: list[Progress] = []  # the latest fetch, fresh records only
        self._confirmed: set[str] = set()  # peer ids met in an averaging group (or our state's donor)
        self._banned: set[str] = set()  # peer ids whose records count no more
        # when a read last found another peer's fresh record, or this peer last averaged with others
        self._other_seen: float | None = None
        # Peers seen live before training (join's --min-peers wait, from their metrics records): see `peers_in`.
        self.live_at_start = 1
        self._first_epoch: int | None = None  # the round this peer began training in
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="swarm-round-clock", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Stop the thread, after publishing the last `update()` (e.g. "stopped"): otherwise the others would
        extrapolate this peer's last record, as if it still trained, until that record expires."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=10)
            try:
                self._publish()
            except Exception as error:  # the DHT may be shutting down
                log.debug("round clock: last publish failed: %s", error)

    def update(self, epoch: int, steps: int, steps_per_s: float) -> None:
        if self._first_epoch is None:
            self._first_epoch = epoch
        self._mine = Progress(epoch, steps, steps_per_s, time.time())

    def refresh(self) -> None:
        """The last `update()` made anew, as it was: a peer that waits without training (for an opening round's
        average, or its last round's as it leaves) is still there, and others count a peer whose record is a
        record's lifetime old as gone."""
        mine = self._mine
        if mine is not None:
            self.update(mine.epoch, mine.steps, mine.steps_per_s)

    def is_opening(self, epoch: int) -> bool:
        """Whether round `epoch` is one of the run's opening rounds (`RunConfig.opening_rounds`): short, and
        averaged before the next step."""
        return epoch < self.opening_rounds

    def round_steps(self, epoch: int) -> int:
        """Steps a peer makes in round `epoch` (H, or the opening rounds' length)."""
        return self.opening_inner_steps if self.is_opening(epoch) else self.inner_steps

    def steps_before(self, epoch: int) -> int:
        """Steps a peer makes in the rounds before round `epoch`."""
        opening = min(epoch, self.opening_rounds)
        return opening * self.opening_inner_steps + (epoch - opening) * self.inner_steps

    def round_done(self, epoch: int, steps: int) -> bool:
        """Whether this peer's round `epoch` ends now, after `steps` local steps in it."""
        if steps < 1:
            return False
        return self.collective_steps(epoch, steps, time.time()) >= self.round_steps(epoch) * self.peers_in(epoch)

    def peers_in(self, epoch: int) -> int:
        """Peers (this one included) whose steps count towards round `epoch`; in this peer's first round at least
        `live_at_start`. Peers started together begin training up to a second apart and publish progress only once
        they train, so a peer's first round may end before it has read a later starter's record: it then counted
        one peer fewer, ended the round at 3 x H steps instead of 4 x H, and its group (expecting as few) began
        without the late starter, which averaged its next round out of step and downloaded the state."""
        visible = 1 + sum(1 for p in self._others if p.epoch >= epoch - 1)
        return max(visible, self.live_at_start) if self.is_first_round(epoch) else visible

    def is_first_round(self, epoch: int) -> bool:
        """Whether round `epoch` is the first this peer trains in (it has not begun training: yes)."""
        return self._first_epoch is None or epoch == self._first_epoch

    def live_peers(self) -> int:
        """Peers (this one included) with a fresh record, whatever their round: the most a group can hold now.
        (`peers_in` would undercount when rounds are shorter than a record's period: records lag whole rounds.)
        Once peers are confirmed, at most NEWCOMERS unconfirmed ones are expected on top of them; in this peer's
        first round, at least `live_at_start` (there its state's donor may be the one confirmed peer: a group of 4
        began without the fifth peer of a swarm started together)."""
        if self._confirmed:
            confirmed = sum(1 for p in self._others if p.peer_id in self._confirmed)
            live = 1 + confirmed + min(NEWCOMERS, len(self._others) - confirmed)
        else:
            live = 1 + len(self._others)
        in_first_round = self._mine is None or self.is_first_round(self._mine.epoch)
        return max(live, self.live_at_start) if in_first_round else live

    def confirm(self, peer_ids: Iterable[str]) -> None:
        """Peers this one has averaged with (or downloaded the swarm's state from): their records count as they
        are; those of the others are bounded (see the module's docstring). They count as seen now (`alone`):
        under load a peer's first DHT reads can lag its first rounds with the others."""
        confirmed = {p for p in peer_ids if p and p != self.peer_id}
        self._confirmed.update(confirmed)
        if confirmed:
            self._other_seen = time.time()

    def leave_out(self, peer_ids: Iterable[str]) -> None:
        """Peers this one has banned: their records count no more. Such a peer can no longer join our groups,
        so counting it would only make every round wait for a groupmate that never comes (or let it end rounds)."""
        self._banned.update(peer_ids)
        self._confirmed -= self._banned
        self._others = [p for p in self._others if p.peer_id not in self._banned]

    def _counts_fully(self, other: Progress) -> bool:
        return not self._confirmed or other.peer_id in self._confirmed

    def collective_steps(self, epoch: int, steps: int, now: float) -> float:
        """Steps made in round `epoch` by all peers, extrapolated to `now`; infinite if most of the others are
        past it. (A peer still in the previous round counts in `peers_in` but has made none of this round's
        steps; one that is past it counts H steps.) Once some peers are confirmed, only they can make us late,
        and each unconfirmed peer counts between our own `steps` and H."""
        counted = [p for p in self._others if p.epoch >= epoch - 1]
        trusted = [p for p in counted if self._counts_fully(p)]
        if 2 * sum(1 for p in trusted if p.epoch > epoch) > len(trusted):
            return math.inf  # most peers have ended this round: we are late
        total, round_steps = float(steps), float(self.round_steps(epoch))
        cap = 2.0 * round_steps  # one peer's extrapolation is never trusted beyond this
        for other in counted:
            if other.epoch > epoch:
                made = round_steps
            elif other.epoch == epoch:
                made = min(cap, other.steps + other.steps_per_s * max(0.0, now - other.time))
            else:
                made = 0.0
            if not self._counts_fully(other):
                made = min(round_steps, max(float(steps), made))
            total += made
        return total

    def seconds_to_round_end(self, epoch: int, steps: int, steps_per_s: float) -> float:
        """When `round_done` will say yes at the swarm's present pace (this peer making `steps_per_s`): 0 if it
        does now, infinite if nobody is making progress."""
        now = time.time()
        remaining = self.round_steps(epoch) * self.peers_in(epoch) - self.collective_steps(epoch, steps, now)
        if remaining <= 0:
            return 0.0
        rate = steps_per_s + sum(p.steps_per_s for p in self._others if p.epoch == epoch and self._counts_fully(p))
        return remaining / rate if rate > 0 else math.inf

    def schedule_step(self, origin: int, epoch: int, steps: int) -> int:
        """The swarm's place in the learning-rate schedule while this peer is `steps` steps into round `epoch`:
        `origin` (the run's step at round 0) + the steps of the rounds the swarm has ended (H each, after the opening
        ones) + the mean steps its peers have made in this one (extrapolated as for `round_done`, at most its
        length). Every peer that shares the global weights computes about the same number at the same moment,
        whatever its speed or its own step count; a peer that has just downloaded the state of round R starts at
        origin + `steps_before(R)`."""
        collective = self.collective_steps(epoch, steps, time.time())
        in_round = min(float(self.round_steps(epoch)), collective / self.peers_in(epoch))
        return origin + self.steps_before(epoch) + int(in_round)

    def alone(self) -> bool:
        """Whether no other peer is online: none counted live now (`live_peers`), nor any seen for a record's
        lifetime (a DHT read that comes back empty once proves nothing)."""
        seen_lately = self._other_seen is not None and time.time() - self._other_seen <= self._record_lifetime_s
        return self.live_peers() == 1 and not seen_lately

    @property
    def _record_lifetime_s(self) -> float:
        return 3 * self.every_s + 5

    def others_idle(self, epoch: int) -> bool:
        """Whether no other peer is still training towards round `epoch` (all have stopped, or there are none)."""
        return all(p.steps_per_s == 0 for p in self._others if p.epoch in (epoch - 1, epoch))

    def observe(self, others: list[Progress]) -> None:
        """Take `others` (fresh records of the other peers) as the swarm's progress; the DHT thread calls this."""
        self._others = [p for p in others if p.peer_id not in self._banned]
        if self._others:
            self._other_seen = time.time()

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self._exchange()
            except Exception as error:  # the DHT may be shutting down; the clock must never stop training
                log.debug("round clock: DHT exchange failed: %s", error)
            self._stop.wait(self.every_s)

    def _publish(self) -> None:
        mine = self._mine
        if mine is not None:
            record = ProgressRecord(epoch=mine.epoch, steps=mine.steps, steps_per_s=mine.steps_per_s, time=mine.time)
            store_signed(self.dht, self.record, record, ttl_s=self._record_lifetime_s)

    def _exchange(self) -> None:
        protect(self.dht, self.record)
        self._publish()
        own = signer_for(self.dht).local_public_key
        others = []
        now = time.time()
        fresh = now - self._record_lifetime_s
        for entry in read_signed(self.dht, self.record):
            value = entry.value
            if entry.owner != own and fresh < value.time <= now + 60.0:  # not stale, not from the future
                others.append(Progress(value.epoch, value.steps, value.steps_per_s, value.time, entry.peer_id))
        self.observe(others)
