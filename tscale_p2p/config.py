"""Training settings: one dataclass whose fields are the `train` flags, and the TOML file that mirrors them.

Precedence: built-in defaults < `--config FILE.toml` < flags given on the command line.
"""

from __future__ import annotations

import sys
import types
import typing
from dataclasses import dataclass, field, fields
from pathlib import Path

from tscale_p2p.device import PRECISION_CHOICES
from tscale_p2p.errors import UserError
from tscale_p2p.model import MLP_KINDS, WINDOW_SCHEDULES

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

OFFLOAD_MODES = ("none", "optimizer")
ACCUMULATE_ON = ("device", "host")
GRAD_ROUNDING = ("nearest", "stochastic")
DEVICES = ("auto", "cpu", "cuda")
LR_SCHEDULES = ("cosine", "wsd")
SYNC_COMPRESSIONS = ("auto", "none", "bf16", "powersgd", "onebit")
SYNC_FIELDS = ("sync_compression", "sync_warmup_steps", "sync_timeout")  # data-parallel `train` only, not `join`

# Built-in model shapes: tiny enough to train on a laptop CPU, and GPT-2-small's shape on a GPU.
DEFAULT_CPU_MODEL = "e128h4d4w256"
DEFAULT_GPU_MODEL = "e768h12d12w1024"


