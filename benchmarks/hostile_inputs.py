"""What hostile input costs: `tscale-peer peers --json` under a flood of fake peers, and the completion server under
a burst of clients. Real hivemind DHT nodes and a real HTTP server on 127.0.0.1.

    nice -n 10 flock /tmp/tscale-bench.lock python benchmarks/hostile_inputs.py [--fakes 0 2000] [--repeats 3]
        [--clients 50] [--backlogs 5 1024]

peers: one honest peer's DHT node holds its own record plus `--fakes` fake peers' records, each signed by a key of
its own (as an attacker with many keys would sign them, see tests/fake_peers.py), one of them with a NaN loss.
For each count: the wall time of the whole `peers --json` command (a fresh process: imports, DHT start, fetch,
print), the time of `SwarmMetrics.fetch()` alone in a running node, how many records it listed, and whether its
output was strict JSON.

serve: `--clients` clients connect at the same instant (a barrier) and each asks for 2 tokens from a tiny model;
for each listen backlog: how many got an answer, how many had their connection reset, and the time until the last
answer. socketserver's default backlog is 5.
"""

from __future__ import annotations

import argparse
import http.client
import json
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the fake peers live with the tests

import torch  # noqa: E402
from hivemind import DHT  # noqa: E402

from fake_peers import fake_record, fast_rsa_key, flood  # noqa: E402
from tscale_p2p.generate import GenerationEngine  # noqa: E402
from tscale_p2p.model import ModelConfig, Transformer  # noqa: E402
from tscale_p2p.peers.metrics import SwarmMetrics  # noqa: E402
from tscale_p2p.serve import CompletionServer  # noqa: E402

LOOPBACK = ["/ip4/127.0.0.1/tcp/0"]


def peers_row(fakes: int, repeats: int) -> dict:
    host = DHT(start=True, host_maddrs=LOOPBACK)
    maddrs = [str(m) for m in host.get_visible_maddrs()]
    run_id = f"flood{fakes}"
    honest = SwarmMetrics(host, run_id)
    started = time.perf_counter()
    keys = [fast_rsa_key() for _ in range(fakes)]
    wires = [fake_record(i + 1, loss=float("nan") if i == 0 else 2.5).to_wire() for i in range(fakes)]  # fresh now
    attacker = flood(maddrs, run_id, wires, keys) if fakes else None
    flood_s = time.perf_counter() - started
    reader = DHT(start=True, host_maddrs=LOOPBACK, initial_peers=maddrs, client_mode=True)
    try:
        metrics = SwarmMetrics(reader, run_id)
        fetch_s = []
        for _ in range(repeats):
            honest.publish(fake_record(0, peer_id=str(host.peer_id), name="honest"))  # as a live peer refreshes it
            started = time.perf_counter()
            metrics.fetch()
            fetch_s.append(time.perf_counter() - started)
        command_s, listed, strict = [], None, True
        for _ in range(repeats):
            honest.publish(fake_record(0, peer_id=str(host.peer_id), name="honest"))
            started = time.perf_counter()
            done = subprocess.run([sys.executable, "-m", "tscale_p2p.cli", "peers", "--json", "--run-id", run_id,
                                   "--initial-peers", *maddrs], capture_output=True, text=True, timeout=600)
            command_s.append(time.perf_counter() - started)
            if done.returncode != 0:
                raise SystemExit(f"peers --json failed ({done.returncode}): {done.stderr.strip()[-300:]}")
            try:
                listed = len(json.loads(done.stdout, parse_constant=_not_json))
            except ValueError:
                strict, listed = False, len(json.loads(done.stdout))
    finally:
        reader.shutdown()
        if attacker is not None:
            attacker.shutdown()
        host.shutdown()
    return {"fakes": fakes, "flood_s": flood_s, "command_s": statistics.median(command_s),
            "fetch_s": statistics.median(fetch_s), "listed": listed, "strict": strict}


def _not_json(constant: str):
    raise ValueError(f"{constant} is not JSON")


def serve_row(engine: GenerationEngine, clients: int, backlog: int) -> dict:
    server = CompletionServer(engine, "tiny", "127.0.0.1", 0)
    server.socket.listen(backlog)  # the backlog under test, on the listening socket itself
    server.start()
    ready = threading.Barrier(clients)
    outcomes: list = [None] * clients
    last_answer = [0.0]

    def client(i: int) -> None:
        ready.wait()
        try:
            connection = http.client.HTTPConnection(*server.server_address[:2], timeout=120)
            body = json.dumps({"prompt": f"client {i}", "max_tokens": 2, "temperature": 0})
            connection.request("POST", "/v1/completions", body=body, headers={"Content-Type": "application/json"})
            response = connection.getresponse()
            response.read()
            outcomes[i] = response.status
            last_answer[0] = max(last_answer[0], time.perf_counter())
            connection.close()
        except (ConnectionResetError, BrokenPipeError):
            outcomes[i] = "reset"
        except OSError as error:
            outcomes[i] = type(error).__name__

    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    started = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    server.close()
    answered = sum(outcome == 200 for outcome in outcomes)
    return {"backlog": backlog, "clients": clients, "answered": answered,
            "reset": sum(outcome == "reset" for outcome in outcomes),
            "other": clients - answered - sum(outcome == "reset" for outcome in outcomes),
            "all_answered_s": last_answer[0] - started if answered else float("nan")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fakes", type=int, nargs="+", default=[0, 2000])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--clients", type=int, default=50)
    parser.add_argument("--backlogs", type=int, nargs="+", default=[5, 1024])
    parser.add_argument("--skip", choices=("peers", "serve"), action="append", default=[])
    args = parser.parse_args()
    if "peers" not in args.skip:
        print("| fake peers | flood (s) | `peers --json` (s) | fetch() (s) | records listed | strict JSON |")
        print("| ---: | ---: | ---: | ---: | ---: | --- |")
        for fakes in args.fakes:
            row = peers_row(fakes, args.repeats)
            print(f"| {row['fakes']} | {row['flood_s']:.1f} | {row['command_s']:.2f} | {row['fetch_s']:.3f} | "
                  f"{row['listed']} | {'yes' if row['strict'] else 'no (NaN)'} |", flush=True)
    if "serve" not in args.skip:
        torch.manual_seed(0)
        model = Transformer(ModelConfig.from_dims("e64h4d4w128", short_window=8, first_window=4)).eval()
        engine = GenerationEngine(model, slots=4)
        print("\n| listen backlog | clients | answered | reset | other errors | last answer (s) |")
        print("| ---: | ---: | ---: | ---: | ---: | ---: |")
        for backlog in args.backlogs:
            row = serve_row(engine, args.clients, backlog)
            print(f"| {row['backlog']} | {row['clients']} | {row['answered']} | {row['reset']} | {row['other']} | "
                  f"{row['all_answered_s']:.2f} |", flush=True)


if __name__ == "__main__":
    main()
