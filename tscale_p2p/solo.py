"""`tscale-peer train`: the solo training loop, with evaluation, checkpoints and a clean Ctrl+C."""

from __future__ import annotations

import logging
import signal
import threading
from pathlib import Path

import torch

from tscale_p2p.checkpoint import find_latest, resume_from
from tscale_p2p.config import DEFAULT_CPU_MODEL, DEFAULT_GPU_MODEL, TrainConfig
from tscale_p2p.data import load_corpus
from tscale_p2p.errors import UserError
from tscale_p2p.model import ModelConfig
from tscale_p2p.tokenizer import apply_tokenizer, checkpoint_tokenizer
from tscale_p2p.device import resolve_device
from tscale_p2p.trainer import Stopwatch, Trainer

log = logging.getLogger(__name__)


class GracefulStop:
    """Turns the first SIGINT/SIGTERM into a request to stop at the next step boundary.

    A second Ctrl+C interrupts at once (the last checkpoint written stays valid: writes are atomic).
    """

    def __init__(self) -> None:
        self.requested = False
        self._previous: dict[int, object] = {}

    def _handle(self, signum, frame) -> None:
        if self.requested and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.requested = True
        log.warning("%s received: stopping after this step and saving a checkpoint", signal.Signals(signum).name)

    def __enter__(self) -> "GracefulStop":
        if threading.current_thread() is threading.main_thread():
            for signum in (signal.SIGINT, signal.SIGTERM):
                self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)


def default_dims(cfg: TrainConfig, device_type: str) -> str:
    """--model, or the device's default model."""
    return cfg.model or (DEFAULT_GPU_MODEL if device_type == "cuda" else DEFAULT_CPU_MODEL)


def planned_tokens(cfg: TrainConfig, device_type: str) -> int | None:
    """Tokens this process trains on over the run, the default tokenizer's budget; None with --index, whose
    tokens are fixed by how the index was built (`index build`'s default is byte)."""
    if cfg.index is not None:
        return None
    context = cfg.context or ModelConfig.from_dims(default_dims(cfg, device_type)).context
    return cfg.steps * cfg.batch_size * cfg.grad_accum * context


def model_config_for(
    cfg: TrainConfig, device_type: str, vocab_size: int, saved: dict | None = None
) -> ModelConfig:
    """The model to train: from a checkpoint when resuming (explicit flags must agree), else from flags."""
    overrides = {"window_schedule": cfg.window_schedule, "mlp": cfg.mlp, "dropout": cfg.dropout,
                 "attention_dropout": cfg.attention_dropout, "tie_embeddings": cfg.tie_embeddings, "vocab_size": vocab_size}
    if cfg.index is not None:
        from tscale_p2p.index import index_hash

        overrides["index"] = index_hash(cfg.index)  # the model records which corpus's index it reads
    if saved is not None:
        model_cfg = ModelConfig.from_dict(saved)
        if cfg.index is not None or model_cfg.index is not None:
            from tscale_p2p.index import check_index_flag

            check_index_flag(model_cfg.index, cfg.index, "the checkpoint's model")
        if cfg.model is not None:
            wanted = ModelConfig.from_dims(cfg.model, **overrides)
            if wanted.dims != model_cfg.dims:
                raise UserError(
                    f"--model {cfg.model} does not match the checkpoint's model {model_cfg.dims}; "
                    f"drop --model to use the checkpoint's"
                )
        if model_cfg.vocab_size != vocab_size:
            raise UserError(
                f"--data {cfg.data!r} has a vocabulary of {vocab_size} tokens but the checkpoint's model has "
                f"{model_cfg.vocab_size}"
            )
        return model_cfg
    model_cfg = ModelConfig.from_dims(default_dims(cfg, device_type), **overrides)
    if cfg.context is not None and cfg.context > model_cfg.context:
        raise UserError(f"--context {cfg.context} is longer than the model's context w{model_cfg.context}")
    return model_cfg


def prepare_trainer(cfg: TrainConfig, make_trainer=Trainer, device: torch.device | None = None) -> Trainer:
    """Build the trainer for `cfg`, resuming from --out when asked; refuses to clobber an existing run.
    `make_trainer(model_cfg, cfg, corpus, device)` builds it (the data-parallel mode passes its own)."""
    device = device or resolve_device(cfg.device)
    out = Path(cfg.out)
    checkpoint = None
    if cfg.resume:
        checkpoint = resume_from(out)
    elif find_latest(out) is not None:
        raise UserError(f"{str(out)!r} already holds checkpoints; pass --resume to continue, or choose another --out")
    corpus = load_corpus(cfg.data)
    saved = {}
    if checkpoint is not None:
        saved_cfg = ModelConfig.from_dict(checkpoint.model_config, f"checkpoint {checkpoint.path}: meta.json model_config")
        saved = {"saved": checkpoint_tokenizer(checkpoint.path, checkpoint.meta, saved_cfg.vocab_size)}
    corpus = apply_tokenizer(corpus, cfg.tokenizer, seed=cfg.seed, planned_tokens=planned_tokens(cfg, device.type),
                             **saved)
    log.info("data: %s", corpus.description)
    model_cfg = model_config_for(cfg, device.type, corpus.vocab_size, checkpoint.model_config if checkpoint else None)
    trainer = make_trainer(model_cfg, cfg, corpus, device)
    if checkpoint is not None:
        trainer.restore(checkpoint)
        log.info("resumed from %s at step %d", checkpoint.path, trainer.step)
    return trainer


