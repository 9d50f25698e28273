"""1-bit sign packing with one scale per block, and its fused error-feedback form.

A packed vector is `(signs, scales)`: `signs` is uint8 with eight values per byte (bit i of byte j is value
8j+i; a set bit means negative), `scales` is bf16 with one entry per `block_size` values: the block's mean
absolute value, which is the scale that minimises the L2 error of `sign(x) * scale`. The last block may be
short; its scale is the mean over the values it has. Scales are rounded to bf16 *before* the residual is
formed, so error feedback accounts for the rounding too (bf16 halves the scale bytes at no measurable cost in
error: benchmarks/RESULTS.md).

`error_feedback_pack(x, residual)` packs `x + residual` and leaves in `residual` what the packed form could
not carry (`x + residual - unpack(...)`), in one pass over memory: that is the kernel a GPU peer runs per
averaging round. On CUDA tensors it is a Triton kernel; on the CPU it is plain torch (the Triton kernel also
runs on the CPU under `TRITON_INTERPRET=1`, which is how the tests compare the two). The Triton kernels live
in `onebit_triton` and load on first use: a CPU-only install (torch's CPU build brings no Triton) packs with
plain torch and never needs Triton, and so does a CUDA machine without Triton (slower, same bytes).
"""

from __future__ import annotations

import importlib
import importlib.util
import sys

import numpy as np
import torch

_HAS_TRITON = importlib.util.find_spec("triton") is not None


def packed_sizes(numel: int, block_size: int) -> tuple[int, int]:
    """(bytes of signs, number of scales) for a vector of `numel` values."""
    return (numel + 7) // 8, (numel + block_size - 1) // block_size


def _check_block_size(block_size: int) -> None:
    # A power of two >= 8 keeps every block on whole bytes and is a legal Triton tile width.
    if block_size < 8 or block_size & (block_size - 1):
        raise ValueError(f"block_size must be a power of two >= 8, got {block_size}")


_BIT_WEIGHTS = {}


def _bit_weights(device: torch.device) -> torch.Tensor:
    if device not in _BIT_WEIGHTS:
        _BIT_WEIGHTS[device] = torch.tensor([1 << i for i in range(8)], dtype=torch.uint8, device=device)
    return _BIT_WEIGHTS[device]


