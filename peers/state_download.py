"""What a joiner downloads, and why it can trust it: signed state offers, the majority base, a checked download.

A peer that shares the swarm's state announces it in a signed DHT record (`StateOffer`: the outer round and the
fingerprint of its global weights, see peers/records.py), not in hivemind's unsigned priority list, where the
highest claimed priority won: one peer serving finite random weights "at round 1000000" was adopted by every
newcomer. A downloader (`download_checked_state`, run in the averager's process) now

1. takes the base (round, fingerprint) that most offers of this run announce, ties going to the lower round
   (a liar claims a high one), or the base the caller prefers when some peer offers it (a peer out of step with
   its group wants the group's base: offers are refreshed every few seconds, so right after a round one offer
   of the old base and one of the new tie, and the tie went to the old one, round after round), or, once the
   groupmates that declared that base offer a later one, the later base most of them offer (they applied the
   round before we asked: three peers on three different weights chased each other's stale offers so), and
   downloads only from peers that announce it, one after another, the most recently refreshed offer first (the
   likeliest to be still current); peers it has banned (peers/reputation.py) are neither counted nor asked,
   and when none of a base's peers answers (they left: an offer outlives its peer by up to OFFER_TTL_S), their
   offers stop counting and the base is taken again from the others;
2. refuses a tensor whose declared shape, dtype, encoding or size is not the run's before buffering it, so a
   peer cannot make it hold gigabytes; and
3. accepts a state only if its metadata is well-formed (`StateMetadata`: a "round" of "abc" no longer crashes
   the joiner), it is finite, its tokenizer is the run's, and the fingerprint of its weights recomputed here is
   that majority's. A refused state gets one warning naming the peer and why; the next peer is tried. A donor
   that applied a round while we downloaded sends that later round's state: it is taken once most offers
   announce it (its group re-announces right after the round), waited for up to OFFER_CATCH_UP_S; a resyncing
   peer that refused it stayed a round behind its group.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any, Collection, Sequence

import pydantic
import torch
from hivemind import DHT
from hivemind.compression import deserialize_torch_tensor
from hivemind.p2p import PeerID
from hivemind.proto import averaging_pb2, runtime_pb2
from hivemind.utils.asyncio import aiter_with_timeout
from hivemind.utils.streaming import combine_from_streaming

from tscale_p2p.errors import UserError
from tscale_p2p.peers.records import ProtectedKey, RecordModel, protect, read_signed, store_signed
from tscale_p2p.peers.swarm_state import FINGERPRINT, STATE_FORMAT, StateMetadata, fingerprint
from tscale_p2p.tokenizer import from_wire

log = logging.getLogger(__name__)

OFFER_TTL_S = 60.0  # re-announced every few seconds while a peer shares its state
MAX_METADATA_BYTES = 64 * 2**20  # the metadata carries a BPE tokenizer.json, packed
OFFER_CATCH_UP_S = 5.0  # how long a state a round later than the offers waits for most offers to announce it


class StateOffer(RecordModel):
    """A peer's announcement that it shares the state of `round`, whose global weights have fingerprint `weights`."""

    run_hash: str = pydantic.Field(pattern=r"^[0-9a-f]{64}$")
    round: int = pydantic.Field(ge=0, lt=2**40)
    weights: str = pydantic.Field(pattern=FINGERPRINT)


def state_offer_record(run_id: str) -> ProtectedKey:
    return ProtectedKey(f"{run_id}_state", StateOffer, max_ttl_s=OFFER_TTL_S, max_bytes=512)


def announce_state(dht: DHT, run_id: str, run_hash: str, round_number: int, weights: str, wait: bool = True) -> bool:
    """Offer this peer's state (of `round_number`, fingerprint `weights`) to downloaders for OFFER_TTL_S seconds."""
    record = state_offer_record(run_id)
    protect(dht, record)
    offer = StateOffer(run_hash=run_hash, round=round_number, weights=weights)
    return store_signed(dht, record, offer, OFFER_TTL_S, wait=wait)


def majority_base(offers: Sequence[StateOffer]) -> tuple[int, str] | None:
    """The (round, fingerprint) most offers announce; ties: the lower round, then the smaller fingerprint."""
    counts = Counter((offer.round, offer.weights) for offer in offers)
    if not counts:
        return None
    return min(counts, key=lambda base: (-counts[base], base[0], base[1]))


def successor_base(offers: Sequence[StateOffer], after_round: int) -> tuple[int, str] | None:
    """The base later than `after_round` that more than half of `offers` announce, or None."""
    later = majority_base([offer for offer in offers if offer.round > after_round])
    if later is None or 2 * sum((offer.round, offer.weights) == later for offer in offers) <= len(offers):
        return None
    return later


