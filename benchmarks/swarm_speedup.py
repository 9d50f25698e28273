"""What joining buys, as a volunteer sees it: one peer alone against 4 peers in the swarm (in process).

    python benchmarks/swarm_speedup.py --data PATH/tinyshakespeare.txt [--steps 2000] [--inner-steps 50]
        [--batch-size 8] [--apply-after 10] [--round-time 0.9] [--swarm-steps N] [--peer-lr LR] [--seed S]
        [--out DIR]

- solo       one trainer of batch B for `--steps` N steps (join's inner AdamW and schedule), evaluated every
             `--inner-steps` H steps; its last val loss is the target L.
- swarm      `--peers` in-process peers of batch B each, the same N-step schedule, H inner steps a round, the
             codec's trips as SwarmAverager makes them with join's default error feedback for the codec, each
             average applied `--apply-after` steps into the next round (as the real swarm applies one when it
             arrives; swarm_convergence.py's rows, whose twin has landed within 0.2 points of the real swarm);
             the global weights are evaluated after every round, and training stops at the first round <= L.
- exact mean the same rounds with the exact mean of the pseudo-gradients (the reference: no compression).
- one process on the combined batch (`--peers` x B, same schedule): what the extra data buys with no rounds at
             all, the ceiling of the swarm's compute multiplier at this model size and schedule.

`--swarm-steps` gives the last three rows a schedule of their own (a run whose founder expects several peers
sets a shorter one, `join --steps`); the solo run keeps N, and the multiplier stays N / S.

Each in-process peer stands for a volunteer on a machine of its own, so wall time is counted per peer: the solo
run takes N x t_step, the swarm S x t_step + rounds x t_round, with S the steps per peer to reach L, t_step the
median step time of the solo run and t_round `--round-time` (default: a real swarm's measured round). Averaging
overlaps training in the real swarm (busy time 98.8-99.1% on shaped links), so counting every round in full is
an upper bound; N / S (the compute multiplier) is the other end.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from swarm_convergence import add_run_arguments, diloco_in_process, outer_lr_label, trainer_for, val_loss
from tscale_p2p.peers.settings import DEFAULT_ERROR_FEEDBACK, ERROR_FEEDBACK_CARRY

# benchmarks/RESULTS.md, "Swarm rounds and busy time": 4 peers on 100 Mbit/s, 40 ms RTT links, rounds of 0.7-1.1 s
MEASURED_ROUND_S = 0.9
# join's sender residual carry -> swarm_convergence.TRIPS key that averages as SwarmAverager does with it
SWARM_TRIPS = {None: "1-bit both ways, no error feedback", 1.0: "swarm"}
DAMPED_TRIPS = "1-bit both ways, a damped sender residual"
ROWS = ("codec", "exact", "combined")  # besides the solo run, which sets the target


def one_process(args, batch_size: int, name: str, target: float | None = None) -> tuple[list[tuple[int, float]], float]:
    """One trainer of `batch_size`: its val loss curve (steps, loss) every H steps, up to the first <= target, and
    the median step time in seconds."""
    trainer = trainer_for(args, batch_size, seed=1)
    curve, times = [], []
    for step in range(1, args.steps + 1):
        started = time.perf_counter()
        trainer.local_step()
        times.append(time.perf_counter() - started)
        if step % args.inner_steps == 0 or step == args.steps:
            curve.append((step, trainer.evaluate().loss))
            print(f"{name}, step {step}: {curve[-1][1]:.4f}", flush=True)
            if target is not None and curve[-1][1] <= target:
                break
    return curve, statistics.median(times)


def swarm(args, averaging: str, target: float) -> list[tuple[int, float]]:
    """In-process peers' global val loss after every round (steps per peer, loss), up to the first <= target."""
    curve = []

    def scored(steps: int, weights: dict[str, torch.Tensor]) -> bool:
        curve.append((steps, val_loss(args, weights)))
        print(f"{averaging}, {steps} steps a peer: {curve[-1][1]:.4f}", flush=True)
        return curve[-1][1] <= target

    diloco_in_process(args, args.apply_after, args.outer_lr, averaging, args.peer_lr, on_round=scored)
    return curve


