"""Scaled low-precision GEMM: C = (A @ B^T) * scale_a * scale_b, fp8 (fp32 accumulate) or int8 (int32).

Both operands contract along their last axis (A [M, K], B [N, K]), so one kernel serves the three matmuls of a
linear layer once the operands are quantized in the right layout (see `linear.py`). Scales are either one per
row of A and of B, applied once in the epilogue, or one per row and 128-wide K tile (`group=128`), applied to
each K block's partial product.

Two kernels share the tile scheduling and the epilogue:
* `_scaled_mm_tma_kernel`: persistent (one program per SM looping over output tiles) with TMA tensor
  descriptors, for Hopper and newer (compute capability >= 9.0) when strides are 16-byte aligned.
* `_scaled_mm_kernel`: one program per output tile with plain pointer loads, for Ampere/Ada and any shape.
Autotune configurations are pruned to the running device's class (Hopper's 228 KB of shared memory allows
128x256x128 tiles, whose fp32 output (the weight gradient) the TMA kernel stores in two halves to fit; consumer
cards get smaller ones); under TRITON_INTERPRET one small config is used.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from tscale_p2p.kernels.quantize import TILE

_HOPPER = "hopper"
_CONSUMER = "consumer"
_INTERPRET = "interpret"


def _config(kind, bm, bn, bk, stages, warps, group_m=8, subtile=False):
    return triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": group_m, "SUBTILE": subtile},
                         num_stages=stages, num_warps=warps, pre_hook=_set_descriptor_blocks), kind


def _set_descriptor_blocks(nargs):
    """TMA descriptors carry their block shape; set it from the config being launched."""
    if "a_desc" in nargs:
        bm, bn, bk = nargs["BLOCK_M"], nargs["BLOCK_N"], nargs["BLOCK_K"]
        nargs["a_desc"].block_shape = [bm, bk]
        nargs["b_desc"].block_shape = [bn, bk]
        nargs["c_desc"].block_shape = [bm, bn // 2 if nargs["SUBTILE"] else bn]


_TAGGED_CONFIGS = [
    _config(_HOPPER, 128, 256, 128, 3, 8),
    # The same tile storing its output in two halves: the only way it fits beside an fp32 output (wgrad).
    _config(_HOPPER, 128, 256, 128, 3, 8, subtile=True),
    _config(_HOPPER, 128, 128, 128, 4, 8),
    _config(_HOPPER, 128, 256, 64, 4, 8),
    _config(_HOPPER, 64, 256, 128, 4, 4),
    _config(_HOPPER, 256, 128, 128, 3, 8),
    _config(_HOPPER, 128, 128, 128, 5, 8),
    _config(_CONSUMER, 128, 128, 64, 3, 8),
    _config(_CONSUMER, 128, 64, 128, 3, 4),
    _config(_CONSUMER, 64, 128, 64, 4, 4),
    _config(_INTERPRET, 32, 32, 32, 1, 4, group_m=2, subtile=True),
]
_CONFIGS = [c for c, _ in _TAGGED_CONFIGS]


@functools.lru_cache(maxsize=None)
def _device_class() -> str:
    if triton.knobs.runtime.interpret or not torch.cuda.is_available():
        return _INTERPRET
    return _HOPPER if torch.cuda.get_device_capability()[0] >= 9 else _CONSUMER


# Shared memory one block may opt into: Hopper (sm_90) and Ada (sm_89), the latter's also Ampere consumer cards'.
HOPPER_SHARED_MEMORY, ADA_SHARED_MEMORY = 232448, 101376


@functools.lru_cache(maxsize=None)
def _shared_memory_limit() -> int:
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    fallback = HOPPER_SHARED_MEMORY if props.major >= 9 else ADA_SHARED_MEMORY
    return getattr(props, "shared_memory_per_block_optin", fallback)


def _prune_configs(configs, named_args, **kwargs):
    args = {**named_args, **kwargs}
    kind = _device_class()
    kept = [c for c, k in _TAGGED_CONFIGS if k == kind and c in configs]
    if "a_desc" not in args and kind != _INTERPRET:  # the pointer kernel stores whole tiles: no subtiled twins
        kept = [c for c in kept if not c.kwargs["SUBTILE"]]
    if args.get("GROUP_K", 0):  # K blocks must not straddle a scale tile
        kept = [c for c in kept if TILE % c.kwargs["BLOCK_K"] == 0]
    if kind != _INTERPRET:
        # Operand stages (1-byte elements) plus the output tile staged for the epilogue store. OUT_BYTES is in
        # the autotune key: an fp32 output (wgrad, or dgrad of an fp32 input) needs twice the epilogue memory
        # of a bf16 one of the same shape, so a config tuned for one must not be reused for the other.
        limit = _shared_memory_limit() - 4096

        def smem(c):
            bm, bn, bk = c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.kwargs["BLOCK_K"]
            epilogue = bm * bn * args["OUT_BYTES"] // (2 if c.kwargs["SUBTILE"] else 1)
            return c.num_stages * (bm + bn) * bk + epilogue

        fitting = [c for c in kept if smem(c) <= limit]
        kept = fitting or [min(kept, key=smem)]
    return kept


def _autotune_bench(kernel_call, quantiles):
    # Shorter than Triton's default (25 ms warm-up, 100 ms timing) per config: the GEMMs are compute bound and
    # steady after a few runs, and a training run tunes a dozen shapes at start.
    return triton.testing.do_bench(kernel_call, warmup=10, rep=40, quantiles=quantiles)


@triton.jit
def _tile_coords(tile_id, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    """Grouped ordering: GROUP_M row-blocks share B tiles in L2 before moving to the next column-block."""
    group_size = GROUP_M * num_pid_n
    first_m = (tile_id // group_size) * GROUP_M
    rows_in_group = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (tile_id % group_size) % rows_in_group
    pid_n = (tile_id % group_size) // rows_in_group
    return pid_m, pid_n


@triton.jit
def _block_scales(sa_ptr, sb_ptr, offs_m, offs_n, k_start, M, N, stride_sa, stride_sb, GROUP_K: tl.constexpr):
    """Outer product of the A and B scales of the K tile that holds column k_start."""
    kt = k_start // GROUP_K
    sa = tl.load(sa_ptr + offs_m * stride_sa + kt, mask=offs_m < M, other=0.0)
    sb = tl.load(sb_ptr + offs_n * stride_sb + kt, mask=offs_n < N, other=0.0)
    return sa[:, None] * sb[None, :]


@triton.jit
def _row_scaled(acc, sa_ptr, sb_ptr, offs_m, offs_n, M, N, GROUP_K: tl.constexpr):
    """Epilogue: apply per-row scales (a no-op cast when the scales were applied per K tile)."""
    c = acc.to(tl.float32)
    if GROUP_K == 0:
        sa = tl.load(sa_ptr + offs_m, mask=offs_m < M, other=0.0)
        sb = tl.load(sb_ptr + offs_n, mask=offs_n < N, other=0.0)
        c = c * sa[:, None] * sb[None, :]
    return c


@triton.jit
def _zero_acc(BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_K: tl.constexpr, ACC_DTYPE: tl.constexpr):
    """The accumulator: ACC_DTYPE (int32 for int8) when scales wait for the epilogue, else scaled fp32."""
    if GROUP_K == 0:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=ACC_DTYPE)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    return acc


@triton.jit
def _mma(a, b, acc, sa_ptr, sb_ptr, offs_m, offs_n, k_start, M, N, stride_sa, stride_sb,
         GROUP_K: tl.constexpr, ACC_DTYPE: tl.constexpr):
    if GROUP_K == 0:
        acc = tl.dot(a, b.T, acc, out_dtype=ACC_DTYPE)
    else:
        part = tl.dot(a, b.T, out_dtype=ACC_DTYPE).to(tl.float32)
        acc += part * _block_scales(sa_ptr, sb_ptr, offs_m, offs_n, k_start, M, N, stride_sa, stride_sb,
                                    GROUP_K)
    return acc


@triton.autotune(configs=_CONFIGS, key=["M", "N", "K", "GROUP_K", "OUT_BYTES"], prune_configs_by={"early_config_prune": _prune_configs},
                 do_bench=_autotune_bench)
@triton.jit
def _scaled_mm_kernel(a_ptr, b_ptr, c_ptr, sa_ptr, sb_ptr, M, N, K, stride_am, stride_ak, stride_bn, stride_bk,
                      stride_cm, stride_cn, stride_sa, stride_sb, GROUP_K: tl.constexpr, ACC_DTYPE: tl.constexpr,
                      OUT_BYTES: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                      SUBTILE: tl.constexpr):  # SUBTILE: shared configs; this kernel stores whole tiles
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    pid_m, pid_n = _tile_coords(tl.program_id(0), num_pid_m, num_pid_n, GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + offs_m[:, None].to(tl.int64) * stride_am + offs_k[None, :] * stride_ak
    b_ptrs = b_ptr + offs_n[:, None].to(tl.int64) * stride_bn + offs_k[None, :] * stride_bk
    acc = _zero_acc(BLOCK_M, BLOCK_N, GROUP_K, ACC_DTYPE)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        k_left = K - k * BLOCK_K
        a = tl.load(a_ptrs, mask=(offs_m[:, None] < M) & (offs_k[None, :] < k_left), other=0.0)
        b = tl.load(b_ptrs, mask=(offs_n[:, None] < N) & (offs_k[None, :] < k_left), other=0.0)
        acc = _mma(a, b, acc, sa_ptr, sb_ptr, offs_m, offs_n, k * BLOCK_K, M, N, stride_sa, stride_sb,
                   GROUP_K, ACC_DTYPE)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
    c = _row_scaled(acc, sa_ptr, sb_ptr, offs_m, offs_n, M, N, GROUP_K)
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    tl.store(c_ptr + offs_m[:, None].to(tl.int64) * stride_cm + offs_n[None, :] * stride_cn,
             c.to(c_ptr.dtype.element_ty), mask=mask)


@triton.autotune(configs=_CONFIGS, key=["M", "N", "K", "GROUP_K", "OUT_BYTES"], prune_configs_by={"early_config_prune": _prune_configs},
                 do_bench=_autotune_bench)
@triton.jit
def _scaled_mm_tma_kernel(a_desc, b_desc, c_desc, sa_ptr, sb_ptr, M, N, K, stride_sa, stride_sb,
                          GROUP_K: tl.constexpr, ACC_DTYPE: tl.constexpr, OUT_BYTES: tl.constexpr,
                          NUM_SMS: tl.constexpr,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                          GROUP_M: tl.constexpr, SUBTILE: tl.constexpr):
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    k_tiles = tl.cdiv(K, BLOCK_K)
    num_tiles = num_pid_m * num_pid_n
    # The epilogue recomputes its tile's coordinates from its own counter so that the flattened
    # (software-pipelined across tiles) loop carries no coordinates from the main loop into the epilogue.
    tile_id_c = tl.program_id(0) - NUM_SMS
    for tile_id in tl.range(tl.program_id(0), num_tiles, NUM_SMS, flatten=True):
        pid_m, pid_n = _tile_coords(tile_id, num_pid_m, num_pid_n, GROUP_M)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        acc = _zero_acc(BLOCK_M, BLOCK_N, GROUP_K, ACC_DTYPE)
        for ki in range(k_tiles):
            a = a_desc.load([pid_m * BLOCK_M, ki * BLOCK_K])
            b = b_desc.load([pid_n * BLOCK_N, ki * BLOCK_K])
            acc = _mma(a, b, acc, sa_ptr, sb_ptr, offs_m, offs_n, ki * BLOCK_K, M, N, stride_sa, stride_sb,
                       GROUP_K, ACC_DTYPE)
        tile_id_c += NUM_SMS
        pid_m, pid_n = _tile_coords(tile_id_c, num_pid_m, num_pid_n, GROUP_M)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        c = _row_scaled(acc, sa_ptr, sb_ptr, offs_m, offs_n, M, N, GROUP_K)
        if SUBTILE:  # two stores of BLOCK_N / 2 columns: half the shared memory staging the output
            left, right = tl.split(tl.permute(tl.reshape(c, (BLOCK_M, 2, BLOCK_N // 2)), (0, 2, 1)))
            c_desc.store([pid_m * BLOCK_M, pid_n * BLOCK_N], left.to(c_desc.dtype))
            c_desc.store([pid_m * BLOCK_M, pid_n * BLOCK_N + BLOCK_N // 2], right.to(c_desc.dtype))
        else:
            c_desc.store([pid_m * BLOCK_M, pid_n * BLOCK_N], c.to(c_desc.dtype))


@functools.lru_cache(maxsize=None)
def _num_sms(device_index: int) -> int:
    if _device_class() == _INTERPRET:
        return 4
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _tma_ok(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> bool:
    """TMA needs 16-byte aligned base addresses and row strides, and unit inner strides."""
    return all(t.stride(1) == 1 and (t.stride(0) * t.element_size()) % 16 == 0 and t.data_ptr() % 16 == 0
               for t in (a, b, out))


def scaled_mm(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor,
              out_dtype: torch.dtype = torch.bfloat16, group: int | None = None, impl: str = "auto") -> torch.Tensor:
    """C[M, N] = (A[M, K] @ B[N, K]^T) * scales, with fp8 or int8 A and B.

    Scales: [M] and [N] (group=None), or [M, ceil(K/128)] and [N, ceil(K/128)] (group=128).
    impl: "auto" (TMA persistent kernel on Hopper when aligned, else the pointer kernel), "tma" or "pointer".
    """
    M, K = a.shape
    N, Kb = b.shape
    if K != Kb or (a.dtype == torch.int8) != (b.dtype == torch.int8):
        raise ValueError(f"scaled_mm: incompatible operands {tuple(a.shape)} {a.dtype} and {tuple(b.shape)} {b.dtype}")
    if group not in (None, TILE):
        raise ValueError(f"group must be None or {TILE}, got {group}")
    group_k = 0 if group is None else group
    acc_dtype = tl.int32 if a.dtype == torch.int8 else tl.float32
    c = torch.empty((M, N), dtype=out_dtype, device=a.device)
    if impl == "auto":
        impl = "tma" if _device_class() == _HOPPER and _tma_ok(a, b, c) else "pointer"
    stride_sa = scale_a.stride(0)
    stride_sb = scale_b.stride(0)
    if impl == "tma":
        from triton.tools.tensor_descriptor import TensorDescriptor

        # Block shapes are placeholders until the autotuner's pre-hook sets the launched config's.
        a_desc = TensorDescriptor.from_tensor(a, [16, 16])
        b_desc = TensorDescriptor.from_tensor(b, [16, 16])
        c_desc = TensorDescriptor.from_tensor(c, [16, 16])
        sms = _num_sms(a.device.index or 0)
        grid = lambda meta: (min(sms, triton.cdiv(M, meta["BLOCK_M"]) * triton.cdiv(N, meta["BLOCK_N"])),)
        _scaled_mm_tma_kernel[grid](a_desc, b_desc, c_desc, scale_a, scale_b, M, N, K, stride_sa, stride_sb,
                                    GROUP_K=group_k, ACC_DTYPE=acc_dtype, OUT_BYTES=c.element_size(), NUM_SMS=sms)
    elif impl == "pointer":
        grid = lambda meta: (triton.cdiv(M, meta["BLOCK_M"]) * triton.cdiv(N, meta["BLOCK_N"]),)
        _scaled_mm_kernel[grid](a, b, c, scale_a, scale_b, M, N, K, a.stride(0), a.stride(1), b.stride(0),
                                b.stride(1), c.stride(0), c.stride(1), stride_sa, stride_sb,
                                GROUP_K=group_k, ACC_DTYPE=acc_dtype, OUT_BYTES=c.element_size())
    else:
        raise ValueError(f"impl must be 'auto', 'tma' or 'pointer', got {impl!r}")
    return c


def scaled_mm_reference(a, b, scale_a, scale_b, group: int | None = None) -> torch.Tensor:
    """float64 torch reference for `scaled_mm` on the same quantized operands."""
    sa, sb = scale_a.double(), scale_b.double()
    if group is None:
        return (a.double() @ b.double().T) * sa[:, None] * sb[None, :]
    K = a.shape[1]
    a64 = a.double() * sa.repeat_interleave(group, dim=1)[:, :K]
    b64 = b.double() * sb.repeat_interleave(group, dim=1)[:, :K]
    return a64 @ b64.T
