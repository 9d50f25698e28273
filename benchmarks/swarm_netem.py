"""Round time and trainer busy fraction of a swarm on slow links: peers in network namespaces (root, Linux).

    sudo python benchmarks/swarm_netem.py --data PATH/tinyshakespeare.txt [--peers 4] [--rate 100mbit] [--rtt-ms 40]
        [--shaping netem|relay]

Builds one network namespace per peer plus a hub namespace holding a bridge, joined by veth pairs. Two ways
to shape the links:

- `netem` (default): every peer's link is shaped with `tc netem` to `--rate` both ways and half of
  `--rtt-ms` of delay on the peer's egress, so any two peers see the full RTT between them.
- `relay`, for kernels without `sch_netem` (only tbf/htb, no delaying qdisc): `tc tbf` limits every link to
  `--rate` both ways, and the delay comes from a TCP relay in each peer's namespace. The peer listens on
  127.0.0.1 of its namespace only and announces the relay's address (`--announce-maddrs`), so every
  connection to it crosses the relay, which holds each chunk half of `--rtt-ms` in each direction (a
  timestamped queue, so the link stays full: no stop-and-wait). Any two peers then see the full RTT at the
  application level. Unlike netem, TCP's own acknowledgements do not see the delay: each side's congestion
  window grows on the short hop to the relay, so slow start over a long path is not reproduced.

Then runs `--peers` real `tscale-peer join` processes, one per namespace, for `--steps` local steps each,
and reads from their logs:

- round time: wall seconds from starting a round's averaging to its result (matchmaking + all-reduce); with
  `--opening-rounds`, those rounds apart (the peers wait for each before the next step, so their time is the
  run's cost of them, with the swarm loop's wall time);
- busy fraction: the share of the swarm loop's wall time spent inside `Trainer.local_step()`, as the peer logs
  it (while training: the wait for the last round's average before leaving is logged apart);
- with `--breakdown`, where the rest goes: a `sitecustomize` module the script writes into its work folder
  (on the peers' PYTHONPATH; nothing in the package) wraps the swarm loop's pieces with timers and each peer
  prints the totals at exit: the wait for the last round when leaving (drain), the round-end work (outer
  step, weight snapshots, handing the pseudo-gradient to the averager) and the busy fraction without the drain.

Everything is torn down at the end (the namespaces, and with them the links and relays). Nothing leaves the
machine: the only addresses are loopback and the namespaces' own 10.77.0.0/24.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import re
import statistics
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PREFIX = "tsnet"
SUBNET = "10.77.0"
PEER_PORT = 31337  # relay shaping: each peer's p2pd on 127.0.0.1, its relay on the namespace's address
ECHO_PORT = 7777


def sh(*command: str) -> str:
    return subprocess.run(command, check=True, capture_output=True, text=True).stdout


def build_star(prefix: str, subnet: str, hosts: int, host_dev: str, hub_dev: str) -> None:
    """Namespaces PREFIX-0..N-1, each with a veth (HOST_DEVi, address SUBNET.i+1) to a bridge in PREFIX-hub
    (HUB_DEVi); links unshaped."""
    hub = f"{prefix}-hub"
    sh("ip", "netns", "add", hub)
    sh("ip", "-n", hub, "link", "add", "br0", "type", "bridge")
    sh("ip", "-n", hub, "link", "set", "br0", "up")
    for i in range(hosts):
        ns = f"{prefix}-{i}"
        sh("ip", "netns", "add", ns)
        sh("ip", "-n", ns, "link", "set", "lo", "up")
        sh("ip", "link", "add", f"{host_dev}{i}", "netns", ns, "type", "veth",
           "peer", "name", f"{hub_dev}{i}", "netns", hub)
        sh("ip", "-n", ns, "addr", "add", f"{subnet}.{i + 1}/24", "dev", f"{host_dev}{i}")
        sh("ip", "-n", ns, "link", "set", f"{host_dev}{i}", "up")
        sh("ip", "-n", hub, "link", "set", f"{hub_dev}{i}", "master", "br0", "up")


def build_network(peers: int, rate: str, rtt_ms: float, shaping: str) -> str:
    """Namespaces, bridge and shaped links; returns how the links are shaped."""
    hub = f"{PREFIX}-hub"
    build_star(PREFIX, SUBNET, peers, "tsv", "tsh")
    for i in range(peers):
        ns = f"{PREFIX}-{i}"
        if shaping == "relay":  # the rate here, the delay in the relays (start_relays)
            for where, device in ((ns, f"tsv{i}"), (hub, f"tsh{i}")):
                sh("tc", "-n", where, "qdisc", "add", "dev", device, "root", "tbf",
                   "rate", rate, "burst", "64kb", "latency", "100ms")
            continue
        # Peer egress: half the RTT plus the rate limit; hub egress towards the peer: the rate limit.
        sh("tc", "-n", ns, "qdisc", "add", "dev", f"tsv{i}", "root", "netem",
           "delay", f"{rtt_ms / 2}ms", "rate", rate, "limit", "100000")
        sh("tc", "-n", hub, "qdisc", "add", "dev", f"tsh{i}", "root", "netem", "rate", rate, "limit", "100000")
    if shaping == "relay":
        return f"tbf {rate} + relays adding {rtt_ms / 2:g} ms each way ({rtt_ms:g} ms RTT)"
    return f"netem {rate}, {rtt_ms:g} ms RTT"


async def relay(listen_host: str, port: int, delay_s: float) -> None:
    """Forward connections on listen_host:port to 127.0.0.1:port, delaying every chunk by delay_s each way.

    Each direction is a queue of (due time, bytes): reading never waits for delivery, so a full link stays
    full and only latency is added. A half-close is passed on; an error on either side closes both."""
    loop = asyncio.get_running_loop()

    async def forward(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        queue: asyncio.Queue = asyncio.Queue()

        async def deliver() -> None:
            while (item := await queue.get()) is not None:
                due, data = item
                if (wait := due - loop.time()) > 0:
                    await asyncio.sleep(wait)
                writer.write(data)
                await writer.drain()
            if writer.can_write_eof():
                writer.write_eof()

        delivery = asyncio.create_task(deliver())
        try:
            while data := await reader.read(1 << 16):
                queue.put_nowait((loop.time() + delay_s, data))
        finally:
            queue.put_nowait(None)
            await delivery

    async def connection(client_reader, client_writer) -> None:
        try:
            server_reader, server_writer = await asyncio.open_connection("127.0.0.1", port)
        except OSError:
            client_writer.close()
            return
        for w in (client_writer, server_writer):  # small chunks go out at once, as they would on a wire
            w.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            await asyncio.gather(forward(client_reader, server_writer), forward(server_reader, client_writer))
        except (ConnectionError, OSError):
            pass
        finally:
            client_writer.close()
            server_writer.close()

    server = await asyncio.start_server(connection, listen_host, port)
    async with server:
        await server.serve_forever()


def start_relays(peers: int, rtt_ms: float, port: int) -> list[subprocess.Popen]:
    """One relay per peer namespace, on the namespace's address, in front of 127.0.0.1:port."""
    return [
        subprocess.Popen(["ip", "netns", "exec", f"{PREFIX}-{i}", sys.executable, __file__, "--relay",
                          f"{SUBNET}.{i + 1}", str(port), str(rtt_ms / 2)])
        for i in range(peers)
    ]


