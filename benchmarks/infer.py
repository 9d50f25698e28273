"""Decode tokens/s: our KV-cache engine against recomputing the whole sequence for every token.

A model of the given dims with random weights (speed does not depend on what the weights say) generates
greedily from random byte prompts, at each batch size:

- ``kv cache``: `GenerationEngine`, compiled into a CUDA graph on CUDA (the default of `tscale-peer infer`);
- ``kv cache, eager``: the same engine without torch.compile (CUDA only: on the CPU it is the row above);
- ``recompute``: no cache, the model's plain forward over the whole sequence for each new token, TScale's
  way. Its input is right-padded to prompt + recompute tokens so that every step has one shape (the
  windowed layers' FlexAttention compiles once per shape); attention is causal, so the padding changes
  no logit, and it costs at most (prompt + n) / (prompt + n / 2) of an unpadded run.

Decode tokens/s counts the tokens after the first of each sequence (the first comes from the prefill) over
the time between the first token and the last. Compilation happens in warm-up runs, outside the timing.

    python benchmarks/infer.py                                # the ~125M model on the GPU, batch 1 and 16
    python benchmarks/infer.py --dims e128h4d4w256 --device cpu --prompt-tokens 32 --new-tokens 64 \\
        --recompute-tokens 16 --batches 1,4                   # a quick check on a CPU
"""

from __future__ import annotations

import argparse
import time

import torch

from tscale_p2p.device import PRECISION_CHOICES, resolve_device
from tscale_p2p.generate import GenerationEngine, SamplingParams, generate, prepare_for_inference
from tscale_p2p.model import ModelConfig, Transformer


def decode_rate(seqs) -> float:
    tokens = sum(len(seq.tokens) - 1 for seq in seqs)
    return tokens / (max(s.finished_at for s in seqs) - min(s.first_token_at for s in seqs))


def bench_engine(model, prompts, new_tokens: int, compile: bool) -> float:
    engine = GenerationEngine(model, slots=len(prompts), compile=compile)
    params = SamplingParams(max_tokens=new_tokens, temperature=0)
    generate(engine, prompts, SamplingParams(max_tokens=8, temperature=0))  # warm-up: prefill shapes
    return decode_rate(generate(engine, prompts, params))


@torch.no_grad()
def bench_recompute(model, prompts, new_tokens: int, device) -> float:
    prompt = torch.tensor(prompts, device=device)
    batch, start = prompt.shape
    length = start + new_tokens
    idx = torch.zeros(batch, length, dtype=torch.long, device=device)

    def run(steps: int) -> None:
        idx[:, :start] = prompt
        for t in range(start, start + steps):
            idx[:, t] = model(idx)[:, t - 1].argmax(dim=-1)
        idx[:, t].tolist()  # wait for the device, like a server that has to send the token

    run(2)  # warm-up: compiles the windowed layers' attention for this shape
    began = time.perf_counter()
    run(new_tokens)
    # The first token would come from the "prefill"; count the rest, as for the engine.
    return batch * (new_tokens - 1) / (time.perf_counter() - began) if new_tokens > 1 else 0.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dims", default="e768h12d12w1024", help="model dims (default: the ~125M model)")
    parser.add_argument("--window-schedule", default="tscale", choices=("tscale", "dense"))
    parser.add_argument("--batches", default="1,16", help="comma-separated batch sizes (default: 1,16)")
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=256, help="tokens generated per sequence with the cache")
    parser.add_argument("--recompute-tokens", type=int, default=64, help="tokens generated per sequence by recompute")
    parser.add_argument("--device", default="auto", help="auto (CUDA where available), cpu, cuda or cuda:N")
    parser.add_argument("--precision", default="auto", choices=PRECISION_CHOICES, help="auto: bf16 on CUDA, fp32 on CPU")
    args = parser.parse_args()

    device = resolve_device(args.device)
    cfg = ModelConfig.from_dims(args.dims, window_schedule=args.window_schedule)
    torch.manual_seed(0)
    model = prepare_for_inference(Transformer(cfg), args.device, args.precision)
    precision = {torch.float32: "fp32", torch.bfloat16: "bf16"}[model.tok_emb.weight.dtype]
    quantized = {type(m).__name__ for m in model.modules()} & {"Fp8Linear", "Int8Linear"}
    precision += f" + {', '.join(quantized)}" if quantized else ""
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU, {torch.get_num_threads()} threads"
    print(f"# decode tokens/s: {cfg.dims} ({cfg.parameter_count() / 1e6:.0f}M parameters, windows "
          f"{sorted(set(cfg.layer_windows()))}), {precision}, {where}, torch {torch.__version__}")
    print(f"# prompt {args.prompt_tokens} tokens; cache rows generate {args.new_tokens}, recompute "
          f"{args.recompute_tokens} tokens per sequence; greedy")
    methods = [("kv cache", lambda p: bench_engine(model, p, args.new_tokens, compile=device.type == "cuda"))]
    if device.type == "cuda":
        methods.append(("kv cache, eager", lambda p: bench_engine(model, p, args.new_tokens, compile=False)))
    methods.append(("recompute", lambda p: bench_recompute(model, p, args.recompute_tokens, device)))

    print("\n| method | batch | tokens/s | per sequence | vs recompute |")
    print("| --- | ---: | ---: | ---: | ---: |")
    generator = torch.Generator().manual_seed(0)
    for batch in (int(b) for b in args.batches.split(",")):
        prompts = torch.randint(32, 127, (batch, args.prompt_tokens), generator=generator).tolist()
        rates = {}
        for name, run in methods:
            try:
                rates[name] = run(prompts)
            except Exception as error:  # one failing row must not cost the others (device time is scarce)
                print(f"| {name} | {batch} | failed: {type(error).__name__}: {str(error)[:200]} | | |", flush=True)
        for name, rate in rates.items():
            ratio = f"{rate / rates['recompute']:.1f}x" if "recompute" in rates else "-"
            print(f"| {name} | {batch} | {rate:,.0f} | {rate / batch:,.0f} | {ratio} |", flush=True)


if __name__ == "__main__":
    main()