class Alone:
    """The team of a solo run for `run_training`: it leads, and its own stop request is the only one."""

    leader = True

    def should_stop(self, requested: bool) -> bool:
        return requested

    def mean_loss(self, loss: torch.Tensor) -> float:
        return loss.item()


def train_solo(cfg: TrainConfig) -> int:
    """Train until --steps or a stop signal; always leave a checkpoint behind. Returns the exit code."""
    return run_training(prepare_trainer(cfg), cfg)


def run_training(trainer: Trainer, cfg: TrainConfig, team=Alone()) -> int:
    """The training loop of a solo run and of every rank of a data-parallel one (`team` says who leads:
    logs, evaluates, saves; and whether any member asked to stop). Always leaves a checkpoint behind."""
    if trainer.step >= cfg.steps:  # a finished run resumed: another checkpoint of the same step would only rotate out an older one
        if team.leader:
            log.info("nothing to do: %s is at step %d of --steps %d (raise --steps to train on)", cfg.out,
                     trainer.step, cfg.steps)
        return 0
    if team.leader:
        log.info(
            "training %s (%.2fM parameters, windows %s) on %s, %s, %s, for %d steps",
            trainer.model_cfg.dims,
            sum(p.numel() for p in trainer.model.parameters()) / 1e6,
            trainer.model_cfg.layer_windows(),
            cfg.data,
            trainer.device,
            trainer.precision,
            cfg.steps,
        )
    watch, tokens_since = Stopwatch(trainer), 0
    diverged = Divergence(trainer.device, cfg.out)
    with GracefulStop() as stop:
        while trainer.step < cfg.steps and not team.should_stop(stop.requested):
            stats = trainer.local_step()
            diverged.note(stats.loss)
            tokens_since += stats.tokens
            if stats.step % cfg.log_every == 0 or stats.step == cfg.steps:
                diverged.check(stats.step)
                loss = team.mean_loss(stats.loss)
                rate, mfu = trainer.throughput(tokens_since, watch.lap())
                tokens_since = 0
                if team.leader:
                    log.info(
                        "step %d/%d  loss %.4f  lr %.2e  %.0f tok/s%s",
                        stats.step,
                        cfg.steps,
                        loss,
                        stats.lr,
                        rate,
                        f"  MFU {mfu:.1%}" if mfu is not None else "",
                    )
            if not team.leader:
                continue
            if cfg.eval_every and stats.step % cfg.eval_every == 0 and stats.step < cfg.steps:
                report_eval(trainer)
            if cfg.save_every and stats.step % cfg.save_every == 0 and stats.step < cfg.steps:
                diverged.check(stats.step)
                trainer.save(cfg.out)
        stopped = team.should_stop(stop.requested)
    diverged.check(trainer.step)
    if team.leader:
        if not stopped:
            report_eval(trainer)
        trainer.save(cfg.out)
    return 0


class Divergence:
    """Whether any training loss so far was NaN or infinite. Noted on the device, step by step (no wait for the
    GPU); checked where the loop waits anyway (a log line, a checkpoint), so a diverged run stops before it
    writes a checkpoint that would rotate a good one out."""

    def __init__(self, device: torch.device, out: str) -> None:
        self.seen = torch.zeros((), dtype=torch.bool, device=device)
        self.out = out

    def note(self, loss: torch.Tensor) -> None:
        self.seen |= ~torch.isfinite(loss.detach())

    def check(self, step: int) -> None:
        if bool(self.seen):
            raise UserError(
                f"the training loss is no longer a finite number by step {step}: the run diverged; stopped without "
                f"saving it (lower --lr, or raise --warmup, then --resume from the last checkpoint in {self.out})"
            )


def report_eval(trainer: Trainer) -> None:
    result = trainer.evaluate()
    bpb = f"  {result.bits_per_byte:.4f} bits/byte" if result.bits_per_byte is not None else ""
    log.info("step %d  val loss %.4f nats/token%s", trainer.step, result.loss, bpb)