def _pack_torch(x: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    flat = x.reshape(-1).float()
    negative, scales = _negative_and_scales(flat, block_size)
    return _pack_signs(negative, packed_sizes(flat.numel(), block_size)[0]), scales


def _negative_and_scales(flat: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Which values of the fp32 vector `flat` are negative, and its per-block scales (bf16)."""
    numel = flat.numel()
    n_blocks = packed_sizes(numel, block_size)[1]
    full = numel // block_size
    scales = torch.empty(n_blocks, device=flat.device)
    torch.linalg.vector_norm(flat[: full * block_size].view(full, block_size), ord=1, dim=1, out=scales[:full])
    scales[:full].div_(block_size)
    if full < n_blocks:  # the short last block: the mean over the values it has
        scales[full:] = flat[full * block_size :].abs().mean()
    return flat < 0, scales.to(torch.bfloat16)


def _pack_signs(negative: torch.Tensor, n_bytes: int) -> torch.Tensor:
    if negative.device.type == "cpu":
        # numpy's packbits is one pass in C; the torch form below takes five over the values (4x slower here)
        return torch.from_numpy(np.packbits(negative.numpy(), bitorder="little"))
    padded = torch.nn.functional.pad(negative, (0, n_bytes * 8 - negative.numel())).view(-1, 8).to(torch.uint8)
    return (padded * _bit_weights(negative.device)).sum(dim=1, dtype=torch.uint8)


def _negative_bits(signs: torch.Tensor, numel: int) -> torch.Tensor:
    """0/1 (uint8) for each of the `numel` values whose signs `signs` packs (1: negative)."""
    if signs.device.type == "cpu":
        return torch.from_numpy(np.unpackbits(signs.numpy(), count=numel, bitorder="little"))
    return (signs.unsqueeze(1) & _bit_weights(signs.device)).ne(0).view(-1)[:numel].view(torch.uint8)


def _blockwise(values: torch.Tensor, scales: torch.Tensor, block_size: int, op: str) -> None:
    """`values.<op>_(scale of each value's block)` in place (`op`: "copy" or "sub")."""
    full = values.numel() // block_size
    scales = scales.float()
    head = values[: full * block_size].view(full, block_size)
    tail = values[full * block_size :]
    if op == "copy":
        head.copy_(scales[:full].unsqueeze(1).expand(full, block_size))
        tail.copy_(scales[full:].expand(tail.numel()))
    else:
        head.sub_(scales[:full].unsqueeze(1))
        tail.sub_(scales[full:])


def _negate_where(values: torch.Tensor, negative: torch.Tensor) -> None:
    """`values[i] = -values[i]` where `negative[i]` (bool or 0/1 uint8), in place. On the CPU it flips the sign
    bits through a byte view: one pass over a quarter of the memory and no float temporaries, where a
    multiplication by a +-1 vector costs a freshly allocated vector (page faults dominate on a big bucket)."""
    if values.device.type == "cpu" and sys.byteorder == "little":
        values.view(torch.uint8).view(-1, 4)[:, 3].bitwise_xor_(negative.view(torch.uint8) << 7)
    else:
        values.copy_(torch.where(negative.bool(), -values, values))


def _unpack_torch(signs: torch.Tensor, scales: torch.Tensor, numel: int, block_size: int,
                  out: torch.Tensor | None = None) -> torch.Tensor:
    values = torch.empty(numel, device=signs.device) if out is None else out
    _blockwise(values, scales, block_size, "copy")
    _negate_where(values, _negative_bits(signs, numel))
    return values


def pack(x: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Signs (uint8, 8 per byte) and per-block scales (bf16) of the flattened `x`."""
    _check_block_size(block_size)
    if x.is_cuda and _HAS_TRITON:
        return _triton().error_feedback_pack_triton(x, None, block_size)
    return _pack_torch(x, block_size)


def unpack(signs: torch.Tensor, scales: torch.Tensor, numel: int, block_size: int,
           out: torch.Tensor | None = None) -> torch.Tensor:
    """The flat fp32 vector `sign * scale` that `pack` describes; written into `out` (contiguous fp32, `numel`
    values) when given, which spares the allocation."""
    _check_block_size(block_size)
    if out is not None and (out.dtype != torch.float32 or not out.is_contiguous() or out.numel() != numel):
        raise ValueError("out must be a contiguous fp32 tensor of numel values")
    if signs.is_cuda and _HAS_TRITON:
        values = _triton().unpack_triton(signs, scales, numel, block_size)
        return values if out is None else out.copy_(values)
    return _unpack_torch(signs, scales, numel, block_size, None if out is None else out.view(-1))


@torch.no_grad()
def error_feedback_pack(
    x: torch.Tensor, residual: torch.Tensor, block_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pack `x + residual`; `residual` (fp32, contiguous, x's numel) becomes what the packing lost."""
    _check_block_size(block_size)
    if residual.dtype != torch.float32 or not residual.is_contiguous() or residual.numel() != x.numel():
        raise ValueError("residual must be a contiguous fp32 tensor with as many values as x")
    if x.is_cuda and _HAS_TRITON:
        return _triton().error_feedback_pack_triton(x, residual, block_size)
    flat_residual = residual.view(-1)
    flat_residual.add_(x.reshape(-1))
    negative, scales = _negative_and_scales(flat_residual, block_size)
    # residual - sign * scale == sign * (|residual| - scale), bit for bit (IEEE rounding is symmetric), and the
    # right-hand side runs in place: no decoded vector is built
    flat_residual.abs_()
    _blockwise(flat_residual, scales, block_size, "sub")
    _negate_where(flat_residual, negative)
    return _pack_signs(negative, packed_sizes(x.numel(), block_size)[0]), scales


def _triton():
    return importlib.import_module("tscale_p2p.kernels.onebit_triton")


def __getattr__(name: str):
    # `from tscale_p2p.kernels.onebit import error_feedback_pack_triton` (tests, benchmarks) imports Triton then.
    if name in ("error_feedback_pack_triton", "unpack_triton"):
        return getattr(_triton(), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
