"""When the swarm loop ends a round, begins matchmaking, gives a round up, averages its last steps, and resyncs.

Pure decisions over what the loop knows (its round, its steps in it, how long it has lasted) and what the
round clock (peers/progress.py) says about the other peers; no network, no threads, no clock reads but the
round clock's own. `SwarmPeer` (peers/swarm.py) acts on them.
"""

from __future__ import annotations

import enum
import math
from collections import Counter
from typing import Collection, Protocol, Sequence

Base = tuple[int, str]  # (outer round, fingerprint) of the global weights a pseudo-gradient was formed on

# Rounds in a row a peer goes without an average before it takes a pair with a peer it has not averaged with:
# the caution of `RoundSchedule.pair_partners` must not leave two honest peers apart for good when a third
# announces progress but never joins a group.
PAIR_PATIENCE = 2


class SwarmClock(Protocol):
    """What the schedule reads of the other peers' progress (`RoundClock` is the real one)."""

    every_s: float
    live_at_start: int

    def round_steps(self, epoch: int) -> int: ...

    def round_done(self, epoch: int, steps: int) -> bool: ...

    def is_first_round(self, epoch: int) -> bool: ...

    def seconds_to_round_end(self, epoch: int, steps: int, steps_per_s: float) -> float: ...

    def live_peers(self) -> int: ...

    def others_idle(self, epoch: int) -> bool: ...

    def collective_steps(self, epoch: int, steps: int, now: float) -> float: ...


class LastSteps(enum.Enum):
    """What to do with the steps of a round the run ended in the middle of."""

    WAIT = "wait"  # the swarm has not ended the round yet
    AVERAGE = "average"  # end the round and average them with the others
    KEEP_LOCAL = "keep local"  # the swarm made fewer than H steps in all: no outer step on so little work


class Resync(enum.Enum):
    """What a peer out of step with its group does with the state it downloaded."""

    ADOPT = "adopt"  # the donor had applied the group's round already
    ADOPT_AND_STEP = "adopt and step"  # the donor was one round behind: apply this round's average on top
    STAY = "stay out of step"  # nobody shared the group's state: try again next round


def declared_base(metadata: object) -> Base | None:
    """The base a groupmate declared in its round's metadata; None if it is not a well-formed one."""
    if not isinstance(metadata, dict):
        return None
    round_number, weights = metadata.get("round"), metadata.get("weights")
    return (round_number, weights) if isinstance(round_number, int) and isinstance(weights, str) else None


def group_consensus(metadata: Sequence[object]) -> Base | None:
    """The base most members of an averaging group declared (ties: the later round, then the smaller
    fingerprint, so every member picks the same one); None if nobody declared a well-formed base."""
    bases = [base for base in map(declared_base, metadata) if base is not None]
    if not bases:
        return None
    counts = Counter(bases)
    return min(counts, key=lambda base: (-counts[base], -base[0], base[1]))


def resync_plan(consensus: Base, donor: object) -> Resync:
    """How to use a state downloaded because our base differed from the group's `consensus`; `donor` is that
    state's metadata (remote data; None if the download failed). The donor may or may not have applied the
    group's round yet: we want the state after it."""
    donor_round = donor.get("round") if isinstance(donor, dict) else None
    if not isinstance(donor_round, int):
        return Resync.STAY
    if donor_round == consensus[0] and donor.get("weights") == consensus[1]:
        return Resync.ADOPT_AND_STEP
    return Resync.ADOPT if donor_round > consensus[0] else Resync.STAY


