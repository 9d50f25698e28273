"""`tscale-peer index build`: its settings, and the build with a clean Ctrl+C."""

from __future__ import annotations

import argparse
import sys

from pydantic.dataclasses import dataclass

from tscale_p2p.cli.options import Command
from tscale_p2p.config import DataSettings, RunSettings
from tscale_p2p.errors import UserError
from tscale_p2p.settings import SECTION_CONFIG, option, section_fields


@dataclass(config=SECTION_CONFIG)
class IndexSettings:
    """Where the index goes."""

    out: str | None = option(None, "a new (or empty) folder for the index (required)", metavar="DIR")


# Training's own fields for what the index must share with the model that reads it: the data, its tokenizer and
# the seed a bpe:VOCAB is trained with.
TAKEN = {"data": ("data", "tokenizer"), "run": ("seed",)}
INDEX_BUILD = Command(
    (("data", DataSettings), ("run", RunSettings), ("index", IndexSettings)),
    skip=frozenset(f"{table}.{name}" for table, cls in (("data", DataSettings), ("run", RunSettings))
                   for name in section_fields(cls) if name not in TAKEN[table]),
)


def add_index_parser(commands) -> None:
    index = commands.add_parser(
        "index",
        help="build the longest-earlier-match index a model can read as an extra input (--index)",
        description="TScale's \"1T index\": a suffix array of a corpus's train split, memory-mapped on disk, that "
        "gives for every position the token after the longest earlier match of its context (up to 32 tokens).",
    )
    verbs = index.add_subparsers(dest="verb", metavar="VERB", parser_class=type(index))
    verbs.required = True
    build = verbs.add_parser(
        "build",
        help="index the train split of --data",
        description="Index the train split of --data (the same split `train --data` trains on), with the "
        "history-only answers of every position precomputed for training. Pass the folder to "
        "train/join/infer/serve with --index DIR. The index serves only a model trained with the same tokens: give "
        "the --tokenizer the model trains with (byte when left out, as for `train --index`).",
    )
    INDEX_BUILD.add_flags(build)
    build.set_defaults(handler=run_index_build)


def run_index_build(args: argparse.Namespace) -> int:
    from tscale_p2p.data import load_corpus
    from tscale_p2p.index import build_index

    from tscale_p2p.tokenizer import apply_tokenizer

    loaded = INDEX_BUILD.load(args)
    data, out = loaded["data"], loaded["index"].out
    if out is None:
        raise UserError("give --out DIR, a new (or empty) folder for the index")
    corpus = apply_tokenizer(load_corpus(data.data), data.tokenizer, seed=loaded["run"].seed)
    try:
        build_index(corpus, out)  # logs where the index went
    except KeyboardInterrupt:
        print("tscale-peer: interrupted; no index written", file=sys.stderr)
        return 130
    return 0
