"""Tokenizers: UTF-8 bytes, or a byte-level BPE of Hugging Face `tokenizers` trained on the run's own data.

``--tokenizer`` names one:

``byte``
    UTF-8 bytes, vocabulary 256 (`tscale_p2p.data.ByteTokenizer`).
``bpe:VOCAB``
    A byte-level BPE of at most VOCAB tokens (the 256 bytes plus merges) trained on the train split of
    ``--data``: all of it up to `TRAIN_SAMPLE_BYTES`, else that many bytes in pieces at positions drawn
    from the seed. The same corpus, seed and `tokenizers` version give the same tokenizer, cached beside
    the corpus cache as ``data/bpe<VOCAB>-<key>.tokenizer.json``. A small corpus may hold fewer distinct
    merges than asked: the vocabulary is then smaller (logged).
``PATH``
    A ``tokenizer.json`` of the `tokenizers` library with a byte-level decoder (GPT-2's, Llama 3's, or one
    made by ``bpe:VOCAB``), so that every text encodes without unknown tokens and every token has exact bytes.

A text corpus (file, folder, stdlib, hf) is tokenized once, streaming, into the cache beside its byte cache
(``data/tok-<key>/``): the byte path's memory-mapped layout, ids as uint16 when the vocabulary fits, else
uint32. A ``.bin`` corpus given ``--tokenizer PATH`` is checked (no id beyond the vocabulary) and becomes
decodable. Bits per byte divide by the val split's bytes per token: source bytes for text, the tokens' own
byte lengths for a ``.bin``.

The tokenizer travels with the model: `checkpoint_entry` gives the manifest entry and the file a checkpoint
carries (``tokenizer.json``, its sha256 in the manifest), `checkpoint_tokenizer` reads it back verified.
"""

from __future__ import annotations

import base64
import hashlib
import json
import logging
import os
import shutil
import time
import zlib
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np
import torch

from tscale_p2p.atomic import atomic_directory, write_atomically
from tscale_p2p.data import ByteTokenizer, Corpus, TokenStream, default_cache_dir, slow_job
from tscale_p2p.errors import UserError
from tscale_p2p.progress import long_work

log = logging.getLogger(__name__)

# The default: bpe:8192 unless the run would pass over its corpus many times. benchmarks/tokenizer.py measured
# bpe:8192 lowest in bits per byte at equal FLOPs on the stdlib corpus (CPU and GPU models, 1-4 passes) and on tiny
# Shakespeare at ~1.5 passes, and byte lowest on tiny Shakespeare at ~39 passes, where the GPU model overfits the
# corpus's few BPE tokens (benchmarks/RESULTS.md, "The tokenizer on the GPU default model").
DEFAULT_BPE = "bpe:8192"
MAX_DEFAULT_BPE_PASSES = 16
MIN_DEFAULT_BPE_BYTES = 256 << 10  # a smaller train split is too little text to learn 8192 tokens from
_ESTIMATED_BPE_BYTES_PER_TOKEN = 3.4  # bpe:8192 measured 3.2 (tiny Shakespeare) to 3.6 (stdlib)
TOKENIZER_FILE = "tokenizer.json"
TRAIN_SAMPLE_BYTES = 32 << 20  # a BPE learns its merges from at most this much of the train split
MAX_VOCAB = 2**32  # ids are stored as uint32 at most
_SAMPLE_PIECE_BYTES = 1 << 20
_ENCODE_BATCH_BYTES = 4 << 20  # text handed to the (multi-threaded) encoder at once
_PIECE_BYTES = 1 << 18  # long documents are encoded in pieces of about this size, cut after a newline
_CACHE_FORMAT = 1
_MAX_WIRE_BYTES = 64 << 20  # a tokenizer received from a peer unpacks to at most this (Llama 3's is 9 MB)


