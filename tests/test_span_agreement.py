"""Span agreement's rules on their own (the group behaviour is in tests/test_robust.py): digests, which disputes
count, and what a groupmate's message may hold."""

import asyncio

from hivemind.p2p import PeerID

from hivemind.proto import averaging_pb2, runtime_pb2
from hivemind.utils.crypto import RSAPrivateKey

from tscale_p2p.peers.records import owner_subkey, peer_id_of
from tscale_p2p.peers.span_agreement import (
    DIGEST_BYTES,
    MAX_PENDING_GROUPS,
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
    read_digests,
    recoverable_spans,
    span_digest,
    took_another,
    verify_span,
)

PEERS = [PeerID(bytes([i]) * 34) for i in range(4)]


def vector(*labels: int) -> list[bytes]:
    """A digest vector: 0 is no average, -1 refused, any other label the digest of that byte."""
    return [NO_AVERAGE if label == 0 else REFUSED if label == -1 else span_digest([bytes([label])]) for label in labels]


def test_a_digest_depends_on_the_bytes_and_on_where_parts_split():
    assert span_digest([b"ab", b"c"]) != span_digest([b"a", b"bc"])
    assert span_digest([b"ab"]) == span_digest([b"ab"]) != span_digest([b"ac"])
    assert len(span_digest([])) == DIGEST_BYTES and span_digest([]) != NO_AVERAGE


def test_a_span_is_dropped_when_a_groupmate_differs_on_it_alone():
    mine = vector(1, 2, 3, 4)
    assert disputed_spans(mine, {PEERS[1]: vector(1, 2, 3, 4)}) == set()
    assert disputed_spans(mine, {PEERS[1]: vector(1, 0, 3, 4), PEERS[2]: vector(1, 2, 3, 4)}) == {1}
    assert disputed_spans(mine, {PEERS[1]: vector(1, 0, 3, 4), PEERS[2]: vector(1, 2, 9, 4)}) == {1, 2}


def test_only_another_average_or_a_refused_one_speaks_against_a_reducer():
    ours, other, lost, refused = vector(1, 2, 0, -1)
    assert took_another(ours, other) and took_another(ours, refused)
    assert not took_another(ours, ours) and not took_another(ours, lost)


def test_a_signed_span_some_lost_is_kept_when_every_groupmate_that_took_it_got_the_same_bytes():
    """Lost (0) or refused (-1) by some, one digest among the groupmates other than its reducer that took it,
    signed: kept, and fetched by the rest. Two different digests, nobody missing it, no signature, or nobody but
    its reducer holding it: not recoverable (dropped by all)."""
    signed = [True] * 4

    def recoverable(*vectors):
        return recoverable_spans(PEERS, dict(zip(PEERS, vectors)), signed)

    mine = vector(1, 2, 3, 4)
    assert recoverable(mine, vector(1, 2, -1, 4), vector(1, 2, 3, 4)) == {2: span_digest([bytes([3])])}
    assert recoverable(vector(1, 0, 3, 4), vector(1, 2, 3, 4), vector(1, 2, 3, 4)) == {1: span_digest([bytes([2])])}
    assert recoverable_spans(PEERS, {PEERS[0]: mine, PEERS[1]: vector(1, 2, -1, 4), PEERS[3]: vector(1, 2, 9, 4)},
                             signed) == {}
    assert recoverable(mine, vector(1, 2, 3, 4)) == {}
    assert recoverable_spans(PEERS, dict(zip(PEERS, [mine, vector(1, 2, -1, 4)])), [True, True, False, True]) == {}
    assert recoverable(vector(1, 2, 0, 4), vector(1, 2, -1, 4)) == {}  # nobody took it
    # its reducer's word alone: peer 1 claims it took its own span, which we lost
    assert recoverable(vector(1, 0, 3, 4), vector(1, 2, 3, 4)) == {}
    # a two-faced reducer (peer 3) claiming another digest than the one groupmate it told the truth got
    assert recoverable(vector(1, 2, 3, 4), vector(1, 2, 3, -1), vector(1, 2, 3, 4), vector(1, 2, 3, 9)) == {
        3: span_digest([bytes([4])])}


def test_a_signed_copy_is_relayed_only_to_a_groupmate_and_only_where_we_took_it():
    key, reducer = signer()
    truth = span_digest([b"part 1", b"part 2"])
    signature = key.sign(b"g", 2, truth)
    books = EvidenceBooks()
    books.keep(b"g", [PEERS[0], PEERS[1], reducer], [None, None, key.declaration], {2: (truth, signature)},
               {2: [b"part 1", b"part 2"]})
    relayed = books.relayed(PEERS[1], copy_request(b"g", 2))
    assert [m.tensor_part.buffer for m in relayed] == [b"part 1", b"part 2", signature]
    assert books.relayed(PEERS[1], copy_request(b"g", 2)) == []  # once: asking again uploads nothing more
    assert len(books.relayed(PEERS[0], copy_request(b"g", 2))) == 3
    assert books.relayed(PEERS[3], copy_request(b"g", 2)) == []  # not in the group
    assert books.relayed(PEERS[1], copy_request(b"g", 1)) == []  # not a span we hold
    assert books.relayed(PEERS[1], copy_request(b"other", 2)) == []
    garbage = averaging_pb2.AveragingData(group_id=b"g", tensor_part=runtime_pb2.Tensor(buffer=b"\x02\x00\x00"))
    assert books.relayed(PEERS[1], garbage) == []


