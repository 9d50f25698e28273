"""Fused amax + cast quantization to fp8 (e4m3, e5m2) and int8, in one pass over memory.

A quantized tensor is `(q, scale)` with `x ~= q * scale`; scales are fp32. Two layouts cover every operand
of a linear layer's three matmuls (all of them contract along the last axis of both operands, which is the
layout the tensor cores want):

* `quantize_rows(x)`: q has x's shape [M, K]; one scale per row (`group=None`), or one per row and
  128-element tile along K (`group=128`, scale shape [M, ceil(K/128)]).
* `quantize_cols_t(x)`: q is x transposed, [K, M]; one scale per column of x (column maxima from a first
  pass), or one per column and 128-row tile (`group=128`, computed in the one pass).
* `quantize_with_transpose(x)`: both of the above with one scale per row and per column (a weight's two
  layouts), from two passes over 2-D tiles instead of the row pass and the transposed pass.

Stochastic rounding (for gradients) adds uniform noise below the target precision before truncating, so the
rounding is unbiased in expectation (TScale dithers its gradient quantization for the same reason).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl


@dataclass(frozen=True)
class QuantFormat:
    """A low-precision element type: its torch dtype, its largest finite value, and its mantissa bits."""

    name: str
    dtype: torch.dtype
    max_value: float
    mantissa_bits: int  # 0 for integers
    min_normal_exp: int  # log2 of the smallest normal value (unused for integers)

    @property
    def is_int(self) -> bool:
        return not self.dtype.is_floating_point


FORMATS = {
    "e4m3": QuantFormat("e4m3", torch.float8_e4m3fn, 448.0, 3, -6),
    "e5m2": QuantFormat("e5m2", torch.float8_e5m2, 57344.0, 2, -14),
    "int8": QuantFormat("int8", torch.int8, 127.0, 0, 0),
}

TILE = 128  # the fine-grained scale group (DeepSeek-V3 style 1x128 tiles)


@triton.jit
def _scale_of(amax, QMAX: tl.constexpr):
    """The scale that maps amax onto the format's largest value; 1 for an all-zero row or column."""
    return tl.where(amax > 0, amax / QMAX, 1.0)


@triton.jit
def _scale_and_cast(x, scale, rand_bits, QMAX: tl.constexpr, IS_INT: tl.constexpr,
                    MANTISSA_BITS: tl.constexpr, MIN_NORMAL_EXP: tl.constexpr, STOCHASTIC: tl.constexpr,
                    EMULATE_CAST: tl.constexpr, OUT_DTYPE: tl.constexpr):
    """x / scale rounded into OUT_DTYPE: to nearest (ties to even), or stochastically when STOCHASTIC, using
    `rand_bits` (uniform uint32 bits of x's shape, from `_random_bits`; unused otherwise).

    Stochastic rounding, and round-to-nearest under EMULATE_CAST, round in fp32 here so that the final cast is
    exact (Triton 3.9's interpreter rounds fp32 -> fp8 wrongly when the carry reaches the next binade); on a
    GPU round-to-nearest is the hardware's saturating cast.
    """
    y = tl.minimum(tl.maximum(x / scale, -QMAX), QMAX)
    if STOCHASTIC:
        noise = (rand_bits >> 8).to(tl.float32) * (1.0 / (1 << 24))  # uniform in [0, 1)
    else:
        noise = tl.full(y.shape, 0.5, tl.float32)
    if IS_INT:
        q = tl.where(y >= 0, tl.floor(y + noise), -tl.floor(-y + noise))
    elif STOCHASTIC or EMULATE_CAST:
        # Normal range: keep MANTISSA_BITS of the fp32 mantissa. Adding half an ulp (ties to even) or a random
        # fraction of one (stochastic) to the bit pattern, then clearing the dropped bits, rounds the magnitude.
        drop: tl.constexpr = 23 - MANTISSA_BITS
        low: tl.constexpr = (1 << drop) - 1
        bits = y.to(tl.int32, bitcast=True)
        if STOCHASTIC:
            inc = (rand_bits & low).to(tl.int32, bitcast=True)
        else:
            inc = (low >> 1) + ((bits >> drop) & 1)
        normal = ((bits + inc) & ~low).to(tl.float32, bitcast=True)
        # Subnormal range: a fixed quantum of 2^(MIN_NORMAL_EXP - MANTISSA_BITS).
        quantum: tl.constexpr = 2.0 ** (MIN_NORMAL_EXP - MANTISSA_BITS)
        inv_quantum: tl.constexpr = 2.0 ** (MANTISSA_BITS - MIN_NORMAL_EXP)
        sub = tl.where(y >= 0, tl.floor(y * inv_quantum + noise), -tl.floor(-y * inv_quantum + noise)) * quantum
        q = tl.where(tl.abs(y) < 2.0 ** MIN_NORMAL_EXP, sub, normal)
        q = tl.minimum(tl.maximum(q, -QMAX), QMAX)
    else:
        q = y
    return q.to(OUT_DTYPE)


