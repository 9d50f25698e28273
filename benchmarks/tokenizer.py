"""Byte-level against byte-level BPE tokenizers at equal training FLOPs: val bits per byte, and the tokenizers' cost.

For each corpus (the stdlib default, tiny Shakespeare) and tokenizer (byte, bpe:2048, bpe:8192, bpe:32768):

1. Cost (timed, under /tmp/tscale-bench.lock with the load average beside it): training the BPE from scratch
   (a fresh cache folder) and tokenizing the corpus's train + val splits with it (MB of source text per second).
2. Quality: the same model (dims fixed, only the vocabulary follows the tokenizer) trained with the project's
   Trainer for an equal FLOP budget: the byte run's `--steps` steps; every other run takes as many steps as fit
   in that budget at its own FLOPs per token (`ModelConfig.flops_per_token`, which counts the larger output
   layer of a bigger vocabulary). Same batch size and context (in tokens), learning-rate schedule scaled to each
   run's steps. Reported: val loss in nats/token over `--eval-batches` fixed batches, and bits per byte
   (nats / ln 2 / the val split's bytes per token).

    python benchmarks/tokenizer.py [--device cpu|cuda] [--steps 300] [--batch-size 8] [--part both|quality|cost]
        [--data stdlib,PATH/tinyshakespeare.txt] [--tokenizers byte,bpe:2048,bpe:8192,bpe:32768]
"""

from __future__ import annotations

import argparse
import fcntl
import os
import tempfile
import time
from contextlib import contextmanager

import torch

from tscale_p2p.config import DEFAULT_CPU_MODEL, DEFAULT_GPU_MODEL, TrainConfig
from tscale_p2p.data import load_corpus
from tscale_p2p.model import ModelConfig
from tscale_p2p.tokenizer import apply_tokenizer, resolve, tokenize_corpus
from tscale_p2p.trainer import Trainer

LOCK = "/tmp/tscale-bench.lock"
DEFAULT_DATA = "stdlib"
DEFAULT_TOKENIZERS = "byte,bpe:2048,bpe:8192,bpe:32768"


@contextmanager
def timing_lock():
    """One timing benchmark on the machine at a time; -> the 1-minute load average when the lock was taken."""
    with open(LOCK, "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield os.getloadavg()[0]
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def tokenizer_cost(data: str, spec: str) -> dict:
    """Seconds to train `spec` from scratch and to tokenize `data` with it, in a throw-away cache."""
    if spec == "byte":
        return {}
    with tempfile.TemporaryDirectory() as cache, timing_lock() as load:
        corpus = load_corpus(data, cache_dir=cache)  # the byte cache (not timed: the byte path builds it too)
        started = time.perf_counter()
        tokenizer = resolve(spec, corpus, seed=0, cache_dir=cache)
        trained = time.perf_counter()
        tokenize_corpus(corpus, tokenizer, cache_dir=cache)
        done = time.perf_counter()
    megabytes = (len(corpus.train) + len(corpus.val)) / 1e6
    return {"bpe_train_s": trained - started, "tokenize_mb_s": megabytes / (done - trained), "load": load}


def train_at_budget(data: str, spec: str, args, budget: float | None) -> dict:
    """Train the fixed-dims model on `data` tokenized by `spec`; with `budget` (FLOPs), as many steps as fit."""
    device = torch.device(args.device)
    corpus = apply_tokenizer(load_corpus(data), spec, seed=0)
    model_cfg = ModelConfig.from_dims(args.model, vocab_size=corpus.vocab_size)
    flops_per_step = model_cfg.flops_per_token(model_cfg.context) * args.batch_size * model_cfg.context
    steps = args.steps if budget is None else max(1, int(budget // flops_per_step))
    cfg = TrainConfig(data=data, model=args.model, device=args.device, steps=steps, batch_size=args.batch_size,
                      warmup=max(1, steps // 10), eval_batches=args.eval_batches, lr=args.lr, seed=0)
    trainer = Trainer(model_cfg, cfg, corpus, device)
    while trainer.step < steps:
        stats = trainer.local_step()
        if trainer.step % 50 == 0:
            print(f"    {spec} step {trainer.step}/{steps} loss {stats.loss.item():.3f}", flush=True)
    result = trainer.evaluate()
    return {
        "vocab": corpus.vocab_size,
        "bytes_per_token": corpus.bytes_per_token,
        "steps": steps,
        "flops": steps * flops_per_step,
        "tokens": steps * args.batch_size * model_cfg.context,
        "loss": result.loss,
        "bpb": result.bits_per_byte,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--model", help=f"model dims (default: {DEFAULT_CPU_MODEL} on cpu, {DEFAULT_GPU_MODEL} on cuda)")
    parser.add_argument("--steps", type=int, default=300, help="steps of the byte run; its FLOPs are the budget")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--eval-batches", type=int, default=20)
    parser.add_argument("--data", default=DEFAULT_DATA, help="comma-separated --data sources")
    parser.add_argument("--tokenizers", default=DEFAULT_TOKENIZERS, help="comma-separated; the first sets the budget")
    parser.add_argument("--threads", type=int, help="torch CPU threads (default: torch's)")
    parser.add_argument("--part", choices=("both", "quality", "cost"), default="both",
                        help="quality: the equal-FLOPs training runs; cost: the timed tokenizer training and tokenizing")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    args.model = args.model or (DEFAULT_GPU_MODEL if args.device == "cuda" else DEFAULT_CPU_MODEL)
    specs = args.tokenizers.split(",")
    rows = []
    for data in args.data.split(","):
        budget = None
        for spec in specs:
            print(f"{data}  {spec}", flush=True)
            row = {"data": os.path.basename(data), "spec": spec}
            if args.part != "quality":
                row.update(tokenizer_cost(data, spec))
            if args.part != "cost":
                row.update(train_at_budget(data, spec, args, budget))
                budget = budget or row["flops"]
            print(f"  {row}", flush=True)
            rows.append(row)
    if args.part == "cost":
        print("\n| data | tokenizer | BPE train s | tokenize MB/s | load |\n| --- | --- | --- | --- | --- |")
        for r in rows:
            if "tokenize_mb_s" in r:
                print(f"| {r['data']} | {r['spec']} | {r['bpe_train_s']:.1f} | {r['tokenize_mb_s']:.2f} | {r['load']:.1f} |")
        return
    print(f"\nmodel {args.model} on {args.device}, batch {args.batch_size}, equal FLOPs = the first tokenizer's "
          f"{args.steps} steps\n")
    header = ("| data | tokenizer | vocab | bytes/token | steps | GFLOP | train tokens | val nats/token | val bits/byte "
              "| BPE train s | tokenize MB/s | load |")
    print(header)
    print("|" + " --- |" * (header.count("|") - 1))
    for r in rows:
        cost = (f"{r['bpe_train_s']:.1f} | {r['tokenize_mb_s']:.2f} | {r['load']:.1f}" if "tokenize_mb_s" in r
                else "- | - | -")
        print(f"| {r['data']} | {r['spec']} | {r['vocab']} | {r['bytes_per_token']:.2f} | {r['steps']} | "
              f"{r['flops'] / 1e9:.0f} | {r['tokens']:,} | {r['loss']:.4f} | {r['bpb']:.4f} | {cost} |")
    for data in dict.fromkeys(r["data"] for r in rows):
        best = min((r for r in rows if r["data"] == data), key=lambda r: r["bpb"])
        print(f"lowest bits/byte on {data}: {best['spec']} ({best['bpb']:.4f})")


if __name__ == "__main__":
    main()
