"""The host side of `--offload optimizer` alone: does the gradient thread slow the AdamW update down?

    python benchmarks/offload_host.py [--params 200e6] [--repeats 3] [--split 12,3]

The offload optimizer (tscale_p2p/offload.py) runs two host threads at once during a training step: the
update thread (torch's fused CPU AdamW over fp32 masters, then a bf16 cast into the upload slot) and the
gradient thread (bf16 staging buffers added into fp32 accumulators). Each of them enters torch's OpenMP
parallel regions, and with libgomp every calling thread gets a team of its own: two teams of `cores`
threads each on `cores` cores. This script times the two jobs on the same buffers the way offload.py
lays them out (64M-value tensors), alone, concurrently, and concurrently while the calling thread keeps a
core busy as the training loop does, with both threads left at torch's default thread count (what offload.py
does) and, with --split, with the cores split between them, and prints a table.
"""

from __future__ import annotations

import argparse
import os
import threading
import time

import torch

CHUNK = 64 * 2**20  # values per tensor


def buffers(params: int) -> dict[str, list[torch.Tensor]]:
    sizes = [CHUNK] * (params // CHUNK) + ([params % CHUNK] if params % CHUNK else [])
    return {
        "master": [torch.randn(n) for n in sizes],
        "grad": [torch.randn(n) * 1e-3 for n in sizes],
        "staging": [torch.randn(n).bfloat16() for n in sizes],
        "slot": [torch.empty(n, dtype=torch.bfloat16) for n in sizes],
    }


def update_job(state: dict, optimizer: torch.optim.Optimizer) -> None:
    optimizer.step()
    for slot, master in zip(state["slot"], state["master"]):
        slot.copy_(master)


def accumulate_job(state: dict, accumulator: list[torch.Tensor]) -> None:
    for total, staged in zip(accumulator, state["staging"]):
        total.add_(staged)


def timed(job, threads: int | None, repeats: int, results: dict, key: str, start: threading.Barrier | None) -> None:
    if threads is not None:
        torch.set_num_threads(threads)
    if start is not None:
        start.wait()
    times = []
    for _ in range(repeats):
        begin = time.perf_counter()
        job()
        times.append(time.perf_counter() - begin)
    results[key] = min(times)


def keep_busy(workers: list[threading.Thread]) -> None:
    """Stand in for the training loop's thread, which keeps one core busy launching GPU work."""
    while any(worker.is_alive() for worker in workers):
        sum(range(10_000))


def run(state, optimizer, accumulator, split: tuple[int, int] | None, together: bool, busy_caller: bool,
        repeats: int) -> dict:
    results: dict[str, float] = {}
    update_threads, gradient_threads = split if split else (None, None)
    jobs = [(lambda: update_job(state, optimizer), update_threads, "update"),
            (lambda: accumulate_job(state, accumulator), gradient_threads, "accumulate")]
    if together:
        start = threading.Barrier(2)
        workers = [threading.Thread(target=timed, args=(job, n, repeats, results, key, start)) for job, n, key in jobs]
        for worker in workers:
            worker.start()
        if busy_caller:
            keep_busy(workers)
        for worker in workers:
            worker.join()
    else:
        for job, n, key in jobs:
            worker = threading.Thread(target=timed, args=(job, n, repeats, results, key, None))
            worker.start()
            worker.join()
    return results


def thread_split(text: str) -> tuple[int, int]:
    """'12,3' -> (12, 3): two positive thread counts."""
    try:
        update, gradient = (int(n) for n in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected UPDATE,GRADIENT thread counts such as 12,3, got {text!r}")
    if update < 1 or gradient < 1:
        raise argparse.ArgumentTypeError(f"thread counts must be at least 1, got {text!r}")
    return update, gradient


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--params", type=float, default=200e6)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--split", type=thread_split, help="also time the jobs with UPDATE,GRADIENT threads each, "
                        "e.g. 12,3")
    args = parser.parse_args()
    params, cores = int(args.params), os.cpu_count()
    state = buffers(params)
    for master, grad in zip(state["master"], state["grad"]):
        master.grad = grad
    optimizer = torch.optim.AdamW(state["master"], lr=1e-4, fused=True)
    accumulator = [torch.zeros(n.numel()) for n in state["staging"]]
    update_job(state, optimizer)  # allocate the moments
    policies = [("default", None)]
    if args.split:
        policies.append((f"split {args.split[0]}/{args.split[1]}", args.split))
    print(f"{params / 1e6:.0f}M parameters, {cores} cores, torch {torch.__version__}, "
          f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}")
    print(f"| threads | jobs | update s | accumulate s | update vs alone, default |")
    print("| --- | --- | --- | --- | --- |")
    reference = None
    modes = {"alone": (False, False), "together": (True, False), "together, caller busy": (True, True)}
    for label, chosen in policies:
        for mode, (together, busy_caller) in modes.items():
            result = run(state, optimizer, accumulator, chosen, together, busy_caller, args.repeats)
            reference = reference or result["update"]
            print(f"| {label} | {mode} | {result['update']:.3f} | {result['accumulate']:.3f} | "
                  f"{result['update'] / reference:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
