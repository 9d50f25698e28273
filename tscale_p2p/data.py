"""Training data: where text comes from, the byte tokenizer, the train/val split and random windows.

One string names a source (the ``--data`` flag):

``stdlib`` (default)
    The ``.py`` files of the running Python's standard library (site-packages and test folders left
    out): real text that every install already has. Split by document (file), as a folder.
``PATH`` to a text file
    Memory-mapped as it is, no copy. Split by position like nanoGPT's shakespeare_char: the first
    ``1 - val_fraction`` of its bytes train, the rest is val (``int(n * 0.9)`` for the default 0.1).
``DIR``
    Every text file below DIR (hidden files, and files with a NUL byte in their first 8 KiB, skipped).
    Split by document: a file goes to val when a hash of its relative path falls below
    ``val_fraction``, so the split never depends on listing order and survives adding files. If that
    leaves a split empty, the last document moves into it; a folder of one file splits by position.
``PATH.bin``
    Tokens already made by another tokenizer: raw uint16 (nanoGPT), or llm.c's layout (a header of
    256 little-endian int32: magic 20240520, version 1, token count, then uint16 tokens; llama-3 files:
    magic 20240801, version 7, uint32 tokens). Memory-mapped, no copy. When a sibling file named with
    ``val`` in place of the last ``train`` exists (``train.bin``/``val.bin``), it is the val split;
    otherwise the last ``val_fraction`` of the tokens is. The tokenizer is unknown, so bits per byte
    are not reported (`Corpus.bytes_per_token` is None), unless ``--tokenizer`` names its tokenizer.json
    (`tscale_p2p.tokenizer`, which also re-tokenizes text sources with a BPE). `Corpus.vocab_size` is the tokenizer's for
    llm.c files (50257, 128256) and the largest id + 1 for raw ones (scanned once, noted in the cache).
``hf:NAME[:key=value]...``
    A Hugging Face dataset through ``datasets`` (streamed; NAME may also be a local folder of data
    files). Keys: ``config``, ``split`` (default ``train``), ``column`` (default ``text``),
    ``max_tokens`` (stop after about this many). Rows are documents, split by a hash of their index.
    Hub datasets are cached by name: delete the cache folder to fetch a newer version.

Text sources (folders, stdlib, hf) are byte-tokenized once, streaming, into a cache folder keyed by a
hash of the source and the sizes and mtimes of its files: ``$TSCALE_CACHE_DIR``, else
``$XDG_CACHE_HOME/tscale-p2p``, else ``~/.cache/tscale-p2p`` (``data/`` inside it). Each entry is a
folder written under a temporary name and renamed into place, so a crash never leaves half a corpus.

Use::

    corpus = load_corpus("stdlib")                  # or a path, "x.bin", "hf:NAME:column=text"
    corpus.check_context(context)                   # both splits long enough, else UserError
    batches = corpus.batches("train", batch_size, context, seed=peer_seed, device=device)
    x, y = next(batches)                            # LongTensor [B, T]; y is x shifted left by one
    state = batches.state_dict()                    # JSON-able; load_state_dict(state) resumes exactly
    for x, y in corpus.eval_batches(batch_size, context, num_batches, device): ...
    bpb = corpus.bits_per_byte(val_loss_nats)       # None when the tokenizer is unknown

Every bad input raises `UserError` with one line naming the bad value, before anything is written
(a bad row met halfway through a stream discards the half-built cache entry).
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import math
import os
import shutil
import sys
import sysconfig
import time
from array import array
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from tscale_p2p.atomic import atomic_directory, write_atomically
from tscale_p2p.errors import UserError
from tscale_p2p.progress import long_work

log = logging.getLogger(__name__)

VOCAB_SIZE = 256
LLMC_HEADER_INTS = 256
# llm.c's data files: magic -> (version, token dtype, vocabulary of the tokenizer that made them).
LLMC_FORMATS = {20240520: (1, np.uint16, 50257), 20240801: (7, np.uint32, 128256)}
_CACHE_FORMAT = 1
_SNIFF_BYTES = 8192
_CHUNK_BYTES = 1 << 24  # files are copied into the cache in pieces this big, never read whole
_SKIPPED_STDLIB_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}


class ByteTokenizer:
    """UTF-8 bytes as tokens: vocabulary 256, nothing to download, every string round-trips."""

    vocab_size = VOCAB_SIZE
    bytes_per_token = 1.0

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def token_bytes(self, token: int) -> bytes:
        return bytes((token,))

    def decode(self, tokens: Iterable[int] | np.ndarray | torch.Tensor) -> str:
        """Bytes back to text; a window cut inside a multi-byte character shows U+FFFD there."""
        if isinstance(tokens, torch.Tensor):
            tokens = tokens.cpu().numpy()
        ids = np.asarray(tokens if isinstance(tokens, np.ndarray) else list(tokens), dtype=np.int64)
        if ids.size and (ids.min() < 0 or ids.max() >= VOCAB_SIZE):
            raise ValueError(f"byte tokens must lie in [0, {VOCAB_SIZE}), got {ids.min()}..{ids.max()}")
        return ids.astype(np.uint8).tobytes().decode("utf-8", errors="replace")


@dataclass(frozen=True, eq=False)
class TokenStream:
    """One split: a read-only 1-D token array (a memory map) and, where known, where documents start."""

    split: str
    tokens: np.ndarray
    doc_starts: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.tokens)

    def check_context(self, context: int) -> None:
        if context < 1:
            raise UserError(f"context must be at least 1, got {context}")
        if len(self) < context + 1:
            raise UserError(
                f"the {self.split} split has {len(self):,} tokens, too few for context {context} "
                f"(needs {context + 1:,}): use more data, a smaller --context or another val fraction"
            )

    def windows(self, starts: np.ndarray, context: int, device: torch.device | str = "cpu"):
        """Inputs ``tokens[s : s+context]`` and targets ``tokens[s+1 : s+context+1]`` for each start s."""
        # Fancy indexing a memmap reads only the pages these windows touch.
        block = torch.from_numpy(self.tokens[starts[:, None] + np.arange(context + 1)].astype(np.int64))
        x, y = block[:, :-1].contiguous(), block[:, 1:].contiguous()
        device = torch.device(device)
        if device.type == "cuda":
            return x.pin_memory().to(device, non_blocking=True), y.pin_memory().to(device, non_blocking=True)
        return x.to(device), y.to(device)


class WindowSampler:
    """Endless batches of windows at random positions of one split.

    Batch k's positions come from ``numpy.random.default_rng([seed, k])``, so the whole state is
    ``(seed, k)``: resuming from `state_dict()` repeats the exact same batches, and peers given
    different seeds read different windows of the same corpus.
    """

    def __init__(self, stream: TokenStream, batch_size: int, context: int, *, seed: int = 0,
                 device: torch.device | str = "cpu") -> None:
        stream.check_context(context)
        if batch_size < 1:
            raise UserError(f"batch size must be at least 1, got {batch_size}")
        self.stream, self.batch_size, self.context, self.device = stream, batch_size, context, device
        self.seed = seed % 2**64  # SeedSequence takes non-negative entropy only
        self.batches_drawn = 0

    def __iter__(self) -> "WindowSampler":
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.stream.windows(self.next_starts(), self.context, self.device)

    def next_starts(self) -> np.ndarray:
        """The start positions of the next batch's windows (and count it drawn)."""
        rng = np.random.default_rng([self.seed, self.batches_drawn])
        starts = rng.integers(0, len(self.stream) - self.context, size=self.batch_size)
        self.batches_drawn += 1
        return starts

    def state_dict(self) -> dict:
        return {"seed": self.seed, "batches_drawn": self.batches_drawn}

    def load_state_dict(self, state: dict) -> None:
        self.seed, self.batches_drawn = int(state["seed"]), int(state["batches_drawn"])