@dataclass
class TrainConfig:
    """Everything `tscale-peer train` can be told; each field is also a flag and a TOML key."""

    data: str = field(default="stdlib", metadata={"help": "training text: stdlib, a file, a folder, a .bin, or hf:NAME"})
    tokenizer: str | None = field(default=None, metadata={"help": "byte, bpe:VOCAB (a byte-level BPE trained on --data's train split, cached) or a tokenizer.json (with a .bin: the tokenizer that made it) (default: the checkpoint's or the swarm's, else bpe:8192 for a run that passes over --data's train split at most 16 times, byte beyond that, for a split under 256 KiB, or with --index)"})
    index: str | None = field(default=None, metadata={"help": "an index folder of --data's train split (tscale-peer index build): the model also reads its longest earlier match of each context"})
    model: str | None = field(default=None, metadata={"help": "model dims such as e384h6d6w256 (default: e128h4d4w256 on CPU, e768h12d12w1024 on GPU)"})
    window_schedule: str = field(default="tscale", metadata={"choices": WINDOW_SCHEDULES, "help": "attention windows: tscale (short/full alternation) or dense"})
    mlp: str = field(default="relu2", metadata={"choices": MLP_KINDS, "help": "MLP kind: relu2 or swiglu"})
    dropout: float = field(default=0.0, metadata={"help": "residual dropout"})
    attention_dropout: float = field(default=0.0, metadata={"help": "dropout on the attention probabilities (windowed layers then compute every block: FlexAttention has no dropout)"})
    tie_embeddings: bool = field(default=False, metadata={"help": "the output head shares the token embedding matrix (GPT-2's weight tying; not with --offload)"})
    precision: str = field(default="auto", metadata={"choices": PRECISION_CHOICES, "help": "matmul precision: auto (bf16 on GPU, fp32 on CPU), fp32, bf16, fp8, int8"})
    grad_rounding: str = field(default="nearest", metadata={"choices": GRAD_ROUNDING, "help": "fp8/int8: how the gradients' casts round; stochastic (TScale's dithering) is unbiased, and measured no better on loss (benchmarks/RESULTS.md)"})
    device: str = field(default="auto", metadata={"choices": DEVICES, "help": "auto, cpu or cuda"})
    compile: bool = field(default=True, metadata={"help": "torch.compile the model on CUDA"})
    offload: str = field(default="none", metadata={"choices": OFFLOAD_MODES, "help": "none, or optimizer: fp32 master weights and AdamW state in host RAM, the CPU runs the optimizer, the GPU keeps only working (bf16) weights"})
    offload_delay: int = field(default=0, metadata={"help": "with --offload: apply each update this many steps late (0 or 1; 1 as in TScale hides the CPU optimizer behind a whole step, but every gradient is then one step stale: +2%% to +15%% val loss on a small model, more at higher learning rates; benchmarks/RESULTS.md)"})
    offload_accumulate: str = field(default="device", metadata={"choices": ACCUMULATE_ON, "help": "with --offload and --grad-accum: sum micro-batch gradients on the device (bf16, +2 bytes/param of GPU memory, one transfer per step) or on the host (fp32, a transfer and host pass per micro-batch)"})
    activation_checkpointing: bool = field(default=False, metadata={"help": "recompute each block in backward instead of keeping its activations"})
    checkpoint_blocks: int | None = field(default=None, metadata={"help": "with --activation-checkpointing: recompute only the first N blocks (default: all); each block left out keeps its activations, trading memory for speed"})
    gpu_memory_limit: float | None = field(default=None, metadata={"help": "cap this process's GPU memory at this many GiB, like a smaller card"})
    steps: int = field(default=2000, metadata={"help": "optimizer steps to train for"})
    batch_size: int = field(default=16, metadata={"help": "sequences per micro-batch"})
    grad_accum: int = field(default=1, metadata={"help": "micro-batches per optimizer step"})
    context: int | None = field(default=None, metadata={"help": "tokens per sequence (default: the model's context)"})
    lr: float = field(default=3e-3, metadata={"help": "peak learning rate"})
    min_lr_ratio: float = field(default=0.1, metadata={"help": "final learning rate as a fraction of the peak"})
    warmup: int = field(default=100, metadata={"help": "learning-rate warm-up steps"})
    schedule: str = field(default="cosine", metadata={"choices": LR_SCHEDULES, "help": "decay after warm-up: cosine, or wsd (stable then a linear cool-down)"})
    cooldown_fraction: float = field(default=0.2, metadata={"help": "wsd: fraction of the steps spent cooling down"})
    weight_decay: float = field(default=0.1, metadata={"help": "AdamW weight decay of the matrices"})
    embedding_weight_decay: float = field(default=0.0, metadata={"help": "AdamW weight decay of the embeddings, a tied head included (nanoGPT decays them as its matrices)"})
    beta2: float = field(default=0.95, metadata={"help": "AdamW beta2"})
    grad_clip: float = field(default=1.0, metadata={"help": "clip the gradient norm to this (0: off)"})
    eval_every: int = field(default=250, metadata={"help": "evaluate val loss every N steps (0: only at the end)"})
    eval_batches: int = field(default=20, metadata={"help": "micro-batches per evaluation"})
    log_every: int = field(default=10, metadata={"help": "log a line every N steps"})
    save_every: int = field(default=500, metadata={"help": "write a checkpoint every N steps (0: only at the end)"})
    keep: int = field(default=3, metadata={"help": "checkpoints to keep"})
    out: str = field(default="runs/tscale", metadata={"help": "run folder for checkpoints"})
    resume: bool = field(default=False, metadata={"help": "continue from the newest valid checkpoint in --out"})
    seed: int = field(default=0, metadata={"help": "seed for weights and data sampling"})
    sync_compression: str = field(default="auto", metadata={"choices": SYNC_COMPRESSIONS, "help": "data-parallel runs: how gradients are exchanged: none (fp32 all-reduce), bf16 (GPUs only), powersgd (rank 1), onebit (signs + a scale per 256 values with error feedback, ~1.06 bits/value each way); auto is onebit on 2+ ranks"})
    # 200: onebit read +5.6% val loss against none after 2000 steps, 10 read +10.9% (RESULTS.md, Synchronous mode)
    sync_warmup_steps: int = field(default=200, metadata={"help": "data-parallel runs: uncompressed steps before onebit/powersgd start, at every start or resume"})
    sync_timeout: float = field(default=300.0, metadata={"help": "data-parallel runs: seconds a rank waits in an exchange before giving the other ranks up as lost (must exceed rank 0's evaluation and checkpoint time)"})

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        for f in fields(self):
            if "choices" in f.metadata and getattr(self, f.name) not in f.metadata["choices"]:
                raise UserError(
                    f"invalid {f.name.replace('_', '-')} {getattr(self, f.name)!r}; "
                    f"choose one of {', '.join(f.metadata['choices'])}"
                )
        if self.offload_delay not in (0, 1):
            raise UserError(f"offload-delay must be 0 or 1, got {self.offload_delay}")
        if self.offload_delay and self.offload == "none":
            raise UserError("offload-delay applies to offloaded updates; add --offload optimizer")
        if self.checkpoint_blocks is not None:
            if self.checkpoint_blocks < 0:
                raise UserError(f"checkpoint-blocks must not be negative, got {self.checkpoint_blocks}")
            if not self.activation_checkpointing:
                raise UserError("checkpoint-blocks applies to activation checkpointing; add --activation-checkpointing")
        if self.gpu_memory_limit is not None and not self.gpu_memory_limit > 0:
            raise UserError(f"gpu-memory-limit must be a positive number of GiB, got {self.gpu_memory_limit}")
        for name in ("steps", "batch_size", "grad_accum", "eval_batches", "log_every", "keep"):
            if getattr(self, name) < 1:
                raise UserError(f"{name.replace('_', '-')} must be at least 1, got {getattr(self, name)}")
        for name in ("warmup", "eval_every", "save_every", "seed"):
            if getattr(self, name) < 0:
                raise UserError(f"{name.replace('_', '-')} must not be negative, got {getattr(self, name)}")
        if self.context is not None and self.context < 2:
            raise UserError(f"context must be at least 2 tokens, got {self.context}")
        if self.sync_warmup_steps < 0:
            raise UserError(f"sync-warmup-steps must not be negative, got {self.sync_warmup_steps}")
        if not self.sync_timeout > 0:
            raise UserError(f"sync-timeout must be a positive number of seconds, got {self.sync_timeout}")
        if self.embedding_weight_decay < 0:
            raise UserError(f"embedding-weight-decay must not be negative, got {self.embedding_weight_decay}")
        if not self.lr > 0:
            raise UserError(f"lr must be positive, got {self.lr}")

    @classmethod
    def from_toml(cls, path: str | Path, **overrides) -> "TrainConfig":
        """Read a TOML file whose keys are the flag names (dashes or underscores); `overrides` win."""
        values = read_toml_section(path, cls)
        return cls(**{**values, **overrides})