def test_a_groupmate_differing_on_several_spans_is_not_believed():
    theirs = {PEERS[3]: vector(0, 0, 0, 0), PEERS[1]: vector(1, 2, 0, 0), PEERS[2]: vector(1, 2, 3, -1)}
    assert believed(vector(1, 2, 3, 4), theirs) == {PEERS[2]: vector(1, 2, 3, -1)}


def test_spans_neither_peer_took_are_no_difference_between_their_digests():
    """Lost by one and refused by the other: neither took it, so it does not count against believing a groupmate
    (a short first round refusing two spans, one of which its groupmate refused too)."""
    assert believed(vector(1, 0, 3, 0), {PEERS[1]: vector(1, 2, 3, -1)}) == {PEERS[1]: vector(1, 2, 3, -1)}
    assert believed(vector(1, 2, 3, -1), {PEERS[1]: vector(1, 0, 3, 0)}) == {PEERS[1]: vector(1, 0, 3, 0)}
    assert believed(vector(1, 0, 3, 0), {PEERS[1]: vector(1, 2, 3, 4)}) == {}  # two it took and we did not


def test_a_reducer_is_outvoted_when_most_of_its_other_groupmates_refused_what_we_took():
    mine = vector(1, 2, 3, 4)  # we are PEERS[0]; PEERS[3] reduced span 3
    two_refusals = {PEERS[1]: vector(1, 2, 3, -1), PEERS[2]: vector(1, 2, 3, -1), PEERS[3]: vector(1, 2, 3, 4)}
    assert outvoted_reducers(PEERS, PEERS[0], mine, two_refusals) == [3]
    other_bytes = {PEERS[1]: vector(1, 2, 3, 5), PEERS[2]: vector(1, 2, 3, 6)}
    assert outvoted_reducers(PEERS, PEERS[0], mine, other_bytes) == [3]
    one_refusal = {PEERS[1]: vector(1, 2, 3, -1), PEERS[2]: vector(1, 2, 3, 4)}  # a lone liar frames nobody
    assert outvoted_reducers(PEERS, PEERS[0], mine, one_refusal) == []
    timeouts = {PEERS[1]: vector(1, 2, 3, 0), PEERS[2]: vector(1, 2, 3, 0)}  # a slow reducer is no liar
    assert outvoted_reducers(PEERS, PEERS[0], mine, timeouts) == []
    tie = {PEERS[1]: vector(1, 2, -1)}  # a group of three: one against one is a tie
    assert outvoted_reducers(PEERS[:3], PEERS[0], vector(1, 2, 3), tie) == []


def test_only_one_digest_per_span_of_the_group_is_read():
    digests = vector(1, 2, 3)
    assert read_digests(digest_message(b"g", digests), 3) == digests
    assert read_digests(digest_message(b"g", digests), 4) is None  # another group size
    short = digest_message(b"g", digests)
    short.tensor_part.buffer = short.tensor_part.buffer[:-1]
    assert read_digests(short, 3) is None


def test_inboxes_keep_the_first_well_formed_vector_of_each_member_of_an_open_group():
    async def scenario():
        inboxes = DigestInboxes()
        inboxes.open(b"g", PEERS[:3])
        inboxes.deliver(PEERS[1], digest_message(b"g", vector(1, 2, 3)))
        inboxes.deliver(PEERS[1], digest_message(b"g", vector(0, 0, 0)))  # a second vector does not count
        inboxes.deliver(PEERS[3], digest_message(b"g", vector(1, 2, 3)))  # not in the group
        inboxes.deliver(PEERS[2], digest_message(b"other", vector(1, 2, 3)))  # not a group of ours
        inboxes.deliver(PEERS[2], digest_message(b"g", vector(1, 2)))  # malformed
        received = await inboxes.wait(b"g", PEERS[1:3], timeout=0.2)  # PEERS[2] never sends a good one
        assert received == {PEERS[1]: vector(1, 2, 3)}
        for group in range(MAX_PENDING_GROUPS):  # the oldest inbox goes when too many are open
            inboxes.open(bytes([group]), PEERS[:3])
        inboxes.deliver(PEERS[2], digest_message(b"g", vector(1, 2, 3)))
        inboxes.deliver(PEERS[2], digest_message(bytes([1]), vector(1, 2, 3)))
        assert await inboxes.wait(bytes([1]), PEERS[2:3], timeout=5) == {PEERS[2]: vector(1, 2, 3)}

    asyncio.run(scenario())


def signer() -> tuple[SpanSigner, PeerID]:
    """A span signer and the peer id of the identity key that vouches for it."""
    identity = RSAPrivateKey()
    return SpanSigner.of(identity), PeerID.from_base58(peer_id_of(owner_subkey(identity)))


