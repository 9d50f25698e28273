"""Training tokens/s and MFU of fp8 / int8 Triton linears against the bf16 torch.compile baseline, and loss parity.

Self-contained: `tscale_p2p.model.Transformer` driven by a plain loop (bf16 autocast, fp32 master weights,
fused torch.optim.AdamW). Every precision variant compiles the model with torch.compile; the fp8/int8 linears
are opaque to the compiler (it fuses everything around them).

    throughput: python benchmarks/train_throughput.py --dims e768h12d12w1024 --batch 32
                python benchmarks/train_throughput.py --dims e2048h16d30w1024 --batch 16
                ... --vocab 50304 --variants fp8-bf16-head,fp8   (the output head at a GPT-2 vocabulary)
    loss parity: python benchmarks/train_throughput.py --parity --steps 300 --dims e768h12d12w1024 [--jobs 5]

Throughput uses random tokens; parity trains each variant from the same initial weights on the same batches of
byte-level text (the Python standard library's own sources, which every Python install carries) and reports
the final validation loss. MFU = model training FLOPs per token (ModelConfig.flops_per_token) x tokens/s over
the bf16 dense peak (--peak-tflops, 989 for an H100/H200 SXM): fp8 runs are measured against the same bf16 peak.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import subprocess
import sysconfig
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
import torch.nn.functional as F

from tscale_p2p.kernels import convert_linears
from tscale_p2p.model import ModelConfig, Transformer

# name -> (convert_linears precision, keyword arguments)
VARIANTS = {
    "bf16": ("bf16", {}),
    "fp8": ("fp8", {}),  # as the trainer converts: the output head in fp8 too
    "fp8-sr": ("fp8", {"stochastic_grad": True}),
    "fp8-e5m2": ("fp8", {"fp8_grad_format": "e5m2"}),
    "fp8-bf16-head": ("fp8", {"skip": ("lm_head",)}),  # fp8 as trained before the head moved to fp8 too
    "int8": ("int8", {}),  # as the trainer converts: the output head stays bf16
    "int8-head": ("int8", {"skip": ()}),  # the output head in int8 too
}


def stdlib_bytes(limit: int) -> torch.Tensor:
    """Up to `limit` bytes of the standard library's .py sources, in a fixed order."""
    chunks, total = [], 0
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py")):
        data = path.read_bytes()
        chunks.append(data)
        total += len(data)
        if total >= limit:
            break
    return torch.frombuffer(bytearray(b"".join(chunks)[:limit]), dtype=torch.uint8).long()


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def build(cfg: ModelConfig, variant: str, seed: int, compile_model: bool, device: torch.device):
    torch.manual_seed(seed)
    with device:  # initialise on the GPU: a 1.5B model takes ~10 s to initialise on the CPU
        model = Transformer(cfg)
    precision, kwargs = VARIANTS[variant]
    convert_linears(model, precision, **kwargs)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1,
                            fused=device.type == "cuda")
    return model, (torch.compile(model) if compile_model else model), opt


def loss_of(fwd, x, y) -> torch.Tensor:
    with torch.autocast(x.device.type, dtype=torch.bfloat16):
        logits = fwd(x)
    return F.cross_entropy(logits.float().flatten(0, 1), y.flatten())


def step(fwd, opt, x, y) -> torch.Tensor:
    loss = loss_of(fwd, x, y)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss


