"""The run's tokenizer on a swarm peer: what ``--tokenizer`` may say, and where the file comes from.

A run config names its tokenizer (`tscale_p2p.tokenizer.tokenizer_id`): bytes, a BPE by the sha256 of its
tokenizer.json, or an unknown one (pre-tokenized .bin data). A BPE's file lives in ``OUT/tokenizer.json``: the
peer that starts the run writes the one it trained or was given; a joiner without it downloads it from a live
peer, with the state that peer shares, and checks it against the run's hash. The trainer then reads it as
``--tokenizer OUT/tokenizer.json``, so a joiner's data is tokenized exactly as the founder's.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from tscale_p2p.atomic import write_atomically
from tscale_p2p.errors import UserError
from tscale_p2p.peers.fetch import fetch_run_tokenizer
from tscale_p2p.peers.run_config import RunConfig
from tscale_p2p.tokenizer import (
    TOKENIZER_FILE,
    BPETokenizer,
    Tokenizer,
    describe_id,
    parse_spec,
    tokenizer_id,
)


def check_explicit_tokenizer(spec: str, run: RunConfig, run_id: str) -> None:
    """Refuse a --tokenizer that is not the run's, naming both: byte, a BPE of another size, another file."""
    kind, vocab = parse_spec(spec)
    run_vocab = run.model["vocab_size"]
    if kind == "byte":
        ours, same = "the byte tokenizer", run.tokenizer == "byte"
    elif kind == "bpe":
        ours, same = f"a BPE of {vocab} tokens", run.tokenizer.startswith("bpe-") and run_vocab == vocab
    else:
        if not Path(spec).expanduser().is_file():
            raise UserError(f"--tokenizer {spec!r}: no such file (use byte, bpe:VOCAB or a tokenizer.json)")
        tokenizer = BPETokenizer.from_file(Path(spec).expanduser())
        ours, same = tokenizer.describe(), tokenizer_id(tokenizer, run_vocab) == run.tokenizer
    if not same:
        raise UserError(
            f"--tokenizer {spec} ({ours}) differs from run {run_id!r}'s tokenizer ({describe_id(run.tokenizer, run_vocab)}); "
            "drop --tokenizer to adopt the run's, or start another --run-id"
        )


def run_tokenizer_spec(dht, run: RunConfig, run_id: str, out: str, explicit: str | None,
                       fetch_timeout: float = 60.0) -> str | None:
    """The --tokenizer value that makes this peer's trainer read the run's tokens: byte, OUT/tokenizer.json (taken
    from OUT, from an explicit file with the same hash, or from a live peer), or None for a .bin run."""
    if run.tokenizer == "byte":
        return "byte"
    if not run.tokenizer.startswith("bpe-"):
        return None
    path = Path(out) / TOKENIZER_FILE
    if _holds(path, run.tokenizer):
        return str(path)
    if explicit is not None and parse_spec(explicit)[0] == "path" and _holds(Path(explicit).expanduser(), run.tokenizer):
        tokenizer = BPETokenizer.from_file(Path(explicit).expanduser())
    else:
        tokenizer = fetch_run_tokenizer(dht, run_id, run, fetch_timeout)
    save_run_tokenizer(out, tokenizer)
    return str(path)


def save_run_tokenizer(out: str, tokenizer: Tokenizer | None) -> None:
    """Keep a BPE run's tokenizer.json in OUT (atomically), beside the run config."""
    if isinstance(tokenizer, BPETokenizer):
        write_atomically(Path(out) / TOKENIZER_FILE, tokenizer.json_text.encode())


def _holds(path: Path, wanted_id: str) -> bool:
    try:
        return f"bpe-{hashlib.sha256(path.read_bytes()).hexdigest()}" == wanted_id
    except OSError:
        return False
