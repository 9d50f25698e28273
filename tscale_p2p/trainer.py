"""The local trainer: one optimizer step, evaluation, and the three calls the swarm drives.

A solo run (`tscale-peer train`) and a swarm peer (`tscale-peer join`) both call `Trainer.local_step()`;
the swarm adds `snapshot()` at a round's start and `apply_outer_update()` after averaging. Nothing here
knows about the network.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field

from tscale_p2p.checkpoint import Checkpoint, capture_rng_state, restore_rng_state, save_checkpoint
from tscale_p2p.clipping import clip_in_optimizers
from tscale_p2p.config import TrainConfig
from tscale_p2p.device import choose_precision
from tscale_p2p.errors import UserError
from tscale_p2p.model import ModelConfig, Transformer
from tscale_p2p.schema import validated
from tscale_p2p.tokenizer import checkpoint_entry

log = logging.getLogger(__name__)

# Dense bf16 tensor-core peak (FLOP/s) by device-name fragment, for MFU. Unknown devices report no MFU.
PEAK_BF16_FLOPS = {
    "H200": 989e12,
    "H100": 989e12,
    "A100": 312e12,
    "L40S": 362e12,
    "RTX 4090": 165e12,
    "RTX 3090": 71e12,
}


def limit_gpu_memory(gib: float | None, device: torch.device) -> None:
    """`--gpu-memory-limit`: let this process allocate at most `gib` GiB on `device`, like a smaller card."""
    if gib is None:
        return
    if device.type != "cuda":
        log.warning("--gpu-memory-limit applies to CUDA devices only; ignored on %s", device)
        return
    total = torch.cuda.get_device_properties(device).total_memory
    if gib * 2**30 > total:
        raise UserError(f"--gpu-memory-limit {gib:g} GiB is more than the {total / 2**30:.1f} GiB of this GPU")
    index = device.index if device.index is not None else torch.cuda.current_device()  # torch wants an index
    torch.cuda.set_per_process_memory_fraction(gib * 2**30 / total, index)


def is_matrix(name: str, param: torch.Tensor) -> bool:
    """A weight matrix of a linear layer (weight-decayed; bf16 on the device under offload)."""
    return param.dim() >= 2 and "emb" not in name


def is_embedding(name: str, param: torch.Tensor) -> bool:
    """An embedding table (a tied output head included: it is registered as the token embedding)."""
    return param.dim() >= 2 and "emb" in name


def peak_flops(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((flops for key, flops in PEAK_BF16_FLOPS.items() if key in name), None)


@dataclass
class StepStats:
    """What one optimizer step did. `loss` stays a device tensor so logging decides when to synchronise."""

    step: int
    loss: torch.Tensor
    lr: float
    tokens: int


@dataclass
class EvalStats:
    loss: float  # nats per token
    bits_per_byte: float | None


class Trainer:
    """Owns the model, the optimizer and the training data stream of one peer."""

    def __init__(self, model_cfg: ModelConfig, cfg: TrainConfig, corpus, device: torch.device) -> None:
        self.cfg, self.model_cfg, self.corpus, self.device = cfg, model_cfg, corpus, device
        self.context = cfg.context or model_cfg.context
        corpus.check_context(self.context)
        self.precision = choose_precision(cfg.precision, device)
        limit_gpu_memory(cfg.gpu_memory_limit, device)
        self.offloaded = cfg.offload != "none"
        if self.offloaded and model_cfg.tie_embeddings:
            # offload moves weights unit by unit in forward order; a tied matrix belongs to the first and the last
            raise UserError("a model with tied embeddings cannot be trained with --offload optimizer")
        if self.offloaded:
            self._check_host_memory()
        torch.manual_seed(cfg.seed)
        self.model = Transformer(model_cfg)
        if cfg.activation_checkpointing:
            depth = len(self.model.blocks)
            self.model.checkpointed_blocks = depth if cfg.checkpoint_blocks is None else min(cfg.checkpoint_blocks, depth)
        if not self.offloaded:  # offload adopts the fp32 host weights as masters and places working copies
            self.model.to(device)
        if self.precision in ("fp8", "int8"):
            from tscale_p2p.kernels import convert_linears

            convert_linears(self.model, self.precision, stochastic_grad=cfg.grad_rounding == "stochastic")
        self.optimizer = self._make_optimizer()
        if self.offloaded:
            self.model.to(device)  # the buffers: the offloaded optimizer has placed the parameters
        self.forward = self._compiled() if device.type == "cuda" and cfg.compile else self.model
        self.index = None
        if cfg.index is not None or model_cfg.index is not None:
            from tscale_p2p.index import open_training_index  # numba: imported only with an index

            self.index = open_training_index(cfg.index, model_cfg, corpus)
        self.train_batches = self.training_windows(cfg.seed)
        self.step = 0
        self.resumed_from: Path | None = None  # the checkpoint `restore` continued from
        self.schedule_step: int | None = None  # where the LR schedule stands, when not `step` (a swarm's progress)
        self.tokens_seen = 0
        self.flops_per_token = model_cfg.flops_per_token(self.context)
        self.peak_flops = peak_flops(device)

    def training_windows(self, seed: int):
        """Endless training batches drawn with `seed`: (x, y), and the stored index matches with an index."""
        if self.index is None:
            return self.corpus.batches("train", self.cfg.batch_size, self.context, seed=seed, device=self.device)
        from tscale_p2p.index import IndexedWindowSampler

        return IndexedWindowSampler(self.corpus.train, self.index, self.cfg.batch_size, self.context, seed=seed,
                                    device=self.device)

    def _make_optimizer(self):
        """Fused AdamW (on the CPU too: faster than its for-loop default), or its offloaded twin. Matrices decay
        by --weight-decay; embeddings by --embedding-weight-decay, in a group of their own only when it is on,
        so a run without it has the two groups that its earlier checkpoints hold; norms never decay."""
        named = list(self.model.named_parameters())
        decay_embeddings = self.cfg.embedding_weight_decay > 0
        matrices = [p for n, p in named if is_matrix(n, p)]
        embeddings = [p for n, p in named if is_embedding(n, p)] if decay_embeddings else []
        others = [p for n, p in named if not is_matrix(n, p) and not (decay_embeddings and is_embedding(n, p))]
        groups = [
            {"params": matrices, "weight_decay": self.cfg.weight_decay},
            {"params": others, "weight_decay": 0.0},
        ]
        if decay_embeddings:
            groups.append({"params": embeddings, "weight_decay": self.cfg.embedding_weight_decay})
        betas = (0.9, self.cfg.beta2)
        if self.offloaded:
            from tscale_p2p.offload import OffloadedAdamW

            return OffloadedAdamW(
                self.model, self.model.execution_units(), groups, self.device, self._working_dtype,
                lr=self.cfg.lr, betas=betas, grad_clip=self.cfg.grad_clip, delay=self.cfg.offload_delay,
                device_passes=self.cfg.grad_accum if self.cfg.offload_accumulate == "device" else 1,
            )
        return torch.optim.AdamW(groups, lr=self.cfg.lr, betas=betas, fused=True)

    def _working_dtype(self, name: str, param: torch.Tensor) -> torch.dtype:
        """Offload: matrices that autocast would cast to bf16 anyway live in bf16 on the device; embeddings and
        norms (tiny) stay fp32, so the activations are those of an ordinary run."""
        low = self.device.type == "cuda" and self.precision != "fp32"
        return torch.bfloat16 if low and is_matrix(name, param) else torch.float32

    def _check_host_memory(self) -> None:
        from tscale_p2p.offload import check_host_memory

        with torch.device("meta"):  # shapes only, nothing allocated
            shapes = Transformer(self.model_cfg)
        sizes = [(p.numel(), self._working_dtype(n, p)) for n, p in shapes.named_parameters()]
        check_host_memory(sizes, self.cfg.offload_delay, self.cfg.offload)

    def _compiled(self):
        """torch.compile the whole model, or under offload each block's forward: the offload's per-unit hooks
        then run eagerly around compiled blocks instead of breaking one big graph."""
        if not self.offloaded:
            return torch.compile(self.model)
        for block in self.model.blocks:
            block.forward = torch.compile(block.forward)
        return self.model

    def lr_at(self, step: int) -> float:
        """Linear warm-up, then cosine decay or WSD (constant, then a linear cool-down) to min_lr_ratio."""
        cfg = self.cfg
        if step < cfg.warmup:
            return cfg.lr * (step + 1) / cfg.warmup
        floor = cfg.lr * cfg.min_lr_ratio
        if cfg.schedule == "wsd":
            cooldown = max(1, int(cfg.cooldown_fraction * cfg.steps))
            start = cfg.steps - cooldown
            if step < start:
                return cfg.lr
            return floor + (cfg.lr - floor) * max(0.0, (cfg.steps - step) / cooldown)
        progress = min(1.0, (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup))
        return floor + (cfg.lr - floor) * 0.5 * (1 + math.cos(math.pi * progress))

    def _autocast(self):
        enabled = self.device.type == "cuda" and self.precision != "fp32"
        return torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=enabled)

    def _loss(self, x: torch.Tensor, y: torch.Tensor, matches: torch.Tensor | None = None) -> torch.Tensor:
        with self._autocast():
            logits = self.forward(x) if matches is None else self.forward(x, matches)
        return F.cross_entropy(logits.float().view(-1, logits.size(-1)), y.view(-1))

    def local_step(self) -> StepStats:
        """One optimizer step over `grad_accum` micro-batches; the same code for solo and swarm runs."""
        self.model.train()
        lr = self.lr_at(self.step if self.schedule_step is None else self.schedule_step)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        total = torch.zeros((), device=self.device)
        for micro in range(self.cfg.grad_accum):
            batch = next(self.train_batches)  # (x, y), or (x, y, index matches)
            with self._accumulating(last=micro == self.cfg.grad_accum - 1):
                loss = self._loss(*batch) / self.cfg.grad_accum
                loss.backward()
            total += loss.detach()
        if self.cfg.grad_clip > 0 and not self.offloaded:  # the offloaded optimizer clips on the host
            grads = [p.grad for p in self.model.parameters() if p.grad is not None]
            clip_in_optimizers([self.optimizer], torch.nn.utils.get_total_norm(grads), self.cfg.grad_clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        tokens = self.cfg.grad_accum * self.cfg.batch_size * self.context
        self.tokens_seen += tokens
        return StepStats(step=self.step, loss=total, lr=lr, tokens=tokens)

    def _accumulating(self, last: bool):
        """The context of one micro-batch's forward and backward (data-parallel training exchanges gradients
        only on the `last`)."""
        return contextlib.nullcontext()

    @torch.no_grad()
    def evaluate(self, *, whole_split: bool = False) -> EvalStats:
        """Mean val loss over a fixed set of windows, the same ones every time: `--eval-batches`
        micro-batches spread over val, or with `whole_split` every non-overlapping window of val once."""
        self.model.eval()
        num_batches = None if whole_split else self.cfg.eval_batches
        batches = self.corpus.eval_batches(self.cfg.batch_size, self.context, num_batches, self.device)
        losses = [self._loss(x, y, self._lookup(x)) for x, y in batches]
        loss = torch.stack(losses).mean().item()
        return EvalStats(loss=loss, bits_per_byte=self.corpus.bits_per_byte(loss))

    def _lookup(self, x: torch.Tensor) -> torch.Tensor | None:
        """Index matches of windows that are not in the index (val), by lookup; None without an index."""
        return None if self.index is None else self.index.lookup(x).to(self.device)

    def throughput(self, tokens: int, seconds: float) -> tuple[float, float | None]:
        """Tokens/s and model FLOPs utilisation (None where the device's peak is unknown)."""
        rate = tokens / seconds if seconds > 0 else 0.0
        mfu = rate * self.flops_per_token / self.peak_flops if self.peak_flops else None
        return rate, mfu

    @torch.no_grad()
    def snapshot(self) -> dict[str, torch.Tensor]:
        """An fp32 CPU copy of the weights (the swarm keeps one at each round's start)."""
        weights = self.optimizer.master_weights() if self.offloaded else dict(self.model.named_parameters())
        return {name: p.detach().float().cpu().clone() for name, p in weights.items()}

    @torch.no_grad()
    def apply_outer_update(self, weights: dict[str, torch.Tensor]) -> None:
        """Replace the weights with ones computed outside (the swarm's outer step); optimizer state stays."""
        params = dict(self.model.named_parameters())
        missing = set(params) - set(weights)
        if missing:
            raise ValueError(f"outer update lacks {sorted(missing)[:3]}")
        if self.offloaded:
            self.optimizer.load_weights(weights)
            return
        for name, p in params.items():
            p.copy_(weights[name].to(device=p.device, dtype=p.dtype))

    def save(self, out_dir: str | Path, extra_files: dict | None = None) -> Path:
        """Write an atomic checkpoint of everything needed to continue bit-for-bit (see checkpoint.py), with the
        tokenizer the model reads and the caller's `extra_files` (as `save_checkpoint` takes them)."""
        tokenizer, tokenizer_files = checkpoint_entry(self.corpus.tokenizer, self.model_cfg.vocab_size)
        return save_checkpoint(
            out_dir,
            step=self.step,
            model_state=self._model_state(),
            model_config=self.model_cfg.to_dict(),
            optimizer_state=self.optimizer.state_dict(),
            rng_state=capture_rng_state(),
            meta={"tokens_seen": self.tokens_seen, "data": self.train_batches.state_dict(), "tokenizer": tokenizer},
            keep=self.cfg.keep,
            extra_files={**tokenizer_files, **(extra_files or {})},
        )

    def _model_state(self) -> dict[str, torch.Tensor]:
        """The weights to save: under offload the fp32 masters, not the device's working copies."""
        state = self.model.state_dict()
        return {**state, **self.optimizer.master_weights()} if self.offloaded else state

    def restore(self, checkpoint: Checkpoint) -> None:
        """Continue from `checkpoint`: weights, optimizer, RNG and data position."""
        place = validated(_ResumePlace, checkpoint.meta, f"checkpoint {checkpoint.path}: meta.json meta")
        self.start_from(checkpoint)
        self.resumed_from = checkpoint.path
        restore_rng_state(checkpoint.rng_state)
        self.tokens_seen = place.tokens_seen
        self.train_batches.load_state_dict(place.data.model_dump())

    def start_from(self, checkpoint: Checkpoint) -> None:
        """Take `checkpoint`'s weights, optimizer state and place in the schedule, but keep this trainer's own
        data stream and random state (a swarm peer starting from another run's checkpoint)."""
        checkpoint.restore(self.model, self.optimizer)
        if self.offloaded:
            self.optimizer.load_weights(checkpoint.model_state)
        self.step = checkpoint.step

    def synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


class _SamplerPlace(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")

    seed: int
    batches_drawn: int = Field(ge=0)


class _ResumePlace(BaseModel):
    """Where `Trainer.save` records the run had got to (its checkpoint's meta), checked before a resume trusts it."""

    model_config = ConfigDict(strict=True, extra="allow")  # the tokenizer entry is checked where it is read

    tokens_seen: int = Field(ge=0)
    data: _SamplerPlace


class Stopwatch:
    """Wall time between log lines, synchronised with the device so rates are honest."""

    def __init__(self, trainer: Trainer) -> None:
        self.trainer = trainer
        self.start = time.perf_counter()

    def lap(self) -> float:
        self.trainer.synchronize()
        now = time.perf_counter()
        elapsed, self.start = now - self.start, now
        return elapsed
