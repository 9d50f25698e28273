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

**Signed spans break the tie.** A reducer that declared a span key when the group formed signs its span's digest
once (`SpanSigner.sign`, over the group id, its index and the digest) and sends that signature after its last
part. The span key is an Ed25519 key of the session (64-byte signatures, against 256 for the RSA identity key:
one goes with every answer stream), vouched for by the RSA key the peer's id is the hash of (`bound_key`); a groupmate refuses an average whose signature does
not verify. A reducer that signs two different averages of one span in one group has proved itself a liar: when
a dispute shows up, each peer that holds a signed copy sends it to the groupmates that report otherwise
(`evidence_message`), and a peer that gets a validly signed digest other than its own signed copy bans the
reducer at once (`EvidenceBooks`). Nobody can forge another peer's signature, so this frames no honest reducer,
and evidence costs no bytes without a dispute. The two signed digests are a `Proof` anyone can check, so the
peers that caught a liar show it to each groupmate they meet later, once each, and those ban it too. A liar can still deny a groupmate a valid signature (or any
answer): that peer refuses the span, which proves nothing to the others, and the rules above apply.

**Signed copies travel.** Where some groupmates lost a signed span (no average, or one they refused) and all
those other than its reducer that took it got the same bytes, nobody drops it: those that took it keep it, and
the others fetch a copy from one of them (`copy_request`, `EvidenceBooks.relayed`), check its reducer's signature
and take it as that reducer's own answer. A reducer that denies one groupmate a valid answer then costs the group
nothing, nor does a groupmate claiming it refused a span, and a peer whose reducer timed out stays in step where
another groupmate took the span. A span that only its reducer holds is dropped by all: the reducer's own word
settles nothing. Without span keys a copy could be forged by whoever relays it, so unsigned spans are dropped as
before.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import logging
from dataclasses import dataclass, field
from typing import Any, Collection, Iterable, Mapping, Sequence

from hivemind.p2p import PeerID
from hivemind.proto import averaging_pb2, runtime_pb2
from hivemind.utils import MSGPackSerializer
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat
from hivemind.utils.crypto import RSAPrivateKey, RSAPublicKey

from tscale_p2p.peers.records import peer_id_of

logger = logging.getLogger(__name__)

DIGEST_BYTES = hashlib.sha256().digest_size
NO_AVERAGE = bytes(DIGEST_BYTES)  # the digest of a span this peer has no average of (timed out, empty)
REFUSED = b"\xff" * DIGEST_BYTES  # of a span whose average this peer refused (invalid) or whose reducer it banned
_NOT_TAKEN = (NO_AVERAGE, REFUSED)
MAX_PENDING_GROUPS = 4  # inboxes kept at once: a round's, and a few stale ones a slow peer may still reach
SIGNATURE_BYTES = 64  # an Ed25519 signature
MAX_PROOF_BYTES = 4096  # a Proof's message: two digests and signatures, an RSA key and its vouch, a group id
_STATEMENT = b"tscale-p2p span average\x00"
_VOUCH = b"tscale-p2p span key\x00"


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


@dataclass(frozen=True)
class SpanSigner:
    """This peer's span key: an Ed25519 key of the session, and what it declares to its groups (its identity
    key, the span key, and the identity key's signature of the span key)."""

    private: bytes  # raw Ed25519 private key (bytes, so that the averager process can be forked or spawned)
    declaration: tuple[bytes, bytes, bytes]

    @classmethod
    def of(cls, identity: RSAPrivateKey) -> "SpanSigner":
        key = Ed25519PrivateKey.generate()
        public = key.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)
        vouch = base64.b64decode(identity.sign(_VOUCH + public))
        return cls(key.private_bytes_raw(), (identity.get_public_key().to_bytes(), public, vouch))

    def sign(self, group_id: bytes, reducer_index: int, digest: bytes) -> bytes:
        """Our signature of our span's digest in group `group_id`, where we are reducer `reducer_index`."""
        return Ed25519PrivateKey.from_private_bytes(self.private).sign(_statement(group_id, reducer_index, digest))


def bound_key(declared: Any, peer: PeerID) -> Ed25519PublicKey | None:
    """The span key in a groupmate's declaration (`SpanSigner.declaration`, as msgpack hands it over) if the
    identity key in it is the key of its peer id and vouches for it; else None (remote data: never raises)."""
    try:
        identity, public, vouch = declared
        if not (isinstance(identity, bytes) and isinstance(public, bytes) and isinstance(vouch, bytes)):
            return None
        if peer_id_of(identity) != peer.to_base58():
            return None
        if not RSAPublicKey.from_bytes(identity).verify(_VOUCH + public, base64.b64encode(vouch)):
            return None
        return Ed25519PublicKey.from_public_bytes(public)
    except (TypeError, ValueError):
        return None


