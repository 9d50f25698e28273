"""`PeerReputation`: who this peer has caught sending or answering what no honest peer would, and whom it bans.

A groupmate is rejected in a round when, as a sender, a part it sent for our span was malformed, not finite,
over the norm bound, or flagged by the robust rule (peers/robust.py), or when, as a reducer, an average it sent
us was malformed or failed our check. Network trouble (timeouts, a peer that left) is never a rejection: a slow
volunteer is not an attacker. A peer rejected in `BAN_AFTER` rounds, or proven once to have signed two different
averages of its span (`convict`, peers/span_agreement.py), is banned for the rest of the run, by this peer only
(there is no swarm-wide list a liar could write to): its parts are left out, its spans' answers unused, and
groups with it are refused where this peer leads them and skipped where it would follow. Its pair partners hear of
the ban and pair with it no more (peers/ban_notes.py); one that rejected it in a round of its own bans it too
(`corroborate`).

A groupmate out of step (declaring other global weights than most of its group) is excused: its update was made
on other weights and may honestly lie far from the group's, so what the robust rule flags in it earns no strike
(`excuse`). So is one that was out of step in the last group it shared with this peer, for a part far from the
group's only: its first update after a resync still carries the progress it made on the old weights, and a late
starter's such part was struck as far and pointing against the group's. The excuse is rationed, since a peer
chooses what it declares: one that claimed another base round after round was never struck for its flipped parts.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Iterable
from dataclasses import dataclass, field
from typing import NamedTuple

logger = logging.getLogger(__name__)

BAN_AFTER = 2  # rounds with a rejection; one could be bad luck at a threshold, two in one run are not
# Rounds a groupmate is excused in, beyond one in EXCUSE_EVERY of the rounds it shared with us: an honest peer
# needs two per resync (out of step, then its first round back), three when its first download fails; a liar
# declaring another base every time is struck in all but a few.
EXCUSED_ROUNDS = 3
EXCUSE_EVERY = 4
COLLUDING = "a part nearly the same as another sender's"  # the robust rule's verdict on a colluding pair's parts
CORROBORATED = "rejected here, and banned by a pair partner"  # a ban on two witnesses' word (`corroborate`)


class Excused(NamedTuple):
    """Groupmates excused in a round (peer ids): out of step in it, or back in step after it
    (`PeerReputation.excuse`)."""

    out_of_step: set
    back_in_step: set


@dataclass
class PeerReputation:
    """Strikes and bans, keyed by peer id (base58 strings)."""

    ban_after: int = BAN_AFTER
    strikes: dict[str, int] = field(default_factory=dict)
    banned: dict[str, str] = field(default_factory=dict)  # peer id -> the last reason it was rejected for
    # Reducers whose span a groupmate got another average of: no strike (the groupmate may be the liar), but
    # not trusted as a pair partner either (an unsigned two-faced reducer, told apart by nobody, was); likewise
    # peers a pair partner has banned (peers/ban_notes.py).
    disputed: set[str] = field(default_factory=set)
    shared_rounds: dict[str, int] = field(default_factory=dict)  # groups a peer was in with us
    excused_rounds: dict[str, int] = field(default_factory=dict)
    out_of_step_last: set[str] = field(default_factory=set)  # out of step in the last group it shared with us

    def excuse(self, groupmates: Iterable[str], out_of_step: Collection[str]) -> Excused:
        """Count a round with `groupmates`, `out_of_step` of them declaring other weights than the group; return
        those excused in it (see the module's docstring)."""
        excused = Excused(set(), set())
        for peer in groupmates:
            shared = self.shared_rounds.get(peer, 0)
            self.shared_rounds[peer] = shared + 1
            if peer in out_of_step or peer in self.out_of_step_last:
                used = self.excused_rounds.get(peer, 0)
                if used < EXCUSED_ROUNDS + shared // EXCUSE_EVERY:
                    self.excused_rounds[peer] = used + 1
                    (excused.out_of_step if peer in out_of_step else excused.back_in_step).add(peer)
            if peer in out_of_step:
                self.out_of_step_last.add(peer)
            else:
                self.out_of_step_last.discard(peer)
        return excused

    def record_round(self, rejected: dict[str, str]) -> list[str]:
        """Count one strike for each peer rejected in a round (peer id -> why); return those banned by it.

        Colluders flagged in the round in which one of them is banned for it go with it: a part is only ever
        flagged as colluding with another's, so they were its twins. Left with one strike, the last of a pair
        had no twin any more to be caught with, and stayed ("A Little Is Enough" pairs: one of two banned)."""
        newly_banned = []
        for peer, reason in rejected.items():
            if peer in self.banned:
                continue
            self.strikes[peer] = self.strikes.get(peer, 0) + 1
            if self.strikes[peer] >= self.ban_after:
                self._ban(peer, reason, f"rejected in {self.strikes[peer]} rounds, last for {reason}")
                newly_banned.append(peer)
            else:
                logger.warning("rejected %s this round (%s); %d more such round(s) and it is banned",
                               peer, reason, self.ban_after - self.strikes[peer])
        if any(rejected[peer] == COLLUDING for peer in newly_banned):
            for peer, reason in rejected.items():
                if reason == COLLUDING and peer not in self.banned:
                    self._ban(peer, reason, "flagged as colluding in the round its twin was banned for it")
                    newly_banned.append(peer)
        return newly_banned

    def _ban(self, peer: str, reason: str, why: str) -> None:
        self.banned[peer] = reason
        logger.warning("banning %s for the rest of the run: %s", peer, why)

    def convict(self, peer: str, reason: str) -> None:
        """Ban `peer` at once: it was proven to lie (peers/span_agreement.py), no strikes needed."""
        if peer not in self.banned:
            self._ban(peer, reason, reason)

    def corroborate(self, peer: str) -> bool:
        """Ban `peer`, struck here in some round, now that a pair partner has banned it (peers/ban_notes.py): two
        witnesses, one of them this peer. Return whether it was banned now (not if never struck here, or banned)."""
        if peer in self.banned or peer not in self.strikes:
            return False
        self._ban(peer, CORROBORATED, f"rejected here in {self.strikes[peer]} round(s) and banned by a pair partner")
        return True

    @property
    def caught(self) -> set[str]:
        """Peers rejected in some round of the run, or banned."""
        return set(self.strikes) | set(self.banned)

    def is_banned(self, peer: str) -> bool:
        return peer in self.banned
