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
runs on the CPU under `TRITON_INTERPRET=1`, which is how the tests compare the two).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


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
    numel = x.numel()
    n_bytes, n_blocks = packed_sizes(numel, block_size)
    padded = torch.nn.functional.pad(x.reshape(-1).float(), (0, n_blocks * block_size - numel))
    blocks = padded.view(n_blocks, block_size)
    counts = torch.full((n_blocks,), float(block_size), device=x.device)
    counts[-1] = numel - (n_blocks - 1) * block_size
    scales = blocks.abs().sum(dim=1).div_(counts).to(torch.bfloat16)
    negative = (blocks < 0).view(-1, 8).to(torch.uint8)
    signs = (negative * _bit_weights(x.device)).sum(dim=1, dtype=torch.uint8)[:n_bytes]
    return signs, scales


def _unpack_torch(signs: torch.Tensor, scales: torch.Tensor, numel: int, block_size: int) -> torch.Tensor:
    negative = (signs.unsqueeze(1) & _bit_weights(signs.device)).ne(0).view(-1)[:numel]
    magnitudes = scales.float().repeat_interleave(block_size)[:numel]
    return torch.where(negative, -magnitudes, magnitudes)


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


def pack(x: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Signs (uint8, 8 per byte) and per-block scales (bf16) of the flattened `x`."""
    _check_block_size(block_size)
    if x.is_cuda:
        return error_feedback_pack_triton(x, None, block_size)
    return _pack_torch(x, block_size)


def unpack(signs: torch.Tensor, scales: torch.Tensor, numel: int, block_size: int) -> torch.Tensor:
    """The flat fp32 vector `sign * scale` that `pack` describes."""
    _check_block_size(block_size)
    if signs.is_cuda:
        return unpack_triton(signs, scales, numel, block_size)
    return _unpack_torch(signs, scales, numel, block_size)


@torch.no_grad()
def error_feedback_pack(
    x: torch.Tensor, residual: torch.Tensor, block_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pack `x + residual`; `residual` (fp32, contiguous, x's numel) becomes what the packing lost."""
    _check_block_size(block_size)
    if residual.dtype != torch.float32 or not residual.is_contiguous() or residual.numel() != x.numel():
        raise ValueError("residual must be a contiguous fp32 tensor with as many values as x")
    if x.is_cuda:
        return error_feedback_pack_triton(x, residual, block_size)
    flat_residual = residual.view(-1)
    flat_residual.add_(x.reshape(-1))
    signs, scales = _pack_torch(flat_residual, block_size)
    flat_residual.sub_(_unpack_torch(signs, scales, x.numel(), block_size))
    return signs, scales