def _statement(group_id: bytes, reducer_index: int, digest: bytes) -> bytes:
    return _STATEMENT + len(group_id).to_bytes(2, "little") + group_id + reducer_index.to_bytes(2, "little") + digest


def verify_span(key: Ed25519PublicKey | None, group_id: bytes, reducer_index: int, digest: bytes,
                signature: bytes) -> bool:
    """Whether `signature` is `key`'s signature of that span digest (False without a key)."""
    if key is None or not isinstance(signature, bytes) or len(signature) != SIGNATURE_BYTES:
        return False
    try:
        key.verify(signature, _statement(group_id, reducer_index, digest))
    except InvalidSignature:
        return False
    return True


def signature_message(signature: bytes) -> averaging_pb2.AveragingData:
    """What a reducer sends after its span's last part: its signature (empty without a declared key)."""
    part = runtime_pb2.Tensor(buffer=signature, size=[len(signature)], dtype="uint8")
    return averaging_pb2.AveragingData(code=averaging_pb2.AVERAGED_PART, tensor_part=part)


def evidence_message(group_id: bytes, copies: Mapping[int, tuple[bytes, bytes]]) -> averaging_pb2.AveragingData:
    """Signed copies we hold (reducer index -> (digest, signature)), to show groupmates that got other bytes."""
    rows = MSGPackSerializer.dumps([[index, digest, signature] for index, (digest, signature) in sorted(copies.items())])
    return averaging_pb2.AveragingData(
        group_id=group_id, tensor_part=runtime_pb2.Tensor(buffer=rows, size=[len(rows)], dtype="uint8"))


def read_evidence(message: averaging_pb2.AveragingData, group_size: int) -> dict[int, tuple[bytes, bytes]] | None:
    """The signed copies in a groupmate's evidence message, or None where it is malformed (remote data)."""
    if len(message.tensor_part.buffer) > group_size * (SIGNATURE_BYTES + DIGEST_BYTES + 16):
        return None
    try:
        rows = MSGPackSerializer.loads(message.tensor_part.buffer)
        copies = {index: (digest, signature) for index, digest, signature in rows}
    except Exception:  # noqa: BLE001  (msgpack and the unpacking raise many kinds on garbage)
        return None
    for index, (digest, signature) in copies.items():
        if not (isinstance(index, int) and 0 <= index < group_size and isinstance(digest, bytes)
                and len(digest) == DIGEST_BYTES and isinstance(signature, bytes)):
            return None
    return copies


def believed(mine: Sequence[bytes], theirs: Mapping[PeerID, Sequence[bytes]]) -> dict[PeerID, Sequence[bytes]]:
    """The groupmates' digest vectors that differ from ours on one span at most (see the module docstring). A span
    neither of us took (lost to one, refused by the other) is no difference: a peer whose short first round made
    it refuse two spans (one from an honest reducer, one from a liar its groupmate refused) would otherwise believe
    nobody, and the two would part over the honest span."""
    kept = {}
    for peer, digests in theirs.items():
        differing = sum(a != b and not (a in _NOT_TAKEN and b in _NOT_TAKEN) for a, b in zip(mine, digests))
        if differing <= 1:
            kept[peer] = digests
        else:
            logger.info("not believing %s's span digests: they differ from ours on %d spans", peer, differing)
    return kept


def recoverable_spans(peers: Sequence[PeerID], vectors: Mapping[PeerID, Sequence[bytes]],
                      signed: Sequence[bool]) -> dict[int, bytes]:
    """Spans (reducer indices -> digest) that some of us lost while every groupmate but its reducer that took an
    average of it got the same bytes, where the reducer signs its span (`signed`): kept by those that took it,
    fetched by the others. `peers`: the group in reducer order; `vectors`: ours and the believed ones.

    A reducer's word that it took its own span counts for nothing: a liar's copy may pass every check, and
    whether its digests reach a groupmate within the wait decides whether that groupmate takes it, so honest
    peers would part; a span only its reducer holds is dropped by all."""
    recoverable = {}
    for index, is_signed in enumerate(signed):
        others = [digests[index] for peer, digests in vectors.items() if peer != peers[index]]
        taken = set(others) - set(_NOT_TAKEN)
        if is_signed and len(taken) == 1 and any(digest in _NOT_TAKEN for digest in others):
            recoverable[index] = taken.pop()
    return recoverable


def copy_request(group_id: bytes, index: int) -> averaging_pb2.AveragingData:
    """A request for a groupmate's signed copy of reducer `index`'s span average in group `group_id`."""
    return averaging_pb2.AveragingData(group_id=group_id, tensor_part=runtime_pb2.Tensor(
        buffer=index.to_bytes(2, "little"), size=[2], dtype="uint8"))


def took_another(ours: bytes, theirs: bytes) -> bool:
    """Whether a groupmate's digest of a span says it took, or refused, another average than ours. One that lost
    the span (`NO_AVERAGE`: its reducer timed out for it) says nothing of that reducer."""
    return theirs not in (ours, NO_AVERAGE)


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


