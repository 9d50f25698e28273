"""Span agreement's rules on their own (the group behaviour is in tests/test_robust.py): digests, which disputes
count, and what a groupmate's message may hold."""

import asyncio

from hivemind.p2p import PeerID

from tscale_p2p.peers.span_agreement import (
    DIGEST_BYTES,
    MAX_PENDING_GROUPS,
    NO_AVERAGE,
    REFUSED,
    DigestInboxes,
    believed,
    digest_message,
    disputed_spans,
    outvoted_reducers,
    read_digests,
    span_digest,
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


def test_a_groupmate_differing_on_several_spans_is_not_believed():
    theirs = {PEERS[3]: vector(0, 0, 0, 0), PEERS[1]: vector(1, 2, 0, 0), PEERS[2]: vector(1, 2, 3, -1)}
    assert believed(vector(1, 2, 3, 4), theirs) == {PEERS[2]: vector(1, 2, 3, -1)}


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
