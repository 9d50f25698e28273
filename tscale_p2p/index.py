"""TScale's "1T index": for every position, the longest earlier match of its context in a corpus.

For position i of a text, take the context ending at i (at most `MAX_MATCH` tokens), find the longest
suffix of it that also occurs in the indexed corpus, and return the token that followed that occurrence
and the match length. The model adds an embedding of each to the token embedding (model.py), so it learns
when to trust the guess.

The structure is a suffix array of the *reversed* corpus: the suffix ending at text position j reads
``t[j], t[j-1], ..., t[0]``, so every context becomes a prefix query, answered by one binary search and a
look at the two neighbours. The array holds those end positions j, sorted by the reversed string.

**History only.** Training on the indexed corpus itself must not look at the answer: position i may only
use occurrences that end at j < i (their next token ``t[j+1]`` is then at most ``t[i]``, already seen). Those
answers are computed for every position of the corpus at build time, in one pass over the suffix array
(a longest-previous-factor pass: the nearest suffix on either side in sorted order that ends earlier in the
text, and the common length with it, from a stack), and stored beside it. Lookups of text that is not in the
index (validation, prompts, generation) binary-search at run time, batched over a ``(batch, context)``
tensor.

**Which occurrence** (the same rule in both, so the stored answers equal a lookup restricted to history):
of the two nearest candidates around the query's place in sorted order, the one with the longer match
(the left one on a tie); when the match has the full `MAX_MATCH` tokens, the first candidate of that block
in sorted order.

On disk (``index build --out DIR``), all memory-mapped, never read whole:

``tokens.bin``      the indexed tokens (the train split of ``--data``), as stored by the corpus
``suffixes.bin``    the suffix array of the reversed tokens, as end positions (int32 below 2**31 tokens)
``answer_tokens.bin`` / ``answer_lengths.bin``  the history-only answer of every position (token, uint8 length)
``index.json``      the manifest: corpus hash (sha256 of the tokens), tokenizer, vocabulary, sizes

Use::

    build_index(load_corpus("stdlib"), "idx")                 # or `tscale-peer index build`
    index = TokenIndex.open("idx", corpus=corpus)             # refuses a stale index or another tokenizer
    matches = index.history_matches(starts, context)          # [B, T, 2] for training windows of the corpus
    matches = index.lookup(x)                                 # [B, T, 2] for any token windows x [B, T]
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from pathlib import Path

import numba
import numpy as np
import torch

from tscale_p2p.atomic import atomic_directory
from tscale_p2p.data import WindowSampler
from tscale_p2p.errors import UserError
from tscale_p2p.tokenizer import tokenizer_id

log = logging.getLogger(__name__)

# numba's OpenMP layer shares libgomp with torch and leaves torch's CPU ops ~300x slower after a parallel lookup
# (measured: 300 small adds 46 ms before, 16.7 s after); its own thread pool leaves them alone.
numba.config.THREADING_LAYER = "workqueue"

MAX_MATCH = 32  # TScale's context for a match: longer ones are almost always duplicated documents
FORMAT = 1
MANIFEST = "index.json"
TOKENS_FILE, SUFFIXES_FILE = "tokens.bin", "suffixes.bin"
ANSWER_TOKENS_FILE, ANSWER_LENGTHS_FILE = "answer_tokens.bin", "answer_lengths.bin"
_HASH_CHUNK = 1 << 24


def tokenizer_identity(corpus) -> str:
    """How `corpus`'s tokens were made (byte, bpe-<sha256>, external-<vocab>), as the swarm's run config names
    it: an index serves only text tokenized the same way."""
    return tokenizer_id(corpus.tokenizer, corpus.vocab_size)


def corpus_hash(tokens: np.ndarray) -> str:
    """sha256 of the tokens' little-endian bytes, read in chunks."""
    digest = hashlib.sha256()
    for start in range(0, len(tokens), _HASH_CHUNK):
        digest.update(np.ascontiguousarray(tokens[start : start + _HASH_CHUNK]).tobytes())
    return digest.hexdigest()


def _suffix_dtype(n: int) -> np.dtype:
    return np.dtype(np.int32 if n < 2**31 else np.int64)


# ---- build ---------------------------------------------------------------------------------------


