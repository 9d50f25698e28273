"""The fused error-feedback 1-bit pack and the unpack kernel in GB/s, next to a device-to-device copy.

Needs CUDA (and not hivemind, so it runs on a bare GPU machine):

    python benchmarks/onebit_pack.py [--block-size 256]

The pack reads x and the residual and writes the residual, the sign bits (n/8 bytes) and one bf16 scale per
block; the copy reads and writes n fp32 values. `rows` is the kernel's best rows-per-program setting.
"""

from __future__ import annotations

import argparse

import torch
import triton.testing

from tscale_p2p.kernels.onebit import error_feedback_pack_triton, unpack_triton


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--block-size", type=int, default=256, help="values per scale (the codec's BLOCK_SIZE)")
    block = parser.parse_args().block_size
    assert torch.cuda.is_available(), "needs CUDA"
    print(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}  block {block}")
    print("| values | copy GB/s | ef-pack GB/s | pack % of copy | unpack GB/s | rows |")
    print("| --- | --- | --- | --- | --- | --- |")
    for log_size in (24, 26, 28):
        n = 2**log_size
        x = torch.randn(n, device="cuda")
        residual = torch.randn(n, device="cuda") * 0.01
        out = torch.empty_like(x)
        copy_gbs = 8 * n / triton.testing.do_bench(lambda: out.copy_(x), return_mode="median") / 1e6
        timings = {
            rows: triton.testing.do_bench(
                lambda: error_feedback_pack_triton(x, residual, block, rows), return_mode="median"
            )
            for rows in (1, 2, 4, 8, 16, 32)
        }
        rows = min(timings, key=timings.get)
        pack_gbs = (12 * n + n / 8 + 2 * n / block) / timings[rows] / 1e6
        signs, scales = error_feedback_pack_triton(x, residual, block)
        unpack_ms = triton.testing.do_bench(lambda: unpack_triton(signs, scales, n, block), return_mode="median")
        unpack_gbs = (4 * n + n / 8 + 2 * n / block) / unpack_ms / 1e6
        print(f"| {n} | {copy_gbs:.0f} | {pack_gbs:.0f} | {100 * pack_gbs / copy_gbs:.0f}% | {unpack_gbs:.0f} | {rows} |")


if __name__ == "__main__":
    main()
