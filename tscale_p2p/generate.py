"""Text generation with a KV cache that keeps only what each layer's attention window can see.

`GenerationEngine` owns a fixed number of *slots* (rows of a static-shape cache), so one engine serves a
single interactive prompt (`slots=1`) or a stream of server requests (continuous batching: a request is
prefilled into a free slot while the others keep decoding). Per layer the cache is a ring buffer of
``min(window, context)`` positions: position p of a sequence lives in slot ``p % size`` of its row, so a
windowed layer holds exactly its last `window` keys and a full layer its whole context.

Every tensor the decode step touches has a fixed address and shape, which is what lets `torch.compile`
(mode ``reduce-overhead``) capture the step, sampling included, as one CUDA graph. Steps are pipelined: the
device runs step t+1 while the host turns step t's tokens into text.

Sampling draws its randomness from one CPU `torch.Generator` per sequence (exponential noise, Gumbel-max
style), so a seed gives the same text whatever else shares the batch and whichever device runs it.

Use::

    model, model_id = load_model("runs/x", device="cuda", precision="bf16")
    engine = GenerationEngine(model, slots=1)
    [seq] = generate(engine, ["To be"], SamplingParams(temperature=0.8, max_tokens=100), on_text=print)
"""

from __future__ import annotations

import codecs
import logging
import math
import secrets
import time
from collections.abc import Callable, Sequence as SequenceOf
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from tscale_p2p.checkpoint import META_FILE, find_latest, load_checkpoint
from tscale_p2p.data import ByteTokenizer
from tscale_p2p.device import choose_precision, resolve_device
from tscale_p2p.errors import UserError
from tscale_p2p.kernels import convert_linears
from tscale_p2p.model import ModelConfig, Transformer
from tscale_p2p.tokenizer import checkpoint_tokenizer

log = logging.getLogger(__name__)

TOKENIZER = ByteTokenizer()
_MIN_PREFILL_BUCKET = 16


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens. temperature 0 is greedy; top_k 0 and top_p 1 switch those filters off."""

    max_tokens: int = 256
    temperature: float = 0.8
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise UserError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if not (_is_number(self.temperature) and math.isfinite(self.temperature) and self.temperature >= 0):
            raise UserError(f"temperature must be a finite number >= 0 (0 = greedy), got {self.temperature!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or not 0 <= self.top_k < _INT64_END:
            raise UserError(f"top_k must be an integer >= 0 (0 = off) below 2**63, got {self.top_k!r}")
        if not (_is_number(self.top_p) and 0.0 < self.top_p <= 1.0):
            raise UserError(f"top_p must be in (0, 1], got {self.top_p!r}")
        object.__setattr__(self, "temperature", float(self.temperature))
        object.__setattr__(self, "top_p", float(self.top_p))
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)
                                      or not -_INT64_END <= self.seed < _INT64_END):
            raise UserError(f"seed must be an integer in [-2**63, 2**63), got {self.seed!r}")
        object.__setattr__(self, "stop", tuple(self.stop))
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise UserError(f"stop strings must be non-empty strings, got {list(self.stop)!r}")


_INT64_END = 2**63  # top_k lives in an int64 tensor and a seed must fit torch's generator, with room for seed + n


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def sampling_mask(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Which tokens may be sampled: the `top_k` most likely (0 = all), then the smallest set of those whose
    probability (renormalised over the top-k) reaches `top_p`. logits [B, V]; top_k, top_p [B]. -> bool [B, V]"""
    vocab = logits.shape[-1]
    ordered, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(vocab, device=logits.device)
    keep = ranks < torch.where(top_k > 0, top_k, vocab)[:, None]
    probs = ordered.masked_fill(~keep, -math.inf).softmax(dim=-1)
    keep &= (probs.cumsum(dim=-1) - probs) < top_p[:, None]  # the most likely token is always kept
    return torch.zeros_like(keep).scatter(-1, order, keep)


