"""`tscale-peer train --nproc-per-node N`: start the ranks of a data-parallel run through torch's own launcher.

This is `torchrun` (`torch.distributed.run`) called in-process with this command as its module: N ranks on this
host, or with `--nnodes` and `--rdzv-endpoint` one host of a multi-host run (torchrun's c10d rendezvous, which
the first host to start serves on the endpoint's port). The ranks get every other flag as given.

Each rank runs in a session of its own (torchrun's choice), so a Ctrl+C reaches only this launcher, which passes
it on to every rank once: they stop after the same step and rank 0 saves. A rank that fails makes torchrun stop
the others; this launcher then says which rank failed and how, in one line.
"""

from __future__ import annotations

import argparse
import ipaddress
import logging
import re
import signal
import sys

from tscale_p2p.errors import UserError

log = logging.getLogger(__name__)

DEFAULT_RDZV_PORT = 29400  # torchrun's
_HOSTNAME = re.compile(r"^(?=.{1,253}$)([A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?)(\.[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*$")


def add_launch_flags(parser: argparse.ArgumentParser) -> None:
    """The launcher's flags on `train` (kept out of TrainConfig: they choose processes, not training)."""
    group = parser.add_argument_group("data-parallel launch (or start `train` under torchrun)")
    group.add_argument("--nproc-per-node", type=int, metavar="N",
                       help="start N data-parallel ranks on this host through torch.distributed.run (torchrun)")
    group.add_argument("--nnodes", type=int, metavar="N",
                       help="hosts in the run, each started with the same command (default: 1; needs --rdzv-endpoint)")
    group.add_argument("--rdzv-endpoint", metavar="HOST:PORT",
                       help=f"multi-host rendezvous address, the same on every host (port default: {DEFAULT_RDZV_PORT})")


def launch_flags_given(args: argparse.Namespace) -> bool:
    return any(getattr(args, name, None) is not None for name in ("nproc_per_node", "nnodes", "rdzv_endpoint"))


def check_launch_flags(args: argparse.Namespace) -> int:
    """Validate the launcher's flags; returns the world size they describe."""
    if args.nproc_per_node is None:
        raise UserError("--nnodes and --rdzv-endpoint start ranks: add --nproc-per-node N (ranks on this host)")
    if args.nproc_per_node < 1:
        raise UserError(f"nproc-per-node must be at least 1, got {args.nproc_per_node}")
    nnodes = 1 if args.nnodes is None else args.nnodes
    if nnodes < 1:
        raise UserError(f"nnodes must be at least 1, got {nnodes}")
    if nnodes > 1 and args.rdzv_endpoint is None:
        raise UserError(f"--nnodes {nnodes} needs --rdzv-endpoint HOST:PORT, where the hosts meet")
    if args.rdzv_endpoint is not None:
        parse_endpoint(args.rdzv_endpoint)
    return nnodes * args.nproc_per_node


def parse_endpoint(endpoint: str) -> tuple[str, int]:
    """`HOST[:PORT]` (IPv6 in brackets) -> (host, port), or a UserError naming the bad value. No DNS lookup."""
    bad = f"rdzv-endpoint {endpoint!r} is not HOST:PORT (a host name or IP address, and a port 1-65535)"
    match = re.fullmatch(r"\[([0-9A-Fa-f:.]+)\](?::(\d+))?|([^:\[\]]+)(?::(\d+))?", endpoint)
    if match is None:
        raise UserError(bad)
    host = match.group(1) or match.group(3)
    port = int(match.group(2) or match.group(4) or DEFAULT_RDZV_PORT)
    if not 1 <= port <= 65535:
        raise UserError(bad)
    try:
        ipaddress.ip_address(host)
    except ValueError:
        if match.group(1) or not _HOSTNAME.match(host) or host.replace(".", "").isdigit():
            raise UserError(bad) from None
    return host, port


def rank_argv(argv: list[str]) -> list[str]:
    """The command line every rank gets: this one without the launcher's own flags."""
    launcher = argparse.ArgumentParser(add_help=False)
    add_launch_flags(launcher)
    _, rest = launcher.parse_known_args(argv)
    return rest


def launch(args: argparse.Namespace, argv: list[str]) -> int:
    """Start the ranks (flags already validated, training config checked); returns the exit code."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    nnodes = 1 if args.nnodes is None else args.nnodes
    torchrun = ["--nproc-per-node", str(args.nproc_per_node), "--nnodes", str(nnodes)]
    if args.rdzv_endpoint is None:
        torchrun.append("--standalone")  # a free local port for the rendezvous
    else:
        torchrun += ["--rdzv-backend", "c10d", "--rdzv-endpoint", args.rdzv_endpoint, "--rdzv-id", "tscale-peer"]
    torchrun += ["--monitor-interval", "0.5", "--module", "tscale_p2p.cli", *rank_argv(argv)]
    if not args.verbose:  # torchrun's agent logs every start and stop as warnings; the ranks say what matters
        for name in ("torch.distributed.elastic", "torch.distributed.run"):
            logging.getLogger(name).setLevel(logging.ERROR)
    try:
        run(get_args_parser().parse_args(torchrun))
    except ChildFailedError as failure:
        return report_failure(failure)
    except SignalException as stop:
        # torchrun passed the signal on to every rank and waited for them: they have saved and stopped.
        log.info("stopped on %s", signal.Signals(stop.sigval).name)
    return 0


def report_failure(failure) -> int:
    """One line for the first rank that failed; exit 2 when a rank refused its input (it said why), else 1."""
    rank, first = min(failure.failures.items(), key=lambda item: item[1].timestamp)
    if first.exitcode < 0:
        how = f"was killed by {signal.Signals(-first.exitcode).name}"
    else:
        how = f"exited with code {first.exitcode}"
    print(f"tscale-peer: error: rank {rank} (pid {first.pid}) {how}; the other ranks were stopped", file=sys.stderr)
    return 2 if any(f.exitcode == 2 for f in failure.failures.values()) else 1
