"""Tiny Shakespeare (byte level) to val loss 1.47, and the attention window schedule against dense.

Part 1 trains configurations with the project's own Trainer on tinyshakespeare.txt (first 90% train,
last 10% val, bytes: nanoGPT's shakespeare_char split) and reports the steps and wall time to reach the
target val loss, evaluated over every non-overlapping 256-token window of val. nanoGPT's reference:
1.4697 after 5000 iterations (~3 min on an A100).

Part 2 times the attention of a 12-layer, width-768 model at context 1024 and 4096 (forward + backward of
every layer's attention, in bf16), windowed schedule vs dense, and prints the attention FLOPs per token.

    python benchmarks/train_shakespeare.py --data PATH/tinyshakespeare.txt [--runs a,b] [--part 1|2|both]
"""

from __future__ import annotations

import argparse
import time

import torch

from tscale_p2p.config import TrainConfig
from tscale_p2p.data import load_corpus
from tscale_p2p.model import ModelConfig, windowed_attention
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
}


def train_to_target(name: str, data: str, target: float, eval_every: int, device: str = "cuda") -> dict:
    settings = RUNS[name]
    cfg = TrainConfig(data=data, device=device, eval_every=eval_every, **settings)
    corpus = load_corpus(data)
    model_cfg = ModelConfig.from_dims(cfg.model, window_schedule=cfg.window_schedule, mlp=cfg.mlp, dropout=cfg.dropout)
    trainer = Trainer(model_cfg, cfg, corpus, torch.device(device))
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", required=True, help="path to tinyshakespeare.txt")
    parser.add_argument("--runs", default=",".join(RUNS), help=f"comma-separated, from {', '.join(RUNS)}")
    parser.add_argument("--target", type=float, default=1.47)
    parser.add_argument("--eval-every", type=int, default=250)
    parser.add_argument("--part", choices=("1", "2", "both"), default="both")
    args = parser.parse_args()
    print(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}")

    if args.part in ("1", "both"):
        results = [train_to_target(name, args.data, args.target, args.eval_every) for name in args.runs.split(",")]
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