@dataclass(frozen=True)
class StateCheck:
    """What a downloaded state of run `run_id` must be: `shapes` of float32 tensors (the weights, then as many
    momentum buffers), metadata of this run config, and the run's BPE tokenizer when it has one."""

    run_id: str
    run_hash: str
    shapes: tuple[tuple[int, ...], ...]  # of the weights; the momentum buffers follow with the same shapes
    tokenizer: str | None = None  # the run's tokenizer id when it is a BPE ("bpe-<sha256>")

    @classmethod
    def of(cls, run_id: str, run, weights: Sequence[torch.Tensor]) -> "StateCheck":
        """The check for run config `run` (a RunConfig) whose global weights look like `weights`."""
        tokenizer = run.tokenizer if run.tokenizer.startswith("bpe-") else None
        return cls(run_id, run.hash, tuple(tuple(w.shape) for w in weights), tokenizer)

    @property
    def tensor_shapes(self) -> tuple[tuple[int, ...], ...]:
        return self.shapes * 2

    def header_problem(self, index: int, part: runtime_pb2.Tensor) -> str | None:
        """Why the first part of tensor `index` declares something else than the run's, or None."""
        if index >= len(self.tensor_shapes):
            return f"it sends more than {len(self.tensor_shapes)} tensors"
        shape = self.tensor_shapes[index]
        if tuple(part.size) != shape or part.dtype != "float32":
            return f"tensor {index} is declared {part.dtype} {tuple(part.size)}, not float32 {shape}"
        if part.compression != runtime_pb2.CompressionType.NONE:
            return f"tensor {index} is compressed ({runtime_pb2.CompressionType.Name(part.compression)})"
        return None

    def tensor_bytes(self, index: int) -> int:
        numel = 1
        for size in self.tensor_shapes[index]:
            numel *= size
        return 4 * numel

    def problem(self, metadata: Any, tensors: Sequence[torch.Tensor]) -> str | None:
        """Why a (metadata, tensors) state is not one to adopt, or None: malformed metadata, another run config,
        tensors of the wrong shapes or dtype, non-finite values, weights whose fingerprint is not the one declared,
        or a tokenizer that is not the run's."""
        try:
            meta = StateMetadata.model_validate(metadata)
        except pydantic.ValidationError as error:
            return f"malformed metadata ({_first_error(error)})"
        if meta.format != STATE_FORMAT:
            return f"unknown state format {meta.format}"
        if meta.run_hash != self.run_hash:
            return "it belongs to another run config"
        shapes = self.tensor_shapes
        if len(tensors) != len(shapes) or any(tuple(t.shape) != s for t, s in zip(tensors, shapes)):
            return f"{len(tensors)} tensors that do not fit the model"
        if any(t.dtype != torch.float32 for t in tensors):
            return "tensors that are not float32"
        if not all(bool(torch.isfinite(t).all()) for t in tensors):
            return "it has non-finite values"
        actual = fingerprint(tensors[: len(self.shapes)])
        if actual != meta.weights:
            return f"its weights have fingerprint {actual}, not the {meta.weights} it declares"
        if self.tokenizer is not None:
            if meta.tokenizer is None:
                return "it comes without the run's tokenizer"
            try:
                from_wire(meta.tokenizer, self.tokenizer, "the peer")
            except UserError as error:
                return str(error)
        return None


def _first_error(error: pydantic.ValidationError) -> str:
    first = error.errors()[0]
    return f"{'.'.join(map(str, first['loc'])) or 'value'}: {first['msg']}"


class _Refused(Exception):
    """A donor's stream declared something a downloader must not buffer."""


class _NoState(Exception):
    """A donor's stream ended before any state: it no longer shares one (hivemind's handler sends nothing then,
    and a peer that left answers so while its daemon lives), which counts as not answering."""


async def download_checked_state(
    averager, check: StateCheck, prefer: tuple[int, str] | None = None, prefer_donors: Collection[str] = ()
) -> tuple[dict, list[torch.Tensor]] | None:
    """Download the state most peers of the run offer (or `prefer`, a (round, fingerprint), if some peer offers
    it, else the later base most of `prefer_donors`, the peers that declared it, offer), from one of them,
    checked (see the module's docstring); None if no peer sends an acceptable one. Runs in the averager's
    process: `averager` is a SwarmAverager (its DHT, p2p and RPC stub)."""
    gone: set[str] = set()  # donors that did not answer: their offers no longer count
    while True:
        offers = {peer: entry.value for peer, entry in _offers(averager, check).items() if peer not in gone}
        offered = {(offer.round, offer.weights) for offer in offers.values()}
        base = prefer if prefer in offered else None
        if base is None and prefer is not None:
            base = successor_base([offer for peer, offer in offers.items() if peer in prefer_donors], prefer[0])
        if base is None:
            base = majority_base(list(offers.values()))
        if base is None:
            log.info("no peer offers the swarm's state")
            return None
        state = await _download_base(averager, check, offers, base, gone)
        if state is not None or not all(peer in gone for peer, offer in offers.items()
                                        if (offer.round, offer.weights) == base):
            return state
        # Every peer offering that base is gone (an offer outlives its peer by up to OFFER_TTL_S): in a tie with
        # a live peer's offer, a departed one's lower round kept joiners from the live state until it expired.
        log.info("no peer offering round %d answered; counting the offers of the others", base[0])


