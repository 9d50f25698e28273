"""The swarm's codecs, as hivemind compressions: `OneBitCodec` (`--codec sign`) sends one sign bit per value plus
one bf16 scale per block; `E8Codec` (`--codec e8`) sends, in the same bytes, one of 256 directions per 8 values;
`E8StagesCodec` answers `--codec e8s`'s reductions in up to three stages of those a block, where the error is;
`TopKCodec` (`--codec topk`) sends the largest values of each chunk (their docstrings).

Wire format of one tensor (a `runtime_pb2.Tensor` whose `compression` is `ONEBIT_COMPRESSION_TYPE`):
``buffer = block_size (uint32, little-endian) | scales (bf16, one per block) | signs (8 per byte)``,
`size` is the shape and `dtype` the original dtype. With the default 256-value blocks that is
1 + 16/256 = 1.0625 bits per value (block size chosen by measurement: benchmarks/RESULTS.md).

hivemind 1.1.12 has no 1-bit codec and its `CompressionType` enum has no value for ours, so
`register_swarm_codecs()` teaches hivemind's serializer the extra values (peers/hivemind_seam.py). Importing this
module registers them, so every process that unpickles a `SwarmAverager` (or forks after importing it) can decode
them.

A codec is stateless. Error feedback needs memory across rounds, and the codec runs inside the
averager's child process, so the residuals live in `SwarmAverager` (peers/averaging.py).
"""

from __future__ import annotations

import functools
import hashlib
import itertools
from dataclasses import dataclass
from typing import NamedTuple, Optional

import numpy as np
import torch
from hivemind.compression.base import CompressionBase, CompressionInfo
from hivemind.proto import runtime_pb2

from tscale_p2p.kernels.onebit import error_feedback_pack, pack, packed_sizes, unpack
from tscale_p2p.peers.hivemind_seam import register_compression_type

ONEBIT_COMPRESSION_TYPE = 64  # far above hivemind's own values (0-5), so a future release is unlikely to clash
ONEBIT_COMPRESSION_NAME = "ONEBIT_SIGN"
BLOCK_SIZE = 256
_HEADER = np.dtype("<u4")
_DECODABLE_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


class MalformedTensorError(ValueError):
    """A received 1-bit tensor whose bytes do not describe a finite tensor of its stated shape."""