def _byte_to_unicode() -> dict[int, str]:
    """The byte-level alphabet (as in GPT-2): printable bytes stand for themselves, the other 68 bytes for
    the code points from 256 up, in byte order (tests check it against the library's own alphabet)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {b: chr(b) for b in printable}, 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


_UNICODE_TO_BYTE = {char: byte for byte, char in _byte_to_unicode().items()}


class BPETokenizer:
    """A byte-level ``tokenizer.json``: text <-> ids, each token's bytes, and the file's sha256."""

    def __init__(self, json_text: str, where: str) -> None:
        from tokenizers import Tokenizer
        try:
            spec = json.loads(json_text)
            self._tokenizer = Tokenizer.from_str(json_text)
        except Exception as error:  # noqa: BLE001 - the library raises bare Exceptions for bad files
            reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
            raise UserError(f"tokenizer {where}: not a tokenizer.json of the tokenizers library ({reason})") from None
        if not _is_byte_level(spec.get("decoder") if isinstance(spec, dict) else None):
            decoder = (spec.get("decoder") or {}).get("type") if isinstance(spec, dict) else None
            raise UserError(
                f"tokenizer {where}: its decoder is {decoder or 'missing'}, not ByteLevel; tscale-p2p needs a "
                f"byte-level tokenizer (as GPT-2's or one made by --tokenizer bpe:VOCAB) so every token has exact bytes"
            )
        self.json_text, self.where = json_text, where
        self.sha256 = hashlib.sha256(json_text.encode()).hexdigest()
        vocab = self._tokenizer.get_vocab(with_added_tokens=True)
        self.vocab_size = max(vocab.values(), default=-1) + 1
        if not 256 <= self.vocab_size <= MAX_VOCAB:
            raise UserError(
                f"tokenizer {where}: a vocabulary of {self.vocab_size} ids; a byte-level tokenizer needs at least "
                f"the 256 bytes and at most {MAX_VOCAB} ids (uint32)"
            )
        added = {t.content for t in self._tokenizer.get_added_tokens_decoder().values()}
        self._bytes = [b""] * self.vocab_size
        for token, index in vocab.items():
            if token in added or not all(c in _UNICODE_TO_BYTE for c in token):
                self._bytes[index] = token.encode()  # added tokens stand for their text
            else:
                self._bytes[index] = bytes(_UNICODE_TO_BYTE[c] for c in token)
        self.byte_lengths = np.fromiter((len(b) for b in self._bytes), dtype=np.int64, count=self.vocab_size)

    @classmethod
    def from_file(cls, path: str | os.PathLike) -> "BPETokenizer":
        try:
            text = Path(path).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as error:
            reason = getattr(error, "strerror", None) or str(error)
            raise UserError(f"cannot read tokenizer {str(path)!r}: {reason}") from None
        return cls(text, repr(str(path)))

    @property
    def id_dtype(self) -> np.dtype:
        return np.dtype(np.uint16 if self.vocab_size <= 2**16 else np.uint32)

    def describe(self) -> str:
        return f"BPE tokenizer ({self.vocab_size} tokens, sha256 {self.sha256[:12]})"

    def encode(self, text: str) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self._tokenizer.encode_batch(texts, add_special_tokens=False)]

    def token_bytes(self, token: int) -> bytes:
        return self._bytes[token]

    def decode(self, tokens: Iterable[int] | np.ndarray | torch.Tensor) -> str:
        """Tokens back to text through their bytes; a cut multi-byte character shows U+FFFD there."""
        if isinstance(tokens, torch.Tensor):
            tokens = tokens.cpu().numpy()
        ids = np.asarray(tokens if isinstance(tokens, np.ndarray) else list(tokens), dtype=np.int64)
        if ids.size and (ids.min() < 0 or ids.max() >= self.vocab_size):
            raise ValueError(f"tokens must lie in [0, {self.vocab_size}), got {ids.min()}..{ids.max()}")
        return b"".join(self._bytes[i] for i in ids.tolist()).decode("utf-8", errors="replace")


def _is_byte_level(decoder) -> bool:
    if not isinstance(decoder, dict):
        return False
    if decoder.get("type") == "Sequence":
        return any(_is_byte_level(d) for d in decoder.get("decoders", []))
    return decoder.get("type") == "ByteLevel"


Tokenizer = ByteTokenizer | BPETokenizer


def describe(tokenizer: Tokenizer | None) -> str:
    if tokenizer is None:
        return "an unknown tokenizer (a .bin without --tokenizer)"
    return tokenizer.describe() if isinstance(tokenizer, BPETokenizer) else "the byte tokenizer"


def tokenizer_id(tokenizer: Tokenizer | None, vocab_size: int) -> str:
    """What a swarm's run config says about its tokens: byte, bpe-<sha256 of tokenizer.json>, or external-<vocab>."""
    if tokenizer is None:
        return f"external-{vocab_size}"
    return f"bpe-{tokenizer.sha256}" if isinstance(tokenizer, BPETokenizer) else "byte"