def tear_down(peers: int) -> None:
    for name in [f"{PREFIX}-{i}" for i in range(peers)] + [f"{PREFIX}-hub"]:
        subprocess.run(["ip", "netns", "del", name], capture_output=True)


ECHO_SERVER = """
import socket
server = socket.create_server(("{host}", {port}))
connection, _ = server.accept()
while data := connection.recv(64):
    connection.sendall(data)
"""
ECHO_CLIENT = """
import socket, statistics, time
for attempt in range(50):
    try:
        client = socket.create_connection(("{host}", {port}))
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


def measured_rtt_ms(shaping: str, rtt_ms: float) -> float:
    """Median application-level round trip between peer 0 and peer 1 over TCP (the machine has no ping),
    through a relay in relay shaping, as the peers' traffic goes."""
    host = f"{SUBNET}.2"
    helpers = []
    if shaping == "relay":
        helpers.append(subprocess.Popen(["ip", "netns", "exec", f"{PREFIX}-1", sys.executable, __file__, "--relay",
                                         host, str(ECHO_PORT), str(rtt_ms / 2)]))
    server_host = "127.0.0.1" if shaping == "relay" else host
    helpers.append(subprocess.Popen(["ip", "netns", "exec", f"{PREFIX}-1", sys.executable, "-c",
                                     ECHO_SERVER.format(host=server_host, port=ECHO_PORT)]))
    try:
        return float(sh("ip", "netns", "exec", f"{PREFIX}-0", sys.executable, "-c",
                        ECHO_CLIENT.format(host=host, port=ECHO_PORT)))
    finally:
        for helper in helpers:
            helper.kill()