def first_reaching(curve: list[tuple[int, float]], target: float) -> int | None:
    """Steps of the first point of the curve at or below target (None: never)."""
    return next((steps for steps, loss in curve if loss <= target), None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_run_arguments(parser)
    parser.set_defaults(steps=2000, inner_steps=50)
    parser.add_argument("--apply-after", type=int, default=10, help="steps into the next round at which a round's "
                        "average is applied (the real swarm's: when it arrives)")
    parser.add_argument("--round-time", type=float, default=MEASURED_ROUND_S, help="seconds a volunteer waits per "
                        f"averaging round (default {MEASURED_ROUND_S}: the real swarm's measured 0.7-1.1 s on "
                        "100 Mbit/s, 40 ms links, benchmarks/RESULTS.md)")
    parser.add_argument("--rows", default=",".join(ROWS), help=f"the rows besides the solo run, comma-separated: "
                        f"{', '.join(ROWS)} (to split one comparison across processes; default: all)")
    parser.add_argument("--swarm-steps", type=int, help="the swarm rows' schedule in steps a peer (default: "
                        "--steps, the solo run's)")
    parser.add_argument("--peer-lr", type=float, help="the swarm rows' inner peak lr (default: --lr, the solo "
                        "run's): averaging evens out noise, so peers may take shorter steps and the outer step "
                        "longer ones")
    parser.add_argument("--seed", type=int, default=0, help="a repeat of the comparison with other random draws: "
                        "the initial weights and every row's batches")
    parser.add_argument("--out", help="folder for table.md and results.json (the curves)")
    args = parser.parse_args()
    rows_wanted = args.rows.split(",")
    if not rows_wanted or any(row not in ROWS for row in rows_wanted):
        parser.error(f"--rows takes a comma-separated subset of {', '.join(ROWS)}, got {args.rows!r}")
    args.swarm_steps = args.swarm_steps or args.steps
    for name in ("steps", "inner_steps", "peers", "batch_size", "swarm_steps"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if not 0 <= args.apply_after <= args.inner_steps:
        parser.error(f"--apply-after must be in 0..--inner-steps ({args.inner_steps}), got {args.apply_after}")
    args.peer_lr = args.lr if args.peer_lr is None else args.peer_lr
    if not args.peer_lr > 0:  # also refuses nan
        parser.error(f"--peer-lr must be > 0, got {args.peer_lr}")
    if args.seed < 0:
        parser.error(f"--seed must be >= 0, got {args.seed}")
    if not args.round_time >= 0:
        parser.error(f"--round-time must be >= 0 seconds, got {args.round_time}")
    # the rows of swarm_convergence.py that this reuses, from a cold start
    carry = ERROR_FEEDBACK_CARRY[DEFAULT_ERROR_FEEDBACK[args.codec]]
    args.from_step, args.start_state, args.carry = 0, None, carry
    torch.set_num_threads(1)
    started = time.perf_counter()

    solo_curve, step_s = one_process(args, args.batch_size, "solo")
    target = solo_curve[-1][1]
    rows = [("one peer alone", solo_curve, args.steps)]
    swarm_args = argparse.Namespace(**{**vars(args), "steps": args.swarm_steps})
    error_feedback = DEFAULT_ERROR_FEEDBACK[args.codec]
    for row, name, averaging in (
        ("codec", f"{args.peers} peers, {args.codec} codec both ways, error feedback {error_feedback} (join's "
         "default)", SWARM_TRIPS.get(carry, DAMPED_TRIPS)),
        ("exact", f"{args.peers} peers, exact mean (reference)", "exact"),
    ):
        if row in rows_wanted:
            curve = swarm(swarm_args, averaging, target)
            rows.append((name, curve, first_reaching(curve, target)))
    combined = None
    if "combined" in rows_wanted:
        combined, _ = one_process(swarm_args, args.peers * args.batch_size, "combined batch", target)
        # no rounds: its wall time is not a volunteer's, so the table gives it the compute multiplier only
        rows.append((f"one process on the combined batch ({args.peers} x {args.batch_size}; no rounds: the "
                     "ceiling)", combined, first_reaching(combined, target)))

    solo_wall = args.steps * step_s
    lines = [
        f"model {args.model} on {args.device}, batch {args.batch_size} a peer, N={args.steps} steps (warm-up "
        f"{args.warmup}, cosine), inner lr {args.lr} (the swarm's peers {args.peer_lr}), H={args.inner_steps}, "
        f"{outer_lr_label(args)} momentum {args.outer_momentum}, seed {args.seed}, the swarm rows' schedule "
        f"{args.swarm_steps} steps, averages applied {args.apply_after} steps into the next round; target: the solo "
        f"run's final val loss {target:.4f}; t_step {1000 * step_s:.1f} ms (median of the solo run), t_round "
        f"{args.round_time} s"
        f"{' (the real swarm measured 0.7-1.1 s, RESULTS.md)' if args.round_time == MEASURED_ROUND_S else ''}; "
        f"{time.perf_counter() - started:.0f} s",
        "| run | steps a peer to the target (S) | rounds | compute multiplier N/S | volunteer wall time | "
        "speed-up in wall time | val loss there |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name, curve, steps in rows:
        if steps is None:
            lines.append(f"| {name} | not reached in {curve[-1][0]} | {len(curve)} | < {args.steps / curve[-1][0]:.2f} "
                         f"| - | - | {curve[-1][1]:.4f} |")
            continue
        if curve is combined:
            lines.append(f"| {name} | {steps} | - | {args.steps / steps:.2f} | - | - | {dict(curve)[steps]:.4f} |")
            continue
        rounds = 0 if curve is solo_curve else [s for s, _ in curve].index(steps) + 1  # a curve point a round
        wall = steps * step_s + rounds * args.round_time
        lines.append(f"| {name} | {steps} | {rounds or '-'} | {args.steps / steps:.2f} | {wall:.1f} s | "
                     f"{solo_wall / wall:.2f}x | {dict(curve)[steps]:.4f} |")
    lines.append(f"target: {args.peers} peers in <= 1/2.5 of the solo time (a compute multiplier >= 2.5 of "
                 f"{args.peers})")
    print("\n".join(lines), flush=True)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "table.md").write_text("\n".join(lines) + "\n")
        (out / "results.json").write_text(json.dumps(
            {"args": vars(args), "step_s": step_s, "target": target,
             "rows": [dict(run=n, curve=c, steps_to_target=s) for n, c, s in rows]}, indent=1))


if __name__ == "__main__":
    main()