def sample(
    logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, noise: torch.Tensor
) -> torch.Tensor:
    """One token per row. `noise` holds Exp(1) draws [B, V]: argmax(p / noise) is a draw from p, and keeping
    the randomness outside lets each row bring its own seeded generator. Rows with temperature 0 are greedy."""
    logits = logits.float()
    greedy = logits.argmax(dim=-1)
    scaled = logits / temperature.clamp(min=1e-5)[:, None]
    probs = scaled.masked_fill(~sampling_mask(scaled, top_k, top_p), -math.inf).softmax(dim=-1)
    sampled = (probs / noise).argmax(dim=-1)
    return torch.where(temperature > 0, sampled, greedy)


class TextStream:
    """Tokens in (their bytes from `token_bytes`), text out: whole UTF-8 characters only, cut at the first stop
    string; text that may still turn into a stop string is held back until it cannot."""

    def __init__(self, stop: tuple[str, ...] = (), token_bytes: Callable[[int], bytes] = TOKENIZER.token_bytes) -> None:
        self._token_bytes = token_bytes
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._stop = stop
        self.text = ""  # everything decoded so far (cut at a stop string once one appears)
        self._sent = 0
        self.stopped = False

    def push(self, token: int) -> str:
        """Add one token; return the text that is now safe to show."""
        return self._add(self._decoder.decode(self._token_bytes(token)))

    def finish(self) -> str:
        """No more tokens: return whatever was held back (a cut character shows as U+FFFD)."""
        return self._add(self._decoder.decode(b"", final=True), final=True)

    def _add(self, new: str, final: bool = False) -> str:
        if self.stopped:
            return ""
        self.text += new
        hits = [i for i in (self.text.find(s, self._sent) for s in self._stop) if i >= 0]
        end = len(self.text)
        if hits:
            self.stopped = True
            self.text = self.text[: min(hits)]
            end = len(self.text)
        elif not final:
            end -= self._held_back()
        out, self._sent = self.text[self._sent : end], end
        return out

    def _held_back(self) -> int:
        """Length of the longest end of the text that begins some stop string."""
        longest = 0
        for stop in self._stop:
            for k in range(min(len(stop) - 1, len(self.text) - self._sent), longest, -1):
                if self.text.endswith(stop[:k]):
                    longest = k
                    break
        return longest


class GenerationSequence:
    """One prompt being completed: its tokens, its text so far, why it finished, and its timings."""

    def __init__(self, prompt: str | list[int], params: SamplingParams, tokenizer=TOKENIZER) -> None:
        self.prompt = tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        self.params = params
        self.tokens: list[int] = []
        self.stream = TextStream(params.stop, tokenizer.token_bytes)
        self.finish_reason: str | None = None  # "stop" | "length" once done
        self.cancelled = False
        seed = params.seed if params.seed is not None else secrets.randbits(63)
        self.rng = torch.Generator().manual_seed(seed)
        self.started = self.first_token_at = self.finished_at = 0.0

    @property
    def done(self) -> bool:
        return self.finish_reason is not None or self.cancelled

    @property
    def text(self) -> str:
        return self.stream.text

    def decode_tokens_per_second(self) -> float:
        """Tokens after the first (the first comes out of the prefill) per second of decoding."""
        seconds = self.finished_at - self.first_token_at
        return (len(self.tokens) - 1) / seconds if seconds > 0 and len(self.tokens) > 1 else 0.0

    def accept(self, token: int, context: int) -> str:
        """Record a generated token; return the text it makes visible. Sets finish_reason when done."""
        self.tokens.append(token)
        delta = self.stream.push(token)
        if self.stream.stopped:
            self.finish_reason = "stop"
        # The next input would sit at position len(prompt) + len(tokens) - 1, which must be < context.
        elif len(self.tokens) >= self.params.max_tokens or len(self.prompt) + len(self.tokens) > context:
            self.finish_reason = "length"
            delta += self.stream.finish()
        if self.finish_reason:
            self.finished_at = time.perf_counter()
        return delta


