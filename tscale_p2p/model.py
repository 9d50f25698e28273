"""The TScale-style decoder-only transformer, readable top to bottom.

Pre-norm RMSNorm blocks with rotary position embeddings, a ReLU^2 (or SwiGLU) MLP, and an attention
*window schedule*: the first ~15% of layers look only at a very short window, the rest alternate a short
window and the full context (the last layer is always full). That is where TScale's "~2x less attention
cost" comes from; `dense` is the plain causal baseline.

Windowed layers run through FlexAttention with a block mask on CUDA, so blocks outside the window are never
computed; full layers use SDPA's fused causal kernel. On the CPU every layer takes an exact masked SDPA path.
"""

from __future__ import annotations

import math
import re
import typing
from dataclasses import asdict, dataclass, fields, replace
from functools import lru_cache
from typing import Protocol

import torch
import torch.nn.functional as F
from pydantic import ConfigDict, create_model
from torch import nn
from torch.utils.checkpoint import checkpoint

from tscale_p2p.errors import UserError
from tscale_p2p.schema import validated

WINDOW_SCHEDULES = ("tscale", "dense")
MLP_KINDS = ("relu2", "swiglu")
INDEX_LENGTHS = 33  # match lengths 0 (none) to index.MAX_MATCH
_DIMS_LETTERS = {"e": "width", "h": "heads", "d": "depth", "w": "context"}


