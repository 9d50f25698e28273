"""`tscale-peer train --nproc-per-node N`: start the ranks of a data-parallel run through torch's own launcher.

This is `torchrun` (`torch.distributed.run`) called in-process with this command as its module: N ranks on this
host, or with `--nnodes` and `--rdzv-endpoint` one host of a multi-host run (torchrun's c10d rendezvous, which
the first host to start serves on the endpoint's port). The ranks get every other flag as given, and the same
--config file (whose [launch] table they leave out).

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

import pydantic
from pydantic.dataclasses import dataclass

from tscale_p2p.cli.options import add_section_flags
from tscale_p2p.errors import UserError
from tscale_p2p.settings import SECTION_CONFIG, option, section_fields

log = logging.getLogger(__name__)

DEFAULT_RDZV_PORT = 29400  # torchrun's
_HOSTNAME = re.compile(r"^(?=.{1,253}$)([A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?)(\.[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*$")


@dataclass(config=SECTION_CONFIG)
class LaunchSettings:
    """Data-parallel launch (or start `train` under torchrun).

    Kept out of TrainConfig: they choose processes, not training."""

    nproc_per_node: int | None = option(
        None, "start N data-parallel ranks on this host through torch.distributed.run (torchrun)", metavar="N", ge=1)
    nnodes: int | None = option(
        None, "hosts in the run, each started with the same command (default: 1; needs --rdzv-endpoint)",
        metavar="N", ge=1)
    rdzv_endpoint: str | None = option(
        None, f"multi-host rendezvous address, the same on every host (port default: {DEFAULT_RDZV_PORT})",
        metavar="HOST:PORT")

    @pydantic.field_validator("rdzv_endpoint")
    @classmethod
    def _endpoint(cls, value: str | None) -> str | None:
        if value is not None:
            parse_endpoint(value)
        return value

    def __post_init__(self) -> None:
        if self.nproc_per_node is None and (self.nnodes is not None or self.rdzv_endpoint is not None):
            raise UserError("--nnodes and --rdzv-endpoint start ranks: add --nproc-per-node N (ranks on this host)")
        if self.hosts > 1 and self.rdzv_endpoint is None:
            raise UserError(f"--nnodes {self.hosts} needs --rdzv-endpoint HOST:PORT, where the hosts meet")

    @property
    def starts_ranks(self) -> bool:
        return self.nproc_per_node is not None

    @property
    def hosts(self) -> int:
        return 1 if self.nnodes is None else self.nnodes

    @property
    def world_size(self) -> int:
        return self.hosts * self.nproc_per_node


def launch_flags_given(args: argparse.Namespace) -> bool:
    return any(hasattr(args, name) for name in section_fields(LaunchSettings))  # only a flag given is set


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
    add_section_flags(launcher, "launch", LaunchSettings, section_fields(LaunchSettings))
    _, rest = launcher.parse_known_args(argv)
    return rest


def launch(settings: LaunchSettings, argv: list[str], verbose: bool = False) -> int:
    """Start the ranks (training config checked); returns the exit code."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    torchrun = ["--nproc-per-node", str(settings.nproc_per_node), "--nnodes", str(settings.hosts)]
    if settings.rdzv_endpoint is None:
        torchrun.append("--standalone")  # a free local port for the rendezvous
    else:
        torchrun += ["--rdzv-backend", "c10d", "--rdzv-endpoint", settings.rdzv_endpoint, "--rdzv-id", "tscale-peer"]
    torchrun += ["--monitor-interval", "0.5", "--module", "tscale_p2p.cli", *rank_argv(argv)]
    if not verbose:  # torchrun's agent logs every start and stop as warnings; the ranks say what matters
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
