"""The swarm subcommands of `tscale-peer`: `join` and `peers`.

`tscale_p2p.cli.build_parser()` calls `add_join_parser` and `add_peers_parser`; the handlers import the
network stack only when they run, so `tscale-peer --help` stays fast.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

from tscale_p2p.cli import train_config
from tscale_p2p.cli.network import LISTENING, NetworkSettings
from tscale_p2p.cli.options import Command, Loaded
from tscale_p2p.config import TRAIN_SECTIONS
from tscale_p2p.peers.settings import SwarmSettings


# join resumes whenever OUT has a checkpoint; the data-parallel settings belong to `train`
JOIN = Command((("network", NetworkSettings), ("swarm", SwarmSettings),
                *((name, cls) for name, cls in TRAIN_SECTIONS.items() if name != "sync")),
               skip=frozenset({"run.resume"}))
WATCH = Command((("network", NetworkSettings),), skip=LISTENING)  # peers and dashboard: dial out, read the swarm


def add_join_parser(commands) -> None:
    join = commands.add_parser(
        "join",
        help="train together with a peer-to-peer swarm",
        description="Join a training swarm (or start one: without --initial-peers this peer founds a new run and "
        "prints the line others use to join). Joiners adopt the run's model and schedule, so they need no "
        "model flags; Ctrl+C saves a checkpoint and leaves (a second Ctrl+C leaves at once).",
    )
    JOIN.add_flags(join)
    join.set_defaults(handler=run_join)


def add_peers_parser(commands) -> None:
    peers = commands.add_parser(
        "peers",
        help="list the live peers of a swarm run",
        description="Connect to a swarm (dial-out only) and print the metrics every live peer publishes.",
    )
    WATCH.add_flags(peers)
    peers.add_argument("--json", action="store_true", help="print JSON (a list of records) instead of a table")
    peers.set_defaults(handler=run_peers)


def run_join(args: argparse.Namespace) -> int:
    """Train in the swarm: behind the dashboard on a terminal, with plain log lines otherwise (or --no-tui)."""
    from tscale_p2p.peers.join import INTERRUPTED, join
    from tscale_p2p.peers.status import LocalStatus
    from tscale_p2p.tui.terminal import dashboard_can_run  # a light module: Textual is imported only to draw

    loaded = JOIN.load(args)
    cfg, explicit, options = join_settings(loaded)
    status = LocalStatus()
    if not loaded["swarm"].tui or not dashboard_can_run():
        try:
            return join(cfg, explicit, options, status)
        except KeyboardInterrupt:  # Ctrl+C before join() took over SIGINT (while starting up)
            print(INTERRUPTED, file=sys.stderr)
            return 130
    from tscale_p2p.tui.app import run_dashboard_while  # Textual loads only when the dashboard runs

    return run_dashboard_while(lambda: join(cfg, explicit, options, status), status)


def join_inputs(args: argparse.Namespace):
    """(TrainConfig, explicit settings, JoinOptions) for `peers.join.join` from parsed `join` flags (and the
    --config file they name); raises UserError for bad values. For running `join` in a thread of one's own."""
    return join_settings(JOIN.load(args))


def join_settings(loaded: Loaded):
    """`join_inputs` of `join`'s loaded settings."""
    from tscale_p2p.peers.join import JoinOptions
    from tscale_p2p.peers.network import NetworkOptions

    network = loaded["network"]
    # Settings the user chose (TOML file, then flags): these must agree with a run being joined.
    explicit = loaded.explicit(*(name for name, _ in JOIN.sections if name != "network"))
    cfg = train_config(loaded)
    if "out" not in explicit:
        cfg = replace(cfg, out=str(Path("runs") / network.run_id))
    options = JoinOptions(
        network=NetworkOptions(
            initial_peers=network.initial_peers,
            host_maddrs=network.listen_on,
            announce_maddrs=network.announce_maddrs,
            client_mode=network.client_mode,
            identity_path=network.identity_path or str(Path(cfg.out) / "identity.key"),
        ),
        run_id=network.run_id,
        swarm=loaded["swarm"],
    )
    return cfg, explicit, options


