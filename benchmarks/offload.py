"""CPU offload on one GPU: the largest model that trains inside a GPU memory budget, and at what speed.

Three measurements, each in its own process (a clean GPU, its own memory cap):

1. without offload, capped at --budget GiB: which of --plain-sizes still train (AdamW on the GPU costs
   16 bytes/parameter before activations; activation checkpointing on, to give it its best chance);
2. with `--offload optimizer` (bf16 weights on the GPU, fp32 masters + AdamW on the CPU, one-step delayed
   update, activation checkpointing of all blocks or of --checkpoint-blocks of them), capped at --budget GiB:
   tokens/s of each of --offload-sizes;
3. the same models with no cap and no offload (no checkpointing): the uncapped tokens/s the offloaded
   runs are compared with. Both take the same tokens per optimizer step.

It first times torch's CPU AdamW implementations (fused, foreach, for-loop) on this host, since the CPU
update has to hide behind a GPU step. Per offloaded step it reports the host's update and gradient-
accumulation seconds and how long the GPU side stalled waiting for them.

    python benchmarks/offload.py                 # H200: 1B/1.5B plain, 3B offloaded, ~6 minutes
    python benchmarks/offload.py --plain-sizes 1B --offload-sizes 1.5B --offload-probe-sizes 4B --delays 0,1
    python benchmarks/offload.py --dry-run       # the whole flow on the CPU with toy models, seconds
    python benchmarks/offload.py --delay-effect tinyshakespeare.txt   # loss cost of the one-step delay
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

# name -> model dims; parameter counts from ModelConfig.parameter_count
SIZES = {
    "toy": "e64h4d2w64",
    "toy2": "e128h4d4w64",
    "0.5B": "e1536h12d18w2048",
    "1B": "e2048h16d20w2048",
    "1.5B": "e2048h16d30w2048",
    "3B": "e3072h24d27w2048",
    "4B": "e3072h24d36w2048",
}


def child(spec: dict) -> dict:
    """One measurement: build a Trainer per `spec`, warm up, time some steps."""
    from tscale_p2p.config import TrainConfig
    from tscale_p2p.data import load_corpus
    from tscale_p2p.errors import UserError
    from tscale_p2p.model import ModelConfig
    from tscale_p2p.trainer import Trainer

    device = torch.device(spec["device"])
    model_cfg = ModelConfig.from_dims(SIZES[spec["size"]])
    cfg = TrainConfig(
        data=spec["data"], device=spec["device"], model=model_cfg.dims, batch_size=spec["batch"],
        grad_accum=spec["grad_accum"], compile=spec["compile"], offload=spec["offload"],
        offload_delay=spec["delay"], activation_checkpointing=spec["checkpointing"],
        checkpoint_blocks=spec.get("checkpoint_blocks") if spec["checkpointing"] else None,
        gpu_memory_limit=spec["limit"], warmup=10, steps=1000,
    )
    result = {"params": model_cfg.parameter_count()}
    start = time.perf_counter()
    try:
        trainer = Trainer(model_cfg, cfg, load_corpus(spec["data"]), device)
        result["setup_s"] = time.perf_counter() - start
        for _ in range(spec["warmup_steps"]):
            trainer.local_step()
        trainer.synchronize()
        timings = dict(getattr(trainer.optimizer, "timings", {}))
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        t0 = time.perf_counter()
        tokens = 0
        for _ in range(spec["steps"]):
            stats = trainer.local_step()
            tokens += stats.tokens
        trainer.synchronize()
        seconds = time.perf_counter() - t0
        result.update(fits=True, tokens_per_s=tokens / seconds, step_s=seconds / spec["steps"],
                      loss=stats.loss.item())
        if timings:
            now = trainer.optimizer.timings
            result.update({f"{k}_s": (now[k] - timings[k]) / spec["steps"] for k in timings})
        if device.type == "cuda":
            result["peak_gib"] = torch.cuda.max_memory_reserved(device) / 2**30
        if cfg.offload != "none":
            trainer.optimizer.close()
    except torch.OutOfMemoryError:
        result.update(fits=False, why="GPU out of memory")
    except UserError as error:
        result.update(fits=False, why=str(error))
    return result


def measure(spec: dict, timeout: float) -> dict:
    """Run `child(spec)` in a fresh process; its last stdout line is the JSON result."""
    try:
        proc = subprocess.run([sys.executable, __file__, "--child", json.dumps(spec)], capture_output=True,
                              text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"fits": False, "why": f"timed out after {timeout:.0f}s"}
    lines = proc.stdout.strip().splitlines()
    try:
        return json.loads(lines[-1])
    except (IndexError, json.JSONDecodeError):
        tail = proc.stderr.strip().splitlines()[-1:] or ["no output"]
        return {"fits": False, "why": f"exit {proc.returncode}: {tail[0][:160]}"}


def time_cpu_adamw(numel: int) -> dict[str, float]:
    """Million parameters per second of torch's AdamW implementations on this host's CPU."""
    rates = {}
    for name, options in {"fused": {"fused": True}, "foreach": {"foreach": True}, "for-loop": {"foreach": False}}.items():
        params = [torch.nn.Parameter(torch.randn(numel // 8)) for _ in range(8)]
        for p in params:
            p.grad = torch.randn_like(p)
        optimizer = torch.optim.AdamW(params, lr=1e-4, **options)
        optimizer.step()
        start = time.perf_counter()
        for _ in range(3):
            optimizer.step()
        rates[name] = 3 * numel / (time.perf_counter() - start) / 1e6
    return rates


def stale_gradient_loss(trainer, predict: bool) -> float:
    """Plain training (no offload) with every gradient taken one step late, the reference for delay 1: the
    forward and backward of step s run on the weights before the previous update (with `predict`, on those
    weights moved on by that update: w + (w - w_previous)), the optimizer steps the current weights."""
    params = list(trainer.model.parameters())
    current: list[torch.Tensor] = []

    @torch.no_grad()
    def load(weights) -> None:
        for p, w in zip(params, weights):
            p.copy_(w)

    trainer.optimizer.register_step_pre_hook(lambda optimizer, args, kwargs: load(current))
    previous = [p.detach().clone() for p in params]
    before_previous = previous
    for _ in range(trainer.cfg.steps):
        current[:] = [p.detach().clone() for p in params]
        load([2 * w - older for w, older in zip(previous, before_previous)] if predict else previous)
        trainer.local_step()
        before_previous, previous = previous, list(current)
    return trainer.evaluate().loss


def delay_effect(data: str, device: str, model: str, steps: int, batch: int, lrs: list[float]) -> None:
    """Val loss after `steps` steps with the update applied at once (delay 0) and one step late (delay 1), and
    of plain training with one-step-stale gradients, without and with the weights predicted."""
    from tscale_p2p.config import TrainConfig
    from tscale_p2p.data import load_corpus
    from tscale_p2p.model import ModelConfig
    from tscale_p2p.trainer import Trainer

    corpus = load_corpus(data)
    print(f"{'lr':>8} {'delay 0':>8} {'delay 1':>8} {'stale':>8} {'stale, predicted':>16}   "
          f"({model}, {steps} steps of {batch} sequences, {data})")
    for lr in lrs:
        def trainer(offload: str, delay: int) -> Trainer:
            cfg = TrainConfig(data=data, device=device, model=model, batch_size=batch, lr=lr, warmup=10,
                              steps=steps, offload=offload, offload_delay=delay, eval_batches=20)
            return Trainer(ModelConfig.from_dims(model), cfg, corpus, torch.device(device))

        losses = []
        for delay in (0, 1):
            offloaded = trainer("optimizer", delay)
            for _ in range(steps):
                offloaded.local_step()
            losses.append(offloaded.evaluate().loss)
            offloaded.optimizer.close()
        losses += [stale_gradient_loss(trainer("none", 0), predict) for predict in (False, True)]
        print(f"{lr:8.0e} {losses[0]:8.4f} {losses[1]:8.4f} {losses[2]:8.4f} {losses[3]:16.4f}", flush=True)


def names(sizes: str) -> list[str]:
    chosen = [s for s in sizes.split(",") if s]
    unknown = [s for s in chosen if s not in SIZES]
    if unknown:
        raise SystemExit(f"unknown size {unknown[0]!r}; choose from {', '.join(SIZES)}")
    return chosen


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dry-run", action="store_true", help="CPU, toy models, a few steps: check the flow")
    parser.add_argument("--budget", type=float, default=24.0, help="GPU memory budget in GiB")
    parser.add_argument("--plain-sizes", default="1B,1.5B", help="sizes tried without offload inside the budget")
    parser.add_argument("--offload-sizes", default="3B", help="sizes trained with offload inside the budget")
    parser.add_argument("--offload-probe-sizes", default="",
                        help="larger sizes only checked to train with offload inside the budget (eager, no baseline), e.g. 4B")
    parser.add_argument("--delays", default="1", help="offload delays to measure, e.g. 0,1")
    parser.add_argument("--checkpoint-blocks", default="all",
                        help="offloaded rows: blocks to recompute in backward, e.g. all,20,14 (fewer: faster, more memory)")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per measurement")
    parser.add_argument("--tokens-per-step", type=int, default=65536)
    # 3B at context 2048 under offload: bf16 weights 6.1 GB + bf16 gradients summed on the GPU 6.1 GB +
    # checkpointed fp32 block inputs 0.1 GB per block per 8k tokens + one block's recompute: 4 sequences
    # is ~18 GB. Without checkpointing and with 48 GB of fp32 AdamW state, 4 is also what the H200 holds.
    parser.add_argument("--micro-batch", type=int, default=4, help="sequences per micro-batch under offload")
    parser.add_argument("--plain-micro-batch", type=int, default=4, help="sequences per micro-batch without offload")
    parser.add_argument("--no-compile", action="store_true", help="eager mode (faster start, slower steps)")
    parser.add_argument("--delay-effect", metavar="TEXT", help="instead: val loss of delay 0 vs 1 on this text file")
    parser.add_argument("--delay-model", default="e64h4d4w64", help="--delay-effect: model dims")
    parser.add_argument("--delay-steps", type=int, default=300, help="--delay-effect: steps")
    parser.add_argument("--delay-batch", type=int, default=64, help="--delay-effect: sequences per step")
    parser.add_argument("--delay-lrs", default="1e-3,3e-3", help="--delay-effect: learning rates")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(json.loads(args.child))), flush=True)
        return
    if args.delay_effect:
        device = "cpu" if args.dry_run or not torch.cuda.is_available() else "cuda"
        delay_effect(args.delay_effect, device, args.delay_model, args.delay_steps, args.delay_batch,
                     [float(lr) for lr in args.delay_lrs.split(",")])
        return

    dry = args.dry_run
    device = "cpu" if dry else "cuda"
    if not dry and not torch.cuda.is_available():
        parser.error("needs a CUDA GPU (or --dry-run)")
    context = 64 if dry else 2048
    plain_sizes = ["toy"] if dry else names(args.plain_sizes)
    offload_sizes = ["toy", "toy2"] if dry else names(args.offload_sizes)
    sequences = max(1, args.tokens_per_step // context) if not dry else 8
    budget = None if dry else args.budget
    timeout = 120 if dry else 420

    data_dir = tempfile.mkdtemp(prefix="offload-bench-")
    data = Path(data_dir) / "random.txt"  # speed does not depend on the text: random letters, no download
    data.write_bytes(bytes(97 + b % 26 for b in os.urandom(4 * 2**20)))
    os.environ.setdefault("TSCALE_CACHE_DIR", str(Path(data_dir) / "cache"))

    def spec(size, offload, delay, checkpointing, limit, micro_batch, compile_, checkpoint_blocks=None):
        micro = min(micro_batch, sequences)
        return dict(size=size, device=device, data=str(data), offload=offload, delay=delay,
                    checkpointing=checkpointing, checkpoint_blocks=checkpoint_blocks, limit=limit, batch=micro,
                    grad_accum=max(1, sequences // micro), compile=compile_ and not dry, warmup_steps=2, steps=args.steps)

    started = time.perf_counter()
    numel = 2**22 if dry else 2**26
    rates = time_cpu_adamw(numel)
    print(f"CPU AdamW on this host ({torch.get_num_threads()} threads, {numel / 1e6:.0f}M fp32 parameters): "
          + ", ".join(f"{name} {rate:.0f} Mparam/s" for name, rate in rates.items()), flush=True)

    rows = []
    for size in plain_sizes:  # memory fit only: eager, short
        r = measure(spec(size, "none", 0, True, budget, args.plain_micro_batch, False), timeout)
        rows.append((size, f"plain, ckpt, cap {budget or '-'}", r, None))
        print(f"  {size} plain in budget: {r.get('fits')} {r.get('why', '')}", flush=True)
    for size in [] if dry else names(args.offload_probe_sizes):
        r = measure(spec(size, "optimizer", 1, True, budget, args.micro_batch, False), timeout)
        rows.append((size, f"offload d1, ckpt, cap {budget}, eager", r, None))
        print(f"  {size} offload in budget: {r.get('fits')} {r.get('why', '')}", flush=True)
    for size in offload_sizes:
        base = measure(spec(size, "none", 0, False, None, args.plain_micro_batch, not args.no_compile), timeout)
        rows.append((size, "plain, uncapped", base, None))
        print(f"  {size} plain uncapped: {base.get('tokens_per_s', 0):.0f} tok/s {base.get('why', '')}", flush=True)
        for delay in (int(d) for d in args.delays.split(",")):
            for blocks in args.checkpoint_blocks.split(","):
                count = None if blocks == "all" else int(blocks)
                r = measure(spec(size, "optimizer", delay, True, budget, args.micro_batch, not args.no_compile, count),
                            timeout)
                rows.append((size, f"offload d{delay}, ckpt {blocks}, cap {budget or '-'}", r, base))
                print(f"  {size} offload delay {delay}, checkpointing {blocks} blocks: "
                      f"{r.get('tokens_per_s', 0):.0f} tok/s {r.get('why', '')}", flush=True)

    print(f"\nGPU budget {budget} GiB, {sequences * context} tokens per step, context {context}, "
          f"{'eager' if args.no_compile or dry else 'torch.compile'}, {time.perf_counter() - started:.0f}s in all")
    header = f"{'size':>5} {'params':>7} {'mode':<28} {'fits':<5} {'peak GiB':>8} {'tok/s':>8} {'% uncapped':>10} " \
             f"{'step s':>7} {'update s':>8} {'(norm':>6} {'adamw':>6} {'cast)':>6} {'accum s':>7} {'stall s':>7}"
    print(header)
    print("-" * len(header))
    for size, mode, r, base in rows:
        pct = ""
        if base and base.get("tokens_per_s") and r.get("tokens_per_s"):
            pct = f"{100 * r['tokens_per_s'] / base['tokens_per_s']:.0f}%"
        fmt = lambda key, spec_: format(r[key], spec_) if key in r else "-"  # noqa: E731
        print(f"{size:>5} {r.get('params', 0) / 1e9:6.2f}B {mode:<28} {str(r.get('fits', False)):<5} "
              f"{fmt('peak_gib', '8.1f'):>8} {fmt('tokens_per_s', '8.0f'):>8} {pct:>10} {fmt('step_s', '7.2f'):>7} "
              f"{fmt('update_s', '8.2f'):>8} {fmt('update_norm_s', '6.2f'):>6} {fmt('update_adamw_s', '6.2f'):>6} "
              f"{fmt('update_cast_s', '6.2f'):>6} {fmt('accumulate_s', '7.2f'):>7} {fmt('stall_s', '7.2f'):>7}"
              + (f"  ({r['why']})" if not r.get("fits") and r.get("why") else ""))


if __name__ == "__main__":
    main()
