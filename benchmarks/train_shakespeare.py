"""Tiny Shakespeare (byte level) to val loss 1.47, and the attention window schedule against dense.

Part 1 trains configurations with the project's own Trainer on tinyshakespeare.txt (first 90% train,
last 10% val, bytes: nanoGPT's shakespeare_char split) and reports the steps and wall time to reach the
target val loss, evaluated over every non-overlapping 256-token window of val. nanoGPT's reference:
1.4697 after 5000 iterations (~3 min on an A100).

Part 2 times the attention of a 12-layer, width-768 model at context 1024 and 4096 (forward + backward of
every layer's attention, in bf16), windowed schedule vs dense, and prints the attention FLOPs per token.

Part 3 races one of our runs against nanoGPT's own ``train.py config/train_shakespeare_char.py`` on the same
GPU and the same split, one after the other, each in a fresh process: the wall time from launching the
process to the first val loss at or under the target, and each one's best val loss (each evaluated its own
way: nanoGPT's mean of 200 random val batches, ours every val window), each compiling from an empty cache.
Then nanoGPT's saved checkpoint of its lowest reading is evaluated on every val window, as ours are.
nanoGPT is not part of the project: pass a checkout of it with ``--nanogpt DIR``; its ``prepare.py`` runs
first, untimed.

    python benchmarks/train_shakespeare.py --data PATH/tinyshakespeare.txt [--runs a,b] [--part 1|2|both]
    python benchmarks/train_shakespeare.py --data PATH/tinyshakespeare.txt --part 3 --runs NAME --nanogpt DIR
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import pickle
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from tscale_p2p.config import TrainConfig, read_toml_section
from tscale_p2p.data import load_corpus
from tscale_p2p.errors import UserError
from tscale_p2p.model import ModelConfig, windowed_attention
from tscale_p2p.solo import model_config_for
from tscale_p2p.trainer import Trainer

NANOGPT = dict(batch_size=64, lr=1e-3, min_lr_ratio=0.1, warmup=100, steps=5000, beta2=0.99, dropout=0.2)
RUNS = {
    # nanoGPT's shakespeare_char shape and hyper-parameters on our model code
    "nanogpt-dense-relu2": dict(model="e384h6d6w256", window_schedule="dense", mlp="relu2", **NANOGPT),
    "nanogpt-dense-swiglu": dict(model="e384h6d6w256", window_schedule="dense", mlp="swiglu", **NANOGPT),
    "nanogpt-tscale-relu2": dict(model="e384h6d6w256", window_schedule="tscale", mlp="relu2", **NANOGPT),
    # candidates for our best config under 11M parameters: the learning rate decays before overfitting sets in
    "short-dense-relu2": dict(model="e384h6d6w256", window_schedule="dense", mlp="relu2", **{**NANOGPT, "steps": 1200}),
    "short-tscale-relu2": dict(model="e384h6d6w256", window_schedule="tscale", mlp="relu2", **{**NANOGPT, "steps": 1200}),
    "short-tscale-relu2-lr2e-3": dict(model="e384h6d6w256", window_schedule="tscale", mlp="relu2", **{**NANOGPT, "lr": 2e-3, "steps": 800}),
    # more regularisation, so the decay can run longer before overfitting sets in
    "d3-1500": dict(model="e384h6d6w256", **{**NANOGPT, "dropout": 0.3, "steps": 1500}),
    "d3-2000": dict(model="e384h6d6w256", **{**NANOGPT, "dropout": 0.3, "steps": 2000}),
    "d4-2500": dict(model="e384h6d6w256", **{**NANOGPT, "dropout": 0.4, "steps": 2500}),
    "d3-wd3-1500": dict(model="e384h6d6w256", **{**NANOGPT, "dropout": 0.3, "weight_decay": 0.3, "steps": 1500}),
    "d25-lr7e-4-2000": dict(model="e384h6d6w256", **{**NANOGPT, "dropout": 0.25, "lr": 7e-4, "steps": 2000}),
    "d3-wsd-1500": dict(model="e384h6d6w256", **{**NANOGPT, "dropout": 0.3, "schedule": "wsd", "cooldown_fraction": 0.4, "steps": 1500}),
    "deep8-d3-1500": dict(model="e384h6d8w256", **{**NANOGPT, "dropout": 0.3, "steps": 1500}),
    "wide512-d35-2000": dict(model="e512h8d6w256", **{**NANOGPT, "dropout": 0.35, "lr": 7e-4, "steps": 2000}),
    # stronger weight decay on d3-wd3-1500, the best so far
    "d3-wd5-1500": dict(model="e384h6d6w256", **{**NANOGPT, "dropout": 0.3, "weight_decay": 0.5, "steps": 1500}),
    "d3-wd10-1500": dict(model="e384h6d6w256", **{**NANOGPT, "dropout": 0.3, "weight_decay": 1.0, "steps": 1500}),
    "d35-wd5-1800": dict(model="e384h6d6w256", **{**NANOGPT, "dropout": 0.35, "weight_decay": 0.5, "steps": 1800}),
    # nanoGPT's other regularisers: a tied head, decayed embeddings (e: their weight decay), attention dropout (a)
    "tie-d3-wd10-e1-1500": dict(model="e384h6d6w256", tie_embeddings=True, embedding_weight_decay=0.1,
                                **{**NANOGPT, "dropout": 0.3, "weight_decay": 1.0, "steps": 1500}),
    "tie-d3-wd3-e3-1500": dict(model="e384h6d6w256", tie_embeddings=True, embedding_weight_decay=0.3,
                               **{**NANOGPT, "dropout": 0.3, "weight_decay": 0.3, "steps": 1500}),
    "d3-a1-wd10-1500": dict(model="e384h6d6w256", attention_dropout=0.1,
                            **{**NANOGPT, "dropout": 0.3, "weight_decay": 1.0, "steps": 1500}),
    "tie-d2-a2-wd3-e3-2000": dict(model="e384h6d6w256", tie_embeddings=True, embedding_weight_decay=0.3,
                                  attention_dropout=0.2, **{**NANOGPT, "dropout": 0.2, "weight_decay": 0.3, "steps": 2000}),
}


def train_to_target(name: str, data: str, target: float, eval_every: int, *, whole_schedule: bool = False,
                    seed: int = 0, overrides: dict | None = None) -> dict:
    """Train run `name` on CUDA, with `overrides` of its TrainConfig settings, evaluating every `eval_every` steps;
    stop at the target unless `whole_schedule`."""
    cfg = TrainConfig(**{"data": data, "eval_every": eval_every, "seed": seed, "device": "cuda", **RUNS[name],
                         **(overrides or {})})
    corpus = load_corpus(data)
    trainer = Trainer(model_config_for(cfg, cfg.device, corpus.vocab_size), cfg, corpus, torch.device(cfg.device))
    params = sum(p.numel() for p in trainer.model.parameters())
    start = time.perf_counter()
    train_seconds, reached_at, curve, intervals = 0.0, None, [], []
    while trainer.step < cfg.steps:
        t0 = time.perf_counter()
        for _ in range(min(eval_every, cfg.steps - trainer.step)):
            trainer.local_step()
        trainer.synchronize()
        intervals.append((time.perf_counter() - t0) / eval_every)
        train_seconds += time.perf_counter() - t0
        loss = trainer.evaluate(whole_split=True).loss
        curve.append((trainer.step, loss))
        print(f"  {name} step {trainer.step:5d} val {loss:.4f} train {train_seconds:6.1f}s", flush=True)
        if loss <= target and reached_at is None:
            reached_at = (trainer.step, train_seconds, time.perf_counter() - start)
            if not whole_schedule:
                break
    return {
        "name": name,
        "params": params,
        "reached": reached_at,
        "best": min(loss for _, loss in curve),
        "curve": curve,
        # steady state: the median interval, which leaves out the first one's compilation
        "step_ms": 1000 * sorted(intervals)[len(intervals) // 2],
    }


def time_attention(context: int, schedule: str, batch_tokens: int = 65536) -> tuple[float, float]:
    cfg = ModelConfig.from_dims(f"e768h12d12w{context}", window_schedule=schedule)
    batch = max(1, batch_tokens // context)
    shape = (batch, cfg.heads, context, cfg.head_dim)
    q, k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    grad = torch.randn(shape, device="cuda", dtype=torch.bfloat16)

    def all_layers():
        for window in cfg.layer_windows():
            windowed_attention(q, k, v, window).backward(grad)

    for _ in range(3):
        all_layers()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(10):
        start.record()
        all_layers()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    times.sort()
    return times[len(times) // 2] / (batch * context) * 1e6, cfg.attention_flops_per_token()  # ns per token


NANOGPT_EVAL = re.compile(r"step (\d+): train loss [\d.]+, val loss ([\d.]+)")
OURS_EVAL = re.compile(r" step\s+(\d+) val ([\d.]+)")


def timed_val_losses(command: list[str], cwd: Path, pattern: re.Pattern, log, env: dict) -> list[tuple[float, int, float]]:
    """Run `command` and return (seconds since launch, step, val loss) for each evaluation it prints."""
    start = time.perf_counter()
    readings = []
    with subprocess.Popen(command, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          env=env) as proc:
        for line in proc.stdout:
            elapsed = time.perf_counter() - start
            log.write(f"{elapsed:8.2f} {line}")
            if match := pattern.search(line):
                readings.append((elapsed, int(match[1]), float(match[2])))
    if proc.returncode != 0:
        raise SystemExit(f"{command[1]} exited with {proc.returncode}; its output is in {log.name}")
    return readings


@torch.no_grad()
def nanogpt_on_our_windows(nanogpt: Path, data: str, device: str, batch_size: int = 64) -> tuple[float, int]:
    """nanoGPT's saved checkpoint (it keeps the one of its lowest val reading) evaluated as ours is, on every
    non-overlapping window of val with our batches: (val loss, the step it was saved at). nanoGPT's own reading
    is a mean over 200 random batches, so the lowest of its readings is biased low by their noise."""
    prepared = nanogpt / "data" / "shakespeare_char"
    with open(prepared / "meta.pkl", "rb") as handle:
        chars = pickle.load(handle)["stoi"]
    ids = torch.zeros(256, dtype=torch.long)  # our byte -> nanoGPT's character id (the text is ASCII)
    for char, number in chars.items():
        ids[ord(char)] = number
    ids = ids.to(device)
    spec = importlib.util.spec_from_file_location("nanogpt_model", nanogpt / "model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    saved = torch.load(nanogpt / "out-shakespeare-char" / "ckpt.pt", map_location=device)
    model = module.GPT(module.GPTConfig(**saved["model_args"]))
    model.load_state_dict({name.removeprefix("_orig_mod."): w for name, w in saved["model"].items()})
    model.to(device).eval()
    losses = []
    with torch.autocast(device, dtype=torch.bfloat16, enabled=device == "cuda"):  # as nanoGPT evaluates
        for x, y in load_corpus(data).eval_batches(batch_size, saved["model_args"]["block_size"], None, device):
            losses.append(model(ids[x], ids[y])[1].float())
    return torch.stack(losses).mean().item(), saved["iter_num"]


def race_nanogpt(run: str, data: str, nanogpt: Path, target: float, eval_every: int, seed: int, *,
                 overrides: Path | None = None, nanogpt_args: tuple[str, ...] = ()) -> None:
    """Part 3: nanoGPT's shakespeare_char config and our run `run`, one after the other, timed from launch, each
    compiling from an empty cache as on a fresh machine (no warm-up from a sweep run before)."""
    prepared = nanogpt / "data" / "shakespeare_char"
    shutil.copyfile(data, prepared / "input.txt")  # prepare.py reads it instead of downloading
    subprocess.run([sys.executable, "prepare.py"], cwd=prepared, check=True, stdout=subprocess.DEVNULL)
    ours = [sys.executable, str(Path(__file__).resolve()), "--data", str(Path(data).resolve()), "--part", "1",
            "--runs", run, "--target", str(target), "--eval-every", str(eval_every), "--whole-schedule",
            "--seed", str(seed), *(["--overrides", str(overrides.resolve())] if overrides else [])]
    contenders = [
        ("nanoGPT train.py config/train_shakespeare_char.py",
         [sys.executable, "train.py", "config/train_shakespeare_char.py", *nanogpt_args], nanogpt, NANOGPT_EVAL),
        (f"ours: {run}, seed {seed}", ours, Path.cwd(), OURS_EVAL),
    ]
    rows = []
    with open("race.log", "w") as log:
        for label, command, cwd, pattern in contenders:
            log.write(f"### {label}\n")
            with tempfile.TemporaryDirectory(prefix="race-compile-") as cache:
                env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache, "TRITON_CACHE_DIR": os.path.join(cache, "triton")}
                readings = timed_val_losses(command, cwd, pattern, log, env)
            first = next(((t, step) for t, step, loss in readings if loss <= target), None)
            best = min(readings, key=lambda r: r[2])
            rows.append((label, first, best, readings[-1][0]))
    print(f"\n| contender | launch to val <= {target} | at step | best val (step) | launch to end | vs nanoGPT, to target |")
    print("| --- | --- | --- | --- | --- | --- |")
    base = rows[0][1][0] if rows[0][1] else None
    for label, first, best, end in rows:
        to_target = f"{first[0]:.1f} s | {first[1]}" if first else "not reached | -"
        ratio = f"{base / first[0]:.2f}x faster" if first and base else "-"
        print(f"| {label} | {to_target} | {best[2]:.4f} ({best[1]}) | {end:.1f} s | {ratio} |")
    exact, step = nanogpt_on_our_windows(nanogpt, data, "cuda" if torch.cuda.is_available() else "cpu")
    print(f"nanoGPT's saved checkpoint (step {step}, its lowest reading) on every val window, as ours is "
          f"evaluated: {exact:.4f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", required=True, help="path to tinyshakespeare.txt")
    parser.add_argument("--runs", default=",".join(RUNS), help=f"comma-separated, from {', '.join(RUNS)}")
    parser.add_argument("--target", type=float, default=1.47)
    parser.add_argument("--eval-every", type=int, default=250)
    parser.add_argument("--part", choices=("1", "2", "both", "3"), default="both")
    parser.add_argument("--whole-schedule", action="store_true", help="part 1: train on past the target to the end")
    parser.add_argument("--nanogpt", type=Path, help="part 3: a checkout of nanoGPT to race against")
    parser.add_argument("--seed", type=int, default=0, help="our runs' seed for weights and data sampling")
    parser.add_argument("--overrides", type=Path, metavar="TOML",
                        help="parts 1 and 3: a TOML file of train settings that override our runs' own, as in "
                             "tscale-peer train --config (a smoke test: steps = 4, device = \"cpu\", ...)")
    parser.add_argument("--nanogpt-args", default="", metavar="ARGS",
                        help="part 3: more arguments for nanoGPT's train.py, e.g. '--max_iters=20 --device=cpu'")
    args = parser.parse_args()
    try:
        overrides = read_toml_section(args.overrides, TrainConfig) if args.overrides else {}
    except UserError as error:
        parser.error(str(error))
    unknown = [name for name in args.runs.split(",") if name not in RUNS]
    if unknown:
        parser.error(f"unknown --runs {','.join(unknown)}; choose from {', '.join(RUNS)}")
    if args.part == "3":
        if args.nanogpt is None or not (args.nanogpt / "train.py").is_file():
            parser.error(f"--part 3 needs --nanogpt DIR holding nanoGPT's train.py, got {args.nanogpt}")
        if "," in args.runs:
            parser.error(f"--part 3 races one run, got --runs {args.runs}")
        race_nanogpt(args.runs, args.data, args.nanogpt.resolve(), args.target, args.eval_every, args.seed,
                     overrides=args.overrides, nanogpt_args=tuple(shlex.split(args.nanogpt_args)))
        return
    device_name = torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU"
    print(f"device: {device_name}  torch {torch.__version__}")

    if args.part in ("1", "both"):
        results = [
            train_to_target(name, args.data, args.target, args.eval_every, whole_schedule=args.whole_schedule,
                            seed=args.seed, overrides=overrides)
            for name in args.runs.split(",")
        ]
        print(f"\n| run | params | steps to {args.target} | train s to target | wall s incl. compile+eval | ms/step | best val |")
        print("| --- | --- | --- | --- | --- | --- | --- |")
        for r in results:
            reached = r["reached"]
            cells = (f"{reached[0]}", f"{reached[1]:.1f}", f"{reached[2]:.1f}") if reached else ("not reached",) * 3
            print(f"| {r['name']} | {r['params'] / 1e6:.2f}M | {' | '.join(cells)} | {r['step_ms']:.1f} | {r['best']:.4f} |")
        by_name = {r["name"]: dict(r["curve"]) for r in results}
        pairs = [
            ("nanogpt-dense-relu2", "nanogpt-tscale-relu2"),
            ("nanogpt-dense-relu2", "nanogpt-dense-swiglu"),
            ("short-dense-relu2", "short-tscale-relu2"),
        ]
        for a, b in pairs:
            if a in by_name and b in by_name:
                common = sorted(set(by_name[a]) & set(by_name[b]))
                shown = ", ".join(f"{s}: {by_name[a][s]:.4f} vs {by_name[b][s]:.4f}" for s in common[:8])
                print(f"val loss at equal tokens, {a} vs {b}: {shown}")

    if args.part in ("2", "both"):
        print("\n| context | schedule | attention FLOPs/token (fwd) | ratio | attention fwd+bwd ns/token | speed-up |")
        print("| --- | --- | --- | --- | --- | --- |")
        for context in (1024, 4096):
            dense_ns, dense_flops = time_attention(context, "dense")
            window_ns, window_flops = time_attention(context, "tscale")
            print(f"| {context} | dense | {dense_flops / 1e6:.2f}M | 1.00 | {dense_ns:.1f} | 1.00 |")
            print(
                f"| {context} | tscale | {window_flops / 1e6:.2f}M | {dense_flops / window_flops:.2f}x fewer | "
                f"{window_ns:.1f} | {dense_ns / window_ns:.2f}x |"
            )


if __name__ == "__main__":
    main()
