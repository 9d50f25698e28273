"""The 1-bit all-reduce on real gloo process groups (2 and 3 ranks) against a one-process reference of the same
arithmetic, and its error feedback over many steps."""

from __future__ import annotations

import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tscale_p2p.comm_hooks import OneBitAllReduce
from tscale_p2p.kernels.onebit import error_feedback_pack, unpack

BLOCK = 16
SIZES = (1000, 37)  # two "buckets": one spanning many blocks, one shorter than a block per rank
STEPS = 40


def gradient(step: int, rank: int, numel: int) -> torch.Tensor:
    """Rank-specific noise around a mean that does not vanish, so the running sum of means keeps growing."""
    g = torch.Generator().manual_seed(1000 * step + 10 * rank + numel)
    return 0.2 + torch.randn(numel, generator=g) * (1 + rank)


def reference(grads: list[torch.Tensor], workers: list[torch.Tensor], servers: list[torch.Tensor]) -> torch.Tensor:
    """DeepSpeed's compressed all-reduce written out for all ranks in one process; updates the residuals."""
    world, numel = len(grads), grads[0].numel()
    chunk = -(-numel // (world * BLOCK)) * BLOCK
    decoded = []
    for g, residual in zip(grads, workers):
        padded = torch.zeros(world * chunk)
        padded[:numel] = g
        signs, scales = error_feedback_pack(padded, residual, BLOCK)
        residual[numel:] = 0
        decoded.append(unpack(signs, scales, world * chunk, BLOCK).view(world, chunk))
    out = []
    for j in range(world):
        mean = torch.stack([d[j] for d in decoded]).sum(dim=0) / world
        valid = max(0, min(chunk, numel - j * chunk))
        mean[valid:] = 0
        signs, scales = error_feedback_pack(mean, servers[j], BLOCK)
        servers[j][valid:] = 0
        out.append(unpack(signs, scales, chunk, BLOCK))
    return torch.cat(out)[:numel]


def _rank(rank: int, port: int, folder) -> None:
    """One of 3 ranks: the sequence on all 3, then on a group of ranks 0 and 1 (one set of processes, both sizes)."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=3)
    pair = dist.new_group([0, 1])
    for world, group in ((3, None), (2, pair)):
        if rank >= world:
            continue
        allreduce = OneBitAllReduce(group=group, block_size=BLOCK)
        outputs = []
        for step in range(STEPS):
            tensors = [gradient(step, rank, n) for n in SIZES]
            outputs.append([allreduce.reduce(key, t).wait().clone() for key, t in enumerate(tensors)])
        torch.save((outputs, allreduce.wire.bytes_sent, allreduce.wire.values), folder / f"world{world}-rank{rank}.pt")
    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def rank_results(tmp_path_factory):
    folder = tmp_path_factory.mktemp("onebit")
    # spawn, not fork: a forked child can inherit a lock held by one of the parent's threads and hang
    mp.start_processes(_rank, args=(free_port(), folder), nprocs=3, start_method="spawn")
    return folder


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3])
def test_onebit_allreduce_equals_the_reference_on_every_rank_and_its_error_stays_bounded(world, rank_results):
    results = {rank: torch.load(rank_results / f"world{world}-rank{rank}.pt") for rank in range(world)}
    for key, numel in enumerate(SIZES):
        chunk = -(-numel // (world * BLOCK)) * BLOCK
        workers = [torch.zeros(world * chunk) for _ in range(world)]
        servers = [torch.zeros(chunk) for _ in range(world)]
        applied, true_mean = torch.zeros(numel), torch.zeros(numel)
        for step in range(STEPS):
            grads = [gradient(step, r, numel) for r in range(world)]
            expected = reference(grads, workers, servers)
            for rank in range(world):  # every rank applies the same, and it is the reference's
                torch.testing.assert_close(results[rank][0][step][key], expected, rtol=0, atol=0)
            applied += expected
            true_mean += torch.stack(grads).mean(dim=0)
        # Error feedback: what was applied lags the true sum by exactly what the residuals hold now ...
        held = torch.stack(workers).mean(dim=0)[:numel] + torch.cat(servers)[:numel]
        torch.testing.assert_close(applied + held, true_mean, rtol=1e-4, atol=1e-3)
        # ... which stays within one step's gradient while the sum grows: no error accumulates over the steps.
        largest_step = max(gradient(step, r, numel).norm() for step in range(STEPS) for r in range(world))
        assert (applied - true_mean).norm() < largest_step < 0.5 * true_mean.norm()
    # Wire: a chunk of signs + bf16 scales to each other rank, twice (all-to-all, then all-gather).
    bytes_sent, values = results[0][1], results[0][2]
    assert values == STEPS * sum(SIZES)
    per_step = sum(2 * (world - 1) * (c // 8 + 2 * c // BLOCK) for c in (-(-n // (world * BLOCK)) * BLOCK for n in SIZES))
    assert bytes_sent == STEPS * per_step