class OneBitCodec(CompressionBase):
    """Sign bits packed 8 per byte plus a bf16 mean-|x| scale per `block_size` values (see module docstring)."""

    compression_type = ONEBIT_COMPRESSION_TYPE
    # A reducer averages its own part of its span uncoded (it never travels): a decoded part of this dense code
    # covers every value and keeps ~0.8 of its length, so an exact one stands beside it as one more honest part.
    own_part_exact = True

    def __init__(self, block_size: int = BLOCK_SIZE):
        if block_size < 8 or block_size & (block_size - 1) or block_size >= 2**31:
            raise ValueError(f"block_size must be a power of two >= 8, got {block_size}")
        self.block_size = block_size

    @property
    def unit(self) -> int:
        """Values a message's scale covers: hivemind's parts must hold whole units (`SwarmAverager`)."""
        return self.block_size

    @property
    def return_trip(self) -> "OneBitCodec":
        """The codec of a reducer's answer: the same."""
        return self

    def carried(self, tensor: torch.Tensor, residual: Optional[torch.Tensor] = None) -> torch.Tensor:
        """What one message carries of `tensor` (+ `residual`, flat fp32, which then keeps what did not fit)."""
        if residual is None:
            signs, scales = pack(tensor.detach(), self.block_size)
        else:
            signs, scales = error_feedback_pack(tensor.detach(), residual, self.block_size)
        return unpack(signs, scales, tensor.numel(), self.block_size).view(tensor.shape)

    def compress(self, tensor: torch.Tensor, info: CompressionInfo, allow_inplace: bool = False) -> runtime_pb2.Tensor:
        _check_dtype(self, tensor)
        payload, scales = self._encode(tensor.detach())
        buffer = b"".join((
            np.asarray(self.block_size, dtype=_HEADER).tobytes(),
            scales.cpu().view(torch.int16).numpy().tobytes(),
            payload.cpu().numpy().tobytes(),
        ))
        return _message(self, buffer, tensor)

    def _encode(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(payload bytes as uint8, one bf16 scale per block) of the flattened `x`: here its sign bits."""
        return pack(x, self.block_size)

    def _decode(self, payload: torch.Tensor, scales: torch.Tensor, numel: int) -> torch.Tensor:
        """The flat fp32 vector that `_encode` describes."""
        return unpack(payload, scales, numel, self.block_size)

    def check_settings(self, serialized_tensor: runtime_pb2.Tensor) -> None:
        """Refuse a message packed with another block size than this codec's."""
        buffer = serialized_tensor.buffer
        if len(buffer) < _HEADER.itemsize or int(np.frombuffer(buffer, dtype=_HEADER, count=1)[0]) != self.block_size:
            raise MalformedTensorError(f"not packed in blocks of {self.block_size}")

    def extract(self, serialized_tensor: runtime_pb2.Tensor) -> torch.Tensor:
        """Decode, refusing anything that is not exactly what `compress` writes (bytes come from other peers)."""
        buffer, shape = serialized_tensor.buffer, torch.Size(serialized_tensor.size)
        dtype = _DECODABLE_DTYPES.get(serialized_tensor.dtype)
        if dtype is None:
            raise MalformedTensorError(f"unsupported dtype {serialized_tensor.dtype!r}")
        if len(buffer) < _HEADER.itemsize:
            raise MalformedTensorError("buffer shorter than its header")
        block_size = int(np.frombuffer(buffer, dtype=_HEADER, count=1)[0])
        if block_size < 8 or block_size & (block_size - 1):
            raise MalformedTensorError(f"block size {block_size} is not a power of two >= 8")
        numel = shape.numel()
        n_bytes, n_blocks = packed_sizes(numel, block_size)
        if len(buffer) != _HEADER.itemsize + 2 * n_blocks + n_bytes:
            raise MalformedTensorError(f"{len(buffer)} bytes do not match shape {tuple(shape)}")
        raw_scales = np.frombuffer(buffer, dtype=np.int16, count=n_blocks, offset=_HEADER.itemsize)
        scales = torch.from_numpy(raw_scales.copy()).view(torch.bfloat16)
        if not bool(torch.isfinite(scales).all()) or bool((scales < 0).any()):
            raise MalformedTensorError("scales must be finite and non-negative")
        payload = torch.from_numpy(np.frombuffer(buffer, dtype=np.uint8, offset=_HEADER.itemsize + 2 * n_blocks).copy())
        values = type(self)(block_size)._decode(payload, scales, numel).to(dtype).reshape(shape)
        return values.requires_grad_(serialized_tensor.requires_grad)

    def norm(self, serialized_tensor: runtime_pb2.Tensor) -> float:
        """L2 norm of the tensor a well-formed message encodes, from its scales alone (no decoding)."""
        buffer = serialized_tensor.buffer
        block_size = int(np.frombuffer(buffer, dtype=_HEADER, count=1)[0])
        numel = torch.Size(serialized_tensor.size).numel()
        _, n_blocks = packed_sizes(numel, block_size)
        raw_scales = np.frombuffer(buffer, dtype=np.int16, count=n_blocks, offset=_HEADER.itemsize)
        scales = torch.from_numpy(raw_scales.copy()).view(torch.bfloat16).float()
        counts = torch.full((n_blocks,), float(block_size))
        if n_blocks:
            counts[-1] = numel - (n_blocks - 1) * block_size
        return float((scales.square() * counts).sum().sqrt())

    def estimate_compression_ratio(self, info: CompressionInfo) -> float:
        # Exactly one bit per value (scales left out on purpose): hivemind splits tensors into parts of
        # part_size_bytes / (itemsize * ratio) values, and this keeps every part a whole number of blocks, so
        # blocks of a pre-packed tensor line up with the blocks of its parts.
        return 1.0 / (torch.finfo(info.descriptor.dtype).bits)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(block_size={self.block_size})"


# ---- E8 words ----

E8_COMPRESSION_TYPE = 66
E8_COMPRESSION_NAME = "E8_WORDS"
_WORD = 8  # values per word
_SLICE_VALUES = 2**17  # values coded at a time: temporaries of a few MiB, few enough calls that their overhead is small


class E8Codec(OneBitCodec):
    """One byte per 8 values: which of 256 unit directions (`_E8_WORDS`) is closest to them, after a fixed
    random rotation of each block, plus the sign code's bf16 scale per block (so it has `OneBitCodec`'s bytes
    exactly: 1.0625 bits per value at 256-value blocks, and its header, scales and norm).

    Why: a sign and a scale per value lose sqrt(1 - 2/pi) ~ 0.6 of a Gaussian vector's length, and no better
    scalar code exists at one bit; coding 8 values together does better at the same bit (a vector code), here
    0.57 of the length (0.62 for the sign code on the swarm's own updates, where the rotation also evens out
    their heavy tails). The 256 words are the 240 shortest vectors of the E8 lattice (the best-spread 240
    directions in 8 dimensions) and the 16 axes. A word is picked by the largest inner product, so the pick does
    not depend on the scale: encoding what `_decode` returns picks the same words and scale again (the books of
    error feedback assume a message decodes to what its sender computed). The rotation is a Walsh-Hadamard
    transform by butterflies (additions only) after fixed signs, so every peer decodes the same bits whatever
    its hardware. A tensor's last block, if short, is sign-coded.

    Wire format: ``block_size (uint32) | scales (bf16, one per block) | words (one byte per 8 values of each
    full block) | signs (of a short last block, 8 per byte)``; a scale is the rms of its block's decoded values.
    """

    compression_type = E8_COMPRESSION_TYPE

    def carried(self, tensor: torch.Tensor, residual: Optional[torch.Tensor] = None) -> torch.Tensor:
        return _carried(lambda flat: self._decode(*self._encode(flat), flat.numel()), tensor, residual)

    def _encode(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        flat, block = x.reshape(-1).float(), self.block_size
        full = flat.numel() // block
        words = torch.empty(full * block // _WORD, dtype=torch.uint8, device=flat.device)
        fit = torch.empty(full * block // _WORD, device=flat.device)
        signs = _rotation_signs(block, flat.device)
        for first, last in self._slices(full):  # a slice at a time: its temporaries stay in cache
            rotated = walsh_hadamard(flat[first * block : last * block].view(-1, block) * signs)
            best, index = _nearest_words(rotated.view(-1, _WORD))
            fit[first * block // _WORD : last * block // _WORD] = best
            words[first * block // _WORD : last * block // _WORD] = index
        # The least-squares gain of a block's unit words (their mean fit), stored as the rms of its values.
        scales = (fit.view(full, block // _WORD).mean(dim=1) * _WORD**-0.5).to(torch.bfloat16)
        tail = flat[full * block :]
        if not tail.numel():  # nothing for the sign code (whose GPU kernel wants at least one value)
            return words, scales
        tail_signs, tail_scale = pack(tail, block)
        return torch.cat([words, tail_signs]), torch.cat([scales, tail_scale])

    def _decode(self, payload: torch.Tensor, scales: torch.Tensor, numel: int) -> torch.Tensor:
        block = self.block_size
        full, device = numel // block, payload.device
        values = torch.empty(numel, device=device)
        gains = scales[:full].float() * _WORD**0.5
        signs, table = _rotation_signs(block, device), _E8_WORDS.to(device)
        for first, last in self._slices(full):
            picked = table[payload[first * block // _WORD : last * block // _WORD].long()].view(last - first, -1)
            values[first * block : last * block] = (walsh_hadamard(gains[first:last, None] * picked) * signs).view(-1)
        tail = numel - full * block
        if tail:
            values[full * block :] = unpack(payload[full * block // _WORD :], scales[full:], tail, block)
        return values

    def _slices(self, blocks: int) -> list[tuple[int, int]]:
        """(first, last) block of each slice of about _SLICE_VALUES values."""
        step = max(1, _SLICE_VALUES // self.block_size)
        return [(first, min(first + step, blocks)) for first in range(0, blocks, step)]


# ---- E8 words in stages, where the error is ----

E8_STAGES_COMPRESSION_TYPE = 67
E8_STAGES_COMPRESSION_NAME = "E8_STAGES"
MAX_STAGES = 3  # a block's stage count takes 2 bits
# A stage's claim is the error it cuts over its block's energy to this power: 0 would cut the most error (least
# squares) and starves quiet blocks, 1 gives every block one stage (E8 words). Measured in benchmarks/RESULTS.md.
STAGE_WEIGHTING = 0.5
_COUNTS_PER_BYTE = 4


class _Stage(NamedTuple):
    """One stage of E8 words for some blocks (in block order): their words and scales, what is left of each block
    after it, its squared sum, and the stage's claim (the error it cut, weighted)."""

    blocks: torch.Tensor
    words: torch.Tensor
    scales: torch.Tensor
    left: torch.Tensor
    error: torch.Tensor
    claims: torch.Tensor


class E8StagesCodec(OneBitCodec):
    """E8 words in up to `MAX_STAGES` stages a block, each coding what the ones before left, with as many stages
    in all as the tensor has full blocks (one a block on average), each given where the error it cuts, over its
    block's energy to the power `weighting`, is largest.

    Why: the return trip's error lands on every peer's weights alike and holds the code's cost, and a swarm's
    update is far from even across blocks (quiet tensors beside busy ones): one stage everywhere spends as many
    bits on a still block as on a busy one. Stages where they cut most leave 0.49-0.54 of an update's length
    against E8 words' 0.56. Given by the error they cut alone (least squares, `weighting` 0) they leave quiet
    blocks none, round after round, and a cold start ended 0.42 points behind E8 words; weighted by energy^-0.5,
    0.65 points ahead (every one of eight seeds), and level from a run in progress (benchmarks/RESULTS.md). A
    return-trip code only: coding a decoded message again need not pick the same stages, which the sender's
    error-feedback books assume (E8Codec), while a reducer encodes its answer once and keeps what it decodes to.

    Wire format: ``block_size (uint32) | stage counts (2 bits a full block, 4 a byte, the first block in the low
    bits) | scales (bf16: the first stage of each block that has one, in block order, then the second stages', the
    third's; then a short last block's) | words (one byte per 8 values, in the scales' order) | signs of a short
    last block (8 per byte)``: E8Codec's bytes plus 2 bits a block.
    """

    compression_type = E8_STAGES_COMPRESSION_TYPE

    def __init__(self, block_size: int = BLOCK_SIZE, weighting: float = STAGE_WEIGHTING):
        super().__init__(block_size)
        self._stage, self.weighting = E8Codec(block_size), weighting

    def _encode_stages(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(stage count of each full block, scales, payload bytes) of the flattened `x`."""
        flat, block = x.reshape(-1).float(), self.block_size
        full = flat.numel() // block
        body = flat[: full * block].view(full, block)
        energy = body.square().sum(dim=1)
        weight = energy.clamp_min(torch.finfo(torch.float32).tiny) ** -self.weighting
        stages = [self._stage_of(torch.arange(full, device=flat.device), body, energy, weight)]
        while len(stages) < MAX_STAGES and full:
            stages.append(self._next_stage(stages, full, weight))
        # The `full` stages with the largest claims: a block's count is how many of its stages made the cut (a
        # later stage that did without an earlier one stands for it; rare, and it only loses a little).
        picked = torch.cat([stage.claims for stage in stages]).topk(full, sorted=False).indices
        owners = torch.cat([stage.blocks for stage in stages])[picked]
        counts = torch.zeros(full, dtype=torch.long, device=flat.device).index_add_(0, owners, torch.ones_like(owners))
        sent = [counts[stage.blocks] > number for number, stage in enumerate(stages)]
        words = torch.cat([stage.words[mask].reshape(-1) for stage, mask in zip(stages, sent)])
        scales = torch.cat([stage.scales[mask] for stage, mask in zip(stages, sent)])
        tail = flat[full * block :]
        if tail.numel():
            tail_signs, tail_scale = pack(tail, block)
            words, scales = torch.cat([words, tail_signs]), torch.cat([scales, tail_scale])
        return counts, scales, words

    def _stage_of(self, blocks: torch.Tensor, left: torch.Tensor, error: torch.Tensor,
                  weight: torch.Tensor) -> _Stage:
        """One more stage of E8 words for `blocks`, whose rows of `left` (squared sums `error`) are still uncoded."""
        words, scales = self._stage._encode(left.reshape(-1))
        left = left - self._stage._decode(words, scales, left.numel()).view(left.shape)
        after = left.square().sum(dim=1)
        words = words.view(len(blocks), left.shape[1] // _WORD)
        return _Stage(blocks, words, scales, left, after, (error - after) * weight[blocks])

    def _next_stage(self, stages: list[_Stage], full: int, weight: torch.Tensor) -> _Stage:
        """The next stage of the blocks whose next stage could make the cut, coded in order of the most it could
        claim (all the error left, weighted), in batches that double, until that falls below the `full`-th largest
        claim so far, which the cut cannot be below. The same picks as coding it for every block at half the work on
        a swarm's updates, where one block in six or fewer takes a second stage and fewer still a third."""
        last = stages[-1]
        bound = last.error * weight[last.blocks]
        order = bound.argsort(descending=True)
        claims, parts, start, size = torch.cat([stage.claims for stage in stages]), [], 0, max(1, full // 16)
        while start < len(order):
            batch = order[start : start + size]
            batch = batch[bound[batch] >= claims.kthvalue(len(claims) - full + 1).values]
            if len(batch):
                parts.append(self._stage_of(last.blocks[batch], last.left[batch], last.error[batch], weight))
                claims = torch.cat([claims, parts[-1].claims])
            if len(batch) < size:  # the rest claim less still
                break
            start, size = start + size, 2 * size
        if not parts:
            return self._stage_of(last.blocks[:0], last.left[:0], last.error[:0], weight)
        merged = _Stage(*(torch.cat(field) for field in zip(*parts)))
        in_block_order = merged.blocks.argsort()
        return _Stage(*(field[in_block_order] for field in merged))

    def _decode_stages(self, counts: torch.Tensor, scales: torch.Tensor, payload: torch.Tensor,
                       numel: int) -> torch.Tensor:
        """The flat fp32 vector that `_encode_stages` describes."""
        block = self.block_size
        full = numel // block
        values = torch.zeros(numel, device=payload.device)
        body = values[: full * block].view(full, block)
        used = 0
        for stage in range(MAX_STAGES):
            blocks = (counts > stage).nonzero()[:, 0]
            words = payload[used * block // _WORD : (used + blocks.numel()) * block // _WORD]
            decoded = self._stage._decode(words, scales[used : used + blocks.numel()], blocks.numel() * block)
            body.index_add_(0, blocks, decoded.view(-1, block))
            used += blocks.numel()
        tail = numel - full * block
        if tail:
            values[full * block :] = unpack(payload[used * block // _WORD :], scales[used:], tail, block)
        return values

    def carried(self, tensor: torch.Tensor, residual: Optional[torch.Tensor] = None) -> torch.Tensor:
        return _carried(lambda flat: self._decode_stages(*self._encode_stages(flat), flat.numel()), tensor, residual)

    def compress(self, tensor: torch.Tensor, info: CompressionInfo, allow_inplace: bool = False) -> runtime_pb2.Tensor:
        _check_dtype(self, tensor)
        counts, scales, words = self._encode_stages(tensor.detach())
        buffer = b"".join((
            np.asarray(self.block_size, dtype=_HEADER).tobytes(),
            _pack_counts(counts).cpu().numpy().tobytes(),
            scales.cpu().view(torch.int16).numpy().tobytes(),
            words.cpu().numpy().tobytes(),
        ))
        return _message(self, buffer, tensor)

    def extract(self, serialized_tensor: runtime_pb2.Tensor) -> torch.Tensor:
        """Decode, refusing anything that is not exactly what `compress` writes (bytes come from other peers)."""
        dtype = _DECODABLE_DTYPES.get(serialized_tensor.dtype)
        if dtype is None:
            raise MalformedTensorError(f"unsupported dtype {serialized_tensor.dtype!r}")
        shape = torch.Size(serialized_tensor.size)
        values = self._decode_stages(*self._parse(serialized_tensor), shape.numel()).to(dtype).reshape(shape)
        return values.requires_grad_(serialized_tensor.requires_grad)

    def _parse(self, serialized: runtime_pb2.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(unpacked stage counts, scales, payload bytes) of a message, or MalformedTensorError."""
        self.check_settings(serialized)
        buffer, shape, block = serialized.buffer, tuple(serialized.size), self.block_size
        full, tail = divmod(torch.Size(shape).numel(), block)
        count_bytes = -(-full // _COUNTS_PER_BYTE)
        if len(buffer) < _HEADER.itemsize + count_bytes:
            raise MalformedTensorError(f"{len(buffer)} bytes do not match shape {shape}")
        raw_counts = torch.from_numpy(np.frombuffer(buffer, np.uint8, count_bytes, _HEADER.itemsize).copy())
        counts = _unpack_counts(raw_counts, full)
        if not torch.equal(_pack_counts(counts), raw_counts):
            raise MalformedTensorError("the stage counts' padding is not zero")
        stages = int(counts.sum())
        if stages > full:
            raise MalformedTensorError(f"{stages} stages for {full} blocks")
        n_scales, offset = stages + (tail > 0), _HEADER.itemsize + count_bytes
        if len(buffer) != offset + 2 * n_scales + stages * block // _WORD + -(-tail // 8):
            raise MalformedTensorError(f"{len(buffer)} bytes do not match shape {shape}")
        raw_scales = np.frombuffer(buffer, dtype=np.int16, count=n_scales, offset=offset)
        scales = torch.from_numpy(raw_scales.copy()).view(torch.bfloat16)
        if not bool(torch.isfinite(scales).all()) or bool((scales < 0).any()):
            raise MalformedTensorError("scales must be finite and non-negative")
        words = torch.from_numpy(np.frombuffer(buffer, dtype=np.uint8, offset=offset + 2 * n_scales).copy())
        return counts, scales, words

    def norm(self, serialized_tensor: runtime_pb2.Tensor) -> float:
        """L2 norm of the tensor a well-formed message encodes (stages overlap, so it takes decoding)."""
        return float(self.extract(serialized_tensor).norm())


class E8StagedReturnCodec(E8Codec):
    """`--codec e8s`: E8 words out (E8Codec), E8 words in stages back (E8StagesCodec), where one message reaches
    every groupmate and its error lands on every peer's weights alike. `stage_weighting`: the return trip's
    (E8StagesCodec's `weighting`; its encoder's choice alone, so peers need not agree on it)."""

    def __init__(self, block_size: int = BLOCK_SIZE, stage_weighting: float = STAGE_WEIGHTING):
        super().__init__(block_size)
        self.stage_weighting = stage_weighting

    @property
    def return_trip(self) -> E8StagesCodec:
        return E8StagesCodec(self.block_size, self.stage_weighting)


def _pack_counts(counts: torch.Tensor) -> torch.Tensor:
    """Stage counts (each < 4) packed 4 a byte, the first in the low bits."""
    padded = torch.zeros(-(-counts.numel() // _COUNTS_PER_BYTE) * _COUNTS_PER_BYTE, dtype=torch.long,
                         device=counts.device)
    padded[: counts.numel()] = counts
    shifts = 2 * torch.arange(_COUNTS_PER_BYTE, device=counts.device)
    return (padded.view(-1, _COUNTS_PER_BYTE) << shifts).sum(dim=1).to(torch.uint8)


def _unpack_counts(packed: torch.Tensor, count: int) -> torch.Tensor:
    shifts = 2 * torch.arange(_COUNTS_PER_BYTE, device=packed.device)
    return ((packed.long()[:, None] >> shifts) & 3).reshape(-1)[:count]


def _e8_words() -> torch.Tensor:
    """The 256 unit words of `E8Codec`, in a fixed order: the 112 E8 roots (+-1, +-1, 0, ...), the 128 with
    every coordinate +-1/2 and an even number of minus signs, then the 16 axes +-e_i."""
    words = []
    for i, j in itertools.combinations(range(_WORD), 2):
        for si, sj in itertools.product((1.0, -1.0), repeat=2):
            word = [0.0] * _WORD
            word[i], word[j] = si, sj
            words.append(word)
    for minus in range(2**_WORD):
        if bin(minus).count("1") % 2 == 0:
            words.append([-0.5 if minus >> k & 1 else 0.5 for k in range(_WORD)])
    for i in range(_WORD):
        for sign in (1.0, -1.0):
            words.append([sign * 2**0.5 if k == i else 0.0 for k in range(_WORD)])
    return (torch.tensor(words, dtype=torch.float64) / 2**0.5).float()  # every word had length sqrt(2)


def _pair_ranks() -> torch.Tensor:
    """Where the roots on coordinates {i, j} start in `_e8_words` (in fours, one per pair of signs), i, j < 8."""
    ranks = torch.zeros(_WORD, _WORD, dtype=torch.long)
    for rank, (i, j) in enumerate(itertools.combinations(range(_WORD), 2)):
        ranks[i, j] = ranks[j, i] = 4 * rank
    return ranks


_E8_WORDS = _e8_words()
_ROOTS, _HALVES = 112, 128  # the first 112 words are roots, the next 128 half vectors, the last 16 axes
_PAIR_RANK = _pair_ranks()
_BIT = 2 ** torch.arange(_WORD)


def _nearest_words(vectors: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(largest inner product, index in `_E8_WORDS`) of each row of `vectors` (rows of 8), from the words' shape
    rather than 256 inner products each (3-5x faster): the best root takes the two largest |v| with their signs,
    the best half vector every sign (flipping the smallest |v| where that leaves an odd count of minus signs),
    the best axis the largest |v|."""
    device = vectors.device
    magnitude, negative = vectors.abs(), (vectors < 0).long()
    first, i = magnitude.max(dim=1)
    second, j = magnitude.scatter(1, i[:, None], -1.0).max(dim=1)
    smallest, k = magnitude.min(dim=1)
    odd = negative.sum(dim=1) & 1
    minus = (negative * _BIT.to(device)).sum(dim=1) ^ (odd << k)
    i_negative, j_negative = negative.gather(1, i[:, None])[:, 0], negative.gather(1, j[:, None])[:, 0]
    signs = torch.where(i < j, 2 * i_negative + j_negative, 2 * j_negative + i_negative)
    root, half, axis = (first + second) * 0.5**0.5, (magnitude.sum(dim=1) - 2 * odd * smallest) * _WORD**-0.5, first
    best = torch.maximum(torch.maximum(root, half), axis)
    # A half vector's minus signs, as bits, have even parity: halving them ranks them among the 128 (minus >> 1).
    index = torch.where(best == root, _PAIR_RANK.to(device)[i, j] + signs,
                        torch.where(best == half, _ROOTS + (minus >> 1), _ROOTS + _HALVES + 2 * i + i_negative))
    return best, index


@functools.lru_cache(maxsize=None)
def _rotation_signs_cpu(block: int) -> torch.Tensor:
    bits = np.unpackbits(np.frombuffer(hashlib.shake_256(b"tscale-p2p e8 rotation").digest(block // 8), np.uint8))
    return torch.from_numpy(1.0 - 2.0 * bits.astype(np.float32))


def _rotation_signs(block: int, device: torch.device) -> torch.Tensor:
    """A fixed +-1 per position of a block, the same on every peer (from a hash, not a random generator)."""
    return _rotation_signs_cpu(block).to(device)


def walsh_hadamard(rows: torch.Tensor) -> torch.Tensor:
    """The orthonormal Walsh-Hadamard transform of each row (its length a power of two), its own inverse. By
    butterflies rather than a matrix product: sums in a fixed order give the same bits on every machine."""
    count, length = rows.shape
    values, half = rows, 1
    while half < length:
        pairs = values.reshape(count, length // (2 * half), 2, half)
        values = torch.stack((pairs[:, :, 0] + pairs[:, :, 1], pairs[:, :, 0] - pairs[:, :, 1]), dim=2)
        half *= 2
    return values.reshape(count, length) * length**-0.5


def _carried(round_trip, tensor: torch.Tensor, residual: Optional[torch.Tensor]) -> torch.Tensor:
    """`round_trip(flat fp32)` (what a message decodes to) of `tensor` + `residual`, which then keeps the rest:
    `carried` of the codecs whose encoding is not a fused error-feedback kernel."""
    flat = tensor.detach().reshape(-1).float()
    if residual is not None:
        flat = flat + residual
    values = round_trip(flat)
    if residual is not None:
        torch.sub(flat, values, out=residual)
    return values.view(tensor.shape)


def _check_dtype(codec: CompressionBase, tensor: torch.Tensor) -> None:
    if str(tensor.dtype).replace("torch.", "") not in _DECODABLE_DTYPES:
        raise ValueError(f"{type(codec).__name__} does not support {tensor.dtype} tensors")


def _message(codec: CompressionBase, buffer: bytes, like: torch.Tensor) -> runtime_pb2.Tensor:
    return runtime_pb2.Tensor(
        compression=codec.compression_type,
        buffer=buffer,
        size=like.shape,
        dtype=str(like.dtype).replace("torch.", ""),
        requires_grad=like.requires_grad,
    )


# ---- chunked top-k ----

TOPK_COMPRESSION_TYPE = 65
TOPK_COMPRESSION_NAME = "TOPK_CHUNKED"
CHUNK_SIZE = 4096  # values per chunk; an index within it takes 12 bits
TOPK_UP = 64  # values a sender keeps per chunk (1.56%)
TOPK_RETURN = 256  # values a reducer keeps per chunk of the reduced span: four senders' worth
TOPK_LEVELS = 4  # magnitude levels per chunk
_TOPK_HEADER = np.dtype("<u4")  # chunk, k, levels
_INDEX_BITS = 12


class TopKCodec(CompressionBase):
    """The `k` largest-magnitude values of every `chunk` values, sent as 12-bit indices, one sign bit each and
    `levels` bf16 magnitudes per chunk (the mean magnitude of each rank group: ranks 0..k/levels-1, ...).

    Wire format: ``chunk, k, levels (uint32 each) | magnitudes (bf16, levels per chunk) | indices (12 bits each,
    two per three bytes, chunk by chunk in descending magnitude) | signs (8 per byte)``. The indices are sent in
    rank order, so a value's magnitude level costs nothing: its position says it. At the defaults (k=64 of 4096, 4
    levels) that is (64 x 13 + 4 x 16) / 4096 = 0.22 bits per value; the return trip keeps `return_k` = 256
    (0.83 bits), enough for the union of four senders' picks. A short last chunk keeps ceil(k x its length /
    chunk) values. SparseLoCo (arXiv 2508.15706) sends top-k of 4096-value chunks with 2-bit values; ranking the
    indices instead leaves the value one bit.
    """

    compression_type = TOPK_COMPRESSION_TYPE
    own_part_exact = False  # a decoded part keeps a few values a chunk: an exact one would outweigh the others

    def __init__(self, k: int = TOPK_UP, return_k: int = TOPK_RETURN, levels: int = TOPK_LEVELS,
                 chunk: int = CHUNK_SIZE):
        if chunk < 8 or chunk & (chunk - 1) or chunk > 1 << _INDEX_BITS:
            raise ValueError(f"chunk must be a power of two in [8, {1 << _INDEX_BITS}], got {chunk}")
        for name, value in (("k", k), ("return_k", return_k)):
            if not 1 <= value <= chunk:
                raise ValueError(f"{name} must be in [1, chunk={chunk}], got {value}")
        if not 1 <= levels <= min(k, return_k):
            raise ValueError(f"levels must be in [1, {min(k, return_k)}], got {levels}")
        self.k, self.return_k, self.levels, self.chunk = k, return_k, levels, chunk

    @property
    def unit(self) -> int:
        return self.chunk

    @property
    def return_trip(self) -> "TopKCodec":
        return TopKCodec(self.return_k, self.return_k, self.levels, self.chunk)

    def carried(self, tensor: torch.Tensor, residual: Optional[torch.Tensor] = None) -> torch.Tensor:
        return _carried(lambda flat: _topk_dense(_topk_select(flat, self.chunk, self.k, self.levels), flat.numel(),
                                                 self.chunk), tensor, residual)

    def compress(self, tensor: torch.Tensor, info: CompressionInfo, allow_inplace: bool = False) -> runtime_pb2.Tensor:
        _check_dtype(self, tensor)
        picked = _topk_select(tensor.detach().reshape(-1).float().cpu(), self.chunk, self.k, self.levels)
        buffer = b"".join((
            np.asarray([self.chunk, self.k, self.levels], dtype=_TOPK_HEADER).tobytes(),
            picked.magnitudes.view(torch.int16).numpy().tobytes(),
            _pack_indices(picked.indices.numpy().astype(np.uint16)),
            np.packbits(picked.negative.numpy(), bitorder="little").tobytes(),
        ))
        return _message(self, buffer, tensor)

    def check_settings(self, serialized_tensor: runtime_pb2.Tensor) -> None:
        """Refuse a message packed with another chunk, k or levels than this codec's."""
        buffer = serialized_tensor.buffer
        header = tuple(int(v) for v in np.frombuffer(buffer[: 3 * _TOPK_HEADER.itemsize], dtype=_TOPK_HEADER))
        if header != (self.chunk, self.k, self.levels):
            raise MalformedTensorError(f"not packed as chunk {self.chunk}, k {self.k}, levels {self.levels}")

    def extract(self, serialized_tensor: runtime_pb2.Tensor) -> torch.Tensor:
        """Decode, refusing anything that is not exactly what `compress` writes (bytes come from other peers)."""
        picked, numel, dtype = self._parse(serialized_tensor)
        values = _topk_dense(picked, numel, picked.chunk).to(dtype).reshape(tuple(serialized_tensor.size))
        return values.requires_grad_(serialized_tensor.requires_grad)

    def norm(self, serialized_tensor: runtime_pb2.Tensor) -> float:
        """L2 norm of the tensor a well-formed message encodes, from its magnitudes (no decoding)."""
        picked, _, _ = self._parse(serialized_tensor, check_indices=False)
        return float(picked.level_values().square().sum().sqrt())

    def _parse(self, serialized: runtime_pb2.Tensor, check_indices: bool = True) -> tuple["_Picked", int, torch.dtype]:
        buffer, numel = serialized.buffer, torch.Size(serialized.size).numel()
        dtype = _DECODABLE_DTYPES.get(serialized.dtype)
        if dtype is None:
            raise MalformedTensorError(f"unsupported dtype {serialized.dtype!r}")
        header = _TOPK_HEADER.itemsize * 3
        if len(buffer) < header:
            raise MalformedTensorError("buffer shorter than its header")
        chunk, k, levels = (int(v) for v in np.frombuffer(buffer, dtype=_TOPK_HEADER, count=3))
        try:
            TopKCodec(k, k, levels, chunk)
        except ValueError as e:
            raise MalformedTensorError(str(e)) from None
        counts = _picks_per_chunk(numel, chunk, k)
        picks, n_chunks = int(counts.sum()), counts.numel()
        index_bytes = 3 * ((picks + 1) // 2)
        if len(buffer) != header + 2 * levels * n_chunks + index_bytes + (picks + 7) // 8:
            raise MalformedTensorError(f"{len(buffer)} bytes do not match shape {tuple(serialized.size)}")
        offset = header
        raw = np.frombuffer(buffer, dtype=np.int16, count=levels * n_chunks, offset=offset)
        magnitudes = torch.from_numpy(raw.copy()).view(torch.bfloat16).view(n_chunks, levels)
        if not bool(torch.isfinite(magnitudes).all()) or bool((magnitudes < 0).any()):
            raise MalformedTensorError("magnitudes must be finite and non-negative")
        offset += 2 * levels * n_chunks
        indices = _unpack_indices(buffer[offset : offset + index_bytes], picks)
        negative = np.unpackbits(np.frombuffer(buffer, dtype=np.uint8, offset=offset + index_bytes),
                                 count=picks, bitorder="little")
        picked = _Picked(torch.from_numpy(indices.astype(np.int64)), torch.from_numpy(negative.astype(bool)),
                         magnitudes, counts, chunk, levels)
        if check_indices:
            picked.check_indices(numel)
        return picked, numel, dtype

    def estimate_compression_ratio(self, info: CompressionInfo) -> float:
        # As OneBitCodec's: hivemind then cuts parts of 2^20 values (at its default part size), whole chunks.
        return 1.0 / (torch.finfo(info.descriptor.dtype).bits)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(k={self.k}, return_k={self.return_k}, levels={self.levels}, chunk={self.chunk})"


def _picks_per_chunk(numel: int, chunk: int, k: int) -> torch.Tensor:
    """Values kept in each chunk of a vector of `numel`: `k`, and for a short last chunk its share, at least 1."""
    full, tail = divmod(numel, chunk)
    counts = torch.full((full + (tail > 0),), k, dtype=torch.int64)
    if tail:
        counts[-1] = min(tail, max(1, -(-k * tail // chunk)))
    return counts


@dataclass(frozen=True)
class _Picked:
    """One vector's top-k picks: per pick (chunk by chunk, descending magnitude) its index in its chunk and sign;
    per chunk `levels` magnitudes (bf16), each the mean of one rank group's."""

    indices: torch.Tensor  # int64, within-chunk
    negative: torch.Tensor  # bool
    magnitudes: torch.Tensor  # bf16 (n_chunks, levels)
    counts: torch.Tensor  # int64 picks per chunk
    chunk: int
    levels: int

    def chunk_of_pick(self) -> torch.Tensor:
        return torch.repeat_interleave(torch.arange(self.counts.numel()), self.counts)

    def level_of_pick(self) -> torch.Tensor:
        """Each pick's rank group: rank r of a chunk keeping c values is in group r * levels // c."""
        starts = torch.cumsum(self.counts, 0) - self.counts
        chunk = self.chunk_of_pick()
        rank = torch.arange(self.indices.numel()) - starts[chunk]
        return rank * self.levels // self.counts[chunk]

    def level_values(self) -> torch.Tensor:
        """Each pick's magnitude (fp32)."""
        return self.magnitudes.float()[self.chunk_of_pick(), self.level_of_pick()]

    def check_indices(self, numel: int) -> None:
        chunk = self.chunk_of_pick()
        limit = torch.clamp(numel - chunk * self.chunk, max=self.chunk)  # the last chunk may be short
        if bool((self.indices >= limit).any()):
            raise MalformedTensorError("an index is outside its chunk")
        positions = chunk * self.chunk + self.indices
        if torch.unique(positions).numel() != positions.numel():
            raise MalformedTensorError("an index appears twice")


def _topk_select(flat: torch.Tensor, chunk: int, k: int, levels: int) -> _Picked:
    counts = _picks_per_chunk(flat.numel(), chunk, k)
    full = flat.numel() // chunk
    pieces = []
    if full:
        pieces.append(flat[: full * chunk].view(full, chunk))
    if counts.numel() > full:
        pieces.append(flat[full * chunk :].view(1, -1))
    indices, negative, magnitudes = [], [], []
    for piece, c in zip(pieces, (k, int(counts[-1])) if len(pieces) == 2 else (int(counts[0]),)):
        mags, idx = piece.abs().topk(c, dim=1, sorted=True)
        group = torch.arange(c) * levels // c
        sums = torch.zeros(piece.shape[0], levels).index_add_(1, group, mags)
        sizes = torch.bincount(group, minlength=levels).clamp(min=1)
        magnitudes.append((sums / sizes).to(torch.bfloat16))
        indices.append(idx.reshape(-1))
        negative.append(torch.gather(piece, 1, idx).reshape(-1) < 0)
    if not pieces:
        empty = torch.zeros(0, dtype=torch.int64)
        return _Picked(empty, empty.bool(), torch.zeros(0, levels, dtype=torch.bfloat16), counts, chunk, levels)
    return _Picked(torch.cat(indices), torch.cat(negative), torch.cat(magnitudes), counts, chunk, levels)


def _topk_dense(picked: _Picked, numel: int, chunk: int) -> torch.Tensor:
    values = torch.zeros(numel)
    signed = picked.level_values()
    signed[picked.negative] *= -1
    values[picked.chunk_of_pick() * chunk + picked.indices] = signed
    return values


def _pack_indices(indices: np.ndarray) -> bytes:
    """12-bit indices, two per three bytes (a zero pads an odd count)."""
    if indices.size % 2:
        indices = np.append(indices, np.uint16(0))
    a, b = indices[0::2], indices[1::2]
    packed = np.empty((a.size, 3), dtype=np.uint8)
    packed[:, 0] = a & 0xFF
    packed[:, 1] = (a >> 8) | ((b & 0xF) << 4)
    packed[:, 2] = b >> 4
    return packed.tobytes()


def _unpack_indices(raw: bytes, count: int) -> np.ndarray:
    triples = np.frombuffer(raw, dtype=np.uint8).reshape(-1, 3).astype(np.uint16)
    a = triples[:, 0] | ((triples[:, 1] & 0xF) << 8)
    b = (triples[:, 1] >> 4) | (triples[:, 2] << 4)
    indices = np.stack([a, b], axis=1).reshape(-1)
    if indices.size > count and indices[count]:
        raise MalformedTensorError("the padding index is not zero")
    return indices[:count]


# join --codec: name -> the codec, its defaults
CODECS = {"sign": OneBitCodec, "e8": E8Codec, "e8s": E8StagedReturnCodec, "topk": TopKCodec}
SwarmCodec = OneBitCodec | TopKCodec


def register_swarm_codecs() -> None:
    """Make hivemind's (de)serializer know the swarm's compression types. Idempotent; runs on import."""
    register_compression_type(ONEBIT_COMPRESSION_TYPE, ONEBIT_COMPRESSION_NAME, OneBitCodec())
    register_compression_type(E8_COMPRESSION_TYPE, E8_COMPRESSION_NAME, E8Codec())
    register_compression_type(E8_STAGES_COMPRESSION_TYPE, E8_STAGES_COMPRESSION_NAME, E8StagesCodec())
    register_compression_type(TOPK_COMPRESSION_TYPE, TOPK_COMPRESSION_NAME, TopKCodec())


register_swarm_codecs()
