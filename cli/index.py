"""`tscale-peer index build`: its flags, and the build with a clean Ctrl+C."""

from __future__ import annotations

import argparse
import sys


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
        "train/join/infer/serve with --index DIR.",
    )
    build.add_argument("--data", default="stdlib", help="the training data, as for train --data (default: stdlib)")
    build.add_argument("--out", required=True, metavar="DIR", help="a new (or empty) folder for the index")
    build.add_argument("--tokenizer", metavar="SPEC",
                       help="as for train --tokenizer: byte (default), bpe:VOCAB or a tokenizer.json; the index serves "
                       "only a model trained with the same tokens")
    build.add_argument("--seed", type=int, default=0, help="as for train --seed: bpe:VOCAB's training (default: 0)")
    build.set_defaults(handler=run_index_build)


def run_index_build(args: argparse.Namespace) -> int:
    from tscale_p2p.data import load_corpus
    from tscale_p2p.index import build_index

    from tscale_p2p.tokenizer import apply_tokenizer

    corpus = apply_tokenizer(load_corpus(args.data), args.tokenizer, seed=args.seed)
    try:
        build_index(corpus, args.out)  # logs where the index went
    except KeyboardInterrupt:
        print("tscale-peer: interrupted; no index written", file=sys.stderr)
        return 130
    return 0
