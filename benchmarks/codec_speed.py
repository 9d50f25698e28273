"""The swarm's codecs on the CPU, where averaging runs: millions of values a second to encode and decode a part.

    python benchmarks/codec_speed.py [--threads 1] [--sizes 20,24]

Each codec encodes a vector of 2^size Gaussian values (`compress`, what a sender and a reducer do with each part)
and decodes it (`extract`, what a reducer and every receiver do); the best of `--repeats` runs. The values' scale
changes from block to block (log-normal, an e-fold's spread), as a swarm's update does across a model's tensors:
e8s's reducers code a second and third stage only where it could pay, so their speed follows that spread. The
sign code is one pass of a fused kernel; E8 words also rotate each block and match every 8 values against 256
words. A codec whose reducers answer in a code of their own (topk, e8s) gets a row for that too.
"""

from __future__ import annotations

import argparse
import time

import torch

from tscale_p2p.peers.codec import BLOCK_SIZE, CODECS


def best_seconds(work, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        work()
        times.append(time.perf_counter() - started)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (join gives a peer its share)")
    parser.add_argument("--sizes", default="20,24", help="log2 of the values per part, comma-separated")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {args.threads} thread(s)")
    print("| codec | values | encode M values/s | decode M values/s | encode vs sign | decode vs sign |")
    print("| --- | --- | --- | --- | --- | --- |")
    for log_size in (int(s) for s in args.sizes.split(",")):
        draws = torch.Generator().manual_seed(0)
        scales = torch.randn(2**log_size // BLOCK_SIZE, generator=draws).exp().repeat_interleave(BLOCK_SIZE)
        x = torch.randn(2**log_size, generator=draws) * scales
        rates = {}
        for name, make in CODECS.items():
            trip_out = make()
            # a reducer's answer, where it has a code of its own (top-k's denser one, e8s's stages)
            back = [] if trip_out.return_trip is trip_out else [(f"{name} (return trip)", trip_out.return_trip)]
            for label, codec in [(name, trip_out), *back]:
                message = codec.compress(x, None)
                encode = best_seconds(lambda: codec.compress(x, None), args.repeats)
                decode = best_seconds(lambda: codec.extract(message), args.repeats)
                rates[label] = (x.numel() / encode / 1e6, x.numel() / decode / 1e6)
        for name, (encode, decode) in rates.items():
            sign_encode, sign_decode = rates["sign"]
            print(f"| {name} | 2^{log_size} | {encode:.0f} | {decode:.0f} | {encode / sign_encode:.2f}x "
                  f"| {decode / sign_decode:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