def suffix_array_of_reversed(tokens: np.ndarray) -> np.ndarray:
    """End positions j of the corpus sorted by ``t[j], t[j-1], ..., t[0]``.

    libdivsufsort through `pydivsufsort`, chosen over `tokengrams` by measurement (benchmarks/index.py, in
    benchmarks/RESULTS.md): on two cores it sorted 10M byte tokens 2.6x and 100M 19x faster, adding 6 bytes
    of memory per token against 11 (int32 entries below 2**31 tokens, and byte tokens as bytes; tokengrams
    keeps u64 entries and u16 tokens at least); it sorts uint16/uint32 BPE ids too.
    """
    from pydivsufsort import divsufsort

    reversed_tokens = np.ascontiguousarray(tokens[::-1])  # a writable copy: the library refuses read-only input
    if reversed_tokens.dtype != np.uint8:
        reversed_tokens = reversed_tokens.astype(np.dtype(reversed_tokens.dtype).newbyteorder("<"))
    starts = divsufsort(reversed_tokens)
    del reversed_tokens
    ends = starts.astype(_suffix_dtype(len(tokens)), copy=False)
    np.subtract(len(tokens) - 1, ends, out=ends)  # reversed start r is text position n - 1 - r
    return ends


def build_index(corpus, out: str | os.PathLike, *, max_match: int = MAX_MATCH) -> Path:
    """Index `corpus`'s train split into the folder `out` (which must not exist yet or be empty).

    Written into a temporary sibling folder and renamed into place at the end, so an interrupted build
    leaves nothing behind. Returns the folder."""
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise UserError(f"--out {str(out)!r} already exists and is not an empty folder; choose another or delete it")
    tokens = corpus.train.tokens
    n = len(tokens)
    if n < 2:
        raise UserError(f"--data {corpus.source!r}: its train split has {n} tokens, too few to index")
    started = time.monotonic()
    with atomic_directory(out) as tmp:  # replaces an empty `out`
        token_dtype = np.dtype(tokens.dtype).newbyteorder("<")
        stored = np.memmap(tmp / TOKENS_FILE, dtype=token_dtype, mode="w+", shape=(n,))
        digest = hashlib.sha256()
        with _build_progress() as progress:
            # The library sort and the compiled passes release the GIL, so the bar keeps moving through them.
            task = progress.add_task(f"index 1/3: copying and hashing {n:,} tokens", total=n)
            for start in range(0, n, _HASH_CHUNK):
                chunk = np.ascontiguousarray(tokens[start : start + _HASH_CHUNK], dtype=token_dtype)
                stored[start : start + len(chunk)] = chunk
                digest.update(chunk.tobytes())
                progress.advance(task, len(chunk))
            stored.flush()
            progress.update(task, description=f"index 2/3: suffix array of {n:,} tokens (libdivsufsort)",
                            total=None)
            ends = suffix_array_of_reversed(stored)
            suffixes = np.memmap(tmp / SUFFIXES_FILE, dtype=ends.dtype, mode="w+", shape=(n,))
            suffixes[:] = ends
            del ends
            answer_tokens = np.memmap(tmp / ANSWER_TOKENS_FILE, dtype=token_dtype, mode="w+", shape=(n,))
            answer_lengths = np.memmap(tmp / ANSWER_LENGTHS_FILE, dtype=np.uint8, mode="w+", shape=(n,))
            progress.update(task, description=f"index 3/3: history-only answers of {n:,} positions")
            _history_answers(stored, suffixes, max_match, answer_tokens, answer_lengths)
        for array in (suffixes, answer_tokens, answer_lengths):
            array.flush()
        manifest = {
            "format": FORMAT,
            "corpus_hash": digest.hexdigest(),
            "tokenizer": tokenizer_identity(corpus),
            "vocab_size": int(corpus.vocab_size),
            "tokens": n,
            "token_dtype": token_dtype.str,
            "suffix_dtype": suffixes.dtype.str,
            "max_match": max_match,
            "source": corpus.source,
            "description": corpus.description,
        }
        del stored, suffixes, answer_tokens, answer_lengths
        manifest["files"] = {name: (tmp / name).stat().st_size for name in _DATA_FILES}
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1))
    log.info("indexed %s tokens of %s into %s in %.1f s", f"{n:,}", corpus.source, out, time.monotonic() - started)
    return out


def _build_progress():
    from rich.console import Console
    from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    columns = (SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), TimeElapsedColumn())
    return Progress(*columns, console=Console(stderr=True), transient=True)


