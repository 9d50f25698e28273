"""The Triton kernels behind `tscale_p2p.kernels.onebit` (see its docstring for the packed format): the fused
error-feedback pack and the unpack, for CUDA tensors, or for CPU tensors under ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tscale_p2p.kernels.onebit import _check_block_size, packed_sizes


@triton.jit
def _error_feedback_pack_kernel(
    x_ptr, residual_ptr, signs_ptr, scales_ptr, numel,
    BLOCK: tl.constexpr, ROWS: tl.constexpr, UPDATE_RESIDUAL: tl.constexpr,
):
    # Each program packs ROWS consecutive blocks: loads x (+ residual) once, writes signs, scales and the new
    # residual. Everything is elementwise or a per-block reduction, so one pass over memory suffices.
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    offsets = rows[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]
    inside = offsets < numel
    values = tl.load(x_ptr + offsets, mask=inside, other=0.0).to(tl.float32)
    if UPDATE_RESIDUAL:
        values += tl.load(residual_ptr + offsets, mask=inside, other=0.0)
    counts = tl.maximum(tl.sum(inside.to(tl.float32), axis=1), 1.0)
    scales = (tl.sum(tl.abs(values), axis=1) / counts).to(tl.bfloat16).to(tl.float32)
    negative = values < 0
    if UPDATE_RESIDUAL:
        decoded = tl.where(negative, -scales[:, None], scales[:, None])
        tl.store(residual_ptr + offsets, values - decoded, mask=inside)
    bits = tl.reshape(negative.to(tl.int32), (ROWS, BLOCK // 8, 8))
    weights = 1 << tl.arange(0, 8)
    packed = tl.sum(bits * weights[None, None, :], axis=2)
    byte_offsets = rows[:, None] * (BLOCK // 8) + tl.arange(0, BLOCK // 8)[None, :]
    tl.store(signs_ptr + byte_offsets, packed.to(tl.uint8), mask=byte_offsets < (numel + 7) // 8)
    tl.store(scales_ptr + rows, scales, mask=rows * BLOCK < numel)


@triton.jit
def _unpack_kernel(signs_ptr, scales_ptr, out_ptr, numel, BLOCK: tl.constexpr, TILE: tl.constexpr):
    offsets = tl.program_id(0) * TILE + tl.arange(0, TILE)
    inside = offsets < numel
    byte = tl.load(signs_ptr + offsets // 8, mask=inside, other=0).to(tl.int32)
    negative = ((byte >> (offsets % 8)) & 1) != 0
    scale = tl.load(scales_ptr + offsets // BLOCK, mask=inside, other=0.0).to(tl.float32)
    tl.store(out_ptr + offsets, tl.where(negative, -scale, scale), mask=inside)


def _rows_per_program(block_size: int) -> int:
    # ~4096 values per program: enough bytes in flight per SM without spilling registers.
    return max(1, 4096 // block_size)


def error_feedback_pack_triton(
    x: torch.Tensor, residual: torch.Tensor | None, block_size: int, rows_per_program: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The Triton kernel behind `error_feedback_pack` (CUDA, or CPU under TRITON_INTERPRET=1)."""
    _check_block_size(block_size)
    x = x.reshape(-1).contiguous()
    numel = x.numel()
    if numel >= 2**31:  # offsets are int32 in the kernel; SwarmAverager packs tensor by tensor
        raise ValueError(f"pack at most 2**31 - 1 values per call, got {numel}")
    n_bytes, n_blocks = packed_sizes(numel, block_size)
    signs = torch.empty(n_bytes, dtype=torch.uint8, device=x.device)
    scales = torch.empty(n_blocks, dtype=torch.bfloat16, device=x.device)
    if numel == 0:
        return signs, scales
    rows = rows_per_program or _rows_per_program(block_size)
    grid = (triton.cdiv(n_blocks, rows),)
    _error_feedback_pack_kernel[grid](
        x, residual if residual is not None else x, signs, scales, numel,
        BLOCK=block_size, ROWS=rows, UPDATE_RESIDUAL=residual is not None,
    )
    return signs, scales


def unpack_triton(signs: torch.Tensor, scales: torch.Tensor, numel: int, block_size: int) -> torch.Tensor:
    """The Triton kernel behind `unpack` (CUDA, or CPU under TRITON_INTERPRET=1)."""
    _check_block_size(block_size)
    out = torch.empty(numel, dtype=torch.float32, device=signs.device)
    if numel:
        tile = 4096
        _unpack_kernel[(triton.cdiv(numel, tile),)](signs, scales, out, numel, BLOCK=block_size, TILE=tile)
    return out
