"""`OneBitCodec`: hivemind compression that sends one sign bit per value plus one bf16 scale per block.

Wire format of one tensor (a `runtime_pb2.Tensor` whose `compression` is `ONEBIT_COMPRESSION_TYPE`):
``buffer = block_size (uint32, little-endian) | scales (bf16, one per block) | signs (8 per byte)``,
`size` is the shape and `dtype` the original dtype. With the default 256-value blocks that is
1 + 16/256 = 1.0625 bits per value (block size chosen by measurement: benchmarks/RESULTS.md).

hivemind 1.1.12 has no 1-bit codec and its `CompressionType` enum cannot be extended without rebuilding it
(and its p2pd binary comes only in the PyPI wheel). An unknown enum value does survive the protobuf round
trip, so `register_onebit_codec()` teaches hivemind's serializer the extra value instead. Importing this module
registers it, so every process that unpickles a `SwarmAverager` (or forks after importing it) can decode it.

The codec itself is stateless. Error feedback needs memory across rounds, and the codec runs inside the
averager's child process, so the residuals live in `SwarmAverager` (peers/averaging.py).
"""

from __future__ import annotations

import numpy as np
import torch
from hivemind.compression import serialization
from hivemind.compression.base import CompressionBase, CompressionInfo
from hivemind.proto import runtime_pb2

from tscale_p2p.kernels.onebit import error_feedback_pack, pack, packed_sizes, unpack

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

    def __init__(self, block_size: int = BLOCK_SIZE):
        if block_size < 8 or block_size & (block_size - 1) or block_size >= 2**31:
            raise ValueError(f"block_size must be a power of two >= 8, got {block_size}")
        self.block_size = block_size

    def compress(self, tensor: torch.Tensor, info: CompressionInfo, allow_inplace: bool = False) -> runtime_pb2.Tensor:
        self._check_dtype(tensor)
        signs, scales = pack(tensor.detach(), self.block_size)
        return self._message(signs, scales, tensor)

    def compress_with_residual(self, tensor: torch.Tensor, residual: torch.Tensor) -> runtime_pb2.Tensor:
        """Compress `tensor + residual`; `residual` (flat fp32) becomes what the message could not carry."""
        self._check_dtype(tensor)
        signs, scales = error_feedback_pack(tensor.detach(), residual, self.block_size)
        return self._message(signs, scales, tensor)

    def _check_dtype(self, tensor: torch.Tensor) -> None:
        if str(tensor.dtype).replace("torch.", "") not in _DECODABLE_DTYPES:
            raise ValueError(f"{type(self).__name__} does not support {tensor.dtype} tensors")

    def _message(self, signs: torch.Tensor, scales: torch.Tensor, like: torch.Tensor) -> runtime_pb2.Tensor:
        buffer = b"".join(
            (
                np.asarray(self.block_size, dtype=_HEADER).tobytes(),
                scales.cpu().view(torch.int16).numpy().tobytes(),
                signs.cpu().numpy().tobytes(),
            )
        )
        return runtime_pb2.Tensor(
            compression=self.compression_type,
            buffer=buffer,
            size=like.shape,
            dtype=str(like.dtype).replace("torch.", ""),
            requires_grad=like.requires_grad,
        )

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
        signs = torch.from_numpy(np.frombuffer(buffer, dtype=np.uint8, offset=_HEADER.itemsize + 2 * n_blocks).copy())
        values = unpack(signs, scales, numel, block_size).to(dtype).reshape(shape)
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


def register_onebit_codec() -> None:
    """Make hivemind's (de)serializer know `ONEBIT_COMPRESSION_TYPE`. Idempotent; runs on import."""
    serialization._BASE_COMPRESSION_TYPES.setdefault(ONEBIT_COMPRESSION_NAME, OneBitCodec())
    enum = runtime_pb2.CompressionType
    if getattr(enum, "_onebit_registered", False):
        return
    stock_name = enum.Name

    def name(number: int) -> str:
        return ONEBIT_COMPRESSION_NAME if number == ONEBIT_COMPRESSION_TYPE else stock_name(number)

    # The serializer looks codecs up by `CompressionType.Name(value)`; the enum wrapper is a plain Python
    # object, so an instance attribute shadows its method for the one value it does not know.
    enum.Name = name
    enum._onebit_registered = True


register_onebit_codec()
