"""GEMM and quantize throughput of the fp8/int8 Triton kernels against cuBLAS, in one run, on one GPU.

GEMM: for a linear layer with K inputs, N outputs and M tokens, the three matmuls are
    fwd    Y  = X W^T   (M, N, K)      dgrad  dX = dY W   (M, K, N)      wgrad  dW = dY^T X   (N, K, M)
with M = 16384 and K, N in {768, 2048, 3072, 8192}. Every operand is already quantized (K-major, as the
tensor cores want it), so each row times the matmul alone. fwd and dgrad write bf16, wgrad fp32 (as training
does; cuBLAS bf16 always writes bf16). Columns: ours fp8 (e4m3, row-wise scales, persistent TMA kernel on
Hopper), ours int8, cuBLAS fp8 through torch._scaled_mm with tensor-wise and row-wise scales
(use_fast_accum=True, the setting torchao trains with), cuBLAS int8 (torch._int_mm, no scales), and cuBLAS
bf16 torch.matmul. TFLOP/s = 2*M*N*K / median GPU time (triton.testing.do_bench of a CUDA-graph replay:
the kernel without Python's launch cost, which a table of its own reports).

Quantize: GB/s (bytes read + written) of each quantize kernel on a 16384 x 8192 bf16 tensor against the
device-to-device copy bandwidth measured in the same run (torch's copy_ of the same tensor).

    python benchmarks/kernels.py [--sizes 768,2048,3072,8192] [--tokens 16384] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch
import triton

from tscale_p2p.kernels.gemm import _scaled_mm_tma_kernel, scaled_mm
from tscale_p2p.kernels.quantize import TILE, quantize_cols_t, quantize_rows, quantize_with_transpose


def bench_ms(fn) -> float:
    """Median GPU time of `fn`, replayed from a CUDA graph: the kernels alone. A Triton launch costs the CPU
    80-150 us in Python (`launch_cost_table`), more than many of these kernels take, so timing plain calls would
    measure the launch (cuBLAS's calls cost far less)."""
    fn()  # compile and autotune outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return triton.testing.do_bench(graph.replay, warmup=10, rep=50, return_mode="median")


def launch_cost_us(fn, calls: int = 200) -> float:
    """CPU time of one call of `fn` in microseconds (calls queued back to back, no synchronization between)."""
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed / calls * 1e6


def gemm_row(m: int, n: int, k: int, impl: str, out_dtype: torch.dtype) -> dict:
    """TFLOP/s of every implementation on C[m, n] = A[m, k] @ B[n, k]^T, the scaled ones writing `out_dtype`."""
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    flops = 2.0 * m * n * k
    row = {"M": m, "N": n, "K": k}

    a8, sa = quantize_rows(a, "e4m3")
    b8, sb = quantize_rows(b, "e4m3")
    ai, sai = quantize_rows(a, "int8")
    bi, sbi = quantize_rows(b, "int8")
    one = torch.ones((), device="cuda")
    cases = {
        "ours_fp8": lambda: scaled_mm(a8, b8, sa, sb, out_dtype=out_dtype, impl=impl),
        "ours_int8": lambda: scaled_mm(ai, bi, sai, sbi, out_dtype=out_dtype, impl=impl),
        "cublas_fp8_tensor": lambda: torch._scaled_mm(a8, b8.t(), one, one, out_dtype=out_dtype,
                                                      use_fast_accum=True),
        "cublas_fp8_row": lambda: torch._scaled_mm(a8, b8.t(), sa[:, None], sb[None, :],
                                                   out_dtype=out_dtype, use_fast_accum=True),
        "cublas_int8": lambda: torch._int_mm(ai, bi.t()),
        "cublas_bf16": lambda: torch.matmul(a, b.t()),
    }
    if impl == "auto":
        a_t, sa_t = quantize_rows(a, "e4m3", TILE)
        b_t, sb_t = quantize_rows(b, "e4m3", TILE)
        cases["ours_fp8_tile128"] = lambda: scaled_mm(a_t, b_t, sa_t, sb_t, out_dtype=out_dtype, group=TILE)
    for name, fn in cases.items():
        try:
            row[name] = flops / bench_ms(fn) / 1e9
        except Exception as e:  # noqa: BLE001  (a baseline cuBLAS lacks for a shape must not end the sweep)
            print(f"  {name} {m}x{n}x{k}: {type(e).__name__}: {e}", file=sys.stderr)
            row[name] = float("nan")
    # Correctness of what was timed, against the bf16 product of the unquantized operands.
    ref = (a.float() @ b.float().t())
    for name in ("ours_fp8", "ours_int8"):
        out = cases[name]().float()
        row[name + "_relerr"] = ((out - ref).norm() / ref.norm()).item()
    return row


def quantize_rows_table(tokens: int, width: int) -> list[dict]:
    x = torch.randn(tokens, width, device="cuda", dtype=torch.bfloat16)
    y = torch.empty_like(x)
    n = x.numel()
    copy_gbs = 2 * n * 2 / bench_ms(lambda: y.copy_(x)) / 1e6
    x_q, x_s = quantize_rows(x, "e4m3")
    # bytes: read bf16 once, write one byte per element (+ fp32 scales, negligible but counted); the transposed
    # casts with column scales read their input twice (the column maxima, then the cast)
    kernels = {
        "rows e4m3 (row scales)": (lambda: quantize_rows(x, "e4m3"), 3 * n + 4 * tokens),
        "rows e4m3 (1x128 tiles)": (lambda: quantize_rows(x, "e4m3", TILE), 3 * n + 4 * n // TILE),
        "rows int8 (row scales)": (lambda: quantize_rows(x, "int8"), 3 * n + 4 * tokens),
        "rows e4m3 stochastic": (lambda: quantize_rows(x, "e4m3", stochastic=True), 3 * n + 4 * tokens),
        "transposed e4m3 (col scales)": (lambda: quantize_cols_t(x, "e4m3"), 5 * n + 8 * width),
        "transposed e4m3 from e4m3 rows (wgrad operand)": (lambda: quantize_cols_t(x_q, "e4m3", row_mul=x_s),
                                                           3 * n + 4 * tokens + 8 * width),
        "transposed e4m3 (128x1 tiles)": (lambda: quantize_cols_t(x, "e4m3", TILE), 3 * n + 4 * n // TILE),
    }
    rows = [{"kernel": "torch copy_ (bf16, read+write)", "GB/s": copy_gbs, "of_copy": 1.0}]
    for name, (fn, nbytes) in kernels.items():
        gbs = nbytes / bench_ms(fn) / 1e6
        rows.append({"kernel": name, "GB/s": gbs, "of_copy": gbs / copy_gbs})
    return rows


def weight_quantize_table(shapes: list[tuple[int, int]]) -> list[dict]:
    """Both quantized layouts of an fp32 weight (what a linear layer rebuilds after each optimizer step): the row
    kernel and the transposed kernel (which reads the weight twice: its column maxima, then the cast), against
    the tiled two-pass version. GB/s counts one read of the weight and the two one-byte copies written."""
    rows = []
    for shape in shapes:
        w = torch.randn(shape, device="cuda")
        y = torch.empty_like(w)
        n = w.numel()
        copy_gbs = 2 * 4 * n / bench_ms(lambda: y.copy_(w)) / 1e6

        def two_kernels():
            return *quantize_rows(w, "e4m3"), *quantize_cols_t(w, "e4m3")

        for name, fn in (("row kernel + transposed kernel", two_kernels),
                         ("tiled two passes (quantize_with_transpose)", lambda: quantize_with_transpose(w, "e4m3"))):
            ms = bench_ms(fn)
            gbs = 6 * n / ms / 1e6
            rows.append({"shape": f"{shape[0]}x{shape[1]}", "kernel": name, "ms": ms, "GB/s": gbs,
                         "of_copy": gbs / copy_gbs})
    return rows


def launch_cost_table(m: int, n: int, k: int) -> list[dict]:
    """CPU microseconds per call of our GEMM and quantize kernels and of cuBLAS, on one shape."""
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    x8, sx = quantize_rows(x, "e4m3")
    w8, sw = quantize_rows(w, "e4m3")
    calls = {
        "ours fp8 GEMM (scaled_mm)": lambda: scaled_mm(x8, w8, sx, sw),
        "cuBLAS fp8 row-wise (torch._scaled_mm)": lambda: torch._scaled_mm(
            x8, w8.t(), sx[:, None], sw[None, :], out_dtype=torch.bfloat16, use_fast_accum=True),
        "cuBLAS bf16 (torch.matmul)": lambda: torch.matmul(x, w.t()),
        "ours quantize_rows (e4m3)": lambda: quantize_rows(x, "e4m3"),
    }
    return [{"call": name, "cpu_us": launch_cost_us(fn), "gpu_us": bench_ms(fn) * 1e3} for name, fn in calls.items()]


def print_gemm_table(problems: dict, sizes: list[int], m: int, cols: list[str]) -> list[dict]:
    """Print one row per (layer, matmul); return the rows."""
    print("\n## GEMM TFLOP/s (M = %d tokens)\n" % m)
    print("| layer K->N | matmul | M x N x K | " + " | ".join(cols) +
          " | ours fp8 / cuBLAS fp8 row | ours fp8 / bf16 | ours int8 / bf16 | fp8 rel err |")
    print("|" + " --- |" * (len(cols) + 7))
    table = []
    for k in sizes:
        for n in sizes:
            for matmul, shape in (("fwd", (m, n, k)), ("dgrad", (m, k, n)), ("wgrad", (n, k, m))):
                r = problems[shape]
                table.append({"layer_in": k, "layer_out": n, "matmul": matmul, **r})
                print(f"| {k}->{n} | {matmul} | {shape[0]}x{shape[1]}x{shape[2]} | " +
                      " | ".join(f"{r[c]:.0f}" for c in cols) +
                      f" | {r['ours_fp8'] / r['cublas_fp8_row']:.2f} | {r['ours_fp8'] / r['cublas_bf16']:.2f}"
                      f" | {r['ours_int8'] / r['cublas_bf16']:.2f} | {r['ours_fp8_relerr']:.4f} |")
    return table


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="768,2048,3072,8192")
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--impl", default="auto", choices=["auto", "tma", "pointer"])
    p.add_argument("--no-gemm", action="store_true", help="only the quantize table")
    p.add_argument("--json", help="also write every figure here")
    args = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("benchmarks/kernels.py needs a CUDA GPU")
    sizes = [int(s) for s in args.sizes.split(",")]
    m = args.tokens
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}", flush=True)

    # fwd (M, N, K) of layer (K -> N) is the dgrad problem of layer (N -> K): with K and N drawn from the same
    # set, every dgrad shape is some layer's fwd shape, timed once and reported under both names.
    # wgrad writes fp32, as the training backward does (a bf16 output would time smaller epilogues than it runs)
    problems, wgrad_shapes = {}, set()
    for k in [] if args.no_gemm else sizes:
        for n in sizes:
            problems.setdefault((m, n, k), None)
            problems.setdefault((n, k, m), None)
            wgrad_shapes.add((n, k, m))
    for shape in problems:
        out_dtype = torch.float32 if shape in wgrad_shapes else torch.bfloat16
        problems[shape] = gemm_row(*shape, impl=args.impl, out_dtype=out_dtype)
        r = problems[shape]
        print(f"  {shape}: ours fp8 {r['ours_fp8']:.0f}  cuBLAS fp8 row {r['cublas_fp8_row']:.0f}  "
              f"bf16 {r['cublas_bf16']:.0f} TFLOP/s", flush=True)

    cols = ["ours_fp8", "ours_int8", "cublas_fp8_tensor", "cublas_fp8_row", "cublas_int8", "cublas_bf16"]
    if args.impl == "auto":
        cols.insert(2, "ours_fp8_tile128")
    table = [] if args.no_gemm else print_gemm_table(problems, sizes, m, cols)
    if problems:
        print("\n## Configs the autotuner chose for the TMA kernel (M, N, K, ..., dtypes)\n")
        for key, config in _scaled_mm_tma_kernel.cache.items():
            print(f"- {key}: {config}")
    launches = launch_cost_table(m, max(sizes), max(sizes))
    print(f"\n## CPU time per call against GPU time ({m} x {max(sizes)} x {max(sizes)})\n")
    print("| call | CPU us per call | GPU us per call |\n| --- | --- | --- |")
    for r in launches:
        print(f"| {r['call']} | {r['cpu_us']:.0f} | {r['gpu_us']:.0f} |")
    quant = quantize_rows_table(m, max(sizes))
    print(f"\n## Quantize, {m} x {max(sizes)} bf16 input\n")
    print("| kernel | GB/s | of copy bandwidth |\n| --- | --- | --- |")
    for r in quant:
        print(f"| {r['kernel']} | {r['GB/s']:.0f} | {r['of_copy']:.2f} |")
    weights = weight_quantize_table([(2048, 8192), (8192, 2048), (6144, 2048)])
    print("\n## A weight's two quantized layouts (fp32 weight, e4m3)\n")
    print("| weight | kernels | ms | GB/s | of copy bandwidth |\n| --- | --- | --- | --- | --- |")
    for r in weights:
        print(f"| {r['shape']} | {r['kernel']} | {r['ms']:.3f} | {r['GB/s']:.0f} | {r['of_copy']:.2f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "gemm": table, "launch_cost": launches,
                       "quantize": quant, "weights": weights}, f, indent=1)


if __name__ == "__main__":
    main()
