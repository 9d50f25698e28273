"""How much honest peers' updates agree: the cosine between peers' 1-bit coded updates, span by span, each round.

    nice -n 10 python benchmarks/update_cosines.py --data PATH/tinyshakespeare.txt [--peers 3] [--steps 600]
        [--inner-steps 50]

The robust rule (peers/robust.py) flags a part that points against most of the others ("opposed"); this measures
the margin it relies on. In-process peers (the trainers of `benchmarks/swarm_convergence.py`, one seed each) train
rounds of H steps from the same global weights, which each round's exact mean moves with join's outer step; each
peer's update is 1-bit coded as it travels, cut into as many spans as peers (as the butterfly all-reduce cuts it),
and the table gives, per round, the lowest, median and highest cosine between two peers' parts of one span.
"""

from __future__ import annotations

import argparse
import statistics

import torch

from swarm_convergence import add_run_arguments, trainer_for
from tscale_p2p.peers.codec import OneBitCodec
from tscale_p2p.peers.outer import DelayedOuterStep, OuterOptimizer


def coded(codec: OneBitCodec, update: dict[str, torch.Tensor]) -> torch.Tensor:
    return codec.carried(torch.cat([update[name].reshape(-1) for name in sorted(update)]))


def span_cosines(updates: list[torch.Tensor]) -> list[float]:
    """Cosines between every two peers' parts of each of len(updates) equal spans."""
    size = updates[0].numel()
    cosines = []
    for span in range(len(updates)):
        parts = torch.stack([u[span * size // len(updates) : (span + 1) * size // len(updates)] for u in updates])
        unit = parts / parts.norm(dim=1, keepdim=True)
        gram = unit @ unit.T
        pairs = torch.triu_indices(len(updates), len(updates), offset=1)
        cosines += gram[pairs[0], pairs[1]].tolist()
    return cosines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_run_arguments(parser)
    parser.set_defaults(peers=3, steps=600, inner_steps=50)
    args = parser.parse_args()
    args.start_state, args.from_step, args.seed = None, 0, 0
    torch.set_num_threads(1)
    codec = OneBitCodec()
    peers = [trainer_for(args, args.batch_size, seed=1 + i) for i in range(args.peers)]
    outer = OuterOptimizer(peers[0].snapshot(), args.outer_lr, args.outer_momentum)
    rounds = [DelayedOuterStep(outer) for _ in peers]
    print(f"{args.peers} peers of {args.model}, batch {args.batch_size}, H={args.inner_steps}")
    print("| round | lowest cosine | median | highest |")
    print("| --- | --- | --- | --- |")
    lowest = float("inf")
    for number in range(1, args.steps // args.inner_steps + 1):
        updates = []
        for trainer, bookkeeping in zip(peers, rounds):
            for _ in range(args.inner_steps):
                trainer.local_step()
            updates.append(bookkeeping.finish_round(trainer.snapshot()))
        cosines = span_cosines([coded(codec, update) for update in updates])
        lowest = min(lowest, min(cosines))
        print(f"| {number} | {min(cosines):.3f} | {statistics.median(cosines):.3f} | {max(cosines):.3f} |", flush=True)
        average = {name: torch.stack([u[name] for u in updates]).mean(0) for name in updates[0]}
        weights = outer.step(average)
        for trainer, bookkeeping in zip(peers, rounds):
            trainer.apply_outer_update({name: w.clone() for name, w in weights.items()})
            bookkeeping.round_start = {name: w.clone() for name, w in weights.items()}
    print(f"lowest cosine between two honest peers' parts of a span: {lowest:.3f}")


if __name__ == "__main__":
    main()
