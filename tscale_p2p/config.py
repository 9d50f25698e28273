"""Training settings: the sections of `TrainConfig`, each field also a `train` flag and a key of its TOML table.

Precedence: built-in defaults < `--config FILE.toml` < flags given on the command line (`tscale_p2p.cli.options`).
Each field is declared once, with its help and bounds (`tscale_p2p.settings.option`); what one field cannot
check alone is checked in `TrainConfig.__post_init__`.
"""

from __future__ import annotations

from typing import Literal

from pydantic.dataclasses import dataclass

from tscale_p2p.device import PRECISION_CHOICES
from tscale_p2p.errors import UserError
from tscale_p2p.model import MLP_KINDS, WINDOW_SCHEDULES
from tscale_p2p.settings import SECTION_CONFIG, option

OFFLOAD_MODES = ("none", "optimizer")
ACCUMULATE_ON = ("device", "host")
GRAD_ROUNDING = ("nearest", "stochastic")
DEVICES = ("auto", "cpu", "cuda")
LR_SCHEDULES = ("cosine", "wsd")
SYNC_COMPRESSIONS = ("auto", "none", "bf16", "powersgd", "onebit")

# Built-in model shapes: tiny enough to train on a laptop CPU, and GPT-2-small's shape on a GPU.
DEFAULT_CPU_MODEL = "e128h4d4w256"
DEFAULT_GPU_MODEL = "e768h12d12w1024"


@dataclass(config=SECTION_CONFIG)
class ModelSettings:
    """The model's shape (a swarm's joiner adopts the run's)."""

    model: str | None = option(None, "model dims such as e384h6d6w256 (default: e128h4d4w256 on CPU, e768h12d12w1024 on GPU)")
    window_schedule: Literal[WINDOW_SCHEDULES] = option("tscale", "attention windows: tscale (short/full alternation) or dense")
    mlp: Literal[MLP_KINDS] = option("relu2", "MLP kind: relu2 or swiglu")
    dropout: float = option(0.0, "residual dropout", ge=0, lt=1)
    attention_dropout: float = option(0.0, "dropout on the attention probabilities (windowed layers then compute every block: FlexAttention has no dropout)", ge=0, lt=1)
    tie_embeddings: bool = option(False, "the output head shares the token embedding matrix (GPT-2's weight tying; not with --offload)")


@dataclass(config=SECTION_CONFIG)
class DataSettings:
    """What the model reads, and how much of it at once."""

    data: str = option("stdlib", "training text: stdlib, a file, a folder, a .bin, or hf:NAME")
    tokenizer: str | None = option(None, "byte, bpe:VOCAB (a byte-level BPE trained on --data's train split, cached) or a tokenizer.json (with a .bin: the tokenizer that made it) (default: the checkpoint's or the swarm's, else bpe:8192 for a run that passes over --data's train split at most 16 times, byte beyond that, for a split under 256 KiB, or with --index)")
    index: str | None = option(None, "an index folder of --data's train split (tscale-peer index build): the model also reads its longest earlier match of each context")
    context: int | None = option(None, "tokens per sequence (default: the model's context)", ge=2, unit="tokens")
    batch_size: int = option(16, "sequences per micro-batch", ge=1)
    grad_accum: int = option(1, "micro-batches per optimizer step", ge=1)


@dataclass(config=SECTION_CONFIG)
class OptimSettings:
    """The optimizer (AdamW) and its learning-rate schedule."""

    steps: int = option(2000, "optimizer steps to train for", ge=1)
    lr: float = option(3e-3, "peak learning rate", gt=0)
    min_lr_ratio: float = option(0.1, "final learning rate as a fraction of the peak", ge=0)
    warmup: int = option(100, "learning-rate warm-up steps", ge=0)
    schedule: Literal[LR_SCHEDULES] = option("cosine", "decay after warm-up: cosine, or wsd (stable then a linear cool-down)")
    cooldown_fraction: float = option(0.2, "wsd: fraction of the steps spent cooling down", ge=0, le=1)
    weight_decay: float = option(0.1, "AdamW weight decay of the matrices", ge=0)
    embedding_weight_decay: float = option(0.0, "AdamW weight decay of the embeddings, a tied head included (nanoGPT decays them as its matrices)", ge=0)
    beta2: float = option(0.95, "AdamW beta2", ge=0, lt=1)
    grad_clip: float = option(1.0, "clip the gradient norm to this (0: off)", ge=0)