BREAKDOWN_HOOK = """
import sys
_argv = open("/proc/self/cmdline", "rb").read().split(b"\\0")
if b"join" in _argv and b"tscale_p2p.cli" in _argv:  # only the peers, not the relays or helpers
    import atexit, functools, json, time
    from tscale_p2p.peers.swarm import SwarmPeer
    from tscale_p2p.trainer import Trainer
    totals = {}

    def timed(owner, name):
        original = getattr(owner, name)

        @functools.wraps(original)
        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                count, seconds = totals.get(name, (0, 0.0))
                totals[name] = (count + 1, seconds + time.perf_counter() - start)

        setattr(owner, name, wrapper)

    for owner, name in ((SwarmPeer, "run"), (SwarmPeer, "_end_round"), (SwarmPeer, "_drain"), (Trainer, "local_step")):
        timed(owner, name)
    atexit.register(lambda: print("SWARM_LOOP_TIMES " + json.dumps(totals), file=sys.stderr, flush=True))
"""


def breakdown_columns(log: str) -> str:
    """Drain, round-end work and busy fraction without the drain, from a --breakdown peer's exit line."""
    found = re.search(r"SWARM_LOOP_TIMES (.*)", log)
    if not found:
        return " n/a | n/a | n/a |"
    times = {name: seconds for name, (_, seconds) in json.loads(found.group(1)).items()}
    rounds = json.loads(found.group(1)).get("_end_round", (0, 0.0))[0]
    drain = times.get("_drain", 0.0)
    busy = times["local_step"] / (times["run"] - drain)
    per_round = 1000 * times.get("_end_round", 0.0) / max(rounds, 1)
    return f" {drain:.1f} | {per_round:.0f} | {100 * busy:.1f}% |"


def run_swarm(args, work: Path) -> list[str]:
    common = [
        "--data", args.data, "--tokenizer", "byte", "--device", "cpu", "--batch-size", str(args.batch_size), "--max-steps", str(args.steps),
        "--matchmaking-time", str(args.matchmaking_time), "--averaging-timeout", "60", "--eval-every", "0",
        "--save-every", "0", "--log-every", "50", "--run-id", "netem", "--min-peers", str(args.peers),
    ]
    founder_flags = ["--model", args.model, "--inner-steps", str(args.inner_steps), "--steps", str(10 * args.steps),
                     "--opening-rounds", str(args.opening_rounds),
                     "--opening-inner-steps", str(args.opening_inner_steps)]
    logs = [work / f"peer{i}.log" for i in range(args.peers)]
    hook = work / "breakdown"
    if args.breakdown:
        hook.mkdir()
        (hook / "sitecustomize.py").write_text(BREAKDOWN_HOOK)

    def start(i: int, *extra: str) -> subprocess.Popen:
        if args.shaping == "relay":  # reachable only through its relay
            where = ["--host-maddrs", f"/ip4/127.0.0.1/tcp/{PEER_PORT}",
                     "--announce-maddrs", f"/ip4/{SUBNET}.{i + 1}/tcp/{PEER_PORT}"]
        else:
            where = ["--host-maddrs", f"/ip4/{SUBNET}.{i + 1}/tcp/0"]
        command = ["ip", "netns", "exec", f"{PREFIX}-{i}", sys.executable, "-m", "tscale_p2p.cli", "join",
                   "--out", str(work / f"peer{i}"), *where, *common, *extra]
        # Several peers share this machine's cores: one OpenMP thread each, or their spin-waits starve one another.
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        if args.breakdown:
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(hook), os.environ.get("PYTHONPATH")]))
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


def source_version() -> str:
    """The commit the peers run, and whether the working tree differs from it (the code they really run)."""
    def git(*command: str) -> str:
        return subprocess.run(["git", *command], capture_output=True, text=True, cwd=Path(__file__).parent).stdout

    dirty = bool(git("status", "--porcelain", "--untracked-files=no").strip())
    return f"commit {git('rev-parse', '--short', 'HEAD').strip()}" + (" + uncommitted changes" if dirty else "")