@triton.jit
def _random_bits(seed, rows, cols, K):
    """Uniform random bits (uint32) for the tile of x [M, K] at (rows, cols), distinct for every element of x.

    A 32-bit integer hash (Wellons' "lowbias32") of the element's index, offset by a hash of the seed: a few
    integer operations an element. Triton's Philox does 10 rounds to make 4 numbers, of which tl.randint keeps
    one (that made the stochastic cast compute-bound at 14% of copy bandwidth), and splitting randint4x's four
    over the tile costs a shuffle through shared memory. Dithering needs no stronger generator.
    """
    h = (rows[:, None].to(tl.int64) * K + cols[None, :]).to(tl.uint32) + _lowbias32(seed.to(tl.uint32))
    return _lowbias32(h)


@triton.jit
def _lowbias32(h):
    h ^= h >> 16
    h *= 0x7FEB352D
    h ^= h >> 15
    h *= 0x846CA68B
    h ^= h >> 16
    return h


@triton.jit
def _load_tile(x_ptr, pid_m, pid_k, M, K, stride_xm, stride_xk, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    """Tile (pid_m, pid_k) of x [M, K] in fp32 (zeros outside x), with its row and column indices and mask."""
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    mask = (rows[:, None] < M) & (cols[None, :] < K)
    x = tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_xm + cols[None, :] * stride_xk, mask=mask,
                other=0.0).to(tl.float32)
    return x, rows, cols, mask


