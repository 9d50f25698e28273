"""How often a swarm's rounds gather every peer: real `tscale-peer join` processes on 127.0.0.1, CPU hogs beside.

    nice -n 10 python benchmarks/swarm_rounds.py [--peers 3] [--rounds 100] [--hogs 2] [--inner-steps 10]
        [--model e64h2d2w128] [--threads N] [--stagger S] [--eval-every N] [--matchmaking-time 5] [--keep DIR]

Starts `--peers` peers of one run (all at once, waiting for one another with `--min-peers`, or one every `--stagger`
seconds as newcomers join a running swarm), each with `--threads` torch threads (default: its share of the cores,
as `join` picks it), plus `--hogs` busy-looping processes (the load a volunteer's machine has besides the peer),
and lets them train until the founder's log shows `--rounds` rounds once all have joined. Then every peer is stopped (SIGTERM) and the logs are read:

- full: rounds in which this peer averaged with every other peer;
- partial: averaged with some of them;
- alone: averaged with nobody (no group found, or the round failed);
- lost: a groupmate was lost mid-round (its span of the average is missing);
- resync: the peer found its global weights differ from its group's and downloaded the state again;
- round s: the median time of its rounds with others (all-reduce and the span digests after it);
- b/trip: the mean wire bits a value of one trip (a part to its reducer, or an average back), scales included.

Rounds are counted per peer after the last joiner's first round, the last one (cut by the stop) left out. Prints
one row per peer and the total. `--report DIR` prints that table again from the logs a run left in DIR.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

MADDR = re.compile(r"/ip4/127\.0\.0\.1/tcp/\d+/p2p/\w+")
ROUND = re.compile(r"round (\d+): averaged with (?:nobody|(\d+) peer\(s\)(, lost)?)")
RESYNC = re.compile(r"round (\d+): our global weights .* differ from the group's")
TRIP = re.compile(r"round (\d+): averaged with \d+ peer\(s\)[^\n]* in ([\d.]+) s, sent [\d.]+ KiB \(([\d.]+) bits a value\)")


def corpus(path: Path, size: int = 1 << 20) -> Path:
    """A small text file: the first `size` bytes of the standard library's sources (sorted by path). The whole
    of them, `join`'s default data, takes a while to index on a loaded machine; a text of one repeated sentence
    is learnt to a loss of 0.05 within a few rounds, after which the peers' updates hardly differ, as no real
    swarm's do."""
    root = Path(sysconfig.get_paths()["stdlib"])
    with open(path, "wb") as sink:
        for source in sorted(root.glob("*.py")):
            sink.write(source.read_bytes()[: size - sink.tell()])
            if sink.tell() >= size:
                break
    return path


def hog() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "while True: pass"], start_new_session=True)


def launch_peer(folder: Path, i: int, flags: list[str], env: dict) -> subprocess.Popen:
    """`tscale-peer join FLAGS` as peer i in a session of its own (its run in folder/peer{i}, its log beside)."""
    with open(folder / f"peer{i}.log", "wb") as sink:
        return subprocess.Popen(
            [sys.executable, "-m", "tscale_p2p.cli", "join", "--out", str(folder / f"peer{i}"), "--name", f"peer{i}",
             *flags], stdout=sink, stderr=subprocess.STDOUT, env=env, start_new_session=True)


def founder_address(log: Path, founder: subprocess.Popen) -> str:
    """The founder's multiaddr, once its log shows it."""
    while not (found := MADDR.search(log.read_text(errors="replace"))):
        if founder.poll() is not None:
            sys.exit(f"the founder exited:\n{log.read_text(errors='replace')[-3000:]}")
        time.sleep(0.5)
    return found.group(0)


def stop_peers(peers: list[subprocess.Popen]) -> None:
    """SIGTERM to those still running (they save and leave), SIGKILL to any not gone 90 s later."""
    for process in peers:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGTERM)
    for process in peers:
        try:
            process.wait(90)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)


def round_table(log: str, peers: int, after: int = 0) -> dict[str, int]:
    """The counts of the module docstring for one peer's log, rounds after `after` only."""
    rounds = {}
    for match in ROUND.finditer(log):
        rounds[int(match.group(1))] = (int(match.group(2) or 0), bool(match.group(3)))
    if rounds:
        rounds.pop(max(rounds))  # the round the stop cut short
    rounds = {number: outcome for number, outcome in rounds.items() if number > after}
    counts = dict(rounds=len(rounds), full=0, partial=0, alone=0, lost=0)
    for others, lost in rounds.values():
        counts["full" if others == peers - 1 else "partial" if others else "alone"] += 1
        counts["lost"] += lost
    counts["resync"] = len({int(m.group(1)) for m in RESYNC.finditer(log)} & set(rounds))
    trips = [(float(m.group(2)), float(m.group(3))) for m in TRIP.finditer(log) if int(m.group(1)) in rounds]
    counts["round s"] = statistics.median(s for s, _ in trips) if trips else float("nan")
    counts["b/trip"] = statistics.fmean(b for _, b in trips) if trips else float("nan")
    return counts