class RoundSchedule:
    """The swarm loop's timing decisions for one peer whose averager gathers groups for `matchmaking_time` s."""

    def __init__(self, clock: SwarmClock, matchmaking_time: float) -> None:
        self.clock, self.matchmaking_time = clock, matchmaking_time

    def round_ends(self, epoch: int, steps: int) -> bool:
        """Whether this peer's round `epoch` ends now, `steps` steps in: the swarm has made H steps per peer."""
        return self.clock.round_done(epoch, steps)

    def matchmaking_lead(self, epoch: int, steps: int, steps_per_s: float, round_s: float) -> float | None:
        """Seconds to the round's end, when matchmaking should begin now (within one matchmaking window of the
        end: the group then forms while the last steps train, and the average arrives one all-reduce after the
        round ends); else None. Not for rounds no longer than the window (`round_s` so far plus what is left),
        where it would begin as the previous round ends: with it, CI's swarm tests (rounds of 5 steps, well
        under the window) turned flaky, two failures in two runs whose cause is not pinned down; such short
        rounds gain little from it anyway."""
        seconds = self.clock.seconds_to_round_end(epoch, steps, steps_per_s)
        window = self.matchmaking_time
        if seconds > window or round_s + seconds <= window:
            return None
        return seconds

    def group_deadline(self, epoch: int, seconds_to_end: float, leaves_in_s: float | None = None,
                       wait_s: float = 0.0) -> float:
        """Seconds until the group of round `epoch`, which this peer expects to end in `seconds_to_end` seconds, must
        begin: in this peer's first round one of the clock's record periods after that, else then. Peers started
        together begin training up to a second apart, before they have read each other's records, so their
        estimates of the first round's end differ: a leader that closed its group at its own left out a peer whose
        round ended 0.25 s later, which then averaged out of step and downloaded the state. A group whose expected
        peers (`group_size`) are all in begins at once; one that never completes (a peer counted live that cannot
        join: an attacker others banned) waits the whole deadline, so later rounds, whose ends the peers read
        alike, do not wait the extra period (with it, each such round of a 3 + 1 run took a second longer).

        A peer that stops training first (`leaves_in_s` < `seconds_to_end`: out of its own steps) says `wait_s`
        after it stops instead, the longest it then waits for the round's end. hivemind begins a leader's group,
        full or not, once the time its leader said has passed; as the swarm's peers stop one by one the round's end
        moves later, and a peer out of steps that had said the end it expected led a group that began without a
        peer still training (a run's last round left a peer out in about half the real-swarm runs of
        benchmarks/RESULTS.md). Saying a later time, it follows the group of a peer still training, or leads one of
        peers out of steps that begins once all live peers are in."""
        if leaves_in_s is not None and leaves_in_s < seconds_to_end:
            return leaves_in_s + wait_s
        return seconds_to_end + (self.clock.every_s if self.clock.is_first_round(epoch) else 0.0)

    def group_size(self, round_s: float, synchronous: bool = False) -> int | None:
        """The group to expect for a round that has lasted `round_s` seconds: every live peer the round clock
        sees, so that the average starts once they are all in, not when the matchmaking window closes (on the
        H200 benchmark that window made every average a whole round late).

        None (wait out the window, hivemind's default) for a peer that sees nobody, and for rounds shorter than
        two of the clock's record periods: there the records lag whole rounds, peers drift apart, and the
        window is what gathers them (measured: with 5-step rounds in tests/test_swarm.py, groups formed at
        once split the swarm into pairs and forced 5-9 state re-downloads a run, against none). A `synchronous`
        round (an opening one) expects every live peer however short it is: its peers wait for its average before
        they train on, so none drifts a round ahead, and the window would otherwise be most of each round."""
        peers = self.clock.live_peers()
        return peers if peers > 1 and (synchronous or round_s >= 2 * self.clock.every_s) else None

    def pair_partners(self, averaged_with: Collection[str], caught: Collection[str],
                      rounds_alone: int) -> frozenset[str] | None:
        """Whom to average with in a group of two this round: while the round clock sees three or more live
        peers, only peers this one has averaged with before (`averaged_with`, less those `caught`); None (any
        pair, but with a peer the averager has caught) when fewer are live, or after PAIR_PATIENCE rounds in a row
        without an average.

        In a pair neither contribution is a majority: an attacker paired with an honest peer in the swarm's first
        rounds, before anyone could ban it, got its update and its own span's answer through (a 90x update and a
        10^12-token sign flip destroyed the 2 + 1 swarm, benchmarks/RESULTS.md). With three or more live, a
        group of three holds an honest majority the robust rules act on, so it is worth waiting for.

        Until this peer has averaged, the clock's `live_at_start` counts too: peers started together publish their
        clocks' first records as they start, and a first round may be formed before this peer's clock has read any
        (an attacker paired so in a 3 + 1 swarm's first round, and its poisoned weights then won the next group's
        vote)."""
        live = self.clock.live_peers() if averaged_with else max(self.clock.live_peers(), self.clock.live_at_start)
        if live < 3 or rounds_alone >= PAIR_PATIENCE:
            return None
        return frozenset(averaged_with) - frozenset(caught)

    def give_up_after(self, epoch: int) -> float | None:
        """How long a round that ends `epoch` may look for a group before it is given up (`PendingRound.
        give_up_if_alone`), or None while another peer still trains towards it. Twice the matchmaking time:
        one that waits for this round's group is found within that time; a lone peer's rounds and its Ctrl+C
        used to wait the whole averaging timeout instead (30 s by default)."""
        return 2 * self.matchmaking_time if self.clock.others_idle(epoch) else None

    def last_steps(self, epoch: int, steps: int, now: float, timed_out: bool) -> LastSteps:
        """The run is over `steps` steps into round `epoch`: wait (without training) until the swarm ends the
        round or nobody trains towards it any more, so the last steps are averaged in the others' group rather
        than alone; once `timed_out` (the averaging timeout has passed, or a stop was asked for) it averages
        them as they are.

        KEEP_LOCAL when the round ends with fewer than H steps in all: then every peer keeps its last steps
        local. An outer step on so little work would mostly repeat the momentum's lookahead, and the peers that
        ran out of steps at the previous round's end would not take it: the global weights would end different
        (measured: 0.5% worse val loss for the peers that took it, benchmarks/RESULTS.md)."""
        if not (self.clock.round_done(epoch, steps) or self.clock.others_idle(epoch)):
            return LastSteps.AVERAGE if timed_out else LastSteps.WAIT
        collective = self.clock.collective_steps(epoch, steps, now)
        return LastSteps.AVERAGE if collective >= self.clock.round_steps(epoch) else LastSteps.KEEP_LOCAL

    def seconds_to_round_end(self, epoch: int, steps: int, steps_per_s: float) -> float | None:
        """When this round ends at the swarm's pace (the swarm ends it once all its peers together made H steps
        each, not when this peer alone has); None while nobody makes progress."""
        seconds = self.clock.seconds_to_round_end(epoch, steps, steps_per_s)
        return seconds if math.isfinite(seconds) else None
