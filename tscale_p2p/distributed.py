"""Synchronous data-parallel training (TScale's mode for identical hosts) over torch.distributed.

Every rank runs the same `Trainer` step on its own data (a per-rank sampling seed) with the model wrapped in
DDP, whose comm hook averages (and with `--sync-compression` compresses) the gradients; clipping and AdamW then
see the averaged gradient, so every rank applies the same update. Rank 0 logs, evaluates and writes
checkpoints. The process group comes from torchrun's environment (`RANK`, `WORLD_SIZE`, `LOCAL_RANK`,
`MASTER_ADDR`/`MASTER_PORT`): NCCL on GPUs, gloo on CPUs, plus a small gloo group for control messages (stop
requests, the logged loss) that never synchronises a GPU.

Faults: a stop signal on any rank is shared through the control group at the next step boundary, so all
ranks stop after the same step and rank 0 saves once. A rank that dies or hangs makes the others' next
collective fail (at once for a closed connection, after `--sync-timeout` seconds for a silent peer); they
report it in one line and exit 1, leaving the newest checkpoint as it was.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import inspect
import logging
import os
from dataclasses import dataclass
from datetime import timedelta
from functools import partial

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from tscale_p2p.checkpoint import Checkpoint
from tscale_p2p.comm_hooks import OneBitAllReduce, register_compression
from tscale_p2p.config import TrainConfig
from tscale_p2p.errors import UserError
from tscale_p2p.solo import prepare_trainer, run_training
from tscale_p2p.device import resolve_device
from tscale_p2p.trainer import StepStats, Trainer

log = logging.getLogger(__name__)


# The buffers (rotary tables) are the same on every rank by construction: no broadcast of them in every forward.
# torch 2.13 renamed the flag; the GPU machine's 2.11 knows only the old name.
_NO_FORWARD_BUFFER_SYNC = (
    {"forward_sync_buffers": False}
    if "forward_sync_buffers" in inspect.signature(DistributedDataParallel).parameters
    else {"broadcast_buffers": False}
)


class RankLost(Exception):
    """A collective failed: another rank is gone (died, killed, hung past the timeout) or the network failed."""


@dataclass(frozen=True)
class RankEnvironment:
    """Where this process sits in the job, as torchrun (or any launcher that sets its variables) says."""

    rank: int
    world_size: int
    local_rank: int

    @classmethod
    def from_environ(cls, environ=os.environ) -> "RankEnvironment | None":
        """The job torchrun started this process in, or None when it was started on its own."""
        if "RANK" not in environ or "WORLD_SIZE" not in environ:
            return None
        try:
            return cls(int(environ["RANK"]), int(environ["WORLD_SIZE"]), int(environ.get("LOCAL_RANK", 0)))
        except ValueError:
            raise UserError(
                f"RANK={environ['RANK']!r} WORLD_SIZE={environ['WORLD_SIZE']!r} are not whole numbers"
            ) from None


def compression_for(cfg: TrainConfig, world_size: int) -> str:
    """The compression in effect: `auto` is onebit on two or more ranks and none alone."""
    if cfg.sync_compression == "auto":
        return "onebit" if world_size > 1 else "none"
    return cfg.sync_compression


def check_sync_config(cfg: TrainConfig, world_size: int, device_type: str) -> None:
    """Refuse settings that cannot work at this world size and on this device, before any rank starts."""
    compression = compression_for(cfg, world_size)
    if compression == "bf16" and device_type != "cuda" and world_size > 1:
        raise UserError(
            "sync-compression bf16 needs GPUs: torch's bf16 hook runs on NCCL only, not on gloo (CPU ranks); "
            "use none, powersgd or onebit"
        )
    if world_size == 1 and compression != "none":
        raise UserError(
            f"sync-compression {compression} compresses what ranks exchange, and world size 1 exchanges nothing: "
            "start more ranks (--nproc-per-node N or torchrun) or drop --sync-compression"
        )
    if world_size > 1 and cfg.offload != "none":
        raise UserError(
            "--offload optimizer does not work with data-parallel training: the offloaded optimizer copies each "
            "gradient to the host as backward produces it, before DDP has averaged it across ranks"
        )
    if compression == "powersgd" and cfg.sync_warmup_steps < 2:
        raise UserError(
            f"sync-warmup-steps must be at least 2 with powersgd (torch's PowerSGD starts after DDP's second "
            f"step), got {cfg.sync_warmup_steps}"
        )


def rank_seed(seed: int, rank: int) -> int:
    """The data-sampling seed of `rank`: rank 0 samples exactly as a solo run with `seed` does."""
    if rank == 0:
        return seed
    return int.from_bytes(hashlib.sha256(f"rank{rank}/{seed}".encode()).digest()[:8], "little")


class DataParallelTrainer(Trainer):
    """`Trainer` with the model in DDP and a comm hook; the step, optimizer and clipping are the solo ones."""

    def __init__(self, model_cfg, cfg: TrainConfig, corpus, device: torch.device, *, rank: int, world_size: int,
                 compression: str) -> None:
        super().__init__(model_cfg, cfg, corpus, device)
        self.rank, self.world_size = rank, world_size
        self.train_batches = self.training_windows(rank_seed(cfg.seed, rank))
        # torch's PowerSGD hook issues collectives from completion callbacks; on gloo those of different buckets
        # then reach the ranks in different orders (a size-mismatch abort), so there it gets a single bucket.
        one_bucket = {"bucket_cap_mb": 1 << 16} if compression == "powersgd" and device.type != "cuda" else {}
        self.ddp = DistributedDataParallel(
            self.model, device_ids=[device.index] if device.type == "cuda" else None, **_NO_FORWARD_BUFFER_SYNC,
            **one_bucket,
        )
        self.onebit: OneBitAllReduce | None = register_compression(
            self.ddp, compression, cfg.sync_warmup_steps, optimizer=self.optimizer
        )
        self._evaluation_forward = self.forward  # the plain (or compiled) model: evaluation runs on rank 0 alone
        self.forward = torch.compile(self.ddp) if device.type == "cuda" and cfg.compile else self.ddp

    def _accumulating(self, last: bool):
        """Micro-batches before the last only accumulate locally: one exchange per optimizer step."""
        return contextlib.nullcontext() if last else self.ddp.no_sync()

    def local_step(self) -> StepStats:
        stats = super().local_step()
        extra = (self.world_size - 1) * stats.tokens  # the other ranks' micro-batches
        self.tokens_seen += extra
        return dataclasses.replace(stats, tokens=stats.tokens + extra)

    def evaluate(self, *, whole_split: bool = False):
        training_forward, self.forward = self.forward, self._evaluation_forward
        try:
            return super().evaluate(whole_split=whole_split)
        finally:
            self.forward = training_forward

    def restore(self, checkpoint: Checkpoint) -> None:
        """As `Trainer.restore`, but each rank continues its own data stream at the saved position (rank 0's
        stream is the one saved; the others are derived from the seed, so a new world size just adds or drops
        streams)."""
        super().restore(checkpoint)
        self.train_batches.load_state_dict({**checkpoint.meta["data"], "seed": rank_seed(self.cfg.seed, self.rank)})


class ProcessGroupTeam:
    """The ranks of a job as `run_training` sees them: rank 0 leads; stop requests and losses are shared."""

    def __init__(self, rank: int, world_size: int, control: dist.ProcessGroup) -> None:
        self.leader = rank == 0
        self.world_size, self.control = world_size, control

    def should_stop(self, requested: bool) -> bool:
        flag = torch.tensor([float(requested)])
        self._all_reduce(flag, dist.ReduceOp.MAX)
        return bool(flag.item())

    def mean_loss(self, loss: torch.Tensor) -> float:
        total = loss.detach().float().cpu().reshape(1)
        self._all_reduce(total, dist.ReduceOp.SUM)
        return total.item() / self.world_size

    def _all_reduce(self, tensor: torch.Tensor, op) -> None:
        try:
            dist.all_reduce(tensor, op=op, group=self.control)
        except (RuntimeError, dist.DistError) as error:
            raise RankLost(first_line(error)) from None


def first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def train_data_parallel(cfg: TrainConfig, env: RankEnvironment) -> int:
    """One rank of a data-parallel run; returns the exit code (0, or 1 when another rank was lost)."""
    device = resolve_device(cfg.device)
    check_sync_config(cfg, env.world_size, device.type)
    if device.type == "cuda":
        torch.cuda.set_device(env.local_rank)
        device = torch.device("cuda", env.local_rank)
    timeout = timedelta(seconds=cfg.sync_timeout)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", timeout=timeout)
    try:
        control = dist.new_group(backend="gloo", timeout=timeout)
        compression = compression_for(cfg, env.world_size)
        make_trainer = partial(DataParallelTrainer, rank=env.rank, world_size=env.world_size, compression=compression)
        team = ProcessGroupTeam(env.rank, env.world_size, control)
        try:
            trainer = prepare_trainer(cfg, make_trainer=make_trainer, device=device)
            if team.leader:
                log.info("data-parallel: %d ranks, %s, gradients exchanged with %s (first %d steps uncompressed)",
                         env.world_size, dist.get_backend(), compression,
                         cfg.sync_warmup_steps if compression in ("onebit", "powersgd") else 0)
            code = run_training(trainer, cfg, team)
            if team.leader and trainer.onebit is not None and trainer.onebit.wire.values:
                log.info("onebit: %.4f bits/value each way (signs and scales, counted by the hook)",
                         trainer.onebit.wire.bits_per_value_each_way(env.world_size))
            return code
        except RankLost as lost:
            return report_lost(env.rank, str(lost), cfg)
        except (RuntimeError, dist.DistError) as error:
            if not is_collective_failure(error):
                raise
            return report_lost(env.rank, first_line(error), cfg)
    finally:
        with contextlib.suppress(Exception):  # a group whose peers are gone may not shut down cleanly
            dist.destroy_process_group()


def is_collective_failure(error: BaseException) -> bool:
    """Whether an exception out of a step is a failed exchange (a lost peer) rather than a bug to show in full."""
    if isinstance(error, dist.DistError):
        return True
    text = str(error)
    return any(marker in text for marker in ("Connection closed by peer", "Connection reset by peer", "Timed out",
                                             "timed out", "Gloo", "NCCL", "Broken pipe", "ProcessGroup"))


def report_lost(rank: int, reason: str, cfg: TrainConfig) -> int:
    log.error("rank %d: stopping, another rank is gone or unreachable (%s); the newest checkpoint in %s is intact",
              rank, reason, cfg.out)
    return 1
