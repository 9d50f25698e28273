"""`PeerReputation`: who this peer has caught sending or answering what no honest peer would, and whom it bans.

A groupmate is rejected in a round when, as a sender, a part it sent for our span was malformed, not finite,
over the norm bound, or flagged by the robust rule (peers/robust.py), or when, as a reducer, an average it sent
us was malformed or failed our check. Network trouble (timeouts, a peer that left) is never a rejection: a slow
volunteer is not an attacker. A peer rejected in `BAN_AFTER` rounds, or proven once to have signed two different
averages of its span (`convict`, peers/span_agreement.py), is banned for the rest of the run, by this peer only
(there is no swarm-wide list a liar could write to): its parts are left out, its spans' answers unused, and
groups with it are refused where this peer leads them and skipped where it would follow.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

logger = logging.getLogger(__name__)

BAN_AFTER = 2  # rounds with a rejection; one could be bad luck at a threshold, two in one run are not


@dataclass
class PeerReputation:
    """Strikes and bans, keyed by peer id (base58 strings)."""

    ban_after: int = BAN_AFTER
    strikes: dict[str, int] = field(default_factory=dict)
    banned: dict[str, str] = field(default_factory=dict)  # peer id -> the last reason it was rejected for
    # Reducers whose span a groupmate got another average of: no strike (the groupmate may be the liar), but
    # not trusted as a pair partner either (an unsigned two-faced reducer, told apart by nobody, was).
    disputed: set[str] = field(default_factory=set)

    def record_round(self, rejected: dict[str, str]) -> list[str]:
        """Count one strike for each peer rejected in a round (peer id -> why); return those banned by it."""
        newly_banned = []
        for peer, reason in rejected.items():
            if peer in self.banned:
                continue
            self.strikes[peer] = self.strikes.get(peer, 0) + 1
            if self.strikes[peer] >= self.ban_after:
                self.banned[peer] = reason
                newly_banned.append(peer)
                logger.warning("banning %s for the rest of the run: rejected in %d rounds, last for %s",
                               peer, self.strikes[peer], reason)
            else:
                logger.warning("rejected %s this round (%s); %d more such round(s) and it is banned",
                               peer, reason, self.ban_after - self.strikes[peer])
        return newly_banned

    def convict(self, peer: str, reason: str) -> None:
        """Ban `peer` at once: it was proven to lie (peers/span_agreement.py), no strikes needed."""
        if peer not in self.banned:
            self.banned[peer] = reason
            logger.warning("banning %s for the rest of the run: %s", peer, reason)

    @property
    def caught(self) -> set[str]:
        """Peers rejected in some round of the run, or banned."""
        return set(self.strikes) | set(self.banned)

    def is_banned(self, peer: str) -> bool:
        return peer in self.banned
