"""Synchronous data-parallel training: step time, bytes on the wire and val loss of each --sync-compression.

    python benchmarks/sync.py --data PATH/tinyshakespeare.txt [--ranks 2,4] [--rates 1gbit,100mbit]
        [--compressions none,bf16,powersgd,onebit] [--timing-steps 10] [--loss-steps 300]     (root, Linux, CPU)
    python benchmarks/sync.py --device cuda --ranks 2 --rates none --data ...                  (GPUs of one host)

Part 1, speed. On the CPU, for each world size and rate: one network namespace per rank plus a hub namespace
holding a bridge, joined by veth pairs, each link limited to the rate both ways with `tc tbf` (rate only: the
kernel here has no sch_netem, and a synchronous step is bound by bandwidth). The ranks are started as torchrun
starts them on separate hosts (`RANK`, `WORLD_SIZE`, `MASTER_ADDR` of rank 0's namespace; gloo bound to the
rank's veth), train `--timing-steps` steps after the warm-up, and rank 0 logs every step. Reported: the median
step time over the steps after the warm-up (from rank 0's per-step tokens/s), and what each rank's interface sent
per step over those steps (kernel byte counters: payload, gloo framing and TCP/IP headers), also as bits per
gradient value each way (an fp32 ring all-reduce reads 32 plus headers), and for onebit the hook's own count of
the signs and scales it sends. With `--rates none` (and always with `--device cuda`) the ranks run on this host
through `train --nproc-per-node`, unshaped; bytes are then the loopback counters divided by the ranks.

Part 2, quality: each compression trains `--loss-steps` steps with `--loss-ranks` ranks, unshaped (the loss at
equal steps does not depend on the link), then rank 0 evaluates; reported with the difference to `none`.

Nothing leaves the machine: the namespaces use 10.78.0.0/24 only, and are removed at the end.
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from swarm_netem import build_star, sh  # the same namespace star, shaped here with tbf alone

PREFIX = "tsync"
SUBNET = "10.78.0"
MASTER_PORT = 29517
STEP_LINE = re.compile(r"INFO step (\d+)/\d+  loss \S+  lr \S+  (\d+) tok/s")
VAL_LINE = re.compile(r"val loss (\d+\.\d+)")
HOOK_LINE = re.compile(r"onebit: (\d+\.\d+) bits/value each way")


def build_network(ranks: int, rate: str) -> None:
    build_star(PREFIX, SUBNET, ranks, "tsr", "tsb")
    for i in range(ranks):
        for where, device in ((f"{PREFIX}-{i}", f"tsr{i}"), (f"{PREFIX}-hub", f"tsb{i}")):
            sh("tc", "-n", where, "qdisc", "add", "dev", device, "root", "tbf", "rate", rate, "burst", "256kb",
               "latency", "200ms")


def tear_down(ranks: int) -> None:
    for name in [f"{PREFIX}-{i}" for i in range(ranks)] + [f"{PREFIX}-hub"]:
        subprocess.run(["ip", "netns", "del", name], capture_output=True)


def sent_bytes(rank: int | None) -> int:
    """Bytes sent so far by rank's veth, or (rank None) by this host's loopback."""
    if rank is None:
        return int(Path("/sys/class/net/lo/statistics/tx_bytes").read_text())
    return int(sh("ip", "netns", "exec", f"{PREFIX}-{rank}", "cat", f"/sys/class/net/tsr{rank}/statistics/tx_bytes"))


def train_flags(args, compression: str, steps: int, warmup: int, out: Path, evaluate: bool) -> list[str]:
    return ["train", "--data", args.data, "--tokenizer", "byte", "--model", args.model, "--batch-size", str(args.batch_size),
            "--context", str(args.context), "--device", args.device, "--precision", args.precision,
            "--steps", str(steps), "--log-every", "1" if not evaluate else "25", "--eval-every", "0",
            "--eval-batches", str(args.eval_batches if evaluate else 1), "--save-every", "0", "--out", str(out),
            "--sync-compression", compression, "--sync-warmup-steps", str(warmup), "--sync-timeout", "900",
            "--lr", str(args.lr), "--warmup", str(args.lr_warmup), *args.train_args.split()]


def start_ranks(args, ranks: int, shaped: bool, flags: list[str], log: Path) -> list[subprocess.Popen]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": str(args.threads)}
    command = [sys.executable, "-m", "tscale_p2p.cli"]
    if not shaped:
        with open(log, "wb") as sink:
            return [subprocess.Popen([*command, *flags, "--nproc-per-node", str(ranks)], env=env, stderr=sink,
                                     stdout=subprocess.DEVNULL)]
    processes = []
    for i in range(ranks):
        rank_env = {**env, "RANK": str(i), "WORLD_SIZE": str(ranks), "LOCAL_RANK": "0", "MASTER_ADDR": f"{SUBNET}.1",
                    "MASTER_PORT": str(MASTER_PORT), "GLOO_SOCKET_IFNAME": f"tsr{i}"}
        sink = open(log if i == 0 else log.with_suffix(f".rank{i}.log"), "wb")
        processes.append(subprocess.Popen(["ip", "netns", "exec", f"{PREFIX}-{i}", *command, *flags], env=rank_env,
                                          stderr=sink, stdout=subprocess.DEVNULL))
        sink.close()
    return processes


def wait_all(processes: list[subprocess.Popen], log: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    for p in processes:
        try:
            code = p.wait(max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for q in processes:
                q.kill()
            raise SystemExit(f"ranks still running after {timeout:.0f} s; see {log}")
        if code != 0:
            for q in processes:
                q.kill()
            raise SystemExit(f"a rank exited with {code}:\n{log.read_text()[-3000:]}")


def time_one(args, ranks: int, rate: str, compression: str, work: Path, gradient_values: int) -> dict:
    """One speed measurement: median step time and bytes sent per step per rank after the warm-up."""
    shaped = rate != "none"
    warmup = 2
    steps = warmup + 1 + args.timing_steps  # the step after the warm-up (first compressed one) is not timed
    log = work / f"time-{ranks}-{rate}-{compression}.log"
    flags = train_flags(args, compression, steps, warmup, work / f"out-{ranks}-{rate}-{compression}", evaluate=False)
    processes = start_ranks(args, ranks, shaped, flags, log)
    seen, marks, step_times = 0, {}, []
    tokens_per_step = ranks * args.batch_size * args.context
    deadline = time.monotonic() + args.timeout
    while seen < steps:
        if any(p.poll() not in (None, 0) for p in processes) or time.monotonic() > deadline:
            wait_all(processes, log, 1)
        for match in STEP_LINE.finditer(log.read_text(errors="replace")):
            step = int(match.group(1))
            if step <= seen:
                continue
            seen = step
            if step > warmup + 1:
                step_times.append(tokens_per_step / max(1, int(match.group(2))))
            if step in (warmup + 1, steps):  # the byte counters around the timed steps
                marks[step] = [sent_bytes(r if shaped else None) for r in range(ranks if shaped else 1)]
        time.sleep(0.02)
    wait_all(processes, log, args.timeout)
    timed = steps - (warmup + 1)
    per_rank = [(b - a) / timed for a, b in zip(marks[warmup + 1], marks[steps])]
    sent = statistics.mean(per_rank) if shaped else per_rank[0] / ranks
    hook = HOOK_LINE.search(log.read_text(errors="replace"))
    return {
        "step_s": statistics.median(step_times),
        "sent_mb": sent / 1e6,
        "wire_bits": 8 * sent / (2 * (ranks - 1) / ranks * gradient_values),
        "hook_bits": float(hook.group(1)) if hook else None,
    }


def loss_one(args, compression: str, work: Path) -> float:
    log = work / f"loss-{compression}.log"
    flags = train_flags(args, compression, args.loss_steps, args.sync_warmup_steps, work / f"loss-{compression}",
                        evaluate=True)
    processes = start_ranks(args, args.loss_ranks, False, flags, log)
    wait_all(processes, log, args.timeout * 10)
    return float(VAL_LINE.findall(log.read_text())[-1])


def gradient_values(model: str) -> int:
    import torch

    from tscale_p2p.model import ModelConfig, Transformer

    with torch.device("meta"):
        return sum(p.numel() for p in Transformer(ModelConfig.from_dims(model)).parameters())


def source_version() -> str:
    def git(*command: str) -> str:
        return subprocess.run(["git", *command], capture_output=True, text=True, cwd=Path(__file__).parent).stdout.strip()

    return git("rev-parse", "--short", "HEAD") + ("+dirty" if git("status", "--porcelain", "--untracked-files=no") else "")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", required=True)
    parser.add_argument("--model", default="e384h6d6w256")
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--precision", default="auto")
    parser.add_argument("--ranks", default="2,4", help="world sizes for the speed part")
    parser.add_argument("--rates", default="1gbit,100mbit", help="tc rates for the speed part; 'none': unshaped")
    parser.add_argument("--compressions", default="none,bf16,powersgd,onebit")
    parser.add_argument("--timing-steps", type=int, default=10, help="timed steps per setting, after the warm-up")
    parser.add_argument("--loss-steps", type=int, default=300, help="0 skips the quality part")
    parser.add_argument("--loss-ranks", type=int, default=2)
    parser.add_argument("--sync-warmup-steps", type=int, default=10, help="quality part: uncompressed steps first")
    parser.add_argument("--eval-batches", type=int, default=20)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--lr-warmup", type=int, default=30)
    parser.add_argument("--threads", type=int, default=1, help="OMP threads per rank")
    parser.add_argument("--train-args", default="", help="more `train` flags for every run, e.g. '--precision fp8'")
    parser.add_argument("--timeout", type=float, default=900, help="seconds per speed run")
    parser.add_argument("--work", help="keep logs in this new folder (default: a temporary one)")
    args = parser.parse_args()
    compressions = args.compressions.split(",")
    if args.device == "cpu" and "bf16" in compressions:  # torch's bf16 hook needs NCCL
        print("# bf16 left out: torch's bf16 hook runs on NCCL (GPUs) only")
        compressions.remove("bf16")
    rates = args.rates.split(",") if args.device == "cpu" else ["none"]
    if any(r != "none" for r in rates) and os.geteuid() != 0:
        raise SystemExit("shaped rates need root (network namespaces and tc); use --rates none otherwise")
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="tscale-sync-"))
    work.mkdir(parents=True, exist_ok=True)
    values = gradient_values(args.model)
    print(f"# sync.py  {args.model} ({values / 1e6:.2f}M gradient values), batch {args.batch_size} x {args.context} "
          f"per rank, {args.device}, commit {source_version()}, {platform.node()}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    if args.timing_steps > 0:
        print("\n| ranks | link | compression | step s | steps/s | vs none | sent MB/step/rank | wire bits/value each way | hook bits/value each way |")
        print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
        for ranks in [int(r) for r in args.ranks.split(",")]:
            for rate in rates:
                if rate != "none":
                    tear_down(ranks)
                    build_network(ranks, rate)
                try:
                    base = None
                    for compression in compressions:
                        row = time_one(args, ranks, rate, compression, work, values)
                        base = row["step_s"] if compression == "none" else base
                        ratio = f"{base / row['step_s']:.2f}x" if base else "-"
                        hook = f"{row['hook_bits']:.3f}" if row["hook_bits"] is not None else "-"
                        print(f"| {ranks} | {rate} | {compression} | {row['step_s']:.3f} | {1 / row['step_s']:.2f} | "
                              f"{ratio} | {row['sent_mb']:.2f} | {row['wire_bits']:.2f} | {hook} |", flush=True)
                finally:
                    if rate != "none":
                        tear_down(ranks)
    if args.loss_steps > 0:
        print(f"\n| compression | ranks | steps | val loss | vs none |")
        print("| --- | --- | --- | --- | --- |")
        base = None
        for compression in compressions:
            loss = loss_one(args, compression, work)
            base = loss if compression == "none" else base
            delta = f"{100 * (loss / base - 1):+.2f}%" if base else "-"
            print(f"| {compression} | {args.loss_ranks} | {args.loss_steps} | {loss:.4f} | {delta} |", flush=True)
    print(f"\nlogs: {work}")


if __name__ == "__main__":
    main()