# ---- choosing one: --tokenizer, the checkpoint's, the device's default ----------------------------------


def parse_spec(spec: str) -> tuple[str, int | None]:
    """("byte", None), ("bpe", VOCAB) or ("path", None) for a --tokenizer value; bad VOCAB is a UserError."""
    if spec == "byte":
        return "byte", None
    if spec.startswith("bpe:"):
        value = spec[len("bpe:") :]
        try:
            vocab = int(value)
        except ValueError:
            raise UserError(f"--tokenizer {spec!r}: VOCAB must be an integer, e.g. bpe:8192") from None
        if vocab <= 256:
            raise UserError(
                f"--tokenizer {spec!r}: vocabulary {vocab} is too small; a byte-level BPE holds the 256 bytes "
                "plus its merges, so VOCAB must exceed 256"
            )
        if vocab > MAX_VOCAB:
            raise UserError(f"--tokenizer {spec!r}: vocabulary {vocab} is too large for uint32 ids (at most {MAX_VOCAB})")
        return "bpe", vocab
    return "path", None


def default_spec(corpus: Corpus, planned_tokens: int | None) -> str:
    """The --tokenizer a text corpus gets when none is named: DEFAULT_BPE for a run of `planned_tokens` tokens
    that passes over the corpus (counted in estimated BPE tokens) at most MAX_DEFAULT_BPE_PASSES times, else byte
    (also with no planned budget, or a train split under MIN_DEFAULT_BPE_BYTES)."""
    train_bytes = len(corpus.train)
    if planned_tokens is None or train_bytes < MIN_DEFAULT_BPE_BYTES:
        return "byte"
    passes = planned_tokens * _ESTIMATED_BPE_BYTES_PER_TOKEN / train_bytes
    spec = DEFAULT_BPE if passes <= MAX_DEFAULT_BPE_PASSES else "byte"
    log.info("tokenizer: %s by default (the run passes over --data's train split ~%.1f times in %s tokens; "
             "byte beyond %d)", spec, passes, DEFAULT_BPE, MAX_DEFAULT_BPE_PASSES)
    return spec


def apply_tokenizer(
    corpus: Corpus,
    spec: str | None,
    *,
    seed: int,
    planned_tokens: int | None = None,
    saved: Tokenizer | None | str = "none saved",
    cache_dir: str | os.PathLike | None = None,
) -> Corpus:
    """`corpus` tokenized as `spec` says (None: `saved`, the checkpoint's, when there is one; else `default_spec`
    for a run of `planned_tokens`). An explicit `spec` that differs from `saved` is refused, naming both."""
    has_saved = not isinstance(saved, str)
    if spec is None and has_saved:
        tokenizer = saved
    else:
        if spec is None:
            spec = default_spec(corpus, planned_tokens) if corpus.tokenizer is not None else None
        tokenizer = corpus.tokenizer if spec is None else resolve(spec, corpus, seed=seed, cache_dir=cache_dir)
        if has_saved and tokenizer_id(tokenizer, corpus.vocab_size) != tokenizer_id(saved, corpus.vocab_size):
            raise UserError(
                f"--tokenizer {spec} is {describe(tokenizer)}, but the checkpoint's model was trained with "
                f"{describe(saved)}; drop --tokenizer to use the checkpoint's"
            )
    return with_tokenizer(corpus, tokenizer, cache_dir=cache_dir)