def run_peers(args: argparse.Namespace) -> int:
    from tscale_p2p.peers.metrics import SwarmMetrics
    from tscale_p2p.peers.network import NetworkOptions, start_dht

    settings = WATCH.load(args)["network"]
    run_id = settings.run_id
    network = NetworkOptions(
        initial_peers=settings.need_initial_peers(),
        host_maddrs=("/ip4/127.0.0.1/tcp/0",),  # dial-out only: nothing needs to reach us
        client_mode=True,
        retry_for_s=30.0,
    )
    dht = start_dht(network)
    try:
        records = SwarmMetrics(dht, run_id).fetch()
    finally:
        dht.shutdown()
    if args.json:
        # Records are checked finite on the way in; allow_nan=False keeps the output strict JSON regardless.
        print(json.dumps([record.to_wire() for record in records], indent=2, allow_nan=False))
    else:
        print_peer_table(run_id, records)
    return 0


PEER_COLUMNS = ("name", "peer id", "device", "precision", "tok/s", "loss", "round", "step", "tokens", "sent",
                "received", "last avg", "dropped", "banned", "version")


def print_peer_table(run_id: str, records, stdout=None) -> None:
    """The live peers as a table on a terminal; as tab-separated values (a header line, then one line per peer,
    full peer ids and plain numbers) when stdout is a pipe or a file, where a table would be cut to 80 columns."""
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    stdout = stdout or sys.stdout
    if not stdout.isatty():
        if not records:
            print(f"no live peers in run {run_id!r}", file=sys.stderr)
        print("\t".join(PEER_COLUMNS), file=stdout)
        for row in _peer_rows(records, for_terminal=False):
            print("\t".join(cell.replace("\t", " ") for cell in row), file=stdout)
        return
    console = Console(file=stdout)
    if not records:
        console.print(f"no live peers in run {run_id!r}")
        return
    table = Table(title=f"run {run_id}: {len(records)} live peer(s)")
    for column in PEER_COLUMNS:
        numeric = column in ("tok/s", "loss", "round", "step", "tokens", "dropped", "banned")
        table.add_column(column, justify="right" if numeric else "left")
    for row in _peer_rows(records, for_terminal=True):
        table.add_row(*map(Text, row))  # Text, not markup: a peer named "[bold]" is shown as it is
    console.print(table)


def _peer_rows(records, for_terminal: bool) -> list[tuple[str, ...]]:
    """PEER_COLUMNS of each record: short and readable for a terminal, complete and plain for scripts."""
    now = time.time()
    rows = []
    for r in records:
        if for_terminal:
            numbers = (f"{r.tokens_per_s:,.0f}", f"{r.tokens_contributed:,}", _size(r.bytes_sent), _size(r.bytes_received))
        else:
            numbers = (f"{r.tokens_per_s:.0f}", str(r.tokens_contributed), str(r.bytes_sent), str(r.bytes_received))
        tokens_per_s, tokens, sent, received = numbers
        if r.last_averaging is None:
            last = "never"
        else:
            last = f"{now - r.last_averaging:.0f} s ago" if for_terminal else f"{now - r.last_averaging:.0f}"
        rows.append((
            r.name + (" (relayed)" if r.relayed else ""),
            "…" + r.peer_id[-8:] if for_terminal else r.peer_id,
            r.device,
            r.precision + (" +offload" if r.offload else ""),
            tokens_per_s,
            "-" if r.loss is None else f"{r.loss:.4f}",
            str(r.round),
            str(r.step),
            tokens,
            sent,
            received,
            last,
            str(r.dropped_peers),
            str(r.banned_peers),
            r.version,
        ))
    return rows


def _size(n: int) -> str:
    value, unit = float(n), "B"
    for bigger in ("KiB", "MiB", "GiB"):
        if value < 1024:
            break
        value, unit = value / 1024, bigger
    return f"{value:.0f} B" if unit == "B" else f"{value:.1f} {unit}"
