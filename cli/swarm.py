"""The swarm subcommands of `tscale-peer`: `join` and `peers`.

`tscale_p2p.cli.build_parser()` calls `add_join_parser` and `add_peers_parser`; the handlers import the
network stack only when they run, so `tscale-peer --help` stays fast.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import fields, replace
from pathlib import Path

from tscale_p2p.cli import add_dataclass_flags, train_config_from_args
from tscale_p2p.config import SYNC_FIELDS, TrainConfig, read_toml_section
from tscale_p2p.errors import UserError

DEFAULT_RUN_ID = "tscale"


def add_join_parser(commands) -> None:
    join = commands.add_parser(
        "join",
        help="train together with a peer-to-peer swarm",
        description="Join a training swarm (or start one: without --initial-peers this peer founds a new run and "
        "prints the line others use to join). Joiners adopt the run's model and schedule, so they need no "
        "model flags; Ctrl+C saves a checkpoint and leaves (a second Ctrl+C leaves at once).",
    )
    swarm = join.add_argument_group("swarm")
    swarm.add_argument("--initial-peers", nargs="+", default=[], metavar="MADDR",
                       help="multiaddrs of running peers, e.g. /ip4/203.0.113.7/tcp/31337/p2p/12D3KooW...")
    swarm.add_argument("--run-id", default=DEFAULT_RUN_ID, metavar="NAME",
                       help=f"which run to join; DHT keys are namespaced by it (default: {DEFAULT_RUN_ID})")
    swarm.add_argument("--name", metavar="PUBLIC_NAME", help="the name other peers see (default: peer-<id suffix>)")
    swarm.add_argument("--identity-path", metavar="FILE",
                       help="private key file that keeps this peer's id across restarts (default: OUT/identity.key)")
    swarm.add_argument("--host-maddrs", nargs="+", default=[], metavar="MADDR",
                       help="where to listen (default: /ip4/0.0.0.0/tcp/PORT)")
    swarm.add_argument("--announce-maddrs", nargs="+", default=[], metavar="MADDR",
                       help="addresses to tell other peers, e.g. the public address in front of a port forward")
    swarm.add_argument("--port", type=int, metavar="PORT", help="TCP port to listen on, all interfaces (default: any)")
    swarm.add_argument("--client-mode", action="store_true",
                       help="behind NAT/firewall: only dial out (reached through relays); serves no state")
    swarm.add_argument("--inner-steps", type=int, metavar="H",
                       help="local steps between averaging rounds (a new run's setting; default 200)")
    swarm.add_argument("--outer-lr", type=float, metavar="LR", help="outer Nesterov SGD learning rate (new run; 1.0)")
    swarm.add_argument("--outer-momentum", type=float, metavar="M", help="outer Nesterov momentum (new run; 0.7)")
    swarm.add_argument("--max-steps", type=int, metavar="N", help="stop after N local steps (for scripts)")
    swarm.add_argument("--init-from", metavar="CHECKPOINT",
                       help="start from a checkpoint of another run (e.g. `tscale-peer train`'s step-* folder, or "
                       "its --out for the newest): its weights, optimizer state and step; a new run takes its "
                       "model. Ignored when --out already holds this peer's own checkpoint")
    swarm.add_argument("--min-peers", type=int, default=1, metavar="N",
                       help="wait until N peers (this one included) are online before training (for scripts)")
    swarm.add_argument("--matchmaking-time", type=float, default=5.0, metavar="S",
                       help="seconds a round waits to gather peers (default: 5)")
    swarm.add_argument("--averaging-timeout", type=float, default=30.0, metavar="S",
                       help="a round that finds no group in S seconds is applied alone (default: 30; with no "
                       "other peer training, after two matchmaking windows)")
    swarm.add_argument("--error-feedback", nargs="?", const="full", default="damped", choices=("off", "damped", "full"),
                       help="what a 1-bit update could not carry: 'off' drops it, 'full' (the flag alone) adds it "
                       "to the next round's, 'damped' adds half of it (default: %(default)s)")
    swarm.add_argument("--threads", type=int, metavar="N",
                       help="CPU threads for this peer's tensor math (CPU training, offloaded optimizer, packing "
                       "updates). Default: $OMP_NUM_THREADS if set, else this machine's cores divided by the "
                       "join peers running on it (peers that each use every core starve one another)")
    swarm.add_argument("--no-tui", action="store_true", help="plain log lines instead of the dashboard")
    training = join.add_argument_group("training (a joiner adopts the run's model and schedule)")
    training.add_argument("--config", metavar="FILE.toml", help="read settings from a TOML file; flags override it")
    # join resumes whenever OUT has a checkpoint; the data-parallel settings belong to `train`
    add_dataclass_flags(training, TrainConfig, skip=("resume", *SYNC_FIELDS))
    join.set_defaults(handler=run_join)


def add_peers_parser(commands) -> None:
    peers = commands.add_parser(
        "peers",
        help="list the live peers of a swarm run",
        description="Connect to a swarm (dial-out only) and print the metrics every live peer publishes.",
    )
    peers.add_argument("--initial-peers", nargs="+", required=True, metavar="MADDR", help="multiaddrs of running peers")
    peers.add_argument("--run-id", default=DEFAULT_RUN_ID, metavar="NAME", help=f"the run (default: {DEFAULT_RUN_ID})")
    peers.add_argument("--json", action="store_true", help="print JSON (a list of records) instead of a table")
    peers.set_defaults(handler=run_peers)


def run_join(args: argparse.Namespace) -> int:
    """Train in the swarm: behind the dashboard on a terminal, with plain log lines otherwise (or --no-tui)."""
    from tscale_p2p.peers.join import INTERRUPTED, join
    from tscale_p2p.peers.status import LocalStatus
    from tscale_p2p.tui.terminal import dashboard_can_run  # a light module: Textual is imported only to draw

    cfg, explicit, options = join_inputs(args)
    status = LocalStatus()
    if args.no_tui or not dashboard_can_run():
        try:
            return join(cfg, explicit, options, status)
        except KeyboardInterrupt:  # Ctrl+C before join() took over SIGINT (while starting up)
            print(INTERRUPTED, file=sys.stderr)
            return 130
    from tscale_p2p.tui.app import run_dashboard_while  # Textual loads only when the dashboard runs

    return run_dashboard_while(lambda: join(cfg, explicit, options, status), status)


def join_inputs(args: argparse.Namespace):
    """(TrainConfig, explicit settings, JoinOptions) for `peers.join.join` from parsed `join` flags; raises
    UserError for bad values. The dashboard uses it too, to run `join` in a worker thread with its status."""
    from tscale_p2p.peers.join import JoinOptions
    from tscale_p2p.peers.metrics import check_public_name
    from tscale_p2p.peers.network import NetworkOptions, host_maddrs_for, parse_multiaddrs
    from tscale_p2p.peers.run_config import check_run_id

    run_id = check_run_id(args.run_id)
    explicit = explicit_settings(args)
    cfg = train_config_from_args(args)
    if "out" not in explicit:
        cfg = replace(cfg, out=str(Path("runs") / run_id))
    for name in ("inner_steps", "max_steps", "min_peers", "threads"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            raise UserError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    for name in ("matchmaking_time", "averaging_timeout"):
        if not getattr(args, name) > 0:
            raise UserError(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    network = NetworkOptions(
        initial_peers=parse_multiaddrs(args.initial_peers, "--initial-peers", need_peer_id=True),
        host_maddrs=host_maddrs_for(args.port, args.host_maddrs),
        announce_maddrs=parse_multiaddrs(args.announce_maddrs, "--announce-maddrs"),
        client_mode=args.client_mode,
        identity_path=args.identity_path or str(Path(cfg.out) / "identity.key"),
    )
    options = JoinOptions(
        network=network,
        run_id=run_id,
        name=check_public_name(args.name),
        inner_steps=args.inner_steps,
        outer_lr=args.outer_lr,
        outer_momentum=args.outer_momentum,
        max_steps=args.max_steps,
        min_peers=args.min_peers,
        threads=args.threads,
        matchmaking_time=args.matchmaking_time,
        averaging_timeout=args.averaging_timeout,
        error_feedback=args.error_feedback,
        init_from=args.init_from,
    )
    return cfg, explicit, options


def explicit_settings(args: argparse.Namespace) -> dict:
    """Settings the user chose (TOML file, then flags): these must agree with a run being joined."""
    explicit = read_toml_section(args.config, TrainConfig) if args.config else {}
    explicit.update({f.name: getattr(args, f.name) for f in fields(TrainConfig) if hasattr(args, f.name)})
    for name in ("inner_steps", "outer_lr", "outer_momentum"):
        if getattr(args, name) is not None:
            explicit[name] = getattr(args, name)
    return explicit


def run_peers(args: argparse.Namespace) -> int:
    from tscale_p2p.peers.metrics import SwarmMetrics
    from tscale_p2p.peers.network import NetworkOptions, parse_multiaddrs, start_dht
    from tscale_p2p.peers.run_config import check_run_id

    run_id = check_run_id(args.run_id)
    network = NetworkOptions(
        initial_peers=parse_multiaddrs(args.initial_peers, "--initial-peers", need_peer_id=True),
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