def resolve(spec: str, corpus: Corpus, *, seed: int, cache_dir=None) -> Tokenizer:
    """The tokenizer a --tokenizer value names: bpe:VOCAB is trained on `corpus` (or taken from the cache)."""
    kind, vocab = parse_spec(spec)
    if kind == "path":
        path = Path(spec).expanduser()
        if not path.is_file():
            raise UserError(f"--tokenizer {spec!r}: no such file (use byte, bpe:VOCAB or a tokenizer.json)")
        return BPETokenizer.from_file(path)
    if corpus.tokenizer is None and corpus.bytes_per_token is None:
        raise UserError(
            f"--tokenizer {spec}: --data {corpus.source!r} is already tokenized by another tokenizer; "
            "give its tokenizer.json instead (--tokenizer PATH)"
        )
    if kind == "byte":
        return ByteTokenizer()
    return train_bpe(corpus, vocab, seed=seed, cache_dir=cache_dir)


def with_tokenizer(corpus: Corpus, tokenizer: Tokenizer | None, *, cache_dir=None) -> Corpus:
    """`corpus` (as `load_corpus` made it) in `tokenizer`'s ids."""
    is_bin = corpus.tokenizer is None
    if tokenizer is None:
        if not is_bin:
            raise UserError(
                f"--data {corpus.source!r} is text, but the model was trained on tokens of an unknown tokenizer "
                "(a .bin); train on that .bin, or give its tokenizer.json to both"
            )
        return corpus
    if isinstance(tokenizer, ByteTokenizer):
        if is_bin:
            raise UserError(f"--data {corpus.source!r} holds another tokenizer's ids, not bytes: give its tokenizer.json")
        return corpus
    if is_bin:
        return _bin_with_tokenizer(corpus, tokenizer)
    return tokenize_corpus(corpus, tokenizer, cache_dir=cache_dir)


# ---- training a BPE ------------------------------------------------------------------------------------


def train_bpe(corpus: Corpus, vocab: int, *, seed: int = 0, cache_dir=None) -> BPETokenizer:
    """A byte-level BPE of at most `vocab` tokens learnt from `corpus`'s train split (a seeded sample of at most
    `TRAIN_SAMPLE_BYTES` of it), from the cache when this corpus, vocab and seed were trained before."""
    import tokenizers
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    key = _key(corpus_identity(corpus), "bpe", vocab, seed, TRAIN_SAMPLE_BYTES, tokenizers.__version__)
    path = _cache_root(cache_dir) / f"bpe{vocab}-{key}.tokenizer.json"
    if path.is_file():
        return BPETokenizer.from_file(path)
    pieces = _training_sample(corpus.train, seed)
    sample_bytes = sum(b - a for a, b in pieces)
    log.info("training a byte-level BPE of %d tokens on %.1f MB of %s's train split", vocab, sample_bytes / 1e6,
             corpus.source)
    started = time.monotonic()
    hf = HFTokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)  # no invented space: exact round trips
    hf.decoder = decoders.ByteLevel()
    tokens = corpus.train.tokens
    # On a terminal, tokenizers' own bar; under the dashboard, its progress line (that bar would draw over it).
    with long_work(f"training a BPE of {vocab} tokens", total=sample_bytes, transient=True, library_bar=True) as work:
        trainer = trainers.BpeTrainer(
            vocab_size=vocab, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=work.on_terminal
        )

        def texts():
            for a, b in pieces:
                yield bytes(tokens[a:b]).decode("utf-8", errors="replace")
                work.advance(b - a)

        hf.train_from_iterator(texts(), trainer=trainer, length=len(pieces))
    tokenizer = BPETokenizer(hf.to_str(), repr(str(path)))
    if tokenizer.vocab_size < vocab:
        log.info("%s holds only %d distinct merges: the BPE has %d tokens, not %d", corpus.source,
                 tokenizer.vocab_size - 256, tokenizer.vocab_size, vocab)
    write_atomically(path, tokenizer.json_text.encode())
    log.info("trained %s in %.1f s, saved as %s", tokenizer.describe(), time.monotonic() - started, path)
    return tokenizer


