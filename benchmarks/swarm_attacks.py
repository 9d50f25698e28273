"""A poisoned swarm: val loss of the honest peers under each attack, against clean runs of the same length.

    nice -n 10 python benchmarks/swarm_attacks.py [--data stdlib] [--steps 600] [--rows clean:4,sign_flip:3+1,...]
        [--out DIR]
    flock /tmp/tscale-bench.lock python benchmarks/swarm_attacks.py --aggregation-timing

Every peer is a real `tscale-peer join` process on 127.0.0.1 (hivemind DHT, p2pd, SwarmAverager), all started
together against a stock `hivemind-dht` bootstrap node with the same flags; an attacker is the same `join`
with its averager altered by tests/attacks.py (the attacks live with the tests, not in the product):

- sign_flip          sends -10x its update
- heavy_sign_flip    the same, claiming 10^12 tokens
- short_sign_flip    sends -2x its update: too short for the far test
- patient_sign_flip  sends its honest update for 3 rounds (it becomes a pair partner), then -2x it
- scaled             sends 90x its update, just under the contribution norm bound (100x)
- lying_reducer      as a reducer, answers -50x the true average of its span, to everyone
- two_faced_reducer  as a reducer, the truth to one groupmate and 50x it to the others, each signed
- two_faced_unsigned the same, with the true average's signature on every answer (no evidence of the lies)
- alie               "A Little Is Enough": mean - 1 std of the honest updates it knows (its own last two)
- alie_pair          two colluders sending mean - 1 std of their own two honest updates, the same vector
- stall              honest, but its averager hangs 15 s as its 5th all-reduce begins (a laptop lid closed): not
                     an attack to ban (network trouble never is), the row shows what one stalled round costs

A row is `ATTACK:HONEST+ATTACKERS`, e.g. `sign_flip:3+1`; `clean:4` is four honest peers, `mean:4` four honest
peers reducing with hivemind's weighted mean (the cost of the robust rule), `clean:3` the honest peers alone.
Reported per row: val loss of the honest peers' global weights (the mean over them, and the worst), its gap to
the clean run of as many peers in all, whether any weight or loss was non-finite, which honest peers banned the
attackers (from their logs), and the mean time of an averaging round (from the peers' logs).
`--aggregation-timing` instead times one reducer's work on one part: the robust rule against the weighted mean.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import torch

from swarm_convergence import PEER_ENV, _global_weights, _wait_for, val_loss

ATTACKS_SCRIPT = Path(__file__).resolve().parent.parent / "tests" / "attacks.py"
DEFAULT_ROWS = ("clean:4,mean:4,clean:3,sign_flip:3+1,heavy_sign_flip:3+1,scaled:3+1,lying_reducer:3+1,"
                "two_faced_reducer:3+1,two_faced_unsigned:3+1,alie:3+1,alie_pair:3+2,alie:2+1,sign_flip:2+1,heavy_sign_flip:2+1,"
                "scaled:2+1,lying_reducer:2+1,two_faced_reducer:2+1,two_faced_unsigned:2+1,stall:3+1")


def parse_row(row: str) -> tuple[str, int, int]:
    attack, _, peers = row.partition(":")
    honest, _, attackers = peers.partition("+")
    return attack, int(honest), int(attackers or 0)


def run_swarm(args, attack: str, honest: int, attackers: int, work: Path) -> dict:
    """One swarm run; returns the honest peers' val losses, finiteness, bans and round times."""
    work.mkdir(parents=True, exist_ok=True)
    bootstrap_log = work / "bootstrap.log"
    bootstrap = subprocess.Popen([sys.executable, "-m", "hivemind.hivemind_cli.run_dht", "--host_maddrs",
                                  "/ip4/127.0.0.1/tcp/0"], stdout=open(bootstrap_log, "wb"), stderr=subprocess.STDOUT,
                                 start_new_session=True)
    peers = honest + attackers
    flags = [
        "--data", args.data, "--tokenizer", "byte", "--device", "cpu", "--no-compile", "--batch-size", str(args.batch_size),
        "--max-steps", str(args.steps), "--steps", str(args.steps), "--host-maddrs", "/ip4/127.0.0.1/tcp/0",
        "--matchmaking-time", str(args.matchmaking_time), "--averaging-timeout", "30", "--eval-every", "0",
        "--save-every", "0", "--log-every", "50", "--run-id", "attacked", "--model", args.model,
        "--lr", str(args.lr), "--warmup", str(args.warmup), "--inner-steps", str(args.inner_steps),
        "--eval-batches", str(args.eval_batches), "--min-peers", str(peers), "--no-tui",
    ]
    logs = [work / f"peer{i}.log" for i in range(peers)]
    processes = []
    try:
        address = _wait_for(bootstrap_log, r"(/ip4/127\.0\.0\.1/tcp/\d+/p2p/\w+)", bootstrap)
        for i in range(peers):
            is_attacker = i >= honest
            env = dict(PEER_ENV, **({"HIVEMIND_LOGLEVEL": "DEBUG"} if args.verbose else {}))
            if is_attacker or attack == "mean":
                env.update(TSCALE_ATTACK="plain_mean" if attack == "mean" else attack,
                           TSCALE_ATTACK_DIR=str(work / "colluders"))
                (work / "colluders").mkdir(exist_ok=True)
                program = [sys.executable, str(ATTACKS_SCRIPT)]
            else:
                program = [sys.executable, "-m", "tscale_p2p.cli"]
            verbose = ["-v"] if args.verbose else []
            command = [*program, *verbose, "join", "--out", str(work / f"peer{i}"), "--name", f"peer{i}",
                       "--initial-peers", address, *flags]
            processes.append(subprocess.Popen(command, stdout=open(logs[i], "wb"), stderr=subprocess.STDOUT, env=env,
                                              start_new_session=True))
        for process in processes[:honest]:
            if process.wait(timeout=args.timeout) != 0:
                raise SystemExit(f"an honest peer failed; logs in {work}")
    finally:
        for process in processes:
            try:
                os.killpg(process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            process.wait()
        os.killpg(bootstrap.pid, signal.SIGKILL)
        bootstrap.wait()
    texts = [log.read_text(errors="replace") for log in logs]
    attacker_ids = {_peer_id(text) for text in texts[honest:]}
    weights = [_global_weights(work / f"peer{i}", args) for i in range(honest)]
    finite = all(bool(torch.isfinite(t).all()) for w in weights for t in w.values())
    losses = [val_loss(args, w) for w in weights]
    finite = finite and all(math.isfinite(v) for v in losses)
    banned_by = [sum(f"banning {peer} for the rest of the run" in text for peer in attacker_ids) for text in texts[:honest]]
    round_seconds = [float(s) for text in texts[:honest] for s in re.findall(r"round \d+: averaged with \d+ .*? in ([\d.]+) s", text)]
    wrongly_banned = sum(len(re.findall(r"banning \w+ for the rest", text)) - banned
                         for text, banned in zip(texts[:honest], banned_by))
    return dict(losses=losses, finite=finite, banned_by=banned_by, wrongly_banned=wrongly_banned,
                round_s=sum(round_seconds) / len(round_seconds) if round_seconds else float("nan"),
                rounds=len(round_seconds) / max(honest, 1))


def _peer_id(log: str) -> str:
    found = re.search(r"peer id (\w+)", log)
    return found.group(1) if found else "?"


def aggregation_timing(part_values: int = 2**20, repeats: int = 5) -> None:
    """ms per part of 2^20 values (a real part is ~1M values: hivemind's 128 KiB parts of 1-bit data)."""
    from tscale_p2p.peers.robust import robust_aggregate

    print("| contributions | weighted mean ms | robust rule ms | ratio |")
    print("| --- | --- | --- | --- |")
    for senders in (2, 4, 8, 16):
        generator = torch.Generator().manual_seed(senders)
        common = torch.randn(part_values, generator=generator)
        parts = torch.stack([common + torch.randn(part_values, generator=generator) for _ in range(senders)])
        tokens = torch.full((senders,), 1000.0)
        timings = []
        for rule in (lambda: (tokens.float() @ parts) / tokens.sum(), lambda: robust_aggregate(parts, tokens)):
            rule()
            began = time.perf_counter()
            for _ in range(repeats):
                rule()
            timings.append(1000 * (time.perf_counter() - began) / repeats)
        print(f"| {senders} | {timings[0]:.1f} | {timings[1]:.1f} | {timings[1] / timings[0]:.0f}x |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", default="stdlib")
    parser.add_argument("--model", default="e64h4d2w128")
    parser.add_argument("--steps", type=int, default=600, help="local steps per peer")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--inner-steps", type=int, default=50)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--warmup", type=int, default=30)
    parser.add_argument("--matchmaking-time", type=float, default=2.0)
    parser.add_argument("--eval-batches", type=int, default=40)
    parser.add_argument("--timeout", type=float, default=900)
    parser.add_argument("--rows", default=DEFAULT_ROWS, help="comma-separated ATTACK:HONEST+ATTACKERS")
    parser.add_argument("--repeats", type=int, default=1,
                        help="runs of each row (the table gives their mean): single runs differ by a few percent")
    parser.add_argument("--out", help="folder for the peer logs and results.json (default: a temporary one)")
    parser.add_argument("--verbose", action="store_true", help="peers log at debug level (hivemind's too)")
    parser.add_argument("--aggregation-timing", action="store_true", help="time the rule on one part, then exit")
    args = parser.parse_args()
    if args.aggregation_timing:
        aggregation_timing()
        return
    from tscale_p2p.peers.settings import DEFAULT_OUTER_LR, DEFAULT_OUTER_MOMENTUM

    # What swarm_convergence's helpers read (its val_loss builds the trainer join builds from these flags).
    model_args = SimpleNamespace(data=args.data, model=args.model, device="cpu", from_step=0, steps=args.steps,
                                 batch_size=args.batch_size, lr=args.lr, warmup=args.warmup,
                                 eval_batches=args.eval_batches, seed=0, inner_steps=args.inner_steps,
                                 outer_lr=DEFAULT_OUTER_LR, outer_momentum=DEFAULT_OUTER_MOMENTUM, start_state=None)
    vars(args).update({k: v for k, v in vars(model_args).items() if k not in vars(args)})
    out = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="swarm-attacks-"))
    if out.is_dir() and any(out.iterdir()):  # a peer finds its checkpoint there and resumes instead of starting
        parser.error(f"--out {out} is not empty: give a new folder")
    rows = args.rows.split(",")
    if len(set(rows)) != len(rows):  # a row's peers would resume from the checkpoints of its earlier run
        parser.error(f"--rows {args.rows} names a row twice: use --repeats")
    results: dict[str, list[dict]] = {}
    started = time.monotonic()
    for repeat in range(args.repeats):  # whole passes, so that a slow spell of the machine hits every row alike
        for row in rows:
            attack, honest, attackers = parse_row(row)
            began = time.monotonic()
            folder = out / f"{row.replace(':', '-').replace('+', '_')}{f'-{repeat}' if args.repeats > 1 else ''}"
            result = run_swarm(args, attack, honest, attackers, folder)
            results.setdefault(row, []).append(result)
            print(f"{row}: val {mean_loss(result):.4f} {result} ({time.monotonic() - began:.0f} s)", file=sys.stderr,
                  flush=True)
            (out / "results.json").write_text(json.dumps(results, indent=2))
    print(f"\n{args.model}, {args.steps} local steps per peer, H={args.inner_steps}, batch {args.batch_size}, "
          f"data {args.data}; {time.monotonic() - started:.0f} s in all; logs in {out}\n")
    print("| row | honest val loss (mean / worst) | each run | vs clean | finite | attackers banned by | wrong bans | "
          "round s | rounds |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for row, runs in results.items():
        attack, honest, attackers = parse_row(row)
        mean = statistics.mean(mean_loss(run) for run in runs)
        clean = results.get(f"clean:{honest + attackers}")
        gap = f"{100 * (mean / statistics.mean(mean_loss(run) for run in clean) - 1):+.2f}%" if clean else "-"
        banned = "-" if not attackers else " ".join(
            f"{sum(b == attackers for b in run['banned_by'])}/{honest}" for run in runs)
        print(f"| {row} | {mean:.4f} / {max(max(run['losses']) for run in runs):.4f} | "
              f"{', '.join(f'{mean_loss(run):.4f}' for run in runs)} | {gap} | "
              f"{'yes' if all(run['finite'] for run in runs) else 'NO'} | {banned} | "
              f"{sum(run['wrongly_banned'] for run in runs)} | {statistics.mean(run['round_s'] for run in runs):.2f} | "
              f"{statistics.mean(run['rounds'] for run in runs):.1f} |")


def mean_loss(run: dict) -> float:
    """The honest peers' mean val loss in one run."""
    return sum(run["losses"]) / len(run["losses"])


if __name__ == "__main__":
    main()