def first_round_of_all(logs: list[Path]) -> int:
    """The first round of the last peer to join: rounds are counted after it (a joiner's first round is part of
    joining: the others may have averaged it without the newcomer, whose download may be a round old)."""
    firsts = []
    for log in logs:
        found = [int(m.group(1)) for m in ROUND.finditer(log.read_text(errors="replace"))] if log.exists() else []
        firsts.append(min(found, default=10**9))
    return max(firsts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--peers", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=100, help="stop once the founder has logged this many")
    parser.add_argument("--hogs", type=int, default=2, help="busy-looping processes beside the peers")
    parser.add_argument("--inner-steps", type=int, default=10)
    parser.add_argument("--model", default="e64h2d2w128")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--matchmaking-time", type=float, default=5.0)
    parser.add_argument("--eval-every", type=int, help="each peer's val-loss evaluation period (default: join's, 250 steps)")
    parser.add_argument("--threads", type=int, help="torch threads per peer (default: join's own, its share of the cores)")
    parser.add_argument("--stagger", type=float, default=0.0,
                        help="start the peers this many seconds apart, as newcomers join a running swarm (default: all at "
                             "once, waiting for one another with --min-peers)")
    parser.add_argument("--timeout", type=float, default=3600.0, help="give up after this many seconds")
    parser.add_argument("--keep", type=Path, help="write the peers' logs and runs here (default: a temporary folder)")
    parser.add_argument("--report", type=Path, metavar="DIR", help="only print the table of the run whose logs are in DIR")
    args = parser.parse_args()
    if args.report:
        logs = sorted(args.report.glob("peer*.log"))
        print(f"{len(logs)} peers, logs in {args.report}")
        print_table(logs, len(logs))
        return
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stop the peers and hogs on the way out

    folder = args.keep or Path(tempfile.mkdtemp(prefix="swarm-rounds-"))
    folder.mkdir(parents=True, exist_ok=True)
    data = corpus(folder / "corpus.txt")
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if args.threads:
        env["OMP_NUM_THREADS"] = str(args.threads)
    common = ["--data", str(data), "--tokenizer", "byte", "--run-id", "rounds", "--model", args.model, "--batch-size", str(args.batch_size),
              "--device", "cpu", "--inner-steps", str(args.inner_steps), "--matchmaking-time",
              str(args.matchmaking_time), "--save-every", "0", "--log-every", "50",
              "--steps", "10000000", "--no-tui", "--host-maddrs", "/ip4/127.0.0.1/tcp/0"]
    if args.eval_every is not None:
        common += ["--eval-every", str(args.eval_every)]
    hogs = [hog() for _ in range(args.hogs)]
    peers: list[subprocess.Popen] = []
    logs = [folder / f"peer{i}.log" for i in range(args.peers)]
    start = time.monotonic()
    try:
        together = [] if args.stagger else ["--min-peers", str(args.peers)]  # staggered: the founder trains alone first
        peers.append(launch_peer(folder, 0, [*common, *together], env))
        founder = founder_address(logs[0], peers[0])
        for i in range(1, args.peers):
            time.sleep(args.stagger)
            peers.append(launch_peer(folder, i, [*common, "--initial-peers", founder, *together], env))
        while time.monotonic() - start < args.timeout:
            found = {int(m.group(1)) for m in ROUND.finditer(logs[0].read_text(errors="replace"))}
            if len(found) > args.rounds + first_round_of_all(logs) or any(p.poll() is not None for p in peers):
                break
            print(f"\r{time.monotonic() - start:6.0f} s  founder at round {max(found, default=0)}", end="",
                  file=sys.stderr, flush=True)
            time.sleep(5)
        print(file=sys.stderr)
    finally:
        stop_peers(peers)
        for process in hogs:
            os.killpg(process.pid, signal.SIGKILL)
    elapsed = time.monotonic() - start
    print(f"{args.peers} peers, {args.hogs} hogs, model {args.model}, H={args.inner_steps}, "
          f"threads {args.threads or 'default'}, eval every {args.eval_every or 'default'}, matchmaking {args.matchmaking_time:g} s, {elapsed:.0f} s, logs in {folder}")
    print_table(logs, args.peers)

def print_table(logs: list[Path], peers: int) -> None:
    columns = ("rounds", "full", "partial", "alone", "lost", "resync")
    after = first_round_of_all(logs)
    print(f"rounds after {after}, the last joiner's first:")
    print(f"| peer | {' | '.join(columns)} | full share | round s | b/trip |")
    print("|" + " --- |" * (len(columns) + 4))
    total = dict.fromkeys(columns, 0)
    medians, trips = [], []
    for i, log in enumerate(logs):
        counts = round_table(log.read_text(errors="replace"), peers, after)
        for key in columns:
            total[key] += counts[key]
        medians.append(counts["round s"])
        trips.append(counts["b/trip"])
        share = counts["full"] / counts["rounds"] if counts["rounds"] else 0.0
        print(f"| peer{i} | {' | '.join(str(counts[k]) for k in columns)} | {share:.0%} | {counts['round s']:.2f} | "
              f"{counts['b/trip']:.3f} |")
    share = total["full"] / total["rounds"] if total["rounds"] else 0.0
    print(f"| all | {' | '.join(str(total[k]) for k in columns)} | {share:.0%} | {statistics.median(medians):.2f} | "
          f"{max(trips):.3f} (max) |")
    tracebacks = sum(log.read_text(errors="replace").count("Traceback") for log in logs)
    print(f"tracebacks in the logs: {tracebacks}")


if __name__ == "__main__":
    main()