def _training_sample(stream: TokenStream, seed: int) -> list[tuple[int, int]]:
    """(start, end) byte ranges to learn from: the whole split, or seeded pieces adding up to the bound."""
    n = len(stream)
    if n <= TRAIN_SAMPLE_BYTES:
        return [(a, min(a + _SAMPLE_PIECE_BYTES, n)) for a in range(0, n, _SAMPLE_PIECE_BYTES)]
    slots = n // _SAMPLE_PIECE_BYTES
    chosen = np.random.default_rng([seed % 2**64, 0x6270]).choice(slots, TRAIN_SAMPLE_BYTES // _SAMPLE_PIECE_BYTES,
                                                                 replace=False)
    return [(int(s) * _SAMPLE_PIECE_BYTES, (int(s) + 1) * _SAMPLE_PIECE_BYTES) for s in sorted(chosen)]


# ---- tokenizing a text corpus into the cache -------------------------------------------------------------


def tokenize_corpus(corpus: Corpus, tokenizer: BPETokenizer, *, cache_dir=None) -> Corpus:
    """A byte corpus re-tokenized with `tokenizer`, document by document, into the cache (once)."""
    target = _cache_root(cache_dir) / f"tok-{_key(corpus_identity(corpus), tokenizer.sha256)}"
    if not _token_cache_is_complete(target):
        _build_token_cache(target, corpus, tokenizer)
    meta = json.loads((target / "meta.json").read_text())
    dtype = np.dtype(meta["dtype"])
    streams = {
        split: TokenStream(
            split,
            np.memmap(target / f"{split}.ids", dtype=dtype, mode="r", shape=(meta[f"{split}_tokens"],)),
            np.load(target / f"{split}.docs.npy", mmap_mode="r"),
        )
        for split in ("train", "val")
    }
    return Corpus(
        source=corpus.source,
        description=(
            f"{corpus.description.rsplit(', byte tokenizer', 1)[0]}; {tokenizer.describe()}: "
            f"{meta['train_tokens']:,} train / {meta['val_tokens']:,} val tokens, "
            f"{meta['val_bytes'] / max(1, meta['val_tokens']):.2f} bytes per token"
        ),
        train=streams["train"],
        val=streams["val"],
        vocab_size=tokenizer.vocab_size,
        tokenizer=tokenizer,
        bytes_per_token=meta["val_bytes"] / max(1, meta["val_tokens"]),
    )


def _token_cache_is_complete(target: Path) -> bool:
    try:
        meta = json.loads((target / "meta.json").read_text())
        itemsize = np.dtype(meta["dtype"]).itemsize
        return all((target / f"{s}.ids").stat().st_size == meta[f"{s}_tokens"] * itemsize for s in ("train", "val"))
    except (OSError, ValueError, KeyError, TypeError):
        if target.exists():
            log.warning("rebuilding the damaged token cache %s", target)
            shutil.rmtree(target, ignore_errors=True)
        return False


