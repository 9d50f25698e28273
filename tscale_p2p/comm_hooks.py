"""DDP communication hooks for `--sync-compression`: torch's own for none/bf16/powersgd, and our 1-bit one.

`OneBitAllReduce` is DeepSpeed's compressed all-reduce (1-bit Adam) on torch.distributed collectives. On each of
W ranks a gradient bucket of n values is padded to W chunks of whole 1-bit blocks, then:

1. the rank packs `bucket + worker residual` to signs and one bf16 scale per block (`kernels.onebit`, Triton on
   a GPU, torch on the CPU); the residual keeps what the packing lost (error feedback);
2. all-to-all: chunk j of every rank's packed bucket goes to rank j, which unpacks the other W-1 versions of its
   chunk and averages them with its own exact values: its own chunk never crosses the wire, so the rank keeps no
   worker residual for it (packing it too, as DeepSpeed does, only added error);
3. the reducer packs `mean + server residual` (its own residual, for the chunk it reduces) and all-gathers
   the packed chunk; every rank unpacks all W chunks, so every rank applies the same averaged gradient.

Both exchanges carry 1 bit per value plus 16 bits per block (1.0625 bits/value with 256-value blocks), each way.
With `worker_carry=1` and `server_carry=1` the sum of what was applied over many steps equals the sum of the true
mean gradients minus the residuals currently held (the mean of the worker residuals plus the server residuals):
the error never accumulates. `train` damps both residuals instead (`WORKER_CARRY`, `SERVER_CARRY`: half of each is
carried into the next step, as the swarm damps its sender residual): +1.32% val loss against an uncompressed run
over five seeds, against +1.69% with only the worker residual damped and +3.02% (three seeds) with neither,
better at every seed each time; with each reducer's own chunk taken exactly (step 2), +0.51% over five seeds
(benchmarks/RESULTS.md, synchronous mode).

With the optimizer given (AdamW, as `train` does), the exchange carries the preconditioned gradient: the bucket
divided by AdamW's `sqrt(exp_avg_sq) + eps` of its values (the same on every rank, since every rank applied
the same updates), multiplied back after decoding; the residuals live in that space. A block's scale then
measures values that AdamW weighs alike, so a coordinate whose gradients are much smaller than its block's
others is sent at its own size instead of the block's (which AdamW, dividing by that coordinate's own small
second moment, would amplify into noise): +3.0% val loss against an uncompressed run instead of +5.7%
(benchmarks/RESULTS.md).

The first `warmup_steps` optimizer steps of a process use the plain all-reduce: DDP rebuilds its buckets after
its first step (so residuals sized for the first layout would be wasted), and 1-bit Adam too starts with
uncompressed steps. Residuals are per rank and per bucket and live only in memory: a restart (on any world
size) starts them from zero, which forgets at most one step's rounding error.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

from tscale_p2p.errors import UserError
from tscale_p2p.kernels.onebit import error_feedback_pack, unpack

COMPRESSIONS = ("none", "bf16", "powersgd", "onebit")
BLOCK_SIZE = 256  # the swarm codec's block size (measured there: benchmarks/RESULTS.md)
WORKER_CARRY = 0.5  # the share of the worker residual carried into the next step (module docstring)
SERVER_CARRY = 0.5  # the same for the reducer's residual

# all_gather_into_tensor was renamed all_gather_single in torch 2.12; the GPU machine runs 2.11.
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


@dataclass
class WireCount:
    """Bytes this rank handed to collectives for other ranks, and gradient values communicated."""

    bytes_sent: int = 0
    values: int = 0

    def bits_per_value_each_way(self, world_size: int) -> float:
        """Bits sent per value in each direction (to the reducers, back from them); an fp32 ring all-reduce,
        which also sends (W-1)/W of the values each way, reads 32 here."""
        share = 2 * (world_size - 1) / world_size * self.values
        return 8 * self.bytes_sent / share if share else 0.0


@dataclass
class OneBitAllReduce:
    """1-bit compressed all-reduce (mean) with worker and server error feedback; see the module docstring."""

    group: dist.ProcessGroup | None = None
    warmup_steps: int = 0
    optimizer: torch.optim.Optimizer | None = None  # AdamW: exchange its preconditioned gradient (module docstring)
    block_size: int = BLOCK_SIZE
    worker_carry: float = WORKER_CARRY  # both 1: exact error feedback (module docstring)
    server_carry: float = SERVER_CARRY
    steps: int = 0  # optimizer steps (hook calls on the last bucket) seen so far
    worker_residuals: dict[int, torch.Tensor] = field(default_factory=dict)
    server_residuals: dict[int, torch.Tensor] = field(default_factory=dict)
    wire: WireCount = field(default_factory=WireCount)
    # Scratch vectors per bucket, kept between steps: on the CPU a fresh bucket-sized vector costs more in page
    # faults than the pass that fills it (the step-time gain is in benchmarks/RESULTS.md, synchronous mode).
    _scratch: dict[tuple[str, int], torch.Tensor] = field(default_factory=dict)

    def hook(self, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        """The DDP comm hook (`ddp.register_comm_hook(state, OneBitAllReduce.ddp_hook)` form)."""
        warming_up = self.steps < self.warmup_steps
        if bucket.is_last():
            self.steps += 1
        if warming_up:
            return default_hooks.allreduce_hook(self.group, bucket)
        denominators = None
        if self.optimizer is not None:
            out = self._vector("denominators", bucket.index(), bucket.buffer().numel(), bucket.buffer().device)
            denominators = adam_denominators(self.optimizer, bucket.parameters(), out)
        return self.reduce(bucket.index(), bucket.buffer(), denominators)

    @staticmethod
    def ddp_hook(state, bucket):  # unannotated: DDP checks annotations, which this module keeps as strings
        return state.hook(bucket)

    def layout(self, numel: int) -> tuple[int, int]:
        """(world size, values per chunk): W chunks of whole blocks covering `numel` values."""
        world = dist.get_world_size(self.group)
        span = world * self.block_size
        return world, (numel + span - 1) // span * self.block_size

    def reduce(
        self, key: int, tensor: torch.Tensor, denominators: torch.Tensor | None = None
    ) -> torch.futures.Future[torch.Tensor]:
        """Average `tensor` over the group in place, 1-bit compressed; `key` names its residuals (a bucket).
        With `denominators` (flat, tensor's numel, the same on every rank) the 1-bit exchange carries
        `tensor / denominators` and the mean is multiplied back. Returns a future holding `tensor`."""
        world, chunk = self.layout(tensor.numel())
        rank = dist.get_rank(self.group)
        numel, block, device = tensor.numel(), self.block_size, tensor.device
        sign_bytes, scale_count = chunk // 8, chunk // block
        flat = self._vector("flat", key, world * chunk, device)
        values = tensor.reshape(-1)
        if denominators is None:
            flat[:numel].copy_(values)
        else:
            torch.div(values, denominators, out=flat[:numel])
        flat[numel:] = 0
        residual = self._residual(self.worker_residuals, key, world * chunk, device)
        signs, scales = error_feedback_pack(flat, residual, block)
        residual[numel:] = 0  # padding is not a gradient: keep no error for it
        own = residual[rank * chunk : (rank + 1) * chunk]  # what packing lost of the chunk this rank reduces
        own_error = self._vector("own_error", key, chunk, device)
        own_error.copy_(own)
        own.zero_()
        if self.worker_carry != 1:
            residual.mul_(self.worker_carry)
        send = torch.cat([signs.view(world, sign_bytes), scales.view(world, scale_count).view(torch.uint8)], dim=1)
        received = torch.empty_like(send)
        row_bytes = send.shape[1]
        gathered = torch.empty(world * row_bytes, dtype=torch.uint8, device=device)
        self.wire.bytes_sent += 2 * (world - 1) * row_bytes  # a chunk to each other rank, twice
        self.wire.values += numel
        padding_from = max(0, min(chunk, numel - rank * chunk))  # where this rank's chunk runs past the tensor
        # Each exchange completes before the next starts: collectives must be issued in the same order on
        # every rank, and issuing the all-gather from a completion callback would race the next bucket's.
        dist.all_to_all_single(received, send, group=self.group)
        mean = self._mean_of_packed(key, received, chunk)
        mean.add_(own_error, alpha=1 / world)  # our own row decoded, plus what packing lost of it: exact
        mean[padding_from:] = 0
        server_residual = self._residual(self.server_residuals, key, chunk, device)
        own_signs, own_scales = error_feedback_pack(mean, server_residual, block)
        server_residual[padding_from:] = 0
        if self.server_carry != 1:
            server_residual.mul_(self.server_carry)
        _all_gather_flat(gathered, torch.cat([own_signs, own_scales.view(torch.uint8)]), group=self.group)
        for index, row in enumerate(gathered.view(world, row_bytes)):  # decoded straight into the bucket
            start, end = index * chunk, min(numel, (index + 1) * chunk)
            if start < end:
                self._unpack_row(row, chunk, values[start:end])
        if denominators is not None:
            values.mul_(denominators)
        done: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        done.set_result(tensor)
        return done

    def _unpack_row(self, row: torch.Tensor, chunk: int, out: torch.Tensor) -> torch.Tensor:
        """Decode the first `out.numel()` values of one packed chunk (its signs, then bf16 scales as bytes)."""
        count, sign_bytes = out.numel(), chunk // 8
        scales = row[sign_bytes:].view(torch.bfloat16)[: (count + self.block_size - 1) // self.block_size]
        return unpack(row[: (count + 7) // 8], scales, count, self.block_size, out=out)

    def _mean_of_packed(self, key: int, rows: torch.Tensor, chunk: int) -> torch.Tensor:
        mean = self._vector("mean", key, chunk, rows.device)
        self._unpack_row(rows[0], chunk, mean)
        if len(rows) > 1:
            decoded = self._vector("decoded", key, chunk, rows.device)
            for row in rows[1:]:
                mean.add_(self._unpack_row(row, chunk, decoded))
        return mean.div_(len(rows))

    def _vector(self, name: str, key: int, numel: int, device: torch.device) -> torch.Tensor:
        """Scratch fp32 vector `name` of bucket `key` (contents undefined), reallocated when its size changes."""
        vector = self._scratch.get((name, key))
        if vector is None or vector.numel() != numel or vector.device != device:
            vector = self._scratch[(name, key)] = torch.empty(numel, dtype=torch.float32, device=device)
        return vector

    @staticmethod
    def _residual(store: dict[int, torch.Tensor], key: int, numel: int, device: torch.device) -> torch.Tensor:
        """The residual for `key`, zeros when new or when the bucket changed size (DDP's rebuild)."""
        residual = store.get(key)
        if residual is None or residual.numel() != numel or residual.device != device:
            residual = store[key] = torch.zeros(numel, dtype=torch.float32, device=device)
        return residual


def adam_denominators(optimizer: torch.optim.Optimizer, params: list[torch.Tensor],
                      out: torch.Tensor | None = None) -> torch.Tensor | None:
    """`sqrt(exp_avg_sq) + eps` of `params`, flat and in their order: what AdamW divides each gradient value by
    (up to its bias correction, one factor for all), written into `out` (fp32, as many values) when given. None
    while AdamW has no state for some of them."""
    eps = {p: group["eps"] for group in optimizer.param_groups for p in group["params"]}
    states = [optimizer.state.get(p) for p in params]
    if any(not state or "exp_avg_sq" not in state for state in states):
        return None
    if out is None:
        out = torch.empty(sum(p.numel() for p in params), dtype=torch.float32, device=params[0].device)
    start = 0
    for p, state in zip(params, states):
        part = out[start : start + p.numel()]
        torch.sqrt(state["exp_avg_sq"].reshape(-1), out=part).add_(eps[p])
        start += p.numel()
    return out


def register_compression(
    ddp: torch.nn.parallel.DistributedDataParallel, compression: str, warmup_steps: int,
    group: dist.ProcessGroup | None = None, optimizer: torch.optim.Optimizer | None = None,
) -> OneBitAllReduce | None:
    """Install the comm hook for `compression` on `ddp`; returns the 1-bit state (for its byte count) or None.
    `optimizer` (AdamW, stepping `ddp`'s parameters) lets the 1-bit hook exchange the preconditioned gradient."""
    if compression not in COMPRESSIONS:
        raise UserError(f"invalid sync-compression {compression!r}; choose one of {', '.join(COMPRESSIONS)}")
    if compression == "onebit":
        state = OneBitAllReduce(group=group, warmup_steps=warmup_steps, optimizer=optimizer)
        ddp.register_comm_hook(state, OneBitAllReduce.ddp_hook)
        return state
    if compression == "powersgd":
        if warmup_steps < 2:  # torch's PowerSGD refuses to start before DDP's second step
            raise UserError(f"sync-warmup-steps must be at least 2 with powersgd, got {warmup_steps}")
        state = powerSGD_hook.PowerSGDState(
            process_group=group, matrix_approximation_rank=1, start_powerSGD_iter=warmup_steps
        )
        ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
        return None
    hooks: dict[str, Callable] = {"none": default_hooks.allreduce_hook, "bf16": default_hooks.bf16_compress_hook}
    ddp.register_comm_hook(group, hooks[compression])
    return None
