"""Round time and trainer busy fraction of a swarm on slow links: peers in network namespaces (root, Linux).

    sudo python benchmarks/swarm_netem.py --data PATH/tinyshakespeare.txt [--peers 4] [--rate 100mbit] [--rtt-ms 40]

Builds one network namespace per peer plus a hub namespace holding a bridge, joined by veth pairs; every
peer's link is shaped with `tc netem` to `--rate` both ways and half of `--rtt-ms` of delay on the peer's
egress (so any two peers see the full RTT between them). Then runs `--peers` real `tscale-peer join`
processes, one per namespace, for `--steps` local steps each, and reads from their logs:

- round time: wall seconds from starting a round's averaging to its result (matchmaking + all-reduce);
- busy fraction: the share of the swarm loop's wall time spent inside `Trainer.local_step()`.

Everything is torn down at the end (the namespaces, and with them the links). Nothing leaves the machine.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PREFIX = "tsnet"
SUBNET = "10.77.0"


def sh(*command: str) -> str:
    return subprocess.run(command, check=True, capture_output=True, text=True).stdout


def build_network(peers: int, rate: str, rtt_ms: float, rate_only: bool) -> str:
    """Namespaces, bridge and shaped links; returns how the links are shaped."""
    hub = f"{PREFIX}-hub"
    sh("ip", "netns", "add", hub)
    sh("ip", "-n", hub, "link", "add", "br0", "type", "bridge")
    sh("ip", "-n", hub, "link", "set", "br0", "up")
    for i in range(peers):
        ns = f"{PREFIX}-{i}"
        sh("ip", "netns", "add", ns)
        sh("ip", "-n", ns, "link", "set", "lo", "up")
        sh("ip", "link", "add", f"tsv{i}", "netns", ns, "type", "veth", "peer", "name", f"tsh{i}", "netns", hub)
        sh("ip", "-n", ns, "addr", "add", f"{SUBNET}.{i + 1}/24", "dev", f"tsv{i}")
        sh("ip", "-n", ns, "link", "set", f"tsv{i}", "up")
        sh("ip", "-n", hub, "link", "set", f"tsh{i}", "master", "br0", "up")
        if rate_only:  # kernels without sch_netem: token-bucket rate limits, no added delay
            for where, device in ((ns, f"tsv{i}"), (hub, f"tsh{i}")):
                sh("tc", "-n", where, "qdisc", "add", "dev", device, "root", "tbf",
                   "rate", rate, "burst", "64kb", "latency", "100ms")
            continue
        # Peer egress: half the RTT plus the rate limit; hub egress towards the peer: the rate limit.
        sh("tc", "-n", ns, "qdisc", "add", "dev", f"tsv{i}", "root", "netem",
           "delay", f"{rtt_ms / 2}ms", "rate", rate, "limit", "100000")
        sh("tc", "-n", hub, "qdisc", "add", "dev", f"tsh{i}", "root", "netem", "rate", rate, "limit", "100000")
    return f"tbf {rate} (no delay)" if rate_only else f"netem {rate}, {rtt_ms:.0f} ms RTT"


def tear_down(peers: int) -> None:
    for name in [f"{PREFIX}-{i}" for i in range(peers)] + [f"{PREFIX}-hub"]:
        subprocess.run(["ip", "netns", "del", name], capture_output=True)


ECHO_SERVER = """
import socket
server = socket.create_server(("{host}", 7777))
connection, _ = server.accept()
while data := connection.recv(64):
    connection.sendall(data)
"""
ECHO_CLIENT = """
import socket, statistics, time
for attempt in range(50):
    try:
        client = socket.create_connection(("{host}", 7777))
        break
    except OSError:
        time.sleep(0.1)
client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
times = []
for _ in range(10):
    start = time.perf_counter()
    client.sendall(b"x")
    client.recv(64)
    times.append(time.perf_counter() - start)
