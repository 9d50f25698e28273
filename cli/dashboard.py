"""`tscale-peer dashboard`: watch a swarm from any machine, without training.

`tscale_p2p.cli.build_parser()` calls `add_dashboard_parser`; the handler imports Textual and the network
stack only when it runs, so `tscale-peer --help` stays fast.
"""

from __future__ import annotations

import argparse

from tscale_p2p.cli.swarm import WATCH
from tscale_p2p.errors import UserError


def add_dashboard_parser(commands) -> None:
    dashboard = commands.add_parser(
        "dashboard",
        help="watch a swarm in the terminal dashboard, without training",
        description="Connect to a swarm as a dial-out-only DHT peer and show its live peers, throughput, "
        "loss and log in the terminal dashboard. Keys: s sorts the peers, ? shows help, q quits.",
    )
    WATCH.add_flags(dashboard)
    dashboard.set_defaults(handler=run_dashboard_command)


def run_dashboard_command(args: argparse.Namespace) -> int:
    from tscale_p2p.tui.app import run_dashboard
    from tscale_p2p.tui.source import SwarmWatchSource
    from tscale_p2p.tui.terminal import dashboard_can_run

    network = WATCH.load(args)["network"]
    initial_peers = network.need_initial_peers()
    if not dashboard_can_run():
        raise UserError("the dashboard needs a terminal on stdin and stdout; for plain output use 'tscale-peer peers'")
    run_dashboard(SwarmWatchSource(network.run_id, initial_peers))
    return 0
