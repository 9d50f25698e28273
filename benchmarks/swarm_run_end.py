"""Whether a run's last round gathers every peer when the peers run out of steps at different times: real
`tscale-peer join` processes on 127.0.0.1.

    python benchmarks/swarm_run_end.py [--runs 6] [--max-steps 280,400,240,280] [--steps 300] [--inner-steps 100]
        [--model e64h4d2w128] [--matchmaking-time 3] [--hogs 0] [--keep DIR]

Each run starts one peer per `--max-steps` entry at once against a stock `hivemind-dht` node, all of a fresh
run (`--min-peers`, a schedule of `--steps` steps, H = `--inner-steps`); peer i leaves after its own `--max-steps`
local steps or at the schedule's end, whichever comes first. The default gives the run's last round three peers
that run out of steps in it, at different times, and wait for the swarm to end the round
(`SwarmPeer._wait_for_the_swarms_round_end`), and one that still trains and ends it: as in swarm_convergence.py's
real swarms, where each peer stops at its own `--max-steps` while the swarm's schedule, which counts every
peer's steps, has not reached its end.

Printed per run: each peer's last averaged round (with how many others, and the global weights it logged). A run
passes when every peer averaged the same last round with all the others and logged the same weights.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import sys
import tempfile
import time
from pathlib import Path

from swarm_convergence import bootstrap_address, start_bootstrap, step_counts, stop_bootstrap
from swarm_rounds import corpus, hog, launch_peer, stop_peers

LAST = re.compile(r"round (\d+): averaged with (nobody|\d+ peer\(s\))[^\n]*?(?:weights (\w+))?$", re.MULTILINE)


def last_round(log: str) -> tuple[int, int, str] | None:
    """(round, others averaged with, weights) of the last round a peer's log reports averaged; None if none."""
    found = list(LAST.finditer(log))
    if not found:
        return None
    number, others, weights = found[-1].groups()
    return int(number), 0 if others == "nobody" else int(others.split()[0]), weights or ""


def one_run(args, folder: Path, data: Path, max_steps: list[int]) -> bool:
    folder.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    common = ["--data", str(data), "--tokenizer", "byte", "--run-id", "run-end", "--model", args.model,
              "--device", "cpu", "--no-compile", "--no-tui", "--batch-size", "8", "--steps", str(args.steps),
              "--warmup", "20", "--inner-steps", str(args.inner_steps),
              "--matchmaking-time", str(args.matchmaking_time),
              "--save-every", "0", "--eval-every", "0", "--log-every", "50", "--min-peers", str(len(max_steps)),
              "--host-maddrs", "/ip4/127.0.0.1/tcp/0"]
    peers = []
    bootstrap = start_bootstrap(folder / "bootstrap.log")
    try:
        address = bootstrap_address(folder / "bootstrap.log", bootstrap)
        for i, steps in enumerate(max_steps):
            peers.append(launch_peer(folder, i, [*common, "--max-steps", str(steps), "--initial-peers", address], env))
        deadline = time.monotonic() + args.timeout
        while time.monotonic() < deadline and any(p.poll() is None for p in peers):
            time.sleep(1)
    finally:
        stop_peers(peers)
        stop_bootstrap(bootstrap)
    ends = [last_round((folder / f"peer{i}.log").read_text(errors="replace")) for i in range(len(max_steps))]
    rounds = {end[0] for end in ends if end}
    passed = (None not in ends and len(rounds) == 1 and len({end[2] for end in ends}) == 1
              and all(end[1] == len(max_steps) - 1 for end in ends))
    described = ", ".join(f"peer{i} " + (f"round {e[0]} with {e[1]} ({e[2] or '-'})" if e else "none")
                          for i, e in enumerate(ends))
    print(f"| {folder.name} | {'all in' if passed else 'missed'} | {described} |", flush=True)
    return passed


def peer_step_counts(text: str) -> list[int]:
    """`--max-steps`: swarm_convergence's `step_counts`, one per peer, of two peers or more (argparse type)."""
    counts = step_counts(text)
    if len(counts) < 2:
        raise argparse.ArgumentTypeError(f"step counts of two peers or more separated by commas, got {text!r}")
    return counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=6)
    parser.add_argument("--max-steps", type=peer_step_counts, default="280,400,240,280",
                        help="each peer's own --max-steps, comma-separated")
    parser.add_argument("--steps", type=int, default=300, help="the run's schedule, in steps")
    parser.add_argument("--inner-steps", type=int, default=100)
    parser.add_argument("--model", default="e64h4d2w128")
    parser.add_argument("--matchmaking-time", type=float, default=3.0)
    parser.add_argument("--hogs", type=int, default=0, help="busy-looping processes beside the peers")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds a run may take")
    parser.add_argument("--keep", type=Path, help="write the peers' logs and runs here (default: a temporary folder)")
    args = parser.parse_args()
    max_steps = args.max_steps
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stop the peers and hogs on the way out
    folder = args.keep or Path(tempfile.mkdtemp(prefix="swarm-run-end-"))
    folder.mkdir(parents=True, exist_ok=True)
    data = corpus(folder / "corpus.txt")
    hogs = [hog() for _ in range(args.hogs)]
    try:
        print(f"{len(max_steps)} peers, --max-steps {','.join(map(str, max_steps))}, schedule {args.steps} steps, "
              f"H={args.inner_steps}, {args.hogs} hogs, logs in {folder}")
        print("| run | last round | each peer's last averaged round (others, weights) |\n| --- | --- | --- |")
        passed = sum(one_run(args, folder / f"run{k}", data, max_steps) for k in range(1, args.runs + 1))
    finally:
        for process in hogs:
            os.killpg(process.pid, signal.SIGKILL)
    print(f"last round with every peer: {passed} of {args.runs} runs")


if __name__ == "__main__":
    main()