def main() -> None:
    if sys.argv[1:2] == ["--relay"]:  # one relay, started by start_relays inside a peer's namespace
        host, port, delay_ms = sys.argv[2:5]
        asyncio.run(relay(host, int(port), float(delay_ms) / 1000))
        return
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", required=True)
    parser.add_argument("--peers", type=int, default=4)
    parser.add_argument("--rate", default="100mbit")
    parser.add_argument("--rtt-ms", type=float, default=40.0)
    parser.add_argument("--model", default="e256h4d4w128")
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--inner-steps", type=int, default=50)
    parser.add_argument("--opening-rounds", type=int, default=0,
                        help="the run's opening rounds (join's --opening-rounds): each waited for before the next step")
    parser.add_argument("--opening-inner-steps", type=int, default=10)
    parser.add_argument("--matchmaking-time", type=float, default=5.0)
    parser.add_argument("--timeout", type=float, default=1800)
    parser.add_argument("--shaping", choices=("netem", "relay"), default="netem",
                        help="netem: tc netem rate+delay; relay: tbf rate + delaying TCP relays (no sch_netem)")
    parser.add_argument("--breakdown", action="store_true",
                        help="time the swarm loop's pieces in each peer (drain, round-end work); see above")
    parser.add_argument("--work", help="keep the peers' logs and checkpoints in this new folder (default: a temporary one)")
    args = parser.parse_args()

    tear_down(args.peers)  # leftovers of an interrupted run
    relays: list[subprocess.Popen] = []
    load_before = os.getloadavg()
    started, commit = time.strftime("%Y-%m-%d %H:%M", time.gmtime()), source_version()
    try:
        try:
            shaping = build_network(args.peers, args.rate, args.rtt_ms, args.shaping)
        except subprocess.CalledProcessError as error:
            raise SystemExit(f"cannot build the network ({' '.join(error.cmd)}: {error.stderr.strip()}); "
                             "without sch_netem in the kernel, use --shaping relay") from None
        rtt = measured_rtt_ms(args.shaping, args.rtt_ms)
        if args.shaping == "relay":
            relays = start_relays(args.peers, args.rtt_ms, PEER_PORT)
        if args.work:
            Path(args.work).mkdir(parents=True)
            logs = run_swarm(args, Path(args.work))
        else:
            with tempfile.TemporaryDirectory() as work:
                logs = run_swarm(args, Path(work))
    finally:
        for process in relays:
            process.kill()
        tear_down(args.peers)
    load_after = os.getloadavg()

    print(f"{started} - {time.strftime('%H:%M UTC', time.gmtime())}, {commit}, {platform.node()}: "
          f"{len(os.sched_getaffinity(0))} CPUs; load average (1/5/15 min) before "
          f"{'/'.join(f'{x:.1f}' for x in load_before)}, after {'/'.join(f'{x:.1f}' for x in load_after)}")
    opening = f", {args.opening_rounds} opening rounds of {args.opening_inner_steps}" if args.opening_rounds else ""
    print(f"{args.peers} peers, links: {shaping} (measured TCP round trip: {rtt:.2f} ms), model {args.model}, "
          f"batch {args.batch_size}, H={args.inner_steps}{opening}, {args.steps} steps per peer, matchmaking "
          f"{args.matchmaking_time} s")
    extra = " drain at exit (s) | round-end work (ms/round) | busy without the drain |" if args.breakdown else ""
    print("| peer | rounds (with others / alone) | opening rounds: median / max (s) | round time median (s) | max (s) "
          "| KiB sent/round | swarm loop (s) | busy fraction |" + extra)
    print("| --- " * (8 + 3 * args.breakdown) + "|")
    for i, log in enumerate(logs):
        grouped = [(int(number), float(seconds), float(kib)) for number, seconds, kib in re.findall(
            r"round (\d+): averaged with \d+ peer\(s\)(?:, lost \d+ of them mid-round)? in ([\d.]+) s, "
            r"sent ([\d.]+) KiB", log)]
        alone = len(re.findall(r"averaged with nobody", log))
        opening_times = [t for number, t, _ in grouped if number <= args.opening_rounds]
        times = [t for number, t, _ in grouped if number > args.opening_rounds]
        sent = [k for _, _, k in grouped]
        busy = re.search(r"trainer busy ([\d.]+)% of (\d+) s", log)
        opening_cell = (f"{statistics.median(opening_times):.2f} / {max(opening_times):.2f}" if opening_times else "-")
        print(f"| {i} | {len(grouped)} / {alone} | {opening_cell} | "
              f"{statistics.median(times) if times else float('nan'):.2f} | {max(times, default=float('nan')):.2f} | "
              f"{statistics.mean(sent) if sent else float('nan'):.0f} | {busy.group(2) if busy else 'n/a'} | "
              f"{busy.group(1) + '%' if busy else 'n/a'} |" + (breakdown_columns(log) if args.breakdown else ""))


if __name__ == "__main__":
    main()
