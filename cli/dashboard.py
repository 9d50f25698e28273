"""`tscale-peer dashboard`: watch a swarm from any machine, without training.

`tscale_p2p.cli.build_parser()` calls `add_dashboard_parser`; the handler imports Textual and the network
stack only when it runs, so `tscale-peer --help` stays fast.
"""

from __future__ import annotations

import argparse

from tscale_p2p.errors import UserError
from tscale_p2p.cli.swarm import DEFAULT_RUN_ID


def add_dashboard_parser(commands) -> None:
    dashboard = commands.add_parser(
        "dashboard",
        help="watch a swarm in the terminal dashboard, without training",
        description="Connect to a swarm as a dial-out-only DHT peer and show its live peers, throughput, "
        "loss and log in the terminal dashboard. Keys: s sorts the peers, ? shows help, q quits.",
    )
    dashboard.add_argument(
        "--initial-peers", nargs="+", required=True, metavar="MADDR", help="multiaddrs of running peers"
    )
    dashboard.add_argument(
        "--run-id", default=DEFAULT_RUN_ID, metavar="NAME", help=f"the run to watch (default: {DEFAULT_RUN_ID})"
    )
    dashboard.set_defaults(handler=run_dashboard_command)


def run_dashboard_command(args: argparse.Namespace) -> int:
    from tscale_p2p.peers.network import parse_multiaddrs
    from tscale_p2p.peers.run_config import check_run_id
    from tscale_p2p.tui.app import run_dashboard
    from tscale_p2p.tui.source import SwarmWatchSource
    from tscale_p2p.tui.terminal import dashboard_can_run

    run_id = check_run_id(args.run_id)
    initial_peers = parse_multiaddrs(args.initial_peers, "--initial-peers", need_peer_id=True)
    if not dashboard_can_run():
        raise UserError("the dashboard needs a terminal on stdin and stdout; for plain output use 'tscale-peer peers'")
    run_dashboard(SwarmWatchSource(run_id, initial_peers))
    return 0