def field_types(cls) -> dict[str, tuple[type, ...]]:
    """The accepted Python types of each dataclass field (Optional unpacked)."""
    hints = typing.get_type_hints(cls)
    accepted: dict[str, tuple[type, ...]] = {}
    for f in fields(cls):
        hint = hints[f.name]
        if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
            accepted[f.name] = tuple(t for t in typing.get_args(hint))
        else:
            accepted[f.name] = (hint,)
    return accepted


def read_toml_section(path: str | Path, cls) -> dict:
    """Read a TOML file and check every key and type against the dataclass `cls`."""
    path = Path(path)
    try:
        with path.open("rb") as handle:
            raw = tomllib.load(handle)
    except FileNotFoundError:
        raise UserError(f"config file {str(path)!r} does not exist") from None
    except tomllib.TOMLDecodeError as error:
        raise UserError(f"config file {str(path)!r} is not valid TOML: {error}") from None
    except OSError as error:
        raise UserError(f"cannot read config file {str(path)!r}: {error.strerror}") from None
    accepted = field_types(cls)
    values = {}
    for key, value in raw.items():
        name = key.replace("-", "_")
        if name not in accepted:
            raise UserError(f"unknown key {key!r} in config file {str(path)!r}")
        types_ok = accepted[name]
        if float in types_ok and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if isinstance(value, bool) and bool not in types_ok or not isinstance(value, tuple(t for t in types_ok if t is not type(None))):
            wanted = " or ".join(t.__name__ for t in types_ok if t is not type(None))
            raise UserError(f"key {key!r} in config file {str(path)!r} must be {wanted}, got {value!r}")
        values[name] = value
    return values