def print_kernel_profile(fwd, opt, x, y, top: int) -> None:
    """The `top` GPU kernels of one training step by total device time: where a variant's time goes."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step(fwd, opt, x, y)
        sync(x.device)
    print(prof.key_averages().table(sort_by="self_device_time_total", row_limit=top, max_name_column_width=70),
          flush=True)


def throughput(cfg: ModelConfig, variant: str, batch: int, steps: int, warmup: int, compile_model: bool,
               peak_tflops: float, device: torch.device, profile_top: int = 0) -> dict:
    model, fwd, opt = build(cfg, variant, 0, compile_model, device)
    t = cfg.context
    x = torch.randint(0, cfg.vocab_size, (batch, t), device=device)
    y = torch.randint(0, cfg.vocab_size, (batch, t), device=device)
    start = time.perf_counter()
    for _ in range(warmup):  # compilation and autotuning happen here
        step(fwd, opt, x, y)
    sync(device)
    warm_s = time.perf_counter() - start
    start = time.perf_counter()
    for _ in range(steps):
        loss = step(fwd, opt, x, y)
    sync(device)
    elapsed = time.perf_counter() - start
    if profile_top:
        print(f"## {variant}: top {profile_top} kernels of one step", flush=True)
        print_kernel_profile(fwd, opt, x, y, profile_top)
    tokens_s = steps * batch * t / elapsed
    mfu = cfg.flops_per_token(t) * tokens_s / (peak_tflops * 1e12)
    result = {"variant": variant, "dims": cfg.dims, "vocab": cfg.vocab_size, "params": cfg.parameter_count(),
              "batch": batch, "tokens_per_s": tokens_s, "mfu": mfu, "step_ms": 1e3 * elapsed / steps, "warmup_s": warm_s,
              "loss": loss.item()}
    del model, fwd, opt
    if device.type == "cuda":
        result["max_mem_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    return result


def parity(cfg: ModelConfig, variant: str, batch: int, steps: int, data: torch.Tensor, compile_model: bool,
           eval_batches: int, device: torch.device) -> dict:
    model, fwd, opt = build(cfg, variant, 0, compile_model, device)
    t = cfg.context
    split = int(0.95 * len(data))
    train, val = data[:split].to(device), data[split:].to(device)
    gen = torch.Generator().manual_seed(1)  # same batches for every variant
    lr_peak, warm = 1e-3, max(1, steps // 10)
    curve = []
    start = time.perf_counter()
    for i in range(steps):
        lr = lr_peak * min(1.0, (i + 1) / warm) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * i / steps)))
        for group in opt.param_groups:
            group["lr"] = lr
        starts = torch.randint(0, len(train) - t - 1, (batch,), generator=gen).to(device)
        idx = starts[:, None] + torch.arange(t + 1, device=device)
        chunk = train[idx]
        loss = step(fwd, opt, chunk[:, :-1], chunk[:, 1:])
        if i % 50 == 0 or i == steps - 1:
            curve.append((i, loss.item()))
        if i % 250 == 0:  # progress, so that a run cut short still shows how far each variant got
            print(f"{variant}: step {i}/{steps}, train loss {curve[-1][1]:.4f}, "
                  f"{time.perf_counter() - start:.0f} s", flush=True)
    sync(device)
    train_s = time.perf_counter() - start
    model.eval()
    losses = []
    with torch.no_grad():
        for j in range(eval_batches):
            offs = torch.arange(batch, device=device) * (t + 1) + j * batch * (t + 1)
            offs = offs % (len(val) - t - 1)
            chunk = val[offs[:, None] + torch.arange(t + 1, device=device)]
            losses.append(loss_of(fwd, chunk[:, :-1], chunk[:, 1:]).item())
    return {"variant": variant, "dims": cfg.dims, "steps": steps, "batch": batch, "val_loss": sum(losses) / len(losses),
            "train_curve": curve, "train_s": train_s}


def parity_in_processes(args: argparse.Namespace, variants: list[str]) -> list[dict]:
    """Run each variant's parity training in its own process, `args.jobs` at a time on the one GPU (parity needs
    no timing, and the small variants leave most of the GPU idle); their results, in `variants` order."""
    common = ["--parity", "--dims", args.dims, "--batch", str(args.batch), "--steps", str(args.steps),
              "--data-bytes", str(args.data_bytes), "--eval-batches", str(args.eval_batches), "--device", args.device]
    common += ["--no-compile"] if args.no_compile else []

    def one(variant: str) -> dict | None:
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "result.json"
            # stdout passes through (progress lines and the result); stderr is kept for a failure's message
            proc = subprocess.run([sys.executable, __file__, *common, "--variants", variant, "--json", str(out)],
                                  stderr=subprocess.PIPE, text=True)
            if proc.returncode or not out.exists():
                print(f"{variant}: FAILED (exit {proc.returncode}): {proc.stderr.strip()[-400:]}", flush=True)
                return None
            return json.loads(out.read_text().splitlines()[-1])

    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        results = list(pool.map(one, variants))
    return [r for r in results if r is not None]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dims", default="e768h12d12w1024")
    p.add_argument("--variants", default="bf16,fp8,int8", help=f"comma-separated, of {', '.join(VARIANTS)}")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--no-compile", action="store_true")
    p.add_argument("--peak-tflops", type=float, default=989.0)
    p.add_argument("--vocab", type=int, default=256, help="throughput: the vocabulary (the output head's size), e.g. "
                   "50304 for a GPT-2-tokenized corpus; parity trains on bytes (256)")
    p.add_argument("--parity", action="store_true", help="train --steps on stdlib bytes; report final val loss")
    p.add_argument("--data-bytes", type=int, default=40_000_000)
    p.add_argument("--eval-batches", type=int, default=20)
    p.add_argument("--device", default="cuda", help="cuda; cpu only for a smoke run (fp8/int8 then need "
                                                        "TRITON_INTERPRET=1 and are very slow)")
    p.add_argument("--profile", type=int, default=0, metavar="N",
                   help="after timing, print each variant's N most expensive GPU kernels in one step")
    p.add_argument("--json", help="append each result as one JSON line to this file")
    p.add_argument("--jobs", type=int, default=1, help="--parity: train this many variants at once, each in its "
                                                       "own process on the same GPU")
    args = p.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        sys.exit("benchmarks/train_throughput.py: no CUDA GPU (use --device cpu for a smoke run)")
    torch.backends.cuda.matmul.allow_tf32 = True
    if args.vocab < 1:
        p.error(f"--vocab must be >= 1, got {args.vocab}")
    if args.parity and args.vocab != 256:
        p.error(f"--parity trains on bytes: --vocab must be 256, got {args.vocab}")
    cfg = ModelConfig.from_dims(args.dims, vocab_size=args.vocab)
    variants = args.variants.split(",")
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        p.error(f"unknown --variants {','.join(unknown)}; choose from {', '.join(VARIANTS)}")
    data = stdlib_bytes(args.data_bytes) if args.parity else None
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"# {name}, {cfg.dims}, vocab {cfg.vocab_size}, {cfg.parameter_count() / 1e6:.0f}M params, batch "
          f"{args.batch} x {cfg.context}, compile={not args.no_compile}", flush=True)
    results = []
    if args.parity and args.jobs > 1:
        results = parity_in_processes(args, variants)  # each process has printed its own result line
        if args.json:
            with open(args.json, "a") as f:
                f.writelines(json.dumps(r) + "\n" for r in results)
        variants = []
    for variant in variants:
        try:
            if args.parity:
                r = parity(cfg, variant, args.batch, args.steps, data, not args.no_compile, args.eval_batches,
                           device)
            else:
                r = throughput(cfg, variant, args.batch, args.steps, args.warmup, not args.no_compile,
                               args.peak_tflops, device, args.profile)
        except Exception as e:  # noqa: BLE001  (one failing variant must not lose the others' numbers)
            print(f"{variant}: FAILED {type(e).__name__}: {e}", flush=True)
            continue
        print(json.dumps(r), flush=True)
        results.append(r)
        if args.json:
            with open(args.json, "a") as f:
                f.write(json.dumps(r) + "\n")
    base = next((r for r in results if r["variant"] == "bf16"), None)
    if args.parity:
        print("\n| variant | steps | final val loss | vs bf16 |\n| --- | --- | --- | --- |")
        for r in results:
            rel = f"{(r['val_loss'] / base['val_loss'] - 1) * 100:+.2f}%" if base else "-"
            print(f"| {r['variant']} | {r['steps']} | {r['val_loss']:.4f} | {rel} |")
    else:
        print("\n| variant | dims | tokens/s | MFU (bf16 peak) | step ms | vs bf16 (same compile setting) |\n"
              "| --- | --- | --- | --- | --- | --- |")
        for r in results:
            rel = f"{r['tokens_per_s'] / base['tokens_per_s']:.2f}x" if base else "-"
            print(f"| {r['variant']} | {r['dims']} | {r['tokens_per_s']:.0f} | {r['mfu'] * 100:.1f}% | "
                  f"{r['step_ms']:.1f} | {rel} |")


if __name__ == "__main__":
    main()