@dataclass(frozen=True)
class ModelConfig:
    """Shape of a model. `from_dims("e384h6d6w256")` reads TScale's compact notation."""

    width: int = 128
    heads: int = 4
    depth: int = 4
    context: int = 256
    vocab_size: int = 256
    head_dim: int | None = None  # None: width // heads
    mlp: str = "relu2"
    mlp_ratio: float = 4.0
    window_schedule: str = "tscale"
    short_window: int = 64
    first_window: int = 16
    first_fraction: float = 0.15
    dropout: float = 0.0
    attention_dropout: float = 0.0  # dropout on the attention probabilities, in training
    tie_embeddings: bool = False  # the output head is the token embedding matrix (GPT-2's and nanoGPT's weight tying)
    rope_base: float = 10000.0
    index: str | None = None  # corpus hash of the index whose matches the model reads (index.py); None: no index input

    def __post_init__(self) -> None:
        for name in ("width", "heads", "depth", "context", "vocab_size", "short_window", "first_window"):
            if getattr(self, name) <= 0:
                raise UserError(f"{name} must be positive, got {getattr(self, name)}")
        if self.head_dim is None:
            if self.width % self.heads:
                raise UserError(
                    f"width {self.width} is not divisible by {self.heads} heads "
                    f"(set head_dim explicitly or pick a width that is a multiple of the heads)"
                )
            object.__setattr__(self, "head_dim", self.width // self.heads)
        if self.head_dim % 2:
            raise UserError(f"head_dim {self.head_dim} must be even for rotary embeddings")
        if self.mlp not in MLP_KINDS:
            raise UserError(f"unknown mlp {self.mlp!r}; choose one of {', '.join(MLP_KINDS)}")
        if self.window_schedule not in WINDOW_SCHEDULES:
            raise UserError(
                f"unknown window schedule {self.window_schedule!r}; choose one of {', '.join(WINDOW_SCHEDULES)}"
            )
        for name in ("dropout", "attention_dropout"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise UserError(f"{name.replace('_', '-')} must be in [0, 1), got {getattr(self, name)}")

    @classmethod
    def from_dims(cls, dims: str, **overrides) -> "ModelConfig":
        """Parse `e<width>h<heads>d<depth>w<context>` (letters in any order, each optional)."""
        text = dims.strip().lower()
        parts = re.findall(r"([a-z])(\d+)", text)
        if not parts or "".join(f"{k}{v}" for k, v in parts) != text:
            raise UserError(f"cannot parse model dims {dims!r}; expected e.g. 'e384h6d6w256'")
        values: dict[str, int] = {}
        for letter, number in parts:
            if letter not in _DIMS_LETTERS:
                raise UserError(f"unknown letter {letter!r} in model dims {dims!r}; use e, h, d and w")
            if _DIMS_LETTERS[letter] in values:
                raise UserError(f"letter {letter!r} appears twice in model dims {dims!r}")
            values[_DIMS_LETTERS[letter]] = int(number)
        try:
            return cls(**{**overrides, **values})
        except UserError as error:
            raise UserError(f"model dims {dims!r}: {error}") from None

    @property
    def dims(self) -> str:
        return f"e{self.width}h{self.heads}d{self.depth}w{self.context}"

    def to_dict(self) -> dict:
        """The fields, less those added later that are at their defaults: a model that does not use them keeps
        the config (and the hash) it had before they existed, and older checkpoints still match it."""
        data = asdict(self)
        for name, default in _LATER_FIELDS.items():
            if data[name] == default:
                del data[name]
        return data

    @classmethod
    def from_dict(cls, data: dict, what: str = "model config") -> "ModelConfig":
        """The config saved by `to_dict` (in a checkpoint, a run config; `what` names it in errors): unknown keys
        and values of the wrong type are a UserError, as are values `__post_init__` refuses."""
        if not isinstance(data, dict):
            raise UserError(f"{what} must be a mapping, got {type(data).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise UserError(f"unknown {what} keys: {', '.join(unknown)}")
        validated(_model_config_fields(), data, what)
        return cls(**data)

    def with_(self, **changes) -> "ModelConfig":
        return replace(self, **changes)

    @property
    def mlp_hidden(self) -> int:
        hidden = self.mlp_ratio * self.width
        if self.mlp == "swiglu":  # two input matrices: keep the parameter count of the ReLU^2 MLP
            hidden = hidden * 2 / 3
        return int(math.ceil(hidden / 64) * 64)

    def layer_windows(self) -> list[int]:
        """Attention window of each layer (`context` means full causal attention)."""
        if self.window_schedule == "dense":
            return [self.context] * self.depth
        first = max(1, round(self.first_fraction * self.depth)) if self.depth > 2 else 0
        windows = [min(self.first_window, self.context)] * first
        rest = self.depth - first
        for j in range(rest):  # alternate short and full, ending on a full layer
            full = (rest - 1 - j) % 2 == 0
            windows.append(self.context if full else min(self.short_window, self.context))
        return windows

    def parameter_count(self, embeddings: bool = True) -> int:
        attn = self.width * 3 * self.heads * self.head_dim + self.heads * self.head_dim * self.width
        mlp_in = 2 if self.mlp == "swiglu" else 1
        mlp = self.width * self.mlp_hidden * mlp_in + self.mlp_hidden * self.width
        block = attn + mlp + 2 * self.width
        total = self.depth * block + self.width
        if embeddings:
            total += (1 if self.tie_embeddings else 2) * self.vocab_size * self.width
            if self.index is not None:
                total += (self.vocab_size + 1 + INDEX_LENGTHS) * self.width
        return total

    def attention_flops_per_token(self, context: int | None = None) -> float:
        """Forward attention FLOPs per token (QK^T and AV), averaged over the positions of a sequence."""
        t = context or self.context
        inner = self.heads * self.head_dim
        total = 0.0
        for window in self.layer_windows():
            w = min(window, t)
            # keys seen by position i: min(i + 1, w); mean over i in [0, t)
            keys = (w * (w + 1) / 2 + (t - w) * w) / t
            total += 4 * inner * keys
        return total

    def flops_per_token(self, context: int | None = None) -> float:
        """Training FLOPs per token: 6 per matmul parameter plus 3x the forward attention FLOPs."""
        return 6 * (self.parameter_count(embeddings=False) + self.vocab_size * self.width) + 3 * (
            self.attention_flops_per_token(context)
        )


# Fields that came after the first checkpoints, with the value that behaves as the code did before them.
_LATER_FIELDS = {"index": None, "attention_dropout": 0.0, "tie_embeddings": False}


@lru_cache(maxsize=1)
def _model_config_fields():
    """A strict pydantic model of ModelConfig's fields (an int is an int: no "12", no true, no 1.5)."""
    hints = typing.get_type_hints(ModelConfig)
    return create_model("ModelConfigFields", __config__=ConfigDict(strict=True),
                        **{f.name: (hints[f.name], f.default) for f in fields(ModelConfig)})


class Rotary(nn.Module):
    """Rotary position embedding tables, computed once for the model's context."""

    def __init__(self, head_dim: int, context: int, base: float) -> None:
        super().__init__()
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        angles = torch.outer(torch.arange(context, dtype=torch.float32), inv_freq)
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def forward(self, x: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """Rotate x of shape [B, H, T, D] by the positions [B, T] of its tokens (default: 0..T-1 in every row)."""
        if positions is None:
            t = x.shape[-2]
            cos, sin = self.cos[:t], self.sin[:t]
        else:
            cos, sin = self.cos[positions][:, None], self.sin[positions][:, None]
        x1, x2 = x.float().chunk(2, dim=-1)
        rotated = torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)
        return rotated.type_as(x)


@lru_cache(maxsize=64)
def _window_mask(t: int, window: int, device: torch.device) -> torch.Tensor:
    i = torch.arange(t, device=device)
    distance = i[:, None] - i[None, :]
    return (distance >= 0) & (distance < window)


@lru_cache(maxsize=64)
def flex_block_mask(t: int, window: int, device: torch.device):
    """FlexAttention block mask of a causal sliding window; blocks wholly outside it are skipped."""
    from torch.nn.attention.flex_attention import create_block_mask

    def sliding_causal(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (q_idx - kv_idx < window)

    return create_block_mask(sliding_causal, B=None, H=None, Q_LEN=t, KV_LEN=t, device=device)


@lru_cache(maxsize=1)
def _compiled_flex_attention():
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


def windowed_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int, block_mask=None, dropout: float = 0.0
) -> torch.Tensor:
    """Causal attention of q, k, v ([B, H, T, D]) where each query sees at most `window` keys (itself
    included), dropping attention probabilities with probability `dropout`. On CUDA a windowed layer uses
    FlexAttention with `block_mask` (made by `flex_block_mask`) unless `dropout` is on: FlexAttention has no
    dropout, so such a layer then takes the exact masked path, which computes every block."""
    t = q.shape[-2]
    if window >= t:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=dropout)
    if q.is_cuda and not dropout:
        block_mask = block_mask if block_mask is not None else flex_block_mask(t, window, q.device)
        return _compiled_flex_attention()(q, k, v, block_mask=block_mask)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=_window_mask(t, window, q.device), dropout_p=dropout)


@torch.compiler.disable
def block_masks_for(windows: list[int], t: int, device: torch.device) -> dict:
    """The block masks a forward pass needs, built outside any compiled graph (they are cached inputs)."""
    if device.type != "cuda":
        return {}
    return {w: flex_block_mask(t, w, device) for w in set(windows) if w < t}


class KVCache(Protocol):
    """One layer's keys and values kept from call to call, for generation (`generate.RingKVCache`)."""

    def update(
        self, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Keep k, v [B, H, T, D] of the tokens at `positions` [B, T] (None: whole prompts from position 0).
        -> (keys, values, mask) for the queries to attend to; mask None: the layer's windowed causal attention
        over the keys and values just given."""
        ...


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, window: int) -> None:
        super().__init__()
        self.heads, self.head_dim, self.window = cfg.heads, cfg.head_dim, window
        self.dropout_p = cfg.attention_dropout
        inner = cfg.heads * cfg.head_dim
        self.qkv = nn.Linear(cfg.width, 3 * inner, bias=False)
        self.proj = nn.Linear(inner, cfg.width, bias=False)

    def split_heads(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        b, t, _ = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, self.head_dim).permute(2, 0, 3, 1, 4)
        return q, k, v

    def merge_heads(self, y: torch.Tensor) -> torch.Tensor:
        b, _, t, _ = y.shape
        return self.proj(y.transpose(1, 2).reshape(b, t, self.heads * self.head_dim))

    def forward(
        self, x: torch.Tensor, rotary: Rotary, block_mask=None, cache: KVCache | None = None,
        positions: torch.Tensor | None = None,
    ) -> torch.Tensor:
        q, k, v = self.split_heads(x)
        q, k = rotary(q, positions), rotary(k, positions)
        mask = None
        if cache is not None:
            k, v, mask = cache.update(k, v, positions)
        if mask is None:
            y = windowed_attention(q, k, v, self.window, block_mask, self.dropout_p if self.training else 0.0)
        else:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.merge_heads(y)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.kind = cfg.mlp
        fan_out = cfg.mlp_hidden * (2 if cfg.mlp == "swiglu" else 1)
        self.fc = nn.Linear(cfg.width, fan_out, bias=False)
        self.proj = nn.Linear(cfg.mlp_hidden, cfg.width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        if self.kind == "swiglu":
            gate, up = h.chunk(2, dim=-1)
            h = F.silu(gate) * up
        else:
            h = F.relu(h).square()
        return self.proj(h)


def in_compute_dtype(x: torch.Tensor) -> torch.Tensor:
    """x in autocast's dtype when autocast is on. nn.RMSNorm returns fp32 under autocast; the projections that
    read a norm's output cast it anyway (nn.Linear) or quantize it (fp8/int8 layers, which then read half the
    bytes), so the cast happens once, where torch.compile fuses it into the norm."""
    device_type = x.device.type
    if torch.is_autocast_enabled(device_type):
        return x.to(torch.get_autocast_dtype(device_type))
    return x


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, window: int) -> None:
        super().__init__()
        self.attn_norm = nn.RMSNorm(cfg.width)
        self.attn = Attention(cfg, window)
        self.mlp_norm = nn.RMSNorm(cfg.width)
        self.mlp = MLP(cfg)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(
        self, x: torch.Tensor, rotary: Rotary, block_masks: dict | None = None, cache: KVCache | None = None,
        positions: torch.Tensor | None = None,
    ) -> torch.Tensor:
        block_mask = (block_masks or {}).get(self.attn.window)
        x = x + self.dropout(self.attn(in_compute_dtype(self.attn_norm(x)), rotary, block_mask, cache, positions))
        return x + self.dropout(self.mlp(in_compute_dtype(self.mlp_norm(x))))


class Transformer(nn.Module):
    """Decoder-only language model: `model(idx) -> logits` for token ids of shape [B, T].

    Generation passes one `KVCache` per block, and the `positions` of the tokens when they do not start at 0.

    The first `checkpointed_blocks` blocks keep only their input in training and recompute themselves in
    backward (about a third more compute per block for a fraction of its activation memory).
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.checkpointed_blocks = 0
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.width)
        if cfg.index is not None:  # the index's guess of the next token (vocab_size: no match) and its match length
            self.index_token_emb = nn.Embedding(cfg.vocab_size + 1, cfg.width)
            self.index_length_emb = nn.Embedding(INDEX_LENGTHS, cfg.width)
        self.rotary = Rotary(cfg.head_dim, cfg.context, cfg.rope_base)
        self.blocks = nn.ModuleList(Block(cfg, window) for window in cfg.layer_windows())
        self.norm = nn.RMSNorm(cfg.width)
        self.lm_head = nn.Linear(cfg.width, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:  # one Parameter, registered under tok_emb (named_parameters lists it once)
            self.lm_head.weight = self.tok_emb.weight
        self.dropout = nn.Dropout(cfg.dropout)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        residual_std = 0.02 / math.sqrt(2 * self.cfg.depth)
        for name, p in self.named_parameters():
            if p.dim() < 2:
                nn.init.ones_(p)
            elif name.endswith("proj.weight"):  # writes into the residual stream: scaled down with depth
                nn.init.normal_(p, std=residual_std)
            else:
                nn.init.normal_(p, std=0.02)

    def embed(self, idx: torch.Tensor, matches: torch.Tensor | None = None) -> torch.Tensor:
        """Token embeddings of idx [B, T]; a model with an index input adds those of its matches [B, T, 2]
        (next token, match length; from `TokenIndex`)."""
        x = self.tok_emb(idx)
        if self.cfg.index is None:
            return x
        if matches is None:
            raise ValueError("this model reads index matches: pass matches (TokenIndex.lookup)")
        return x + self.index_token_emb(matches[..., 0]) + self.index_length_emb(matches[..., 1])

    def forward(
        self, idx: torch.Tensor, matches: torch.Tensor | None = None, positions: torch.Tensor | None = None,
        caches: list[KVCache] | None = None,
    ) -> torch.Tensor:
        return self.lm_head(self.hidden_states(idx, matches, positions, caches))

    def hidden_states(
        self, idx: torch.Tensor, matches: torch.Tensor | None = None, positions: torch.Tensor | None = None,
        caches: list[KVCache] | None = None,
    ) -> torch.Tensor:
        """What `lm_head` reads, [B, T, width] (generation turns only the positions it samples into logits)."""
        if idx.shape[1] > self.cfg.context:
            raise ValueError(f"sequence of {idx.shape[1]} tokens exceeds the model context {self.cfg.context}")
        x = self.dropout(self.embed(idx, matches))
        # Block masks serve sequences that start at position 0; tokens at other positions attend through a cache.
        masks = block_masks_for(self.cfg.layer_windows(), idx.shape[1], idx.device) if positions is None else {}
        for index, (block, cache) in enumerate(zip(self.blocks, caches or [None] * len(self.blocks))):
            if index < self.checkpointed_blocks and torch.is_grad_enabled():
                x = checkpoint(block, x, self.rotary, masks, cache, positions, use_reentrant=False)
            else:
                x = block(x, self.rotary, masks, cache, positions)
        return self.norm(x)

    def execution_units(self) -> list[list[nn.Module]]:
        """The modules that hold parameters, grouped in the order the forward uses them; the first module of
        each group runs first (CPU offload moves weights unit by unit)."""
        embeddings = [self.tok_emb, self.index_token_emb, self.index_length_emb] if self.cfg.index else [self.tok_emb]
        return [embeddings, *([block] for block in self.blocks), [self.norm, self.lm_head]]
