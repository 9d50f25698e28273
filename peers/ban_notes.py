"""Bans told to pair partners: each peer publishes whom it has banned, and heeds its partners' word in pairs only.

A peer bans on its own evidence (peers/reputation.py), and some honest peers can hold evidence against an attacker
while others hold none: an "A Little Is Enough" update lies close to the honest ones, and the robust rule flagged it
in the spans two of three honest peers reduced, not in the third's. The two then neither followed the attacker nor
let it into their groups, so it paired with the third, round after round, and that peer's val loss ended at 2.41
against 1.91 (benchmarks/swarm_attacks.py, alie:3+1).

So every peer publishes the ids of the peers it has banned in a signed record of its own (`BanNote`), and a peer
holds a peer that one of its pair partners banned as disputed: no pair with it, and no following it as a leader
while its pairs are for partners (peers/averaging.py). A note alone is not a ban, since a partner may lie: it keeps
pairs from forming, never a group of three or more, where the robust rules act on each peer's own evidence. A note
on a peer this one has rejected in a round of its own is: two witnesses (`SwarmAverager.heed_partners_bans`).

Each ban carries the round it was made in: a peer still follows a group led by a peer it just banned for one more
step, as its groupmates that have not banned it yet still do, and counts that step from the first ban among itself
and its partners, so that all of them leave that leader in the same step (peers/averaging.py, `_skipped_leader`).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Annotated

import pydantic
from hivemind import DHT

from tscale_p2p.peers.records import ProtectedKey, RecordModel, protect, read_signed, store_signed

MAX_NOTED_BANS = 32  # ids in one note: an honest peer bans a handful in a run
NOTE_TTL_S = 60.0  # a peer republishes within seconds (`BanNotes.exchange`); a gone peer's note expires

_PeerId = Annotated[str, pydantic.Field(min_length=1, max_length=64, pattern=r"^[1-9A-HJ-NP-Za-km-z]+$")]
_Round = Annotated[int, pydantic.Field(ge=0, le=2**31)]


class BanNote(RecordModel):
    """The peers one peer has banned for the run (base58 peer ids), and the round it banned each in."""

    banned: tuple[_PeerId, ...] = pydantic.Field(max_length=MAX_NOTED_BANS)
    rounds: tuple[_Round, ...] = pydantic.Field(max_length=MAX_NOTED_BANS)

    @pydantic.model_validator(mode="after")
    def _a_round_for_each_ban(self) -> "BanNote":
        if len(self.rounds) != len(self.banned):
            raise ValueError(f"{len(self.rounds)} rounds for {len(self.banned)} banned peers")
        return self


def ban_note_record(run_id: str) -> ProtectedKey:
    return ProtectedKey(f"{run_id}_bans", BanNote, max_ttl_s=NOTE_TTL_S, max_bytes=4096)


class BanNotes:
    """This peer's note and the latest ones of the others, for one run (`exchange` runs in a background thread)."""

    def __init__(self, dht: DHT | None, run_id: str, peer_id: str) -> None:
        self.dht, self.record, self.peer_id = dht, ban_note_record(run_id), peer_id
        self._notes: dict[str, dict[str, int]] = {}  # peer id (the note's signer) -> the peers it banned -> round
        self._ban_rounds: dict[str, int] = {}  # our bans -> the round we first told of each

    def exchange(self, banned: Collection[str], round_number: int) -> None:
        """Publish our note (none while we have banned nobody; a ban not told before is dated `round_number`,
        the round this peer has applied last) and read everyone's."""
        protect(self.dht, self.record)
        if banned:
            told = sorted(banned)[:MAX_NOTED_BANS]
            rounds = tuple(self._ban_rounds.setdefault(peer, round_number) for peer in told)
            store_signed(self.dht, self.record, BanNote(banned=tuple(told), rounds=rounds), ttl_s=NOTE_TTL_S)
        self.observe({entry.peer_id: dict(zip(entry.value.banned, entry.value.rounds))
                      for entry in read_signed(self.dht, self.record) if entry.peer_id != self.peer_id})

    def observe(self, notes: Mapping[str, Mapping[str, int]]) -> None:
        """Take `notes` (signer -> the peers it banned -> the round of each ban) as the others' latest; `exchange`
        calls this."""
        self._notes = {signer: dict(bans) for signer, bans in notes.items()}

    def noted_by(self, partners: Collection[str]) -> dict[str, int]:
        """The peers that any of `partners` has banned, ourselves aside, with the first round one of them did."""
        noted: dict[str, int] = {}
        for partner in partners:
            for peer, round_number in self._notes.get(partner, {}).items():
                if peer != self.peer_id:
                    noted[peer] = min(round_number, noted.get(peer, round_number))
        return noted