_DATA_FILES = (TOKENS_FILE, SUFFIXES_FILE, ANSWER_TOKENS_FILE, ANSWER_LENGTHS_FILE)


def _history_answers(tokens, suffixes, max_match, answer_tokens, answer_lengths) -> None:
    n = len(tokens)
    lcp = np.empty(n, dtype=np.uint8)  # common length (capped) of neighbours in sorted order
    _adjacent_lcp(tokens, suffixes, max_match, lcp)
    left_end = np.empty(n, dtype=suffixes.dtype)
    left_lcp = np.empty(n, dtype=np.uint8)
    stack = np.empty(n, dtype=suffixes.dtype)
    _answers_pass(tokens, suffixes, lcp, max_match, left_end, left_lcp, stack, answer_tokens, answer_lengths)


# The kernels: plain loops compiled by numba (a stack pass over 10^8 entries is not a numpy expression).


@numba.njit(parallel=True, cache=True, nogil=True)
def _adjacent_lcp(tokens, suffixes, max_match, out):
    out[0] = 0
    for p in numba.prange(1, len(suffixes)):
        a, b = suffixes[p - 1], suffixes[p]
        k = 0
        while k < max_match and k <= a and k <= b and tokens[a - k] == tokens[b - k]:
            k += 1
        out[p] = k


@numba.njit(cache=True, nogil=True)
def _answers_pass(tokens, suffixes, lcp, max_match, left_end, left_lcp, stack, answer_tokens, answer_lengths):
    """For each suffix (sorted rank p, ending at text position i = suffixes[p]), the nearest ranks on each
    side whose suffix ends before i, and the common length with each (the minimum of `lcp` in between,
    kept per stack entry); then the rule of the module docstring."""
    n = len(suffixes)
    gap = np.empty(n, dtype=np.uint8)  # stack entry k: min lcp between its rank and the next entry's (or p)
    top = -1
    for p in range(n):
        if top >= 0 and lcp[p] < gap[top]:
            gap[top] = lcp[p]
        while top >= 0 and suffixes[stack[top]] > suffixes[p]:
            popped = gap[top]
            top -= 1
            if top >= 0 and popped < gap[top]:
                gap[top] = popped
        if top >= 0:
            left_end[p], left_lcp[p] = suffixes[stack[top]], gap[top]
        else:
            left_end[p], left_lcp[p] = -1, 0
        top += 1
        stack[top], gap[top] = p, max_match
    top = -1
    full = False  # some position needs the block rule (a full-length match)
    for p in range(n - 1, -1, -1):
        if top >= 0 and lcp[p + 1] < gap[top]:
            gap[top] = lcp[p + 1]
        while top >= 0 and suffixes[stack[top]] > suffixes[p]:
            popped = gap[top]
            top -= 1
            if top >= 0 and popped < gap[top]:
                gap[top] = popped
        right_end, right_lcp = -1, 0
        if top >= 0:
            right_end, right_lcp = suffixes[stack[top]], gap[top]
        i = suffixes[p]
        if left_lcp[p] >= max_match or right_lcp >= max_match:
            full = True
            answer_lengths[i] = max_match  # the token comes from the block pass below
        elif left_end[p] >= 0 and left_lcp[p] > 0 and left_lcp[p] >= right_lcp:
            answer_lengths[i], answer_tokens[i] = left_lcp[p], tokens[left_end[p] + 1]
        elif right_end >= 0 and right_lcp > 0:
            answer_lengths[i], answer_tokens[i] = right_lcp, tokens[right_end + 1]
        else:
            answer_lengths[i], answer_tokens[i] = 0, 0
        top += 1
        stack[top], gap[top] = p, max_match
    if not full:
        return
    # Full-length matches: the first rank of the suffix's block (neighbours sharing max_match tokens) that
    # ends before it, by binary search in the block's running minimum of end positions (reusing `stack`).
    begin = 0
    while begin < n:
        end = begin + 1
        while end < n and lcp[end] >= max_match:
            end += 1
        if end - begin > 1:
            running = suffixes[begin]
            for q in range(begin, end):
                if suffixes[q] < running:
                    running = suffixes[q]
                stack[q] = running
            for p in range(begin, end):
                i = suffixes[p]
                if answer_lengths[i] < max_match:
                    continue
                lo, hi = begin, end  # first q with running minimum < i (it exists: a candidate is in the block)
                while lo < hi:
                    mid = (lo + hi) // 2
                    if stack[mid] < i:
                        hi = mid
                    else:
                        lo = mid + 1
                answer_tokens[i] = tokens[suffixes[lo] + 1]
        begin = end