@dataclass(config=SECTION_CONFIG)
class DeviceSettings:
    """Where and in what precision the model trains, and what goes to host memory."""

    device: Literal[DEVICES] = option("auto", "auto, cpu or cuda")
    precision: Literal[PRECISION_CHOICES] = option("auto", "matmul precision: auto (bf16 on GPU, fp32 on CPU), fp32, bf16, fp8, int8")
    grad_rounding: Literal[GRAD_ROUNDING] = option("nearest", "fp8/int8: how the gradients' casts round; stochastic (TScale's dithering) is unbiased, and measured no better on loss (benchmarks/RESULTS.md)")
    compile: bool = option(True, "torch.compile the model on CUDA")
    offload: Literal[OFFLOAD_MODES] = option("none", "none, or optimizer: fp32 master weights and AdamW state in host RAM, the CPU runs the optimizer, the GPU keeps only working (bf16) weights")
    offload_delay: int = option(0, "with --offload: apply each update this many steps late (0 or 1; 1 as in TScale hides the CPU optimizer behind a whole step, but every gradient is then one step stale: +2% to +15% val loss on a small model, more at higher learning rates; benchmarks/RESULTS.md)", ge=0, le=1)
    offload_accumulate: Literal[ACCUMULATE_ON] = option("device", "with --offload and --grad-accum: sum micro-batch gradients on the device (bf16, +2 bytes/param of GPU memory, one transfer per step) or on the host (fp32, a transfer and host pass per micro-batch)")
    activation_checkpointing: bool = option(False, "recompute each block in backward instead of keeping its activations")
    checkpoint_blocks: int | None = option(None, "with --activation-checkpointing: recompute only the first N blocks (default: all); each block left out keeps its activations, trading memory for speed", ge=0)
    gpu_memory_limit: float | None = option(None, "cap this process's GPU memory at this many GiB, like a smaller card", gt=0, unit="GiB")


@dataclass(config=SECTION_CONFIG)
class RunSettings:
    """Evaluation, logging, checkpoints and the seed."""

    eval_every: int = option(250, "evaluate val loss every N steps (0: only at the end)", ge=0)
    eval_batches: int = option(20, "micro-batches per evaluation", ge=1)
    log_every: int = option(10, "log a line every N steps", ge=1)
    save_every: int = option(500, "write a checkpoint every N steps (0: only at the end)", ge=0)
    keep: int = option(3, "checkpoints to keep", ge=1)
    out: str = option("runs/tscale", "run folder for checkpoints")
    resume: bool = option(False, "continue from the newest valid checkpoint in --out")
    seed: int = option(0, "seed for weights and data sampling", ge=0)


@dataclass(config=SECTION_CONFIG)
class SyncSettings:
    """Data-parallel `train` runs (ranks under torchrun or --nproc-per-node); not a swarm's."""

    sync_compression: Literal[SYNC_COMPRESSIONS] = option("auto", "data-parallel runs: how gradients are exchanged: none (fp32 all-reduce), bf16 (GPUs only), powersgd (rank 1), onebit (signs + a scale per 256 values with error feedback, ~1.06 bits/value each way); auto is onebit on 2+ ranks")
    # 200: onebit read +5.6% val loss against none after 2000 steps, 10 read +10.9% (RESULTS.md, Synchronous mode)
    sync_warmup_steps: int = option(200, "data-parallel runs: uncompressed steps before onebit/powersgd start, at every start or resume", ge=0)
    sync_timeout: float = option(300.0, "data-parallel runs: seconds a rank waits in an exchange before giving the other ranks up as lost (must exceed rank 0's evaluation and checkpoint time)", gt=0, unit="seconds")


# Each section by its TOML table name; `train` takes them all, `join` all but the data-parallel one.
TRAIN_SECTIONS = {"model": ModelSettings, "data": DataSettings, "optim": OptimSettings, "device": DeviceSettings,
                  "run": RunSettings, "sync": SyncSettings}


@dataclass(config=SECTION_CONFIG)
class TrainConfig(SyncSettings, RunSettings, DeviceSettings, OptimSettings, DataSettings, ModelSettings):
    """Everything `tscale-peer train` can be told: the fields of its sections, flat (`cfg.lr`, `cfg.model`)."""

    def __post_init__(self) -> None:
        if self.offload_delay and self.offload == "none":
            raise UserError("offload-delay applies to offloaded updates; add --offload optimizer")
        if self.checkpoint_blocks is not None and not self.activation_checkpointing:
            raise UserError("checkpoint-blocks applies to activation checkpointing; add --activation-checkpointing")