@dataclass(frozen=True, eq=False)
class Corpus:
    """A source's train and val splits plus what the trainer needs to know about its tokens."""

    source: str
    description: str
    train: TokenStream
    val: TokenStream
    vocab_size: int  # byte data: 256; .bin: its tokenizer's (llm.c) or the largest id + 1 (raw)
    tokenizer: ByteTokenizer | None  # None: tokens made by a tokenizer we do not have
    bytes_per_token: float | None  # None: unknown, so no bits per byte

    def batches(self, split: str, batch_size: int, context: int, *, seed: int = 0,
                device: torch.device | str = "cpu") -> WindowSampler:
        return WindowSampler(self.stream(split), batch_size, context, seed=seed, device=device)

    def eval_batches(
        self, batch_size: int, context: int, num_batches: int | None = None,
        device: torch.device | str = "cpu", split: str = "val",
    ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """The same windows every call: ``num_batches * batch_size`` windows spread evenly over the
        split, or, with ``num_batches=None``, every non-overlapping window once."""
        stream = self.stream(split)
        stream.check_context(context)  # here, not on the first next(): a bad size fails at the call
        last_start = len(stream) - context - 1
        if num_batches is None:
            starts = np.arange(0, last_start + 1, context, dtype=np.int64)
        else:
            starts = np.linspace(0, last_start, num_batches * batch_size).round().astype(np.int64)
        return (stream.windows(starts[i : i + batch_size], context, device) for i in range(0, len(starts), batch_size))

    def check_context(self, context: int) -> None:
        """Raise `UserError` unless both splits hold at least ``context + 1`` tokens (call it at start-up,
        so a too-small val split fails before training rather than at the first evaluation)."""
        self.train.check_context(context)
        self.val.check_context(context)

    def bits_per_byte(self, nats_per_token: float) -> float | None:
        if self.bytes_per_token is None:
            return None
        return nats_per_token / math.log(2) / self.bytes_per_token

    def stream(self, split: str) -> TokenStream:
        if split not in ("train", "val"):
            raise ValueError(f"split must be 'train' or 'val', not {split!r}")
        return self.train if split == "train" else self.val


def default_cache_dir() -> Path:
    if os.environ.get("TSCALE_CACHE_DIR"):
        return Path(os.environ["TSCALE_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "tscale-p2p"


def load_corpus(src: str = "stdlib", *, cache_dir: str | os.PathLike | None = None,
                val_fraction: float = 0.1) -> Corpus:
    """Open the source named by `src` (see the module docstring), tokenizing text into the cache once."""
    if not 0.0 < val_fraction < 1.0:
        raise UserError(f"val fraction must lie strictly between 0 and 1, got {val_fraction}")
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    if src == "stdlib":
        return _load_stdlib(cache / "data", val_fraction)
    if src.startswith("hf:"):
        return _load_hf(src, cache / "data", val_fraction)
    path = Path(src).expanduser()
    if not path.exists():
        raise UserError(f"data path {src!r} does not exist")
    if path.is_dir():
        return _load_folder(src, path, cache / "data", val_fraction)
    if path.suffix == ".bin":
        return _load_bin(src, path, cache / "data", val_fraction)
    return _load_text_file(src, path, val_fraction)


# ---- single text file: memory-mapped as is, split by position --------------------------------


def _load_text_file(src: str, path: Path, val_fraction: float) -> Corpus:
    size = path.stat().st_size
    if size == 0:
        raise UserError(f"data file {src!r} is empty")
    tokens = np.memmap(path, dtype=np.uint8, mode="r")
    cut = int(size * (1 - val_fraction))  # nanoGPT shakespeare_char: data[:int(n*0.9)]
    if cut == 0 or cut == size:
        raise UserError(f"data file {src!r} ({size} bytes) is too small to split into train and val")
    return Corpus(
        source=src,
        description=f"{path} ({size:,} bytes, first {cut:,} train, last {size - cut:,} val), byte tokenizer",
        train=TokenStream("train", tokens[:cut], np.zeros(1, np.int64)),
        val=TokenStream("val", tokens[cut:], np.zeros(1, np.int64)),
        vocab_size=VOCAB_SIZE,
        tokenizer=ByteTokenizer(),
        bytes_per_token=1.0,
    )


# ---- folders, stdlib, hf: byte-tokenized once into the cache, split by document ----------------


def _load_folder(src: str, root: Path, cache: Path, val_fraction: float) -> Corpus:
    files = sorted(
        p for p in _walk(root, lambda d: not d.startswith(".")) if not p.name.startswith(".") and p.is_file()
    )
    key = _key_of_files("folder", str(root.resolve()), root, files, val_fraction)
    return _cached_byte_corpus(
        src, f"{root}", cache / key, _file_documents(root, files), val_fraction,
        empty_message=f"data folder {src!r} holds no text files", total_bytes=sum(p.stat().st_size for p in files),
    )


def _load_stdlib(cache: Path, val_fraction: float) -> Corpus:
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in _walk(root, lambda d: d not in _SKIPPED_STDLIB_DIRS) if p.suffix == ".py")
    key = _key_of_files("stdlib", sys.version, root, files, val_fraction)
    return _cached_byte_corpus(
        "stdlib", f"Python {sys.version.split()[0]} standard library ({root})", cache / key,
        _file_documents(root, files),
        val_fraction, empty_message=f"no .py files found in the standard library at {root}",
        total_bytes=sum(p.stat().st_size for p in files),
    )


def _walk(root: Path, keep_dir) -> Iterator[Path]:
    for folder, dirs, names in os.walk(root):
        dirs[:] = sorted(d for d in dirs if keep_dir(d))
        for name in names:
            yield Path(folder) / name


def _file_documents(root: Path, files: list[Path]) -> Iterator[tuple[str, Iterator[bytes]]]:
    """(relative path, its bytes in chunks) for each text file: empty files and ones with a NUL byte
    near the start (binaries) are skipped. Each file's chunks must be read before asking for the next."""
    for path in files:
        with open(path, "rb") as f:
            head = f.read(_CHUNK_BYTES)
            if head and b"\0" not in head[:_SNIFF_BYTES]:
                yield path.relative_to(root).as_posix(), _chain(head, iter(lambda: f.read(_CHUNK_BYTES), b""))


def _key_of_files(kind: str, identity: str, root: Path, files: list[Path], val_fraction: float) -> str:
    digest = hashlib.sha256(json.dumps([_CACHE_FORMAT, kind, identity, val_fraction]).encode())
    for p in files:
        st = p.stat()
        digest.update(f"{p.relative_to(root).as_posix()}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return f"{kind}-{digest.hexdigest()[:20]}"


def _load_hf(src: str, cache: Path, val_fraction: float) -> Corpus:
    name, *options = src[len("hf:") :].split(":")
    settings = {"config": None, "split": "train", "column": "text", "max_tokens": None}
    for option in options:
        key, sep, value = option.partition("=")
        if not sep or key not in settings or not value:
            raise UserError(
                f"bad option {option!r} in {src!r}: use hf:NAME[:key=value]... with keys {', '.join(settings)}"
            )
        settings[key] = value
    if not name:
        raise UserError(f"{src!r} names no dataset: use hf:NAME, e.g. hf:roneneldan/TinyStories")
    max_tokens = None
    if settings["max_tokens"] is not None:
        try:
            max_tokens = int(settings["max_tokens"])
        except ValueError:
            max_tokens = 0
        if max_tokens < 1:
            raise UserError(f"max_tokens in {src!r} must be a positive integer, got {settings['max_tokens']!r}")
    local = Path(name).expanduser()
    if local.is_dir():
        files = sorted(p for p in _walk(local, lambda d: not d.startswith(".")) if p.is_file())
        key = _key_of_files("hf", json.dumps([str(local.resolve()), settings]), local, files, val_fraction)
    else:
        key = _key_of_files("hf", json.dumps([name, settings]), Path("."), [], val_fraction)
    target = cache / key
    # A cached dataset needs neither `datasets` nor the network.
    rows = iter(()) if _cache_is_complete(target) else _open_hf(src, name, settings)
    documents = _hf_documents(src, rows, settings["column"], max_tokens)
    return _cached_byte_corpus(
        src, f"Hugging Face dataset {name} ({settings['split']} split, column {settings['column']!r})",
        target, documents, val_fraction, empty_message=f"{src!r} yields no text", total_bytes=max_tokens,
    )


def _open_hf(src: str, name: str, settings: dict):
    try:
        import datasets
    except ImportError:
        raise UserError(f"{src!r} needs the `datasets` package: pip install 'tscale-p2p[hf]'") from None
    try:
        return iter(datasets.load_dataset(name, settings["config"], split=settings["split"], streaming=True))
    except (FileNotFoundError, ConnectionError, ValueError) as e:
        # How datasets reports an unknown dataset (DatasetNotFoundError is a FileNotFoundError), an
        # unreachable hub, and a bad split or config.
        first_line = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UserError(f"cannot open Hugging Face dataset {src!r}: {first_line}") from None


def _hf_documents(
    src: str, rows: Iterator[dict], column: str, max_tokens: int | None
) -> Iterator[tuple[str, list[bytes]]]:
    written = 0
    for index, row in enumerate(rows):
        if column not in row:
            columns = ", ".join(map(repr, row))
            raise UserError(f"{src!r}: no column {column!r}; columns are {columns} (add :column=NAME)")
        text = row[column]
        if text is None:
            continue
        if not isinstance(text, str):
            raise UserError(f"{src!r}: column {column!r} holds {type(text).__name__}, not text (add :column=NAME)")
        data = text.encode("utf-8")
        if data:
            yield str(index), [data]
            written += len(data)
        if max_tokens is not None and written >= max_tokens:
            return


def _cached_byte_corpus(src: str, what: str, target: Path, documents: Iterator[tuple[str, Iterable[bytes]]],
                        val_fraction: float, *, empty_message: str, total_bytes: int | None) -> Corpus:
    if not _cache_is_complete(target):
        # Pull the first document before touching the disk, so a source with no text changes nothing.
        first = next(documents, None)
        if first is None:
            raise UserError(empty_message)
        _build_cache(target, _chain(first, documents), val_fraction, what, total_bytes)
    meta = json.loads((target / "meta.json").read_text())
    streams = {
        split: TokenStream(
            split,
            np.memmap(target / f"{split}.u8", dtype=np.uint8, mode="r"),
            np.load(target / f"{split}.docs.npy", mmap_mode="r"),
        )
        for split in ("train", "val")
    }
    return Corpus(
        source=src,
        description=(
            f"{what}: {meta['train_docs']:,} documents / {meta['train_tokens']:,} tokens train, "
            f"{meta['val_docs']:,} / {meta['val_tokens']:,} val, byte tokenizer"
        ),
        train=streams["train"],
        val=streams["val"],
        vocab_size=VOCAB_SIZE,
        tokenizer=ByteTokenizer(),
        bytes_per_token=1.0,
    )


def _chain(first, rest: Iterator) -> Iterator:
    yield first
    yield from rest


def _cache_is_complete(target: Path) -> bool:
    try:
        meta = json.loads((target / "meta.json").read_text())
        return all((target / f"{s}.u8").stat().st_size == meta[f"{s}_tokens"] for s in ("train", "val"))
    except (OSError, ValueError, KeyError):
        if target.exists():
            log.warning("rebuilding the damaged data cache %s", target)
            shutil.rmtree(target, ignore_errors=True)
        return False


def _in_val(doc_key: str, val_fraction: float) -> bool:
    h = int.from_bytes(hashlib.blake2b(doc_key.encode(), digest_size=8).digest(), "little")
    return h < val_fraction * 2**64


def _build_cache(target: Path, documents: Iterator[tuple[str, Iterable[bytes]]], val_fraction: float, what: str,
                 total_bytes: int | None) -> None:
    """Write the two splits into a temporary folder, then rename it to `target` in one step."""
    started = time.monotonic()
    try:
        with atomic_directory(target) as tmp:
            _write_cache(tmp, documents, val_fraction, what, total_bytes)
    except OSError:  # another process finished the same corpus first: use theirs
        if not _cache_is_complete(target):
            raise
    log.info("tokenized %s into %s in %.1f s", what, target, time.monotonic() - started)


def _write_cache(tmp: Path, documents: Iterator[tuple[str, Iterable[bytes]]], val_fraction: float, what: str,
                 total_bytes: int | None) -> None:
    files = {s: open(tmp / f"{s}.u8", "w+b") for s in ("train", "val")}
    try:
        starts = {s: array("q") for s in ("train", "val")}
        sizes = {"train": 0, "val": 0}
        with slow_job(f"tokenizing {what}", total_bytes) as progress:
            for doc_key, chunks in documents:
                split = "val" if _in_val(doc_key, val_fraction) else "train"
                starts[split].append(sizes[split])
                for chunk in chunks:
                    files[split].write(chunk)
                    sizes[split] += len(chunk)
                    progress.advance(len(chunk))
        _balance_splits(files, starts, sizes, val_fraction, what)
        for split, f in files.items():
            f.close()
            np.save(tmp / f"{split}.docs.npy", np.frombuffer(starts[split], dtype=np.int64))
        meta = {"format": _CACHE_FORMAT, "source": what, "dtype": "uint8"}
        for split in ("train", "val"):
            meta[f"{split}_tokens"], meta[f"{split}_docs"] = sizes[split], len(starts[split])
        (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
    finally:
        for f in files.values():
            f.close()


def _balance_splits(files: dict, starts: dict, sizes: dict, val_fraction: float, what: str) -> None:
    """Give an empty split the last document of the other; a lone document is split by position."""
    for empty, full in (("val", "train"), ("train", "val")):
        if sizes[empty] or not sizes[full]:
            continue
        if len(starts[full]) >= 2:
            _move_tail(files, sizes, full, empty, starts[full].pop())
            starts[empty].append(0)
            return
        # One document in all: its first part trains, the rest is val, as for a single text file.
        if full == "val":
            _move_tail(files, sizes, "val", "train", 0)
            starts["train"], starts["val"] = starts["val"], array("q")
        cut = int(sizes["train"] * (1 - val_fraction))
        if cut == 0 or cut == sizes["train"]:
            raise UserError(f"{what} ({sizes['train']} bytes) is too small to split into train and val")
        _move_tail(files, sizes, "train", "val", cut)
        starts["val"].append(0)
        return


def _move_tail(files: dict, sizes: dict, src: str, dst: str, begin: int) -> None:
    """Append bytes ``begin:`` of split `src` to split `dst`, then cut them from `src`."""
    files[src].seek(begin)
    files[dst].seek(sizes[dst])
    shutil.copyfileobj(files[src], files[dst], _CHUNK_BYTES)
    files[src].truncate(begin)
    sizes[dst] += sizes[src] - begin
    sizes[src] = begin


# Tokenizing and scanning report through the shared long-work path (a rich bar on a terminal, the dashboard's
# progress line under the dashboard); jobs quicker than 2 s show nothing.
slow_job = functools.partial(long_work, delay=2.0, transient=True)


# ---- tokenized .bin files: memory-mapped as they are --------------------------------------------


def _load_bin(src: str, path: Path, cache: Path, val_fraction: float) -> Corpus:
    train_tokens, vocab, layout = _open_bin(src, path, cache)
    sibling = path.with_name("val".join(path.name.rsplit("train", 1)))
    if "train" in path.name and sibling.is_file():
        val_tokens, val_vocab, _ = _open_bin(str(sibling), sibling, cache)
        vocab = max(vocab, val_vocab)
        split_how = f"val from {sibling.name}"
    else:
        cut = int(len(train_tokens) * (1 - val_fraction))
        if cut == 0 or cut == len(train_tokens):
            raise UserError(f"token file {src!r} ({len(train_tokens)} tokens) is too small to split into train and val")
        train_tokens, val_tokens = train_tokens[:cut], train_tokens[cut:]
        split_how = f"last {len(val_tokens) / (cut + len(val_tokens)):.0%} val"
    return Corpus(
        source=src,
        description=(
            f"{path} ({layout}, {len(train_tokens):,} train / {len(val_tokens):,} val tokens, {split_how}, "
            f"vocab {vocab}); tokenizer unknown, so no bits per byte"
        ),
        train=TokenStream("train", train_tokens),
        val=TokenStream("val", val_tokens),
        vocab_size=vocab,
        tokenizer=None,
        bytes_per_token=None,
    )


def _open_bin(src: str, path: Path, cache: Path) -> tuple[np.ndarray, int, str]:
    """Memory-map a token file: (tokens, vocabulary, layout name).

    llm.c files name their tokenizer, so its vocabulary; for raw files it is the largest id + 1.
    """
    size = path.stat().st_size
    if size == 0:
        raise UserError(f"token file {src!r} is empty")
    with open(path, "rb") as f:
        raw = f.read(4 * LLMC_HEADER_INTS)
    head = np.frombuffer(raw[: len(raw) // 4 * 4], dtype="<i4")
    if len(head) and int(head[0]) in LLMC_FORMATS:
        version, dtype, vocab = LLMC_FORMATS[int(head[0])]
        if len(head) < LLMC_HEADER_INTS:
            raise UserError(f"token file {src!r} is shorter than llm.c's {4 * LLMC_HEADER_INTS}-byte header")
        count, itemsize = int(head[2]), np.dtype(dtype).itemsize
        if int(head[1]) != version:
            raise UserError(f"token file {src!r}: llm.c header version {int(head[1])}, expected {version}")
        if count <= 0 or 4 * LLMC_HEADER_INTS + count * itemsize != size:
            raise UserError(
                f"token file {src!r}: llm.c header says {count} tokens but the file holds "
                f"{(size - 4 * LLMC_HEADER_INTS) / itemsize:g}"
            )
        tokens = np.memmap(path, dtype=np.dtype(dtype).newbyteorder("<"), mode="r",
                           offset=4 * LLMC_HEADER_INTS, shape=(count,))
        largest = _largest_token(path, tokens, cache, limit=vocab)
        if largest >= vocab:  # an embedding lookup would fail (or read garbage) in the middle of training
            raise UserError(
                f"token file {src!r}: token id {largest} is outside the vocabulary of {vocab} its llm.c header names"
            )
        return tokens, vocab, "llm.c"
    if size % 2:
        raise UserError(f"token file {src!r} has an odd byte count ({size}); uint16 tokens take 2 bytes each")
    tokens = np.memmap(path, dtype="<u2", mode="r")
    return tokens, _largest_token(path, tokens, cache) + 1, "raw"


def _largest_token(path: Path, tokens: np.ndarray, cache: Path, limit: int | None = None) -> int:
    """The largest token id in a token file, scanned in chunks once and remembered in the cache (unless it is
    `limit` or more: the file is about to be refused, and a refusal leaves nothing behind)."""
    st = path.stat()
    key = hashlib.sha256(f"{_CACHE_FORMAT}\0{path.resolve()}\0{st.st_size}\0{st.st_mtime_ns}\0{len(tokens)}".encode())
    note = cache / f"maxid-{key.hexdigest()[:20]}.json"
    try:
        return int(json.loads(note.read_text())["max_token"])
    except (OSError, ValueError, KeyError, TypeError):
        pass
    chunk = 1 << 24
    largest = 0
    with slow_job(f"scanning {path.name}", len(tokens), unit="items") as progress:
        for i in range(0, len(tokens), chunk):
            largest = max(largest, int(tokens[i : i + chunk].max()))
            progress.advance(min(chunk, len(tokens) - i))
    if limit is not None and largest >= limit:
        return largest
    write_atomically(note, json.dumps({"max_token": largest}).encode())
    return largest