@dataclass(frozen=True)
class Proof:
    """Two different digests one reducer signed for its span in one group: proof, to anyone, that it lied."""

    group_id: bytes
    index: int
    declaration: tuple  # the reducer's span key declaration (`SpanSigner.declaration`)
    first: tuple  # (digest, signature)
    second: tuple

    def liar(self) -> str | None:
        """The peer id (base58) this proves a liar; None where it proves nothing (remote data: never raises)."""
        try:
            peer = peer_id_of(self.declaration[0])
            (first, first_signature), (second, second_signature) = self.first, self.second
            if peer is None or first == second or not isinstance(self.group_id, bytes):
                return None
            key = bound_key(self.declaration, PeerID.from_base58(peer))
            for digest, signature in ((first, first_signature), (second, second_signature)):
                if not verify_span(key, self.group_id, self.index, digest, signature):
                    return None
        except (TypeError, ValueError, IndexError, OverflowError):
            return None
        return peer

    def message(self) -> averaging_pb2.AveragingData:
        blob = MSGPackSerializer.dumps([self.group_id, self.index, list(self.declaration), list(self.first),
                                        list(self.second)])
        return averaging_pb2.AveragingData(tensor_part=runtime_pb2.Tensor(buffer=blob, size=[len(blob)], dtype="uint8"))

    @classmethod
    def read(cls, message: averaging_pb2.AveragingData) -> "Proof | None":
        """The proof in a groupmate's message, unchecked (see `liar`), or None where it does not parse."""
        if len(message.tensor_part.buffer) > MAX_PROOF_BYTES:
            return None
        try:
            group_id, index, declaration, first, second = MSGPackSerializer.loads(message.tensor_part.buffer)
            return cls(group_id, index, tuple(declaration), tuple(first), tuple(second))
        except Exception:  # noqa: BLE001  (msgpack and the unpacking raise many kinds on garbage)
            return None


@dataclass(frozen=True)
class _Book:
    peers: tuple
    declarations: tuple  # each reducer's declared span key (remote data: see `bound_key`)
    copies: dict  # reducer index -> (digest, signature) we hold, its signature checked
    replies: dict  # reducer index -> the reply bytes of the signed averages we took, part by part
    relayed: set = field(default_factory=set)  # (peer, reducer index) copies sent: each groupmate gets each once


class EvidenceBooks:
    """The signed copies of a few recent groups' spans, to check groupmates' evidence against and to relay to
    groupmates that lost them (either may be asked after our all-reduce has ended)."""

    def __init__(self) -> None:
        self._books: dict[bytes, _Book] = {}

    def keep(self, group_id: bytes, peers: Sequence[PeerID], declarations: Sequence[Any],
             copies: Mapping[int, tuple[bytes, bytes]], replies: Mapping[int, Sequence[bytes]]) -> None:
        while len(self._books) >= MAX_PENDING_GROUPS:
            self._books.pop(next(iter(self._books)))
        self._books[group_id] = _Book(tuple(peers), tuple(declarations), dict(copies), dict(replies))

    def relayed(self, sender: PeerID, request: averaging_pb2.AveragingData) -> list[averaging_pb2.AveragingData]:
        """Our signed copy of the span `sender` asks for (`copy_request`): its reply bytes part by part, then its
        reducer's signature; nothing where `sender` was not in that group, we took no signed average of it, or
        we sent it that copy already (asking again and again would make us upload spans for nothing)."""
        book = self._books.get(request.group_id)
        buffer = request.tensor_part.buffer
        index = int.from_bytes(buffer, "little") if len(buffer) == 2 else None
        if book is None or sender not in book.peers or index not in book.replies or (sender, index) in book.relayed:
            return []
        book.relayed.add((sender, index))
        parts = [averaging_pb2.AveragingData(tensor_part=runtime_pb2.Tensor(buffer=reply))
                 for reply in book.replies[index]]
        return [*parts, signature_message(book.copies[index][1])]

    def equivocators(self, sender: PeerID, message: averaging_pb2.AveragingData) -> list[Proof]:
        """Proofs against the reducers that `sender`'s evidence shows signed another digest of their span than
        the one they signed to us."""
        book = self._books.get(message.group_id)
        if book is None or sender not in book.peers:
            return []
        copies = read_evidence(message, len(book.peers))
        if copies is None:
            logger.info("ignoring malformed span evidence from %s", sender)
            return []
        proofs = []
        for index, (digest, signature) in copies.items():
            ours = book.copies.get(index)
            if ours is None or ours[0] == digest:
                continue
            proof = Proof(message.group_id, index, book.declarations[index], ours, (digest, signature))
            if proof.liar() == book.peers[index].to_base58():
                proofs.append(proof)
        return proofs