def _build_token_cache(target: Path, corpus: Corpus, tokenizer: BPETokenizer) -> None:
    """Encode both splits into a temporary folder, then rename it to `target` in one step."""
    started = time.monotonic()
    total = len(corpus.train) + len(corpus.val)
    meta = {"format": _CACHE_FORMAT, "source": corpus.source, "tokenizer_sha256": tokenizer.sha256,
            "dtype": tokenizer.id_dtype.name}
    try:
        with atomic_directory(target) as tmp:
            with slow_job(f"tokenizing {corpus.source} with {tokenizer.describe()}", total) as progress:
                for split in ("train", "val"):
                    stream = corpus.stream(split)
                    with open(tmp / f"{split}.ids", "wb") as out:
                        count, starts = _encode_stream(stream, tokenizer, out, progress)
                    np.save(tmp / f"{split}.docs.npy", starts)
                    meta[f"{split}_tokens"], meta[f"{split}_docs"] = count, len(starts)
                    meta[f"{split}_bytes"] = len(stream)
            for split in ("train", "val"):
                if meta[f"{split}_tokens"] == 0:
                    raise UserError(f"--data {corpus.source!r}: its {split} split has no tokens")
            (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
    except OSError:  # another process finished the same cache first: use theirs
        if not _token_cache_is_complete(target):
            raise
    seconds = time.monotonic() - started
    log.info("tokenized %s (%.1f MB) with %s in %.1f s (%.2f MB/s) into %s", corpus.source, total / 1e6,
             tokenizer.describe(), seconds, total / 1e6 / max(seconds, 1e-9), target)


def _encode_stream(stream: TokenStream, tokenizer: BPETokenizer, out, progress) -> tuple[int, np.ndarray]:
    """Write the ids of every document of `stream` to `out`; -> (token count, each document's first token)."""
    tokens = stream.tokens
    bounds = [*(int(s) for s in stream.doc_starts), len(tokens)] if stream.doc_starts is not None else [0, len(tokens)]
    doc_starts: list[int] = []
    count = 0
    batch: list[tuple[bool, bytes]] = []  # (starts a document, text bytes)
    batch_bytes = 0

    def flush() -> None:
        nonlocal count, batch, batch_bytes
        encoded = tokenizer.encode_batch([data.decode("utf-8", errors="replace") for _, data in batch])
        for (first, data), ids in zip(batch, encoded):
            if first:
                doc_starts.append(count)
            np.asarray(ids, dtype=tokenizer.id_dtype).tofile(out)
            count += len(ids)
            progress.advance(len(data))
        batch, batch_bytes = [], 0

    for begin, end in zip(bounds[:-1], bounds[1:]):
        for i, piece in enumerate(_pieces(tokens, begin, end)):
            batch.append((i == 0, piece))
            batch_bytes += len(piece)
            if batch_bytes >= _ENCODE_BATCH_BYTES:
                flush()
    if batch:
        flush()
    return count, np.asarray(doc_starts, dtype=np.int64)


def _pieces(tokens: np.ndarray, begin: int, end: int) -> Iterator[bytes]:
    """A document's bytes in pieces of about `_PIECE_BYTES`, each cut just after a newline where there is one
    (the BPE never merges across one, so cuts there change no token)."""
    while begin < end:
        stop = min(begin + _PIECE_BYTES, end)
        if stop < end:
            newline = bytes(tokens[begin:stop]).rfind(b"\n")
            if newline > 0:
                stop = begin + newline + 1
        yield bytes(tokens[begin:stop])
        begin = stop


# ---- a .bin made by a known tokenizer --------------------------------------------------------------------


def _bin_with_tokenizer(corpus: Corpus, tokenizer: BPETokenizer) -> Corpus:
    """A .bin corpus that names its tokenizer: its ids checked against the vocabulary, bits per byte known."""
    largest, val_bytes = 0, 0
    with slow_job(f"checking {corpus.source}'s ids", len(corpus.train) + len(corpus.val)) as progress:
        for stream in (corpus.train, corpus.val):
            for i in range(0, len(stream), 1 << 24):
                chunk = np.asarray(stream.tokens[i : i + (1 << 24)])
                largest = max(largest, int(chunk.max()))
                if largest >= tokenizer.vocab_size:
                    raise UserError(
                        f"--data {corpus.source!r} holds token id {largest}, beyond the vocabulary of "
                        f"--tokenizer {tokenizer.where} ({tokenizer.vocab_size} ids): not the tokenizer that made it"
                    )
                if stream is corpus.val:
                    val_bytes += int(tokenizer.byte_lengths[chunk].sum())
                progress.advance(len(chunk))
    bytes_per_token = val_bytes / len(corpus.val)
    return Corpus(
        source=corpus.source,
        description=(
            f"{corpus.description.split('; tokenizer unknown')[0]}; {tokenizer.describe()}, "
            f"{bytes_per_token:.2f} bytes per token"
        ),
        train=corpus.train,
        val=corpus.val,
        vocab_size=tokenizer.vocab_size,
        tokenizer=tokenizer,
        bytes_per_token=bytes_per_token,
    )


# ---- in checkpoints ------------------------------------------------------------------------------------


def checkpoint_entry(tokenizer: Tokenizer | None, vocab_size: int) -> tuple[dict, dict[str, bytes]]:
    """(manifest entry, files to store) for a checkpoint of a model trained with `tokenizer`."""
    if isinstance(tokenizer, BPETokenizer):
        entry = {"kind": "bpe", "sha256": tokenizer.sha256, "vocab_size": tokenizer.vocab_size}
        return entry, {TOKENIZER_FILE: tokenizer.json_text.encode()}
    if tokenizer is None:
        return {"kind": "external", "vocab_size": vocab_size}, {}
    return {"kind": "byte"}, {}


def checkpoint_tokenizer(path: str | os.PathLike, meta: dict, vocab_size: int) -> Tokenizer | None:
    """The tokenizer a checkpoint's model was trained with (None: an unknown one), its file checked against the
    manifest's sha256. Checkpoints from before tokenizers were saved: bytes when the vocabulary is 256."""
    entry = meta.get("tokenizer")
    if entry is None:
        return ByteTokenizer() if vocab_size == 256 else None
    kind = entry.get("kind") if isinstance(entry, dict) else None
    if kind == "byte":
        return ByteTokenizer()
    if kind == "external":
        return None
    if kind != "bpe":
        raise UserError(f"checkpoint {path}: unknown tokenizer entry {entry!r}")
    file = Path(path) / TOKENIZER_FILE
    try:
        data = file.read_bytes()
    except OSError as error:
        raise UserError(f"checkpoint {path}: cannot read its {TOKENIZER_FILE}: {error.strerror}") from None
    digest = hashlib.sha256(data).hexdigest()
    if digest != entry.get("sha256"):
        raise UserError(
            f"checkpoint {path}: {TOKENIZER_FILE} has sha256 {digest[:12]}, the manifest says "
            f"{str(entry.get('sha256'))[:12]} (damaged or replaced)"
        )
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise UserError(f"checkpoint {path}: its {TOKENIZER_FILE} is not UTF-8 text") from None
    return BPETokenizer(text, repr(str(file)))


# ---- between peers -----------------------------------------------------------------------------------


def to_wire(tokenizer: BPETokenizer) -> str:
    """The tokenizer.json compressed into a JSON- and msgpack-safe string (a state download's metadata carries it)."""
    return base64.b64encode(zlib.compress(tokenizer.json_text.encode(), 9)).decode("ascii")


def from_wire(value: object, expected_id: str, where: str) -> BPETokenizer:
    """The tokenizer `to_wire` packed, refused (UserError) unless it is the one `expected_id` names."""
    try:
        inflate = zlib.decompressobj()
        data = inflate.decompress(base64.b64decode(value, validate=True), _MAX_WIRE_BYTES)
    except (TypeError, ValueError, zlib.error):
        raise UserError(f"the tokenizer sent by {where} is not a packed tokenizer.json") from None
    if inflate.unconsumed_tail:
        raise UserError(f"the tokenizer sent by {where} unpacks to more than {_MAX_WIRE_BYTES >> 20} MiB")
    digest = hashlib.sha256(data).hexdigest()
    if f"bpe-{digest}" != expected_id:
        raise UserError(f"the tokenizer sent by {where} has sha256 {digest[:12]}, the run's is {expected_id[4:16]}")
    return BPETokenizer(data.decode("utf-8"), f"from {where}")


def describe_id(tokenizer_id_: str, vocab_size: int) -> str:
    """`describe` for a `tokenizer_id` alone (the run config's), without its file."""
    if tokenizer_id_.startswith("bpe-"):
        return f"BPE tokenizer ({vocab_size} tokens, sha256 {tokenizer_id_[4:16]})"
    return "the byte tokenizer" if tokenizer_id_ == "byte" else describe(None)


# ---- helpers -------------------------------------------------------------------------------------------


def corpus_identity(corpus: Corpus) -> list:
    """What names a byte corpus's contents: the files its splits map (cache folders are immutable, text files
    carry size and mtime) and the splits' lengths."""
    identity: list = [corpus.source]
    for stream in (corpus.train, corpus.val):
        name = getattr(stream.tokens, "filename", None)
        if name is None:  # not a memory map: its bytes themselves
            identity.append(hashlib.sha256(np.ascontiguousarray(stream.tokens).tobytes()).hexdigest())
            continue
        st = os.stat(name)
        identity.append([str(name), st.st_size, st.st_mtime_ns, len(stream)])
    return identity


def _key(*parts) -> str:
    return hashlib.sha256(json.dumps([_CACHE_FORMAT, *parts]).encode()).hexdigest()[:20]


def _cache_root(cache_dir) -> Path:
    return (Path(cache_dir) if cache_dir is not None else default_cache_dir()) / "data"

