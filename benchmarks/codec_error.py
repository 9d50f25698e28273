"""How much of a real pseudo-gradient the 1-bit codecs keep, round by round (a minute on a CPU).

    python benchmarks/codec_error.py [--data stdlib] [--model e64h4d2w128] [--rounds 6] [--inner-steps 200]

One peer makes `--rounds` DiLoCo rounds of `--inner-steps` AdamW steps, with join's outer optimizer applied to its
own pseudo-gradient at each round's end; each round's pseudo-gradient (weights at the round's start minus weights
at its end, all parameters in one flat vector) goes through the swarm's codec (signs
and a mean-|x| scale per 256 values, peers/codec.py), and, for comparison, through the same codec after a
randomized Hadamard rotation of each block (a common trick to make heavy-tailed blocks Gaussian before sign
quantization), through `--codec e8` (E8Codec: one of 256 directions per 8 rotated values, the same bytes) and
through `--codec e8s`'s return trip (E8StagesCodec: E8 words in 0-3 stages a block, where the error is, 2 bits a
block more; here over the whole vector, in the swarm over each part of a span), at its weighting and at 0 (least
squares).
Printed per round: the vector's kurtosis (3 for a Gaussian), its cosine with the previous round's (how much coding
a round against the last one could save), and for each code the relative L2 error |q - x| / |x| and the cosine
between q and x. For Gaussian blocks, sign times mean |x| has relative error sqrt(1 - 2/pi) = 0.603 (cosine
0.798): no 1-bit sign code does better on such data; a code of 8 values at a time can.
"""

from __future__ import annotations

import argparse
import math

import torch

from swarm_convergence import trainer_for
from swarm_return_trip import onebit
from tscale_p2p.peers.settings import DEFAULT_OUTER_LR, DEFAULT_OUTER_MOMENTUM
from tscale_p2p.peers.outer import DelayedOuterStep, OuterOptimizer
from tscale_p2p.peers.codec import BLOCK_SIZE, E8Codec, E8StagesCodec, walsh_hadamard

GAUSSIAN_LIMIT = math.sqrt(1 - 2 / math.pi)


def rotated_onebit(x: torch.Tensor, seed: int = 0) -> torch.Tensor:
    """The codec applied to randomly signed, Hadamard-rotated blocks of `x`, rotated back."""
    padded = torch.cat([x, x.new_zeros(-x.numel() % BLOCK_SIZE)]).view(-1, BLOCK_SIZE)
    flips = torch.randint(0, 2, (BLOCK_SIZE,), generator=torch.Generator().manual_seed(seed)).float() * 2 - 1
    rotated = walsh_hadamard(padded * flips)
    coded = onebit(rotated.reshape(-1), None).view_as(rotated)
    return (walsh_hadamard(coded) * flips).reshape(-1)[: x.numel()]


def errors(coded: torch.Tensor, x: torch.Tensor) -> tuple[float, float]:
    """(relative L2 error, cosine) of `coded` against `x`."""
    return float((coded - x).norm() / x.norm()), float(coded @ x / (coded.norm() * x.norm()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", default="stdlib")
    parser.add_argument("--model", default="e64h4d2w128")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--inner-steps", type=int, default=200)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--warmup", type=int, default=100)
    args = parser.parse_args()
    settings = argparse.Namespace(
        **vars(args), from_step=0, steps=args.rounds * args.inner_steps, eval_batches=1, start_state=None, seed=0,
        outer_lr=DEFAULT_OUTER_LR, outer_momentum=DEFAULT_OUTER_MOMENTUM,
    )
    trainer = trainer_for(settings, args.batch_size, seed=1)
    rounds = DelayedOuterStep(OuterOptimizer(trainer.snapshot(), DEFAULT_OUTER_LR, DEFAULT_OUTER_MOMENTUM))
    print("| round | kurtosis | cosine with the last round's | codec: rel. error | codec: cosine | rotated: rel. error "
          "| rotated: cosine | e8: rel. error | e8: cosine | e8 stages: rel. error | e8 stages: cosine "
          "| e8 stages, least squares: rel. error | least squares: cosine |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    previous = None
    for number in range(1, args.rounds + 1):
        for _ in range(args.inner_steps):
            trainer.local_step()
        pseudo_gradient = rounds.finish_round(trainer.snapshot())
        trainer.apply_outer_update(rounds.apply_average(trainer.snapshot(), pseudo_gradient))
        x = torch.cat([g.reshape(-1) for g in pseudo_gradient.values()]).float().cpu()
        centred = x - x.mean()
        kurtosis = float((centred**4).mean() / (centred**2).mean() ** 2)
        plain, rotated = errors(onebit(x, None), x), errors(rotated_onebit(x), x)
        e8, stages = errors(E8Codec().carried(x), x), errors(E8StagesCodec().carried(x), x)
        squares = errors(E8StagesCodec(weighting=0.0).carried(x), x)
        last = "" if previous is None else f"{errors(previous, x)[1]:.3f}"
        print(f"| {number} | {kurtosis:.1f} | {last} | {plain[0]:.3f} | {plain[1]:.3f} | {rotated[0]:.3f} "
              f"| {rotated[1]:.3f} | {e8[0]:.3f} | {e8[1]:.3f} | {stages[0]:.3f} | {stages[1]:.3f} | {squares[0]:.3f} "
              f"| {squares[1]:.3f} |", flush=True)
        previous = x
    print(f"Gaussian limit of sign x mean|x|: relative error {GAUSSIAN_LIMIT:.3f}, cosine {math.sqrt(2 / math.pi):.3f}")


if __name__ == "__main__":
    main()
