"""How much honest peers' updates agree: the cosine between peers' 1-bit coded updates, span by span, each round;
and how much of each update the last round's average already holds.

    nice -n 10 python benchmarks/update_cosines.py --data PATH/tinyshakespeare.txt [--peers 3] [--steps 600]
        [--inner-steps 50] [--from-step N]

The robust rule (peers/robust.py) flags a part that points against most of the others ("opposed"); this measures
the margin it relies on. In-process peers (the trainers of `benchmarks/swarm_convergence.py`, one seed each) train
rounds of H steps from the same global weights, which each round's exact mean moves with join's outer step; each
peer's update is 1-bit coded as it travels, cut into as many spans as peers (as the butterfly all-reduce cuts it),
and the table gives, per round, the lowest, median and highest cosine between two peers' parts of one span.

The last column asks whether a code could send less by sending each update minus a prediction every peer holds
(the last round's average, the same on every peer): the norm left of a peer's update once the best multiple of
that average is taken off, as a share of its norm (mean over peers; 1.0: the average predicts nothing).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

import torch

from swarm_convergence import add_run_arguments, pretrain, trainer_for
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


def left_by(prediction: torch.Tensor | None, update: torch.Tensor) -> float:
    """|update - c * prediction| / |update| at the best c (1.0 without a prediction)."""
    if prediction is None or not prediction.norm() > 0:
        return 1.0
    c = (update @ prediction) / (prediction @ prediction)
    return float((update - c * prediction).norm() / update.norm())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_run_arguments(parser)
    parser.set_defaults(peers=3, steps=600, inner_steps=50)
    parser.add_argument("--from-step", type=int, default=0, metavar="N", help="start every peer from N steps of "
                        "one process on the combined batch (a run in progress), as swarm_convergence.py does")
    args = parser.parse_args()
    if args.from_step < 0:
        parser.error(f"--from-step must be >= 0, got {args.from_step}")
    args.start_state, args.seed = None, 0
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as scratch:
        if args.from_step:
            args.start_state = str(pretrain(args, Path(scratch) / "start"))
        measure(args)


def measure(args) -> None:
    """Train the rounds and print the table."""
    codec = OneBitCodec()
    peers = [trainer_for(args, args.batch_size, seed=1 + i) for i in range(args.peers)]
    outer = OuterOptimizer(peers[0].snapshot(), args.outer_lr, args.outer_momentum)
    rounds = [DelayedOuterStep(outer) for _ in peers]
    print(f"{args.peers} peers of {args.model}, batch {args.batch_size}, H={args.inner_steps}")
    print("| round | lowest cosine | median | highest | left by the last round's average |")
    print("| --- | --- | --- | --- | --- |")
    lowest, last_average = float("inf"), None
    for number in range(1, args.steps // args.inner_steps + 1):
        updates = []
        for trainer, bookkeeping in zip(peers, rounds):
            for _ in range(args.inner_steps):
                trainer.local_step()
            updates.append(bookkeeping.finish_round(trainer.snapshot()))
        cosines = span_cosines([coded(codec, update) for update in updates])
        lowest = min(lowest, min(cosines))
        flat = [torch.cat([update[name].reshape(-1) for name in sorted(update)]) for update in updates]
        left = statistics.mean(left_by(last_average, update) for update in flat)
        print(f"| {number} | {min(cosines):.3f} | {statistics.median(cosines):.3f} | {max(cosines):.3f} | {left:.3f} |",
              flush=True)
        last_average = torch.stack(flat).mean(0)
        average = {name: torch.stack([u[name] for u in updates]).mean(0) for name in updates[0]}
        weights = outer.step(average)
        for trainer, bookkeeping in zip(peers, rounds):
            trainer.apply_outer_update({name: w.clone() for name, w in weights.items()})
            bookkeeping.round_start = {name: w.clone() for name, w in weights.items()}
    print(f"lowest cosine between two honest peers' parts of a span: {lowest:.3f}")


if __name__ == "__main__":
    main()