print(statistics.median(times) * 1000)
"""


def measured_rtt_ms() -> float:
    """Median TCP round trip between peer 0 and peer 1 (the machine has no ping)."""
    host = f"{SUBNET}.2"
    server = subprocess.Popen(["ip", "netns", "exec", f"{PREFIX}-1", sys.executable, "-c", ECHO_SERVER.format(host=host)])
    try:
        return float(sh("ip", "netns", "exec", f"{PREFIX}-0", sys.executable, "-c", ECHO_CLIENT.format(host=host)))
    finally:
        server.kill()


def run_swarm(args, work: Path) -> list[str]:
    common = [
        "--data", args.data, "--device", "cpu", "--batch-size", str(args.batch_size), "--max-steps", str(args.steps),
        "--matchmaking-time", str(args.matchmaking_time), "--averaging-timeout", "60", "--eval-every", "0",
        "--save-every", "0", "--log-every", "50", "--run-id", "netem", "--min-peers", str(args.peers),
    ]
    founder_flags = ["--model", args.model, "--inner-steps", str(args.inner_steps), "--steps", str(10 * args.steps)]
    logs = [work / f"peer{i}.log" for i in range(args.peers)]

    def start(i: int, *extra: str) -> subprocess.Popen:
        command = ["ip", "netns", "exec", f"{PREFIX}-{i}", sys.executable, "-m", "tscale_p2p.cli", "join",
                   "--out", str(work / f"peer{i}"), "--host-maddrs", f"/ip4/{SUBNET}.{i + 1}/tcp/0", *common, *extra]
        # Several peers share this machine's cores: one OpenMP thread each, or their spin-waits starve one another.
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        return subprocess.Popen(command, stdout=open(logs[i], "wb"), stderr=subprocess.STDOUT, env=env)

    processes = [start(0, *founder_flags)]
    try:
        deadline = time.monotonic() + 120
        while not (found := re.search(r"--initial-peers (\S+)", logs[0].read_text(errors="replace"))):
            if time.monotonic() > deadline or processes[0].poll() is not None:
                raise SystemExit(f"the founder did not start; see {logs[0]}")
            time.sleep(0.2)
        processes += [start(i, "--initial-peers", found.group(1)) for i in range(1, args.peers)]
        for process in processes:
            process.wait(timeout=args.timeout)
    finally:
        for process in processes:
            process.kill()
    return [log.read_text(errors="replace") for log in logs]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", required=True)
    parser.add_argument("--peers", type=int, default=4)
    parser.add_argument("--rate", default="100mbit")
    parser.add_argument("--rtt-ms", type=float, default=40.0)
    parser.add_argument("--model", default="e256h4d4w128")
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--inner-steps", type=int, default=50)
    parser.add_argument("--matchmaking-time", type=float, default=5.0)
    parser.add_argument("--timeout", type=float, default=1800)
    parser.add_argument("--rate-only", action="store_true",
                        help="shape with tbf (rate only, no delay) where the kernel has no sch_netem")
    args = parser.parse_args()

    tear_down(args.peers)  # leftovers of an interrupted run
    try:
        try:
            shaping = build_network(args.peers, args.rate, args.rtt_ms, args.rate_only)
        except subprocess.CalledProcessError as error:
            raise SystemExit(f"cannot build the network ({' '.join(error.cmd)}: {error.stderr.strip()}); "
                             "without sch_netem in the kernel, try --rate-only") from None
        rtt = measured_rtt_ms()
        with tempfile.TemporaryDirectory() as work:
            logs = run_swarm(args, Path(work))
    finally:
        tear_down(args.peers)

    print(f"{args.peers} peers, links: {shaping} (TCP round trip: {rtt:.2f} ms), model {args.model}, "
          f"batch {args.batch_size}, H={args.inner_steps}, {args.steps} steps per peer, matchmaking {args.matchmaking_time} s")
    print("| peer | rounds (with others / alone) | round time median (s) | max (s) | KiB sent/round | busy fraction |")
    print("| --- | --- | --- | --- | --- | --- |")
    for i, log in enumerate(logs):
        grouped = re.findall(r"averaged with (\d+) peer\(s\) in ([\d.]+) s, sent ([\d.]+) KiB", log)
        alone = len(re.findall(r"averaged with nobody", log))
        times = [float(t) for _, t, _ in grouped]
        sent = [float(k) for _, _, k in grouped]
        busy = re.search(r"trainer busy ([\d.]+)%", log)
        print(f"| {i} | {len(grouped)} / {alone} | {statistics.median(times) if times else float('nan'):.2f} | "
              f"{max(times, default=float('nan')):.2f} | {statistics.mean(sent) if sent else float('nan'):.0f} | "
              f"{busy.group(1) + '%' if busy else 'n/a'} |")


if __name__ == "__main__":
    main()