@triton.jit
def _quantize_rows_kernel(x_ptr, q_ptr, s_ptr, M, K, stride_xm, stride_xk, stride_qm, stride_sm, seed,
                          QMAX: tl.constexpr, IS_INT: tl.constexpr, MANTISSA_BITS: tl.constexpr,
                          MIN_NORMAL_EXP: tl.constexpr, STOCHASTIC: tl.constexpr, EMULATE_CAST: tl.constexpr,
                          BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_k = tl.program_id(1)
    x, rows, cols, mask = _load_tile(x_ptr, pid_m, pid_k, M, K, stride_xm, stride_xk, BLOCK_M, BLOCK_K)
    scale = _scale_of(tl.max(tl.abs(x), axis=1), QMAX)
    rand_bits = _random_bits(seed, rows, cols, K) if STOCHASTIC else 0
    q = _scale_and_cast(x, scale[:, None], rand_bits, QMAX, IS_INT, MANTISSA_BITS, MIN_NORMAL_EXP, STOCHASTIC,
                        EMULATE_CAST, q_ptr.dtype.element_ty)
    tl.store(q_ptr + rows[:, None].to(tl.int64) * stride_qm + cols[None, :], q, mask=mask)
    tl.store(s_ptr + rows * stride_sm + pid_k, scale, mask=rows < M)


@triton.jit
def _quantize_cols_t_kernel(x_ptr, q_ptr, s_ptr, colmax_ptr, rowmul_ptr, M, K, stride_xm, stride_xk, stride_qk,
                            stride_sk, seed, QMAX: tl.constexpr, IS_INT: tl.constexpr,
                            MANTISSA_BITS: tl.constexpr, MIN_NORMAL_EXP: tl.constexpr, STOCHASTIC: tl.constexpr,
                            EMULATE_CAST: tl.constexpr, TILE_SCALES: tl.constexpr, ROW_MUL: tl.constexpr,
                            BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_k = tl.program_id(1)
    x, rows, cols, mask = _load_tile(x_ptr, pid_m, pid_k, M, K, stride_xm, stride_xk, BLOCK_M, BLOCK_K)
    if ROW_MUL:
        x = x * tl.load(rowmul_ptr + rows, mask=rows < M, other=0.0)[:, None]
    if TILE_SCALES:
        amax = tl.max(tl.abs(x), axis=0)
    else:
        amax = tl.load(colmax_ptr + cols, mask=cols < K, other=0.0)
    scale = _scale_of(amax, QMAX)
    rand_bits = _random_bits(seed, rows, cols, K) if STOCHASTIC else 0
    q = _scale_and_cast(x, scale[None, :], rand_bits, QMAX, IS_INT, MANTISSA_BITS, MIN_NORMAL_EXP, STOCHASTIC,
                        EMULATE_CAST, q_ptr.dtype.element_ty)
    tl.store(q_ptr + cols[None, :].to(tl.int64) * stride_qk + rows[:, None], q, mask=mask)
    if TILE_SCALES:
        tl.store(s_ptr + cols * stride_sk + pid_m, scale, mask=cols < K)
    else:
        if pid_m == 0:
            tl.store(s_ptr + cols * stride_sk, scale, mask=cols < K)


@triton.jit
def _abs_max_kernel(x_ptr, rowmul_ptr, row_amax_ptr, col_amax_ptr, M, K, stride_xm, stride_xk,
                    ROW_MUL: tl.constexpr, ROW_AMAX: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
                    ROW_BLOCKS: tl.constexpr):
    """Each program's ROW_BLOCKS tiles, stacked along M, of x (times rowmul[:, None] if ROW_MUL) raise
    col_amax[cols] and, if ROW_AMAX, row_amax[rows] (zero-initialised) to their maxima."""
    pid_k = tl.program_id(1)
    cols = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    tile_max = tl.zeros((BLOCK_M, BLOCK_K), dtype=tl.float32)
    for i in range(ROW_BLOCKS):
        x, rows, _, _ = _load_tile(x_ptr, tl.program_id(0) * ROW_BLOCKS + i, pid_k, M, K, stride_xm, stride_xk,
                                      BLOCK_M, BLOCK_K)
        if ROW_MUL:
            x = x * tl.load(rowmul_ptr + rows, mask=rows < M, other=0.0)[:, None]
        ax = tl.abs(x)
        # A max is the same in any order, so the atomics keep the result deterministic.
        if ROW_AMAX:
            tl.atomic_max(row_amax_ptr + rows, tl.max(ax, axis=1), mask=rows < M)
        tile_max = tl.maximum(tile_max, ax)  # element-wise: one reduction across the tile's rows, after the loop
    # One atomic per column and program: many programs raising the same addresses would serialize.
    tl.atomic_max(col_amax_ptr + cols, tl.max(tile_max, axis=0), mask=cols < K)


@triton.jit
def _quantize_both_kernel(x_ptr, q_ptr, qt_ptr, row_amax_ptr, col_amax_ptr, s_ptr, st_ptr, M, K, stride_xm,
                          stride_xk, QMAX: tl.constexpr, IS_INT: tl.constexpr, MANTISSA_BITS: tl.constexpr,
                          MIN_NORMAL_EXP: tl.constexpr, EMULATE_CAST: tl.constexpr, BLOCK_M: tl.constexpr,
                          BLOCK_K: tl.constexpr):
    """One read of a tile, two casts: x / row scale into q [M, K], x / column scale into q^T [K, M]; the first
    column of programs writes the row scales, the first row of programs the column scales."""
    pid_m = tl.program_id(0)
    pid_k = tl.program_id(1)
    x, rows, cols, mask = _load_tile(x_ptr, pid_m, pid_k, M, K, stride_xm, stride_xk, BLOCK_M, BLOCK_K)
    row_amax = tl.load(row_amax_ptr + rows, mask=rows < M, other=0.0)
    col_amax = tl.load(col_amax_ptr + cols, mask=cols < K, other=0.0)
    row_scale = _scale_of(row_amax, QMAX)
    col_scale = _scale_of(col_amax, QMAX)
    q = _scale_and_cast(x, row_scale[:, None], 0, QMAX, IS_INT, MANTISSA_BITS, MIN_NORMAL_EXP, False,
                        EMULATE_CAST, q_ptr.dtype.element_ty)
    tl.store(q_ptr + rows[:, None].to(tl.int64) * K + cols[None, :], q, mask=mask)
    q_t = _scale_and_cast(x, col_scale[None, :], 0, QMAX, IS_INT, MANTISSA_BITS, MIN_NORMAL_EXP, False,
                          EMULATE_CAST, qt_ptr.dtype.element_ty)
    tl.store(qt_ptr + cols[None, :].to(tl.int64) * M + rows[:, None], q_t, mask=mask)
    if pid_k == 0:
        tl.store(s_ptr + rows, row_scale, mask=rows < M)
    if pid_m == 0:
        tl.store(st_ptr + cols, col_scale, mask=cols < K)


@triton.jit
def _transpose_kernel(x_ptr, y_ptr, M, K, stride_xm, stride_ym, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    mask = (rows[:, None] < M) & (cols[None, :] < K)
    x = tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_xm + cols[None, :], mask=mask)
    tl.store(y_ptr + cols[None, :].to(tl.int64) * stride_ym + rows[:, None], x, mask=mask)


def _format(fmt: str | QuantFormat) -> QuantFormat:
    return fmt if isinstance(fmt, QuantFormat) else FORMATS[fmt]


def _seed(stochastic: bool) -> int:
    return int(torch.randint(0, 2**31 - 1, (1,)).item()) if stochastic else 0


def _check_group(group: int | None) -> None:
    if group not in (None, TILE):
        raise ValueError(f"group must be None (one scale per row) or {TILE}, got {group}")


def _emulate_cast() -> bool:
    return bool(triton.knobs.runtime.interpret)


def quantize_rows(x: torch.Tensor, fmt: str | QuantFormat = "e4m3", group: int | None = None,
                  stochastic: bool = False):
    """Quantize a 2-D tensor with one scale per row (group=None) or per row and 128-wide tile (group=128):
    (q, scale), scale of shape [M] or [M, ceil(K/128)]."""
    _check_group(group)
    f = _format(fmt)
    M, K = x.shape
    if group is None:
        block_k = triton.next_power_of_2(K)
        if block_k > 16384:
            raise ValueError(f"row-wise quantization holds a whole row on chip; K={K} is over 16384")
    else:
        block_k = TILE
    block_m = max(1, min(64, 8192 // block_k))
    n_groups = triton.cdiv(K, block_k)
    q = torch.empty((M, K), dtype=f.dtype, device=x.device)
    scale = torch.empty((M, n_groups), dtype=torch.float32, device=x.device)
    _quantize_rows_kernel[(triton.cdiv(M, block_m), n_groups)](
        x, q, scale, M, K, x.stride(0), x.stride(1), q.stride(0), scale.stride(0), _seed(stochastic),
        QMAX=f.max_value, IS_INT=f.is_int, MANTISSA_BITS=f.mantissa_bits, MIN_NORMAL_EXP=f.min_normal_exp,
        STOCHASTIC=stochastic, EMULATE_CAST=_emulate_cast(), BLOCK_M=block_m, BLOCK_K=block_k,
        num_warps=8 if block_m * block_k >= 4096 else 4)
    return q, (scale[:, 0] if group is None else scale)


# (BLOCK_M, BLOCK_K, ROW_BLOCKS) of the column-maxima pass before the transposed cast: 1024 rows a program, so
# few atomics per column.
COL_AMAX_BLOCKS = (64, 128, 16)
# BLOCK_M = BLOCK_K of both passes of `quantize_with_transpose`.
WEIGHT_TILE = 64


def _cols_t_blocks(tiles: bool, one_byte: bool) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_K, num_warps) of the transposed cast."""
    if tiles:
        return TILE, 64, 8
    if one_byte:  # the wgrad operand: 0.74-0.79 of copy bandwidth on an H200, against 0.69-0.71 on 64x128 x 8 warps
        return 128, 128, 4
    return 64, 128, 8


def quantize_cols_t(x: torch.Tensor, fmt: str | QuantFormat = "e4m3", group: int | None = None,
                    stochastic: bool = False, row_mul: torch.Tensor | None = None):
    """Quantize x [M, K] (times `row_mul[:, None]` if given) into its transpose [K, M], scaled per column of x
    (per row of the result).

    group=None: one scale per column, shape [K], from a first pass over x for the column maxima. group=128: one
    scale per column and 128-row tile, computed in the one pass; shape [K, ceil(M/128)].
    x may itself be quantized (fp8 or int8, with its scales folded into `row_mul`): that is how the weight
    gradient's operand is made from the row-quantized dY, reading one byte an element.
    """
    _check_group(group)
    f = _format(fmt)
    M, K = x.shape
    tiles = group is not None
    q = torch.empty((K, M), dtype=f.dtype, device=x.device)
    block_m, block_k, warps = _cols_t_blocks(tiles, one_byte=x.element_size() == 1)
    scale = torch.empty((K, triton.cdiv(M, TILE)) if tiles else (K, 1), dtype=torch.float32, device=x.device)
    row_mul_arg = row_mul if row_mul is not None else scale
    if not tiles:
        col_amax = torch.zeros(K, dtype=torch.float32, device=x.device)
        amax_m, amax_k, row_blocks = COL_AMAX_BLOCKS
        _abs_max_kernel[(triton.cdiv(M, amax_m * row_blocks), triton.cdiv(K, amax_k))](
            x, row_mul_arg, col_amax, col_amax, M, K, x.stride(0), x.stride(1), ROW_MUL=row_mul is not None,
            ROW_AMAX=False, BLOCK_M=amax_m, BLOCK_K=amax_k, ROW_BLOCKS=row_blocks, num_warps=4)
    grid = (triton.cdiv(M, block_m), triton.cdiv(K, block_k))
    _quantize_cols_t_kernel[grid](
        x, q, scale, scale if tiles else col_amax, row_mul_arg, M, K, x.stride(0), x.stride(1),
        q.stride(0), scale.stride(0), _seed(stochastic),
        QMAX=f.max_value, IS_INT=f.is_int, MANTISSA_BITS=f.mantissa_bits,
        MIN_NORMAL_EXP=f.min_normal_exp, STOCHASTIC=stochastic, EMULATE_CAST=_emulate_cast(),
        TILE_SCALES=tiles, ROW_MUL=row_mul is not None, BLOCK_M=block_m, BLOCK_K=block_k, num_warps=warps)
    return q, (scale if tiles else scale[:, 0])


def quantize_with_transpose(x: torch.Tensor, fmt: str | QuantFormat = "e4m3"):
    """(q, row scales, q^T, column scales) of a 2-D tensor, both layouts a linear layer needs of its weight:
    the same values as `quantize_rows(x, fmt)` and `quantize_cols_t(x, fmt)`.

    Two passes over x on 2-D tiles, both at memory speed: the row and column maxima (atomic max per tile), then
    both casts from one read, three launches in all. (The row kernel with the column amax reads one long row per
    loop iteration, and with the transposed cast after it x is read twice at a fifth of copy bandwidth.)
    """
    f = _format(fmt)
    M, K = x.shape
    block_m = block_k = WEIGHT_TILE
    grid = (triton.cdiv(M, block_m), triton.cdiv(K, block_k))
    amax = torch.zeros(M + K, dtype=torch.float32, device=x.device)
    scales = torch.empty(M + K, dtype=torch.float32, device=x.device)
    _abs_max_kernel[grid](x, amax, amax, amax[M:], M, K, x.stride(0), x.stride(1), ROW_MUL=False, ROW_AMAX=True,
                          BLOCK_M=block_m, BLOCK_K=block_k, ROW_BLOCKS=1, num_warps=4)
    q = torch.empty((M, K), dtype=f.dtype, device=x.device)
    q_t = torch.empty((K, M), dtype=f.dtype, device=x.device)
    _quantize_both_kernel[grid](x, q, q_t, amax, amax[M:], scales, scales[M:], M, K, x.stride(0), x.stride(1),
                                QMAX=f.max_value, IS_INT=f.is_int, MANTISSA_BITS=f.mantissa_bits,
                                MIN_NORMAL_EXP=f.min_normal_exp, EMULATE_CAST=_emulate_cast(), BLOCK_M=block_m,
                                BLOCK_K=block_k, num_warps=4)
    return q, scales[:M], q_t, scales[M:]


def transpose(q: torch.Tensor) -> torch.Tensor:
    """The contiguous transpose [K, M] of a 2-D tensor [M, K] with unit inner stride (fp8/int8 values: the
    GEMM reads both operands contracting along their last axis, so a layout change is a copy)."""
    M, K = q.shape
    if q.stride(1) != 1:
        raise ValueError("transpose needs a unit inner stride")
    out = torch.empty((K, M), dtype=q.dtype, device=q.device)
    block_m, block_k = 64, 128  # 0.92-0.95 of copy bandwidth on an H200 (64 x 64: 0.81-0.85)
    _transpose_kernel[(triton.cdiv(M, block_m), triton.cdiv(K, block_k))](
        q, out, M, K, q.stride(0), out.stride(0), BLOCK_M=block_m, BLOCK_K=block_k, num_warps=4)
    return out


def quantize_rows_torch(x: torch.Tensor, fmt: str = "e4m3"):
    """`quantize_rows(x, fmt)` (one scale per row, round to nearest) written in torch ops, in the kernel's fp32
    arithmetic: (q, scale). Under torch.compile the compiler fuses these ops into the kernel that produces x (a
    norm, an activation), so x itself never makes the trip to memory and back; outside a compiled graph the
    Triton kernel is the faster of the two."""
    # The format's constants as literals: Dynamo (torch 2.13) fails to trace a QuantFormat field here when a
    # second graph in the same process reaches this function from inside an autograd.Function.
    if fmt == "int8":
        dtype, qmax = torch.int8, 127.0
    elif fmt == "e5m2":
        dtype, qmax = torch.float8_e5m2, 57344.0
    else:
        dtype, qmax = torch.float8_e4m3fn, 448.0
    xf = x.float()
    amax = xf.abs().amax(dim=1)
    scale = torch.where(amax > 0, amax / qmax, torch.ones_like(amax))
    y = (xf / scale[:, None]).clamp(-qmax, qmax)
    if fmt == "int8":  # half away from zero, as the kernel rounds
        y = torch.where(y >= 0, torch.floor(y + 0.5), -torch.floor(0.5 - y))
    return y.to(dtype), scale


def quantize_reference(x: torch.Tensor, fmt: str | QuantFormat = "e4m3", group: int | None = None):
    """Plain-torch reference for `quantize_rows` (round to nearest): returns (q, scale)."""
    f = _format(fmt)
    M, K = x.shape
    g = K if group is None else group
    pad = (-K) % g
    xp = torch.nn.functional.pad(x.double(), (0, pad)).view(M, -1, g)
    amax = xp.abs().amax(dim=2)
    scale = torch.where(amax > 0, amax / f.max_value, torch.ones_like(amax)).float()
    y = (xp / scale.double()[:, :, None]).clamp(-f.max_value, f.max_value)
    q = (y.round() if f.is_int else y).to(f.dtype).view(M, -1)[:, :K]
    return q, (scale[:, 0] if group is None else scale)


def dequantize(q: torch.Tensor, scale: torch.Tensor, group: int | None = None) -> torch.Tensor:
    """float64 value of a row-layout quantized tensor (q [M, K] with row or row-tile scales)."""
    s = scale.double()
    if group is None:
        return q.double() * s[:, None]
    return q.double() * s.repeat_interleave(group, dim=1)[:, : q.shape[1]]