@numba.njit(parallel=True, cache=True, nogil=True)
def _lookup_kernel(tokens, suffixes, windows, first, history, max_match, out_tokens, out_lengths):
    """Answers for every column t >= first[b] of every row b of `windows`, from the context
    ``windows[b, first[b] : t + 1]``. With `history`, the single row is the indexed corpus itself and column t
    may only use occurrences ending before t; otherwise any occurrence with a next token (j < n - 1)."""
    rows, width = windows.shape
    n = len(suffixes)
    for flat in numba.prange(rows * width):
        b, t = flat // width, flat % width
        out_tokens[b, t], out_lengths[b, t] = 0, 0
        if t < first[b]:
            continue
        c = min(max_match, t - first[b] + 1)
        limit = t if history else n - 1
        lo, hi = 0, n  # the first suffix >= the reversed context, compared over c tokens
        while lo < hi:
            mid = (lo + hi) // 2
            j = suffixes[mid]
            k = 0
            while k < c and k <= j and tokens[j - k] == windows[b, t - k]:
                k += 1
            if k == c:
                hi = mid
            elif k > j or tokens[j - k] < windows[b, t - k]:  # shorter (a prefix of the query) or smaller
                lo = mid + 1
            else:
                hi = mid
        right = lo
        while right < n and suffixes[right] >= limit:
            right += 1
        left = lo - 1
        while left >= 0 and suffixes[left] >= limit:
            left -= 1
        right_lcp, left_lcp = 0, 0
        if right < n:
            j = suffixes[right]
            while right_lcp < c and right_lcp <= j and tokens[j - right_lcp] == windows[b, t - right_lcp]:
                right_lcp += 1
        if left >= 0:
            j = suffixes[left]
            while left_lcp < c and left_lcp <= j and tokens[j - left_lcp] == windows[b, t - left_lcp]:
                left_lcp += 1
        if right_lcp >= c:
            out_tokens[b, t], out_lengths[b, t] = tokens[suffixes[right] + 1], c
        elif left_lcp > 0 and left_lcp >= right_lcp:
            out_tokens[b, t], out_lengths[b, t] = tokens[suffixes[left] + 1], left_lcp
        elif right_lcp > 0:
            out_tokens[b, t], out_lengths[b, t] = tokens[suffixes[right] + 1], right_lcp


# ---- open and look up ------------------------------------------------------------------------------


