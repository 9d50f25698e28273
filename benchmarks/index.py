"""The longest-earlier-match index (tscale_p2p/index.py): build cost, lookup speed against training, and quality.

    build:   python benchmarks/index.py build [--sizes 10M,100M]
             suffix-array build of `tokengrams` (MemmapIndex, u16 tokens, u64 entries) against `pydivsufsort`
             (libdivsufsort, u8 tokens, int32 entries), each on the reversed tokens, then the whole
             `build_index` (copy + suffix array + history-only answers): tokens/s, peak RSS, bytes per token
             on disk. Text: the .py sources of the installed packages and the standard library, sorted by
             path, cut at N bytes. Every build runs in a fresh process; peak RSS is its ru_maxrss (mapped file
             pages included) and "base" the RSS it had before building.
    lookup:  python benchmarks/index.py lookup [--device cpu|cuda] [--steps 20] [--rounds 3]
             batched lookups of validation windows (batch x context of the trainer) per second, against the
             trainer's training tokens/s with and without the index input, on the stdlib default data.
    quality: python benchmarks/index.py quality [--steps 600] [--data stdlib,PATH/tinyshakespeare.txt]
             the same model trained for the same steps on the same batches with and without the index (built on
             the train split only); val loss and bits/byte on val text that is not in the index, split by the
             match length (>= 32 tokens: duplicated text), and the index's own top-1 accuracy on val.

Timing runs belong under `flock /tmp/tscale-bench.lock`; each table prints the load average beside it.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import resource
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

WORK = Path(os.environ.get("TSCALE_INDEX_BENCH_DIR", Path(tempfile.gettempdir()) / "tscale-index-bench"))


def load_average() -> str:
    return "load %.2f %.2f %.2f" % os.getloadavg()


def parse_size(text: str) -> int:
    scale = {"K": 10**3, "M": 10**6, "G": 10**9}
    return int(float(text[:-1]) * scale[text[-1].upper()]) if text[-1].upper() in scale else int(text)


def table(header: list[str], rows: list[list]) -> None:
    print("| " + " | ".join(header) + " |")
    print("| " + " | ".join("---" for _ in header) + " |")
    for row in rows:
        print("| " + " | ".join(str(cell) for cell in row) + " |")
    print(flush=True)


# ---- build ------------------------------------------------------------------------------------------


def source_tokens(n: int) -> Path:
    """A file of n byte tokens: .py sources of site-packages then the stdlib, sorted by path (made once)."""
    path = WORK / f"tokens-{n}.u8"
    if path.exists() and path.stat().st_size == n:
        return path
    WORK.mkdir(parents=True, exist_ok=True)
    roots = [Path(p) for p in dict.fromkeys((sysconfig.get_paths()["purelib"], sysconfig.get_paths()["stdlib"]))]
    written = 0
    with open(path.with_suffix(".tmp"), "wb") as out:
        for root in roots:
            for file in sorted(root.rglob("*.py")):
                data = file.read_bytes()[: n - written]
                out.write(data)
                written += len(data)
                if written >= n:
                    break
            if written >= n:
                break
    if written < n:
        raise SystemExit(f"only {written:,} bytes of Python sources here, fewer than {n:,}")
    path.with_suffix(".tmp").rename(path)
    return path


def build_child(kind: str, tokens_path: str, out: str) -> None:
    """Run one build in this (fresh) process and print its figures as JSON."""
    import tokengrams

    from tscale_p2p.data import ByteTokenizer, Corpus, TokenStream
    from tscale_p2p.index import build_index, suffix_array_of_reversed

    tokens = np.memmap(tokens_path, dtype=np.uint8, mode="r")
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # after the imports: what the build adds
    started = time.perf_counter()
    if kind == "tokengrams":
        reversed_path = Path(out) / "reversed.u16"
        Path(out).mkdir(parents=True, exist_ok=True)
        tokens[::-1].astype("<u2").tofile(reversed_path)
        started = time.perf_counter()  # the u16 copy it needs is not its sort
        tokengrams.MemmapIndex.build(str(reversed_path), str(Path(out) / "table.u64"), vocab=2**16, verbose=False)
        disk = (Path(out) / "table.u64").stat().st_size + reversed_path.stat().st_size
    elif kind == "pydivsufsort":
        suffixes = suffix_array_of_reversed(tokens)
        disk = suffixes.nbytes + tokens.nbytes
    else:  # the whole build_index
        stream = TokenStream("train", tokens)
        corpus = Corpus("bench", "bench tokens", stream, stream, 256, ByteTokenizer(), 1.0)
        build_index(corpus, out)
        disk = sum(f.stat().st_size for f in Path(out).iterdir())
    seconds = time.perf_counter() - started
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(json.dumps({"seconds": seconds, "peak_kib": peak, "base_kib": base, "disk": disk}))


def run_build(args) -> None:
    import shutil

    rows = []
    for size in args.sizes.split(","):
        n = parse_size(size)
        tokens = source_tokens(n)
        if args.warm:  # compile and cache the numba kernels outside the timed runs
            tiny = source_tokens(10_000)
            subprocess.run([sys.executable, __file__, "_build-child", "index", str(tiny), str(WORK / "warm")],
                           check=True, capture_output=True)
            shutil.rmtree(WORK / "warm", ignore_errors=True)
        for kind in args.kinds.split(","):
            out = WORK / f"built-{kind}-{n}"
            shutil.rmtree(out, ignore_errors=True)
            load = load_average()
            done = subprocess.run([sys.executable, __file__, "_build-child", kind, str(tokens), str(out)],
                                  capture_output=True, text=True)
            if done.returncode:
                rows.append([f"{n:,}", kind, "failed: " + done.stderr.strip().splitlines()[-1], "", "", "", load])
                continue
            r = json.loads(done.stdout.strip().splitlines()[-1])
            rows.append([f"{n:,}", kind, f"{r['seconds']:.1f}", f"{n / r['seconds'] / 1e6:.2f}",
                         f"{r['peak_kib'] / 2**20:.2f}", f"{(r['peak_kib'] - r['base_kib']) * 1024 / n:.1f}",
                         f"{r['disk'] / n:.1f}", load])
            if kind != "index" or not args.keep:
                shutil.rmtree(out, ignore_errors=True)
    table(["tokens", "build", "seconds", "M tokens/s", "peak RSS GiB", "peak - base, bytes/token",
           "disk bytes/token", "uptime"], rows)


# ---- shared by lookup and quality ---------------------------------------------------------------------


def corpus_and_index(name: str):
    from tscale_p2p.data import load_corpus
    from tscale_p2p.index import TokenIndex, build_index

    corpus = load_corpus(name)
    folder = WORK / f"index-{hashlib.sha256(name.encode()).hexdigest()[:12]}"
    try:
        index = TokenIndex.open(folder, corpus=corpus)
    except Exception:  # noqa: BLE001 - missing or stale: build it afresh
        import shutil

        shutil.rmtree(folder, ignore_errors=True)
        build_index(corpus, folder)
        index = TokenIndex.open(folder, corpus=corpus)
    return corpus, index


def make_trainer(corpus, index, args, with_index: bool):
    from tscale_p2p.config import DEFAULT_CPU_MODEL, DEFAULT_GPU_MODEL, TrainConfig
    from tscale_p2p.model import ModelConfig
    from tscale_p2p.device import resolve_device
    from tscale_p2p.trainer import Trainer

    device = resolve_device(args.device)
    dims = args.model or (DEFAULT_GPU_MODEL if device.type == "cuda" else DEFAULT_CPU_MODEL)
    cfg = TrainConfig(data=corpus.source, index=str(index.path) if with_index else None, steps=args.steps,
                      batch_size=args.batch_size, device=args.device, seed=args.seed, eval_every=0)
    model_cfg = ModelConfig.from_dims(dims, vocab_size=corpus.vocab_size,
                                      index=index.corpus_hash if with_index else None)
    return Trainer(model_cfg, cfg, corpus, device)


# ---- lookup ---------------------------------------------------------------------------------------------


def run_lookup(args) -> None:
    import numba

    numba.set_num_threads(min(args.lookup_threads, numba.config.NUMBA_NUM_THREADS))
    corpus, index = corpus_and_index("stdlib")
    trainer = make_trainer(corpus, index, args, with_index=False)
    context = trainer.context
    windows = [x for x, _ in corpus.eval_batches(args.batch_size, context, args.lookup_batches)]
    index.lookup(windows[0])  # compile (cached after the first run)
    load = load_average()
    started = time.perf_counter()
    for x in windows:
        index.lookup(x)
    lookup_rate = len(windows) * windows[0].numel() / (time.perf_counter() - started)
    rows = [["lookup, val windows", f"{args.batch_size}x{context}", f"{numba.get_num_threads()} threads",
             f"{lookup_rate:,.0f}", "", load]]
    # The two trainers take turns, `--rounds` times, and each keeps its best round: a shared machine's load
    # then hits both alike instead of whichever ran second.
    trainers = {with_index: make_trainer(corpus, index, args, with_index) for with_index in (False, True)}
    for trainer in trainers.values():
        for _ in range(args.warmup_steps):
            trainer.local_step()
    rates = {False: 0.0, True: 0.0}
    load = load_average()
    for _ in range(args.rounds):
        for with_index, trainer in trainers.items():
            trainer.synchronize()
            started = time.perf_counter()
            for _ in range(args.steps):
                stats = trainer.local_step()
            stats.loss.item()
            trainer.synchronize()
            rates[with_index] = max(rates[with_index], args.steps * stats.tokens / (time.perf_counter() - started))
    for with_index, trainer in trainers.items():
        rows.append([f"training {'with' if with_index else 'without'} the index", f"{args.batch_size}x{context}",
                     f"{trainer.device}, {trainer.model_cfg.dims}, {trainer.precision}", f"{rates[with_index]:,.0f}",
                     f"{rates[with_index] / rates[False]:.3f}", f"{load} .. {load_average()}"])
    table(["what", "batch x context", "where", "tokens/s", "vs training without", "uptime"], rows)
    print(f"lookups / training tokens consumed (with the index): {lookup_rate / rates[True]:.1f}x")


# ---- quality -----------------------------------------------------------------------------------------------


@torch.no_grad()
def evaluate(trainer, corpus, index, args) -> dict:
    """Per-token val losses of `trainer`'s model on fixed val windows, split by the index's match length."""
    trainer.model.eval()
    losses, lengths, hits = [], [], []
    for x, y in corpus.eval_batches(args.batch_size, trainer.context, args.eval_batches, trainer.device):
        matches = index.lookup(x)
        with trainer._autocast():
            logits = trainer.forward(x, matches.to(trainer.device)) if trainer.index else trainer.forward(x)
        losses.append(F.cross_entropy(logits.float().flatten(0, 1), y.flatten(), reduction="none").cpu())
        lengths.append(matches[..., 1].flatten())
        hits.append((matches[..., 0] == y.cpu()).flatten())
    loss, length, hit = torch.cat(losses), torch.cat(lengths), torch.cat(hits)
    long = length >= index.max_match
    return {"loss": loss.mean().item(), "loss_long": loss[long].mean().item() if long.any() else math.nan,
            "loss_short": loss[~long].mean().item(), "share_long": long.float().mean().item(),
            "top1": hit.float().mean().item(), "top1_long": hit[long].float().mean().item() if long.any() else math.nan,
            "positions": len(loss)}


def run_quality(args) -> None:
    rows = []
    for name in args.data.split(","):
        corpus, index = corpus_and_index(name)
        results = {}
        for with_index in (False, True):
            trainer = make_trainer(corpus, index, args, with_index)
            started = time.perf_counter()
            while trainer.step < args.steps:
                stats = trainer.local_step()
                if trainer.step % 100 == 0:
                    print(f"  {name} {'index' if with_index else 'plain'} step {trainer.step} "
                          f"loss {stats.loss.item():.4f}", file=sys.stderr, flush=True)
            minutes = (time.perf_counter() - started) / 60
            results[with_index] = r = evaluate(trainer, corpus, index, args)
            bpb = corpus.bits_per_byte(r["loss"])
            rows.append([name, "with index" if with_index else "without", f"{trainer.model_cfg.dims}",
                         f"{args.steps} x {args.batch_size}x{trainer.context}", f"{r['loss']:.4f}", f"{bpb:.4f}",
                         f"{r['loss_short']:.4f}", f"{r['loss_long']:.4f}", f"{minutes:.1f}"])
            print("  done: " + " | ".join(rows[-1]), file=sys.stderr, flush=True)  # a long run keeps what it has
        plain, indexed = results[False], results[True]
        rows.append([name, "index / without", "", "", f"{indexed['loss'] / plain['loss']:.3f}", "",
                     f"{indexed['loss_short'] / plain['loss_short']:.3f}",
                     f"{indexed['loss_long'] / plain['loss_long']:.3f}", ""])
        print(f"{name}: {plain['positions']:,} val positions; match >= {index.max_match} tokens at "
              f"{plain['share_long']:.1%} of them; index top-1 accuracy {plain['top1']:.1%} overall, "
              f"{plain['top1_long']:.1%} where the match is >= {index.max_match}", flush=True)
    table(["data", "model", "dims", "steps x batch", "val loss", "bits/byte", "val loss, match < 32",
           "val loss, match >= 32", "train minutes"], rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="what", required=True)
    build = sub.add_parser("build")
    build.add_argument("--sizes", default="10M,100M")
    build.add_argument("--kinds", default="tokengrams,pydivsufsort,index")
    build.add_argument("--no-warm", dest="warm", action="store_false")
    build.add_argument("--keep", action="store_true", help="keep the built indexes under " + str(WORK))
    child = sub.add_parser("_build-child")
    child.add_argument("kind")
    child.add_argument("tokens")
    child.add_argument("out")
    for name, default_steps in (("lookup", 20), ("quality", 600)):
        p = sub.add_parser(name)
        p.add_argument("--device", default="cpu")
        p.add_argument("--model", help="dims (default: the trainer's default for the device)")
        p.add_argument("--steps", type=int, default=default_steps)
        p.add_argument("--batch-size", type=int, default=16)
        p.add_argument("--seed", type=int, default=0)
        p.add_argument("--data", default="stdlib", help="comma-separated --data sources")
        p.add_argument("--eval-batches", type=int, default=50)
        p.add_argument("--warmup-steps", type=int, default=3)
        p.add_argument("--lookup-batches", type=int, default=20)
        p.add_argument("--lookup-threads", type=int, default=2)
        p.add_argument("--rounds", type=int, default=3, help="lookup: turns of each trainer (the best counts)")
        p.add_argument("--threads", type=int, help="torch CPU threads (default: torch's)")
    args = parser.parse_args()
    if getattr(args, "threads", None):
        torch.set_num_threads(args.threads)
    if args.what == "_build-child":
        build_child(args.kind, args.tokens, args.out)
    elif args.what == "build":
        run_build(args)
    elif args.what == "lookup":
        run_lookup(args)
    else:
        run_quality(args)


if __name__ == "__main__":
    main()