class RingKVCache(nn.Module):
    """Keys and values of one layer for `batch` sequences: the newest `size` positions of each, position p in
    slot p % size. With size = the layer's window, every filled slot is inside the window.

    As the model's `KVCache` it serves decode steps: one new token per row; `PromptFill` serves prefills."""

    def __init__(self, batch: int, heads: int, head_dim: int, size: int, dtype: torch.dtype, device) -> None:
        super().__init__()
        self.size = size
        shape = (batch, heads, size, head_dim)
        self.register_buffer("k", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.register_buffer("v", torch.zeros(shape, dtype=dtype, device=device), persistent=False)

    def store_prompt(self, rows: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: torch.Tensor) -> None:
        """Fill whole rows from a prompt's keys/values [n, H, T, D] (right-padded; `lengths` [n] are real)."""
        slots = torch.arange(self.size, device=k.device)[None, :]
        last = lengths[:, None] - 1
        # Slot j holds the newest position p <= last with p = j (mod size); slots past `last` stay unused
        # (masked out) until decoding reaches them, and the gather index only has to be in range.
        positions = (slots + self.size * ((last - slots).clamp(min=0) // self.size)).clamp(max=k.shape[2] - 1)
        index = positions[:, None, :, None].expand(-1, k.shape[1], -1, k.shape[3])
        self.k[rows] = k.gather(2, index).to(self.k.dtype)
        self.v[rows] = v.gather(2, index).to(self.v.dtype)

    def append(self, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor) -> None:
        """Write one new key/value per row ([B, H, 1, D]) at each row's own position [B]."""
        rows = torch.arange(k.shape[0], device=k.device)
        slots = positions % self.size
        self.k[rows, :, slots] = k[:, :, 0]
        self.v[rows, :, slots] = v[:, :, 0]

    def visible(self, positions: torch.Tensor) -> torch.Tensor:
        """Attention mask [B, 1, 1, size] for queries at `positions`: the slots written so far."""
        slots = torch.arange(self.size, device=positions.device)
        return (slots[None, :] <= positions[:, None])[:, None, None, :]

    def update(self, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor):
        """A decode step's token per row ([B, H, 1, D] at `positions` [B, 1]): attend over the filled slots."""
        self.append(k, v, positions[:, 0])
        return self.k, self.v, self.visible(positions[:, 0])


class PromptFill:
    """A `RingKVCache` as a prefill sees it: the prompts' keys/values go into `rows` of the cache, and their
    queries attend within the prompts (the model's own windowed attention)."""

    def __init__(self, cache: RingKVCache, rows: torch.Tensor, lengths: torch.Tensor) -> None:
        self.cache, self.rows, self.lengths = cache, rows, lengths

    def update(self, k: torch.Tensor, v: torch.Tensor, positions: None):
        self.cache.store_prompt(self.rows, k, v, self.lengths)
        return k, v, None


@dataclass
class _LaunchedStep:
    """A decode step on its way: who held each row when it started, and where its tokens will land."""

    rows: list[GenerationSequence | None]
    tokens: torch.Tensor
    done: torch.cuda.Event | None

    def ready(self) -> None:
        if self.done is not None:
            self.done.synchronize()


class GenerationEngine(nn.Module):
    """A model plus a static KV cache of `slots` rows, stepping all live sequences together.

    `admit` prefills new sequences into free slots (and samples their first token); `step` runs one decode
    step for every slot and hands each live sequence its next token. On CUDA the step is compiled into a CUDA
    graph unless `compile=False`. A model with an index input needs its `index` (a `TokenIndex`): the match of
    every generated token is looked up as it is produced, so those steps are not pipelined.
    """

    def __init__(self, model: Transformer, slots: int = 1, compile: bool | None = None, index=None) -> None:
        super().__init__()
        if slots < 1:
            raise UserError(f"the number of generation slots must be at least 1, got {slots}")
        self.model = model.eval()
        cfg: ModelConfig = model.cfg
        self.cfg = cfg
        # A loaded model carries its tokenizer (`load_model`, the swarm's fetch); a bare one reads bytes.
        self.tokenizer = getattr(model, "tokenizer", TOKENIZER)
        if self.tokenizer is None:
            raise UserError(
                "this model was trained on a .bin of an unknown tokenizer, so text cannot be turned into its tokens; "
                "train with --tokenizer PATH (that .bin's tokenizer.json) to make it decodable"
            )
        if index is not None or cfg.index is not None:
            from tscale_p2p.index import check_index_flag

            check_index_flag(cfg.index, None if index is None else str(index.path), "the model")
        self.index = index
        weight = model.tok_emb.weight
        device, dtype = weight.device, weight.dtype
        self.caches = nn.ModuleList(
            RingKVCache(slots, cfg.heads, cfg.head_dim, min(window, cfg.context), dtype, device)
            for window in cfg.layer_windows()
        )
        # Inputs of the decode step, updated in place so that a captured CUDA graph sees them.
        self.register_buffer("tokens", torch.zeros(slots, dtype=torch.long, device=device), persistent=False)
        self.register_buffer("positions", torch.zeros(slots, dtype=torch.long, device=device), persistent=False)
        self.register_buffer("temperature", torch.zeros(slots, device=device), persistent=False)
        self.register_buffer("top_k", torch.zeros(slots, dtype=torch.long, device=device), persistent=False)
        self.register_buffer("top_p", torch.ones(slots, device=device), persistent=False)
        self.register_buffer("noise", torch.ones(slots, cfg.vocab_size, device=device), persistent=False)
        # each row's index match (next token, length) for its current token
        self.register_buffer("matches", torch.zeros(slots, 2, dtype=torch.long, device=device), persistent=False)
        self.slots: list[GenerationSequence | None] = [None] * slots
        # Host-side buffers of the pipelined step, two of each: one step is in flight while the last is read.
        pinned = device.type == "cuda"
        self._host_tokens = torch.zeros(2, slots, dtype=torch.long, pin_memory=pinned)
        self._host_noise = torch.ones(2, slots, cfg.vocab_size, pin_memory=pinned)
        self._launches = 0
        self._in_flight: _LaunchedStep | None = None
        if compile is None:
            compile = device.type == "cuda"
        self._step = self._decode_and_sample
        if compile:
            for buffer in self.buffers():  # the graph writes into them: same address every replay, no copies
                torch._dynamo.mark_static_address(buffer)
            self._step = torch.compile(self._decode_and_sample, mode="reduce-overhead", fullgraph=True, dynamic=False)
            log.info("compiling the decode step for %d slot(s) on %s (once per process)", slots, device)
            with torch.no_grad():
                # One eager step first: fp8/int8 linears quantize their weights on first use and keep them. Made
                # inside the CUDA graphs' memory pool, those copies would outlive the graph that allocated them,
                # which cudagraph trees refuse.
                self._decode_and_sample()
                for _ in range(3):  # cudagraph trees record on the third call
                    self._step()

    @property
    def device(self) -> torch.device:
        return self.tokens.device

    @property
    def free_slots(self) -> int:
        return sum(seq is None for seq in self.slots)

    @property
    def active(self) -> list[GenerationSequence]:
        return [seq for seq in self.slots if seq is not None]

    def check(self, seq: GenerationSequence) -> None:
        """Refuse a sequence this model cannot run (UserError)."""
        if not seq.prompt:
            raise UserError("the prompt is empty: give at least one character")
        if len(seq.prompt) > self.cfg.context:
            raise UserError(
                f"the prompt is {len(seq.prompt)} tokens long, longer than the model's context of "
                f"{self.cfg.context} tokens"
            )

    @torch.no_grad()
    def admit(self, new: SequenceOf[GenerationSequence]) -> dict[GenerationSequence, str]:
        """Prefill `new` (at most `free_slots`, each passed through `check`) in one batch; sample the first
        token of each. Returns the text each one made visible; finished ones do not keep their slot."""
        if len(new) > self.free_slots:
            raise ValueError(f"{len(new)} sequences for {self.free_slots} free slots")
        if not new:
            return {}
        for seq in new:
            self.check(seq)
        rows = [i for i, seq in enumerate(self.slots) if seq is None][: len(new)]
        now = time.perf_counter()
        for row, seq in zip(rows, new):
            self.slots[row] = seq
            seq.started = now
        row_index = torch.tensor(rows, device=self.device)
        self.temperature[row_index] = torch.tensor([s.params.temperature for s in new], device=self.device)
        self.top_k[row_index] = torch.tensor([s.params.top_k for s in new], device=self.device)
        self.top_p[row_index] = torch.tensor([s.params.top_p for s in new], device=self.device)
        logits = self._prefill(row_index, [seq.prompt for seq in new])
        first = sample(
            logits,
            self.temperature[row_index],
            self.top_k[row_index],
            self.top_p[row_index],
            self._draw_noise(new).to(self.device),
        )
        self.tokens[row_index] = first
        self.positions[row_index] = torch.tensor([len(s.prompt) for s in new], device=self.device)
        now = time.perf_counter()
        deltas = {}
        for seq, token in zip(new, first.tolist()):
            seq.first_token_at = now
            deltas[seq] = seq.accept(token, self.cfg.context)
        self._release_finished()
        self._look_up_current_tokens()
        return deltas

    @torch.no_grad()
    def step(self) -> dict[GenerationSequence, str]:
        """One decode step for every slot; returns the text each live sequence made visible.

        Pipelined: the step launched last time is read while the device already runs the next one, so the
        host's work (text, stop strings, the next launch) hides behind the device's. A sequence that ends
        or starts in between simply ignores that one in-flight step's token for its row."""
        self._release_finished()  # cancelled since the last step
        if not self.active:
            return {}
        if self.index is not None:  # the next step's input needs this step's token looked up first
            finished = self._launch()
        else:
            if self._in_flight is None:
                self._in_flight = self._launch()
            finished, self._in_flight = self._in_flight, self._launch()
        finished.ready()
        tokens = finished.tokens.tolist()
        deltas = {
            seq: seq.accept(tokens[row], self.cfg.context)
            for row, seq in enumerate(finished.rows)
            if seq is not None and seq is self.slots[row] and not seq.done
        }
        self._release_finished()
        self._look_up_current_tokens()
        return deltas

    def _look_up_current_tokens(self) -> None:
        """With an index: the match of each live row's newest token, from the row's text so far."""
        if self.index is None or not self.active:
            return
        rows = [row for row, seq in enumerate(self.slots) if seq is not None]
        found = self.index.lookup_last([self.slots[row].prompt + self.slots[row].tokens for row in rows])
        self.matches[torch.tensor(rows, device=self.device)] = found.to(self.device)

    def _launch(self) -> _LaunchedStep:
        """Start one decode step (asynchronously on CUDA) and the copy of its tokens to the host."""
        buffer = self._launches % 2
        self._launches += 1
        rows = list(self.slots)
        if any(seq is not None and seq.params.temperature > 0 for seq in rows):
            noise = self._host_noise[buffer]
            self._draw_noise(rows, out=noise)
            self.noise.copy_(noise, non_blocking=True)
        host = self._host_tokens[buffer]
        host.copy_(self._step(), non_blocking=True)
        done = None
        if self.device.type == "cuda":
            done = torch.cuda.Event()
            done.record()
        return _LaunchedStep(rows, host, done)

    def cancel(self, seqs: SequenceOf[GenerationSequence] | None = None) -> None:
        """Stop `seqs` (default: every live sequence) and free their slots."""
        for seq in self.active if seqs is None else seqs:
            seq.cancelled = True
        self._release_finished()

    def _release_finished(self) -> None:
        self.slots = [None if seq is None or seq.done else seq for seq in self.slots]

    def _draw_noise(self, seqs: SequenceOf[GenerationSequence | None], out: torch.Tensor | None = None):
        """Exp(1) draws [len(seqs), V] from each sampling sequence's own generator (ones for the rest)."""
        noise = torch.ones(len(seqs), self.cfg.vocab_size) if out is None else out.fill_(1.0)
        for row, seq in enumerate(seqs):
            if seq is not None and seq.params.temperature > 0:
                noise[row].exponential_(generator=seq.rng).clamp_(min=1e-20)
        return noise

    def _prefill(self, rows: torch.Tensor, prompts: list[list[int]]) -> torch.Tensor:
        """Run the prompts through the model, storing every layer's keys/values in `rows`. -> logits [n, V] of
        each prompt's last token."""
        lengths = torch.tensor([len(p) for p in prompts], device=self.device)
        # Right padding never reaches real positions (attention is causal); padding to a few lengths keeps
        # the number of distinct shapes (and FlexAttention compilations on CUDA) small.
        longest = max(len(p) for p in prompts)
        padded = min(self.cfg.context, max(_MIN_PREFILL_BUCKET, 1 << (longest - 1).bit_length()))
        idx = torch.zeros(len(prompts), padded, dtype=torch.long)
        for i, prompt in enumerate(prompts):
            idx[i, : len(prompt)] = torch.tensor(prompt)
        matches = None if self.index is None else self.index.lookup(idx).to(self.device)
        fills = [PromptFill(cache, rows, lengths) for cache in self.caches]
        hidden = self.model.hidden_states(idx.to(self.device), matches, caches=fills)
        last = hidden[torch.arange(len(prompts), device=self.device), lengths - 1]
        return self.model.lm_head(last)

    def _decode_and_sample(self) -> torch.Tensor:
        """Feed every row's current token at its position, sample the next, advance. -> next tokens [B]."""
        positions = self.positions
        matches = None if self.index is None else self.matches[:, None]
        hidden = self.model.hidden_states(self.tokens[:, None], matches, positions[:, None], list(self.caches))
        logits = self.model.lm_head(hidden[:, 0])
        next_tokens = sample(logits, self.temperature, self.top_k, self.top_p, self.noise)
        self.tokens.copy_(next_tokens)
        # Rows that already used the whole context only produce ignored tokens; keep their index in range.
        positions.add_(1).clamp_(max=self.cfg.context - 1)
        return next_tokens


def generate(
    engine: GenerationEngine,
    prompts: SequenceOf[str | list[int]],
    params: SamplingParams | SequenceOf[SamplingParams],
    on_text: Callable[[int, str], None] | None = None,
) -> list[GenerationSequence]:
    """Complete every prompt (more prompts than slots wait for a free one); `on_text(index, text)` is called
    as text becomes visible. All prompts are checked before any work starts."""
    if isinstance(params, SamplingParams):
        params = [params] * len(prompts)
    seqs = [GenerationSequence(prompt, p, engine.tokenizer) for prompt, p in zip(prompts, params, strict=True)]
    for seq in seqs:
        engine.check(seq)
    index = {seq: i for i, seq in enumerate(seqs)}
    waiting = list(seqs)

    def show(deltas: dict[GenerationSequence, str]) -> None:
        for seq, text in deltas.items():
            if text and on_text is not None:
                on_text(index[seq], text)

    while waiting or engine.active:
        admitted, waiting = waiting[: engine.free_slots], waiting[engine.free_slots :]
        show(engine.admit(admitted))
        show(engine.step())
    return seqs


def load_model(
    checkpoint: str | Path, device: str = "auto", precision: str = "auto"
) -> tuple[Transformer, str]:
    """The model of a checkpoint directory (``step-*``) or of the newest valid checkpoint in a run directory,
    on `device` in `precision`, ready for inference. -> (model, a name for it: the run directory's name)."""
    path = Path(checkpoint)
    if not path.is_dir():
        raise UserError(f"checkpoint {path}: no such directory")
    if not (path / META_FILE).exists():
        latest = find_latest(path)
        if latest is None:
            raise UserError(f"checkpoint {path}: holds no valid step-* checkpoint")
        path = latest
    loaded = load_checkpoint(path)
    try:
        cfg = ModelConfig.from_dict(loaded.model_config)
    except (TypeError, UserError) as error:
        raise UserError(f"checkpoint {path}: bad model config: {error}") from None
    model = Transformer(cfg)
    loaded.restore(model)
    model.tokenizer = checkpoint_tokenizer(path, loaded.meta, cfg.vocab_size)
    model = prepare_for_inference(model, device, precision)
    name = path.parent.name if path.name.startswith("step-") else path.name
    log.info("loaded %s (%s, step %d)", path, cfg.dims, loaded.step)
    return model, name


def prepare_for_inference(model: Transformer, device: str = "auto", precision: str = "auto") -> Transformer:
    """Move `model` to `device` with weights in `precision` (auto: bf16 on CUDA, fp32 on the CPU; fp8/int8 swap
    in the quantized linears, or fall back to bf16 where the device lacks them). Rotary tables stay fp32."""
    target = resolve_device(device)
    precision = choose_precision(precision, target)
    # bf16 weights rather than autocast: decoding reads every weight once per token, so bytes are speed.
    model = model.to(device=target, dtype=torch.float32 if precision == "fp32" else torch.bfloat16)
    model.rotary.float()  # angles of late positions need more than bf16's 8 bits of mantissa
    log.info("model on %s in %s", target, precision)
    return convert_linears(model, precision).eval()