class TokenIndex:
    """A built index, memory-mapped read-only. Matches come as LongTensors ``[..., 2]``: (next token, match
    length); a position with no match at all has length 0 and token `no_match_token` (= vocab_size)."""

    def __init__(self, path: Path, manifest: dict, arrays: dict[str, np.ndarray]) -> None:
        self.path, self.manifest = path, manifest
        self.tokens, self.suffixes = arrays[TOKENS_FILE], arrays[SUFFIXES_FILE]
        self.answer_tokens, self.answer_lengths = arrays[ANSWER_TOKENS_FILE], arrays[ANSWER_LENGTHS_FILE]
        self.corpus_hash: str = manifest["corpus_hash"]
        self.tokenizer: str = manifest["tokenizer"]
        self.vocab_size: int = manifest["vocab_size"]
        self.max_match: int = manifest["max_match"]
        self.no_match_token = self.vocab_size

    def __len__(self) -> int:
        return len(self.tokens)

    @classmethod
    def open(cls, path: str | os.PathLike, corpus=None) -> "TokenIndex":
        """Open the index in folder `path`; with `corpus`, refuse it unless it indexes that corpus's train split
        with the same tokenizer. Every problem is a one-line UserError."""
        path = Path(path)
        manifest = read_manifest(path)
        n = manifest["tokens"]
        dtypes = {TOKENS_FILE: manifest["token_dtype"], SUFFIXES_FILE: manifest["suffix_dtype"],
                  ANSWER_TOKENS_FILE: manifest["token_dtype"], ANSWER_LENGTHS_FILE: "|u1"}
        arrays = {}
        for name, dtype in dtypes.items():
            file = path / name
            expected = n * np.dtype(dtype).itemsize
            try:
                size = file.stat().st_size
            except FileNotFoundError:
                raise UserError(f"index {str(path)!r} is damaged: {name} is missing; rebuild it") from None
            if size != expected:
                raise UserError(
                    f"index {str(path)!r} is damaged: {name} holds {size:,} bytes, the manifest implies "
                    f"{expected:,}; rebuild it"
                )
            arrays[name] = np.memmap(file, dtype=dtype, mode="r", shape=(n,))
        index = cls(path, manifest, arrays)
        if corpus is not None:
            index.check_corpus(corpus)
        return index

    def check_corpus(self, corpus) -> None:
        """Refuse this index for `corpus` unless it was built from exactly its train split's tokens."""
        tokenizer = tokenizer_identity(corpus)
        if tokenizer != self.tokenizer:
            raise UserError(
                f"index {str(self.path)!r} was built with the {self.tokenizer} tokenizer, but --data "
                f"{corpus.source!r} is tokenized by {tokenizer}: build an index with the same --tokenizer"
            )
        if len(corpus.train) != len(self) or corpus_hash(corpus.train.tokens) != self.corpus_hash:
            raise UserError(
                f"index {str(self.path)!r} is stale: it indexes another corpus (hash {self.corpus_hash[:12]}) than "
                f"the train split of --data {corpus.source!r}; rebuild it with "
                f"`tscale-peer index build --data {corpus.source} --out DIR`"
            )

    def check_model(self, model_cfg) -> None:
        """Refuse this index for a model trained with another one (or with none)."""
        if model_cfg.index is None:
            raise UserError(f"--index {str(self.path)!r} given, but the model was trained without an index input")
        if model_cfg.index != self.corpus_hash:
            raise UserError(
                f"--index {str(self.path)!r} indexes corpus {self.corpus_hash[:12]}, but the model was trained with "
                f"an index of corpus {model_cfg.index[:12]}: pass that index"
            )

    def history_matches(self, starts: np.ndarray, context: int) -> torch.Tensor:
        """The stored history-only answers of positions ``starts[:, None] + arange(context)`` -> [B, T, 2]."""
        positions = np.asarray(starts, dtype=np.int64)[:, None] + np.arange(context)
        return self._as_matches(self.answer_tokens[positions], self.answer_lengths[positions])

    def lookup(self, windows: torch.Tensor | np.ndarray, first: np.ndarray | None = None) -> torch.Tensor:
        """Answers for every position of token windows [B, T], each from the context at and before it in its
        row (from column ``first[b]`` on; columns before it get no match) -> [B, T, 2] on the CPU."""
        if isinstance(windows, torch.Tensor):
            windows = windows.detach().cpu().numpy()
        windows = np.ascontiguousarray(windows, dtype=np.int64)
        if windows.ndim != 2:
            raise ValueError(f"windows must be [batch, context], got shape {windows.shape}")
        first = np.zeros(len(windows), np.int64) if first is None else np.ascontiguousarray(first, dtype=np.int64)
        return self._run_lookup(windows, first, history=False)

    def lookup_last(self, contexts: list[list[int]]) -> torch.Tensor:
        """The answer for the last position of each context (its last `max_match` tokens used) -> [R, 2]."""
        width = min(self.max_match, max(len(c) for c in contexts))
        windows = np.zeros((len(contexts), width), np.int64)
        first = np.zeros(len(contexts), np.int64)
        for row, context in enumerate(contexts):
            tail = context[-width:]
            windows[row, width - len(tail) :] = tail
            first[row] = width - len(tail)
        return self._run_lookup(windows, first, history=False)[:, -1]

    def history_lookup(self) -> torch.Tensor:
        """The lookup restricted to history at every position of the indexed corpus (what the stored answers
        hold; a reference for tests, quadratic at worst) -> [n, 2]."""
        windows = np.asarray(self.tokens, dtype=np.int64)[None, :]
        return self._run_lookup(windows, np.zeros(1, np.int64), history=True)[0]

    def _run_lookup(self, windows: np.ndarray, first: np.ndarray, history: bool) -> torch.Tensor:
        out_tokens = np.empty(windows.shape, np.int64)
        out_lengths = np.empty(windows.shape, np.int64)
        _lookup_kernel(self.tokens, self.suffixes, windows, first, history, self.max_match, out_tokens, out_lengths)
        return self._as_matches(out_tokens, out_lengths)

    def _as_matches(self, tokens: np.ndarray, lengths: np.ndarray) -> torch.Tensor:
        lengths = torch.from_numpy(np.asarray(lengths, dtype=np.int64))
        tokens = torch.from_numpy(np.asarray(tokens, dtype=np.int64))
        return torch.stack((torch.where(lengths > 0, tokens, self.no_match_token), lengths), dim=-1)