async def _download_base(
    averager, check: StateCheck, offers: dict, base: tuple[int, str], gone: set[str]
) -> tuple[dict, list[torch.Tensor]] | None:
    """The state of `base` from the first of its donors that sends an acceptable one; adds to `gone` those that
    do not answer at all."""
    donors = [peer for peer, offer in offers.items() if (offer.round, offer.weights) == base]  # freshest first
    others = len(offers) - len(donors)
    log.info("%d of %d peers offer the state of round %d, weights %s%s", len(donors), len(offers), *base,
             f" ({others} offer another one: not downloaded)" if others else "")
    timeout = averager.next_chunk_timeout or averager.request_timeout
    for peer in donors:
        try:
            metadata, tensors = await _download_from(averager, peer, check, timeout)
        except _Refused as refused:
            log.warning("refusing the state of peer %s: %s; trying another peer", peer, refused)
            continue
        except Exception as error:  # unreachable, slow, gone, or no longer sharing: the next one
            log.info("could not download the state of peer %s: %r", peer, error)
            gone.add(peer)
            continue
        problem = check.problem(metadata, tensors)
        if problem is None and (metadata["round"], metadata["weights"]) != base:
            got = (metadata["round"], metadata["weights"])
            # The swarm may have moved on a round while we downloaded: taken once most offers announce it.
            if not (got[0] > base[0] and await _offers_catch_up(averager, check, gone, got)):
                problem = (f"it is the state of round {got[0]}, weights {got[1]}, not the one most peers offer "
                           f"(round {base[0]}, weights {base[1]})")
        if problem is not None:
            log.warning("refusing the state of peer %s: %s; trying another peer", peer, problem)
            continue
        return {**metadata, "donor": peer}, tensors
    log.warning("no peer sent an acceptable state of round %d (asked %d)", base[0], len(donors))
    return None


async def _offers_catch_up(averager, check: StateCheck, gone: set[str], got: tuple[int, str]) -> bool:
    """Whether most offers (of peers not `gone`) announce `got` within OFFER_CATCH_UP_S."""
    deadline = time.monotonic() + OFFER_CATCH_UP_S
    while majority_base([entry.value for peer, entry in _offers(averager, check).items() if peer not in gone]) != got:
        if time.monotonic() >= deadline:
            return False
        await asyncio.sleep(0.25)
    return True


def _offers(averager, check: StateCheck) -> dict:
    """peer id -> its latest signed offer of this run's state (ours, and those of peers we banned, excluded)."""
    own, offers = str(averager.peer_id), {}
    for entry in read_signed(averager.dht, state_offer_record(check.run_id)):
        if entry.peer_id == own or entry.value.run_hash != check.run_hash:
            continue
        if averager._is_banned(PeerID.from_base58(entry.peer_id)):  # noqa: SLF001 - see peers/reputation.py
            continue
        offers.setdefault(entry.peer_id, entry)
    return offers


async def _download_from(averager, peer: str, check: StateCheck, timeout: float | None):
    """(metadata, tensors) streamed from `peer`, each tensor's header checked before its data is buffered."""
    stub = averager.get_stub(averager.p2p, PeerID.from_base58(peer), namespace=averager.prefix)
    stream = await stub.rpc_download_state(averaging_pb2.DownloadRequest())
    metadata, tensors, parts, buffered = None, [], [], 0
    try:
        async for message in aiter_with_timeout(stream, timeout=timeout):
            if message.metadata:
                if metadata is not None or len(message.metadata) > MAX_METADATA_BYTES:
                    raise _Refused("it sends oversized or repeated metadata")
                metadata = averager.serializer.loads(message.metadata)
            part = message.tensor_part
            if part.dtype:  # the first part of the next tensor
                if parts:
                    tensors.append(deserialize_torch_tensor(combine_from_streaming(parts)))
                    parts, buffered = [], 0
                problem = check.header_problem(len(tensors), part)
                if problem is not None:
                    raise _Refused(problem)
            elif not parts:
                raise _Refused("it sends tensor data before a tensor's header")
            buffered += len(part.buffer)
            if buffered > check.tensor_bytes(len(tensors)):
                raise _Refused(f"tensor {len(tensors)} holds more bytes than it declared")
            parts.append(part)
        if parts:
            tensors.append(deserialize_torch_tensor(combine_from_streaming(parts)))
    finally:
        close = getattr(stream, "aclose", None)
        if close is not None:  # a refused donor's stream is dropped, not read to its end
            try:
                await close()
            except Exception as error:  # the stream is broken already
                log.debug("closing the state stream of %s: %r", peer, error)
    if metadata is None:
        raise _NoState("it sent no state")
    return metadata, tensors
