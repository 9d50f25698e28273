"""Every Triton kernel compiles for the GPUs it is written for, Hopper (sm_90) and Ada (sm_89), and fits their
shared memory, checked without a GPU.

The CPU tests run the kernels under Triton's interpreter, which accepts code the GPU compiler rejects (a value
defined inside a loop and used after it, for one). Here Triton's own compiler builds each kernel for those
targets, as it would on the user's machine. It runs in a child process without TRITON_INTERPRET, because the
test session imports the kernels in interpreter mode.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

HOPPER, ADA = 90, 89
POINTER_TYPE = {"e4m3": "*fp8e4nv", "e5m2": "*fp8e5", "int8": "*i8"}


def format_constants(name: str) -> dict:
    """The quantize kernels' constexprs for one of `FORMATS`, with the GPU's own cast."""
    from tscale_p2p.kernels.quantize import FORMATS

    f = FORMATS[name]
    return {"QMAX": f.max_value, "IS_INT": f.is_int, "MANTISSA_BITS": f.mantissa_bits,
            "MIN_NORMAL_EXP": f.min_normal_exp, "EMULATE_CAST": False}


def kernel_cases():
    """(label, kernel, target, argument types, constexprs, options) for each kernel in the shapes it is used."""
    import triton.language as tl

    from tscale_p2p.kernels import gemm, onebit_triton, quantize as q

    rows_types = {"seed": "i32", "M": "i32", "K": "i32", "stride_xm": "i32", "stride_xk": "i32", "stride_qm": "i32",
                  "stride_sm": "i32", "s_ptr": "*fp32"}
    for x, fmt, stochastic, block in (("*bf16", "e4m3", False, (4, 2048)), ("*bf16", "int8", True, (64, 128)),
                                      ("*fp32", "e5m2", True, (64, 128))):
        out = POINTER_TYPE[fmt]
        yield (f"quantize rows {x}->{out}", q._quantize_rows_kernel, HOPPER, {**rows_types, "x_ptr": x, "q_ptr": out},
               {**format_constants(fmt), "STOCHASTIC": stochastic, "BLOCK_M": block[0], "BLOCK_K": block[1]},
               {"num_warps": 8})
    cols_types = {"s_ptr": "*fp32", "colmax_ptr": "*fp32", "rowmul_ptr": "*fp32", "M": "i32", "K": "i32",
                  "stride_xm": "i32", "stride_xk": "i32", "stride_qk": "i32", "stride_sk": "i32", "seed": "i32"}
    for x, fmt, tiles, row_mul, stochastic in (("*bf16", "e4m3", False, False, False),
                                               ("*fp8e4nv", "e4m3", False, True, True),
                                               ("*i8", "int8", False, True, False),
                                               ("*bf16", "e4m3", True, False, False)):
        out = POINTER_TYPE[fmt]
        block_m, block_k, warps = q._cols_t_blocks(tiles, one_byte=x != "*bf16")
        yield (f"quantize cols_t {x}->{out}", q._quantize_cols_t_kernel, HOPPER,
               {**cols_types, "x_ptr": x, "q_ptr": out},
               {**format_constants(fmt), "STOCHASTIC": stochastic, "TILE_SCALES": tiles, "ROW_MUL": row_mul,
                "BLOCK_M": block_m, "BLOCK_K": block_k}, {"num_warps": warps})
    amax_types = {"rowmul_ptr": "*fp32", "row_amax_ptr": "*fp32", "col_amax_ptr": "*fp32", "M": "i32", "K": "i32",
                  "stride_xm": "i32", "stride_xk": "i32"}
    for x, row_mul, row_amax, block in (("*fp32", False, True, (q.WEIGHT_TILE, q.WEIGHT_TILE, 1)),
                                         ("*fp8e4nv", True, False, q.COL_AMAX_BLOCKS)):
        yield (f"abs max {x}", q._abs_max_kernel, HOPPER, {**amax_types, "x_ptr": x},
               {"ROW_MUL": row_mul, "ROW_AMAX": row_amax, "BLOCK_M": block[0], "BLOCK_K": block[1],
                "ROW_BLOCKS": block[2]}, {"num_warps": 4})
    for fmt in ("e4m3", "int8"):
        out = POINTER_TYPE[fmt]
        yield (f"quantize both {out}", q._quantize_both_kernel, HOPPER,
               {"x_ptr": "*fp32", "q_ptr": out, "qt_ptr": out, "row_amax_ptr": "*fp32", "col_amax_ptr": "*fp32",
                "s_ptr": "*fp32", "st_ptr": "*fp32", "M": "i32", "K": "i32", "stride_xm": "i32", "stride_xk": "i32"},
               {**format_constants(fmt), "BLOCK_M": q.WEIGHT_TILE, "BLOCK_K": q.WEIGHT_TILE}, {"num_warps": 4})
    yield ("transpose", q._transpose_kernel, HOPPER,
           {"x_ptr": "*fp8e4nv", "y_ptr": "*fp8e4nv", "M": "i32", "K": "i32", "stride_xm": "i32", "stride_ym": "i32"},
           {"BLOCK_M": 64, "BLOCK_K": 128}, {"num_warps": 4})

    # The GEMMs: every autotune configuration of the device class, with the output it is chosen for.
    scalars = {"sa_ptr": "*fp32", "sb_ptr": "*fp32", "M": "i32", "N": "i32", "K": "i32", "stride_sa": "i32",
               "stride_sb": "i32"}
    first_hopper_config = True
    for config, kind in gemm._TAGGED_CONFIGS:
        meta = config.kwargs
        options = {"num_warps": config.num_warps, "num_stages": config.num_stages}
        if kind == gemm._HOPPER:
            out = "fp32" if meta["SUBTILE"] else "bf16"  # the subtiled twin exists for the fp32 output
            c_block = [meta["BLOCK_M"], meta["BLOCK_N"] // 2 if meta["SUBTILE"] else meta["BLOCK_N"]]
            operands = [("fp8e4nv", tl.float32)]
            if first_hopper_config:  # int8 differs only in its accumulator: one tile is enough
                operands.append(("i8", tl.int32))
            first_hopper_config = False
            for operand, acc in operands:
                types = {**scalars,
                         "a_desc": f"tensordesc<{operand}[{meta['BLOCK_M']}, {meta['BLOCK_K']}]>",
                         "b_desc": f"tensordesc<{operand}[{meta['BLOCK_N']}, {meta['BLOCK_K']}]>",
                         "c_desc": f"tensordesc<{out}{c_block}>"}
                yield (f"GEMM (TMA) {operand} {meta}", gemm._scaled_mm_tma_kernel.fn, HOPPER, types,
                       {**meta, "GROUP_K": 0, "ACC_DTYPE": acc, "OUT_BYTES": 4 if out == "fp32" else 2,
                        "NUM_SMS": 132}, options)
        elif kind == gemm._CONSUMER:
            for operand, acc, out, group_k in (("fp8e4nv", tl.float32, "bf16", 0), ("i8", tl.int32, "fp32", 0),
                                               ("fp8e4nv", tl.float32, "fp32", 128)):
                types = {**scalars, "a_ptr": f"*{operand}", "b_ptr": f"*{operand}", "c_ptr": f"*{out}",
                         "stride_am": "i32", "stride_ak": "i32", "stride_bn": "i32", "stride_bk": "i32",
                         "stride_cm": "i32", "stride_cn": "i32"}
                yield (f"GEMM (pointer) {operand} group {group_k} {meta}", gemm._scaled_mm_kernel.fn, ADA, types,
                       {**meta, "GROUP_K": group_k, "ACC_DTYPE": acc, "OUT_BYTES": 4 if out == "fp32" else 2},
                       options)

    for update in (True, False):
        yield (f"1-bit pack, residual {update}", onebit_triton._error_feedback_pack_kernel, HOPPER,
               {"x_ptr": "*fp32", "residual_ptr": "*fp32", "signs_ptr": "*u8", "scales_ptr": "*fp32", "numel": "i32"},
               {"BLOCK": 256, "ROWS": 16, "UPDATE_RESIDUAL": update}, {"num_warps": 4})
    yield ("1-bit unpack", onebit_triton._unpack_kernel, HOPPER,
           {"signs_ptr": "*u8", "scales_ptr": "*fp32", "out_ptr": "*fp32", "numel": "i32"},
           {"BLOCK": 256, "TILE": 4096}, {"num_warps": 4})


def compile_all() -> int:
    """Compile every case; print one line per failure; the number of failures."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from tscale_p2p.kernels.gemm import ADA_SHARED_MEMORY, HOPPER_SHARED_MEMORY

    shared_memory = {HOPPER: HOPPER_SHARED_MEMORY, ADA: ADA_SHARED_MEMORY}
    failures = 0
    for label, kernel, cc, types, constexprs, options in kernel_cases():
        signature = {name: "constexpr" if name in constexprs else types[name] for name in kernel.arg_names}
        try:
            compiled = triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=constexprs),
                                      target=GPUTarget("cuda", cc, 32), options=options)
            if compiled.metadata.shared > shared_memory[cc]:
                raise RuntimeError(f"needs {compiled.metadata.shared} bytes of shared memory, sm_{cc} has "
                                   f"{shared_memory[cc]}")
        except Exception as error:  # noqa: BLE001  (report every kernel, not just the first failure)
            failures += 1
            print(f"FAILED sm_{cc} {label}: {type(error).__name__}: {str(error).strip()[-1500:]}", flush=True)
    return failures


def test_every_kernel_compiles_for_hopper_and_ada(tmp_path):
    pytest.importorskip("triton.backends.nvidia")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton-cache")
    proc = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]


if __name__ == "__main__":
    sys.exit(min(compile_all(), 1) if "TRITON_INTERPRET" not in os.environ else "unset TRITON_INTERPRET first")