def read_manifest(path: Path) -> dict:
    """The manifest of the index in `path`, checked for the keys and types `open` relies on."""
    file = path / MANIFEST
    if not path.is_dir():
        raise UserError(f"index {str(path)!r} does not exist: build one with `tscale-peer index build --data SRC --out DIR`")
    try:
        manifest = json.loads(file.read_text())
    except FileNotFoundError:
        raise UserError(f"{str(path)!r} is not an index (no {MANIFEST}): build one with `tscale-peer index build`") from None
    except (OSError, ValueError) as error:
        raise UserError(f"index {str(path)!r} is damaged: cannot read {MANIFEST} ({error}); rebuild it") from None
    wanted = {"format": int, "corpus_hash": str, "tokenizer": str, "vocab_size": int, "tokens": int,
              "token_dtype": str, "suffix_dtype": str, "max_match": int}
    if not isinstance(manifest, dict) or any(not isinstance(manifest.get(k), t) for k, t in wanted.items()):
        raise UserError(f"index {str(path)!r} is damaged: {MANIFEST} lacks or garbles one of {', '.join(wanted)}; rebuild it")
    if manifest["format"] != FORMAT:
        raise UserError(f"index {str(path)!r} has format {manifest['format']}, this version reads {FORMAT}; rebuild it")
    try:
        dtypes = [np.dtype(manifest["token_dtype"]), np.dtype(manifest["suffix_dtype"])]
    except TypeError:
        raise UserError(f"index {str(path)!r} is damaged: bad dtypes in {MANIFEST}; rebuild it") from None
    if any(d.kind not in "ui" for d in dtypes) or not 1 <= manifest["max_match"] <= 255 or manifest["tokens"] < 2:
        raise UserError(f"index {str(path)!r} is damaged: impossible values in {MANIFEST}; rebuild it")
    return manifest


def index_hash(path: str | os.PathLike) -> str:
    """The corpus hash of the index in `path` (from its manifest only): what a model config records."""
    return read_manifest(Path(path))["corpus_hash"]


def check_index_flag(model_index: str | None, index_dir: str | None, whose: str) -> None:
    """Refuse an --index that does not fit the model `whose` (e.g. "the checkpoint's model", "run 'x'"), which
    reads the index of corpus `model_index` (None: no index input)."""
    if model_index is None and index_dir is not None:
        raise UserError(f"{whose} has no index input: drop --index {index_dir}")
    if model_index is None:
        return
    if index_dir is None:
        raise UserError(
            f"{whose} reads an index of corpus {model_index[:12]}: pass --index DIR with an index of that corpus "
            f"(`tscale-peer index build --data SRC --out DIR` over the same train data builds one)"
        )
    found = index_hash(index_dir)
    if found != model_index:
        raise UserError(
            f"--index {index_dir} indexes corpus {found[:12]}, but {whose} reads an index of corpus {model_index[:12]}: "
            f"build the index over the same train data"
        )


def open_training_index(index_dir: str | None, model_cfg, corpus) -> TokenIndex:
    """The trainer's index: the one the model config names, checked against the training corpus."""
    check_index_flag(model_cfg.index, index_dir, "the model")
    return TokenIndex.open(index_dir, corpus=corpus)


class IndexedWindowSampler(WindowSampler):
    """Training windows plus the stored history-only matches of their positions: batches (x, y, matches)."""

    def __init__(self, stream, index: TokenIndex, batch_size: int, context: int, *, seed: int = 0,
                 device: torch.device | str = "cpu") -> None:
        super().__init__(stream, batch_size, context, seed=seed, device=device)
        self.index = index

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        starts = self.next_starts()
        x, y = self.stream.windows(starts, self.context, self.device)
        matches = self.index.history_matches(starts, self.context)
        if torch.device(self.device).type == "cuda":
            return x, y, matches.pin_memory().to(self.device, non_blocking=True)
        return x, y, matches