def test_a_declared_span_key_counts_only_when_its_peer_ids_key_vouches_for_it():
    (key, peer), (other, other_peer) = signer(), signer()
    assert bound_key(key.declaration, peer) is not None
    assert bound_key(list(key.declaration), peer) is not None  # as msgpack hands it over
    assert bound_key(key.declaration, other_peer) is None  # someone else's identity
    identity, _, vouch = key.declaration
    assert bound_key((identity, other.declaration[1], vouch), peer) is None  # a span key it did not vouch for
    for bad in (None, 7, b"x", (b"ssh-rsa garbage", b"", b""), (identity, b"short", vouch), [identity]):
        assert bound_key(bad, peer) is None


def test_a_span_signature_covers_the_group_the_reducer_and_the_digest():
    key, peer = signer()
    public, digest = bound_key(key.declaration, peer), span_digest([b"average"])
    signature = key.sign(b"group", 2, digest)
    assert verify_span(public, b"group", 2, digest, signature)
    assert not verify_span(public, b"other group", 2, digest, signature)
    assert not verify_span(public, b"group", 1, digest, signature)
    assert not verify_span(public, b"group", 2, span_digest([b"lie"]), signature)
    assert not verify_span(None, b"group", 2, digest, signature)
    assert not verify_span(public, b"group", 2, digest, b"")


def test_evidence_proves_a_reducer_that_signed_two_averages_and_frames_no_honest_one():
    """We took reducer 2's span (signed), a groupmate shows what 2 signed to it: another digest proves a lie; the
    same digest, a forged signature, or a groupmate outside the group prove nothing."""
    (key, liar), (forger_key, forger) = signer(), signer()
    peers = [PEERS[0], forger, liar]
    truth, lie = span_digest([b"truth"]), span_digest([b"lie"])
    books = EvidenceBooks()
    books.keep(b"g", peers, [None, forger_key.declaration, key.declaration], {2: (truth, key.sign(b"g", 2, truth))},
               {})
    proofs = books.equivocators(forger, evidence_message(b"g", {2: (lie, key.sign(b"g", 2, lie))}))
    assert [proof.liar() for proof in proofs] == [liar.to_base58()]
    assert Proof.read(proofs[0].message()).liar() == liar.to_base58()  # anyone can check it
    assert books.equivocators(forger, evidence_message(b"g", {2: (truth, key.sign(b"g", 2, truth))})) == []
    forged = forger_key.sign(b"g", 2, lie)  # a groupmate cannot sign for the reducer
    assert books.equivocators(forger, evidence_message(b"g", {2: (lie, forged)})) == []
    assert books.equivocators(forger, evidence_message(b"g", {2: (lie, key.sign(b"other", 2, lie))})) == []
    assert books.equivocators(PEERS[3], evidence_message(b"g", {2: (lie, key.sign(b"g", 2, lie))})) == []
    assert books.equivocators(forger, evidence_message(b"unknown", {2: (lie, key.sign(b"g", 2, lie))})) == []


def test_malformed_evidence_is_ignored():
    key, liar = signer()
    books = EvidenceBooks()
    truth = span_digest([b"truth"])
    books.keep(b"g", [PEERS[0], PEERS[1], liar], [None, None, key.declaration], {2: (truth, key.sign(b"g", 2, truth))},
               {})
    for buffer in (b"\xc1garbage", b"\x90", b"\x91\x93\x07\xa0\xa0", b"x" * 10**6):
        message = averaging_pb2.AveragingData(group_id=b"g", tensor_part=runtime_pb2.Tensor(buffer=buffer))
        assert books.equivocators(PEERS[1], message) == []


def test_a_proof_convicts_only_the_reducer_that_signed_both_digests():
    (key, liar), (other_key, other) = signer(), signer()
    truth, lie = span_digest([b"truth"]), span_digest([b"lie"])
    proof = Proof(b"g", 2, key.declaration, (truth, key.sign(b"g", 2, truth)), (lie, key.sign(b"g", 2, lie)))
    assert proof.liar() == liar.to_base58()
    framed = Proof(b"g", 2, other_key.declaration, proof.first, proof.second)  # someone else's key on its words
    forged = Proof(b"g", 2, key.declaration, proof.first, (lie, other_key.sign(b"g", 2, lie)))
    same = Proof(b"g", 2, key.declaration, proof.first, proof.first)
    moved = Proof(b"h", 2, key.declaration, proof.first, proof.second)  # signed for another group
    garbage = [Proof(b"g", 2**20, key.declaration, proof.first, proof.second), Proof(7, 2, (), (), ()),
               Proof(b"g", 2, (b"x", b"y", b"z"), proof.first, proof.second), Proof(b"g", 2, key.declaration, (1,), ())]
    for bad in (framed, forged, same, moved, *garbage):
        assert bad.liar() is None
    for buffer in (b"\xc1", b"\x95\x01", b"x" * 10**5):
        assert Proof.read(averaging_pb2.AveragingData(tensor_part=runtime_pb2.Tensor(buffer=buffer))) is None
