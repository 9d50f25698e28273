"""The 1-bit all-reduce on real gloo process groups (2 and 3 ranks) against a one-process reference of the same
arithmetic, its error feedback over many steps, and its exchange of AdamW's preconditioned gradient."""

from __future__ import annotations

import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tscale_p2p.comm_hooks import SERVER_CARRY, WORKER_CARRY, OneBitAllReduce, adam_denominators
from tscale_p2p.kernels.onebit import error_feedback_pack, unpack

BLOCK = 16
SIZES = (1000, 37, 1000)  # "buckets": one spanning many blocks, one shorter than a block per rank, and ...
PRECONDITIONED = 2  # ... one exchanged divided by per-value denominators (as AdamW's sqrt(v) + eps)
STEPS = 40
EXACT, DAMPED = (1.0, 1.0), (WORKER_CARRY, SERVER_CARRY)  # (worker, server) carries: exact error feedback, `train`'s


def denominators(key: int, numel: int) -> torch.Tensor | None:
    """1 and 1e-3 alternating (every block mixes both scales), the same on every rank and step."""
    if key != PRECONDITIONED:
        return None
    return torch.tensor([1.0, 1e-3]).repeat((numel + 1) // 2)[:numel]


def gradient(step: int, rank: int, key: int) -> torch.Tensor:
    """Rank-specific noise around a mean that does not vanish, so the running sum of means keeps growing; the
    preconditioned bucket's values are on the scale of their denominators."""
    numel = SIZES[key]
    g = torch.Generator().manual_seed(1000 * step + 10 * rank + numel)
    scale = denominators(key, numel)
    return (0.2 + torch.randn(numel, generator=g) * (1 + rank)) * (1 if scale is None else scale)


def reference(grads: list[torch.Tensor], workers: list[torch.Tensor], servers: list[torch.Tensor],
              scale: torch.Tensor | None, carry: tuple[float, float] = EXACT) -> torch.Tensor:
    """DeepSpeed's compressed all-reduce written out for all ranks in one process, of `grads / scale` and
    multiplied back by `scale` when there is one, `carry` (worker, server) of each residual kept, each reducer
    taking its own chunk exactly (its 1-bit form plus what packing lost, for which it keeps no residual);
    updates the residuals."""
    world, numel = len(grads), grads[0].numel()
    chunk = -(-numel // (world * BLOCK)) * BLOCK
    decoded, lost = [], []  # lost[j]: what packing lost of rank j's own chunk
    for rank, (g, residual) in enumerate(zip(grads, workers)):
        padded = torch.zeros(world * chunk)
        padded[:numel] = g if scale is None else g / scale
        signs, scales = error_feedback_pack(padded, residual, BLOCK)
        residual[numel:] = 0
        own = residual[rank * chunk : (rank + 1) * chunk]
        lost.append(own.clone())
        own.zero_()
        residual *= carry[0]
        decoded.append(unpack(signs, scales, world * chunk, BLOCK).view(world, chunk))
    out = []
    for j in range(world):
        mean = torch.stack([d[j] for d in decoded]).sum(dim=0) / world
        mean.add_(lost[j], alpha=1 / world)
        valid = max(0, min(chunk, numel - j * chunk))
        mean[valid:] = 0
        signs, scales = error_feedback_pack(mean, servers[j], BLOCK)
        servers[j][valid:] = 0
        servers[j] *= carry[1]
        out.append(unpack(signs, scales, chunk, BLOCK))
    mean = torch.cat(out)[:numel]
    return mean if scale is None else mean * scale


def _rank(rank: int, port: int, folder) -> None:
    """One of 3 ranks: the sequence on all 3, then on a group of ranks 0 and 1 (one set of processes, both sizes)."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=3)
    pair = dist.new_group([0, 1])
    for world, group in ((3, None), (2, pair)):
        if rank >= world:
            continue
        for carry in (EXACT, DAMPED):
            allreduce = OneBitAllReduce(group=group, block_size=BLOCK, worker_carry=carry[0], server_carry=carry[1])
            outputs = []
            for step in range(STEPS):
                outputs.append([
                    allreduce.reduce(key, gradient(step, rank, key), denominators(key, numel)).wait().clone()
                    for key, numel in enumerate(SIZES)
                ])
            result = (outputs, allreduce.wire.bytes_sent, allreduce.wire.values)
            torch.save(result, folder / result_file(world, carry, rank))
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


def result_file(world: int, carry: tuple[float, float], rank: int) -> str:
    return f"world{world}-carry{carry[0]}-{carry[1]}-rank{rank}.pt"


def replay(folder, world: int, key: int, carry: tuple[float, float]):
    """Check that every rank applied the reference's average of bucket `key` at every step (with no `folder`,
    only run the reference); returns the sums applied and of the true means, and the reference's residuals and
    denominators at the end."""
    results = {} if folder is None else {r: torch.load(folder / result_file(world, carry, r)) for r in range(world)}
    numel = SIZES[key]
    chunk = -(-numel // (world * BLOCK)) * BLOCK
    workers = [torch.zeros(world * chunk) for _ in range(world)]
    servers = [torch.zeros(chunk) for _ in range(world)]
    scale = denominators(key, numel)
    applied, true_mean = torch.zeros(numel), torch.zeros(numel)
    for step in range(STEPS):
        grads = [gradient(step, r, key) for r in range(world)]
        expected = reference(grads, workers, servers, scale, carry)
        for rank in results:  # every rank applies the same, and it is the reference's
            torch.testing.assert_close(results[rank][0][step][key], expected, rtol=0, atol=0)
        applied += expected
        true_mean += torch.stack(grads).mean(dim=0)
    return applied, true_mean, workers, servers, scale


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3])
def test_onebit_allreduce_equals_the_reference_on_every_rank_and_its_error_stays_bounded(world, rank_results):
    """With the full worker residual carried (exact error feedback)."""
    for key, numel in enumerate(SIZES):
        applied, true_mean, workers, servers, scale = replay(rank_results, world, key, carry=EXACT)
        # Error feedback: what was applied lags the true sum by exactly what the residuals hold now (divided by
        # the denominators, which are constant here) ...
        held = torch.stack(workers).mean(dim=0)[:numel] + torch.cat(servers)[:numel]
        torch.testing.assert_close(applied + held * (1 if scale is None else scale), true_mean, rtol=1e-4, atol=1e-3)
        # ... which stays within one step's gradient while the sum grows: no error accumulates over the steps.
        largest_step = max(gradient(step, r, key).norm() for step in range(STEPS) for r in range(world))
        assert (applied - true_mean).norm() < largest_step < 0.5 * true_mean.norm()
    # Wire: a chunk of signs + bf16 scales to each other rank, twice (all-to-all, then all-gather).
    _, bytes_sent, values = torch.load(rank_results / result_file(world, EXACT, 0))
    assert values == STEPS * sum(SIZES)
    chunks = [-(-n // (world * BLOCK)) * BLOCK for n in SIZES]
    per_step = sum(2 * (world - 1) * (c // 8 + 2 * c // BLOCK) for c in chunks)
    assert bytes_sent == STEPS * per_step


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3])
def test_the_damped_residuals_are_the_references_and_keep_the_applied_sum_near_the_true_one(world, rank_results):
    """`train`'s hook carries half of each worker and reducer residual into the next step: every rank applies the
    reference of that arithmetic, and the sum applied stays nearer the true sum than with no error feedback (it
    lags it by what the halving dropped)."""
    for key in range(len(SIZES)):
        applied, true_mean, *_ = replay(rank_results, world, key, carry=DAMPED)
        unfed, *_ = replay(None, world, key, carry=(0.0, 0.0))
        assert (applied - true_mean).norm() < 0.9 * (unfed - true_mean).norm()


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3])
def test_the_preconditioned_exchange_sends_small_values_at_their_own_scale_not_at_their_blocks(world, rank_results):
    """Values 1000x smaller than their block's others (AdamW's small-gradient coordinates) reach every rank at
    their own size: the block scale is taken over the values divided by their denominators."""
    applied = torch.stack([step[PRECONDITIONED]
                           for step in torch.load(rank_results / result_file(world, EXACT, 0))[0]])
    small = applied[:, 1::2].abs()
    assert small.max() < 0.05 < applied[:, 0::2].abs().mean()


def test_adam_denominators_are_adamws_divisors_in_the_parameters_order():
    params = [torch.nn.Parameter(torch.randn(3, 4)), torch.nn.Parameter(torch.randn(5))]
    optimizer = torch.optim.AdamW([{"params": params[:1]}, {"params": params[1:], "eps": 1e-3}], lr=0.1)
    assert adam_denominators(optimizer, params) is None  # before its first step AdamW has no second moments
    for p in params:
        p.grad = torch.randn_like(p)
    optimizer.step()
    v = [optimizer.state[p]["exp_avg_sq"] for p in params]
    expected = torch.cat([v[1].sqrt() + 1e-3, v[0].sqrt().reshape(-1) + 1e-8])
    torch.testing.assert_close(adam_denominators(optimizer, params[::-1]), expected, rtol=0, atol=0)
