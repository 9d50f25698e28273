"""Span agreement: after an all-reduce, a group's peers keep only the spans every one of them got the same average of.

Each reducer packs its span's average once and sends every groupmate the very same bytes (peers/averaging.py),
so honest peers that took a span's average hold byte-identical copies. A reducer that tells groupmates different
things (the truth to one, 50x it to the others) is caught only by those it lied to: the one told the truth keeps
the span, the others drop it, and the honest peers' weights part. To keep them together, every peer sends its
groupmates one SHA-256 digest per span (of the reply bytes it took, or `NO_AVERAGE` for a span it lost) and drops
any span whose digest a groupmate reports differently: a failed span then falls back identically on every honest
peer, whoever it failed for (a lie, or a reducer that timed out for one peer only).

Nothing here is signed beyond the libp2p channel, which authenticates the sender of each digest vector: an honest
reducer cannot prove what it sent, so one dispute earns nobody a strike. A reducer earns one only when more than
half of its other groupmates refused its average (`REFUSED`: invalid, or they banned it) or got other bytes than
we did (`outvoted_reducers`): the groupmate a two-faced reducer told the truth bans it too, while liars fewer than
half a group cannot frame an honest one. In a group of three a lone dispute is a tie, and nobody is struck. What a
liar gains by disputing is bounded: a vector that differs from ours on more than one span is not believed (an
honest peer lied to by one reducer differs on exactly one), so it can make its group drop at most one span a
round. Agreement among peers that some digests never reach within the wait is not guaranteed; they fall back to
what they saw themselves.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from dataclasses import dataclass, field
from typing import Collection, Iterable, Mapping, Sequence

from hivemind.p2p import PeerID
from hivemind.proto import averaging_pb2, runtime_pb2

logger = logging.getLogger(__name__)

DIGEST_BYTES = hashlib.sha256().digest_size
NO_AVERAGE = bytes(DIGEST_BYTES)  # the digest of a span this peer has no average of (timed out, empty)
REFUSED = b"\xff" * DIGEST_BYTES  # of a span whose average this peer refused (invalid) or whose reducer it banned
MAX_PENDING_GROUPS = 4  # inboxes kept at once: a round's, and a few stale ones a slow peer may still reach


def span_digest(buffers: Iterable[bytes]) -> bytes:
    """The digest of one span's average: SHA-256 over its reply messages' payloads, in part order."""
    digest = hashlib.sha256()
    for buffer in buffers:
        digest.update(len(buffer).to_bytes(8, "little"))  # part boundaries count: no two splits hash alike
        digest.update(buffer)
    return digest.digest()


def digest_message(group_id: bytes, digests: Sequence[bytes]) -> averaging_pb2.AveragingData:
    """Our digests of a group's spans, as one message (a uint8 tensor of one row per span)."""
    return averaging_pb2.AveragingData(
        group_id=group_id,
        tensor_part=runtime_pb2.Tensor(buffer=b"".join(digests), size=[len(digests), DIGEST_BYTES], dtype="uint8"),
    )


def read_digests(message: averaging_pb2.AveragingData, group_size: int) -> list[bytes] | None:
    """The digests in a groupmate's message, or None where it is not one digest per span of a group this size."""
    part = message.tensor_part
    if list(part.size) != [group_size, DIGEST_BYTES] or len(part.buffer) != group_size * DIGEST_BYTES:
        return None
    return [part.buffer[i * DIGEST_BYTES : (i + 1) * DIGEST_BYTES] for i in range(group_size)]


def believed(mine: Sequence[bytes], theirs: Mapping[PeerID, Sequence[bytes]]) -> dict[PeerID, Sequence[bytes]]:
    """The groupmates' digest vectors that differ from ours on one span at most (see the module docstring)."""
    kept = {}
    for peer, digests in theirs.items():
        differing = sum(a != b for a, b in zip(mine, digests))
        if differing <= 1:
            kept[peer] = digests
        else:
            logger.info("not believing %s's span digests: they differ from ours on %d spans", peer, differing)
    return kept


def disputed_spans(mine: Sequence[bytes], theirs: Mapping[PeerID, Sequence[bytes]]) -> set[int]:
    """The spans (reducer indices) to drop: those where a groupmate's (believed) digests differ from ours."""
    return {i for digests in theirs.values() for i, (a, b) in enumerate(zip(mine, digests)) if a != b}


def outvoted_reducers(
    peers: Sequence[PeerID], me: PeerID, mine: Sequence[bytes], theirs: Mapping[PeerID, Sequence[bytes]]
) -> list[int]:
    """Reducers (indices) whose average we took while most of their other groupmates (`theirs`: believed vectors)
    refused it or got other bytes: more than half of the group without the reducer, us counted in it. Such a
    reducer told groupmates different things. Fewer than half of a group cannot get an honest reducer caught this
    way, and a timeout (`NO_AVERAGE`) never counts against one."""
    outvoted = []
    for index, (reducer, taken) in enumerate(zip(peers, mine)):
        if reducer == me or taken in (NO_AVERAGE, REFUSED):
            continue
        against = sum(1 for peer, digests in theirs.items()
                      if peer != reducer and digests[index] not in (taken, NO_AVERAGE))
        if 2 * against > len(peers) - 1:
            outvoted.append(index)
    return outvoted


@dataclass
class _Inbox:
    members: frozenset
    group_size: int
    received: dict = field(default_factory=dict)  # peer id -> its digests
    arrived: asyncio.Event = field(default_factory=asyncio.Event)


class DigestInboxes:
    """The digest vectors groupmates send us, kept per group from the moment the group's all-reduce begins."""

    def __init__(self) -> None:
        self._inboxes: dict[bytes, _Inbox] = {}

    def open(self, group_id: bytes, peer_ids: Sequence[PeerID]) -> None:
        """Start keeping the digests that `peer_ids`' peers send for group `group_id` (the oldest group's go)."""
        while len(self._inboxes) >= MAX_PENDING_GROUPS:
            self._inboxes.pop(next(iter(self._inboxes)))
        self._inboxes[group_id] = _Inbox(frozenset(peer_ids), len(peer_ids))

    def close(self, group_id: bytes) -> None:
        self._inboxes.pop(group_id, None)

    def deliver(self, sender: PeerID, message: averaging_pb2.AveragingData) -> None:
        """Keep `sender`'s digests if it is in an open group and they are well-formed (its first vector counts)."""
        inbox = self._inboxes.get(message.group_id)
        if inbox is None or sender not in inbox.members or sender in inbox.received:
            return
        digests = read_digests(message, inbox.group_size)
        if digests is None:
            logger.info("ignoring malformed span digests from %s", sender)
            return
        inbox.received[sender] = digests
        inbox.arrived.set()

    async def wait(self, group_id: bytes, expected: Collection[PeerID], timeout: float) -> dict[PeerID, list[bytes]]:
        """The digests received for `group_id`, once all of `expected` have sent theirs or `timeout` has passed."""
        inbox = self._inboxes[group_id]
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while not set(expected) <= set(inbox.received) and loop.time() < deadline:
            inbox.arrived.clear()
            try:
                await asyncio.wait_for(inbox.arrived.wait(), deadline - loop.time())
            except asyncio.TimeoutError:
                break
        missing = set(expected) - set(inbox.received)
        if missing:
            logger.info("no span digests from %d groupmate(s) within %.1f s", len(missing), timeout)
        return dict(inbox.received)
