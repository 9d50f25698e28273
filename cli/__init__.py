"""`tscale-peer`: the command line. Each subcommand parses its flags here and hands off to one module.

This package is the top layer: it may import the dashboard, the swarm, the core and the kernels, and nothing
below imports it (an import-linter contract in pyproject.toml, checked by `.ci/check_layers.py`).
"""

from __future__ import annotations

import argparse
import logging
import sys
import typing

from tscale_p2p import __version__
from tscale_p2p.config import TRAIN_SECTIONS, TrainConfig
from tscale_p2p.errors import UserError
from tscale_p2p.cli.generate import add_infer_parser, add_serve_parser
from tscale_p2p.cli.launch import LaunchSettings, launch, launch_flags_given
from tscale_p2p.cli.index import add_index_parser
from tscale_p2p.cli.options import Command, Loaded

PROG = "tscale-peer"

class ArgumentParser(argparse.ArgumentParser):
    """argparse with our one-line error format and exit code 2."""

    def error(self, message: str) -> typing.NoReturn:
        self.exit(2, f"{PROG}: error: {message} (see '{self.prog} --help')\n")


TRAIN = Command((*TRAIN_SECTIONS.items(), ("launch", LaunchSettings)))


def train_config(loaded: Loaded) -> TrainConfig:
    """The TrainConfig of a command's loaded training sections."""
    return TrainConfig(**loaded.values(*(name for name in TRAIN_SECTIONS if name in loaded.sections)))


def build_parser() -> ArgumentParser:
    parser = ArgumentParser(
        prog=PROG,
        description="Train transformer language models together: solo, or in a peer-to-peer swarm.",
    )
    parser.add_argument("--version", action="version", version=f"{PROG} {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=ArgumentParser)
    commands.required = True

    train = commands.add_parser(
        "train",
        help="train a model alone on this machine (no network)",
        description="Train a model alone on this machine. With no flags it trains a tiny model on the "
        "Python standard library's own source code, which every install has.",
    )
    TRAIN.add_flags(train)
    train.set_defaults(handler=run_train)

    from tscale_p2p.cli.dashboard import add_dashboard_parser
    from tscale_p2p.cli.swarm import add_join_parser, add_peers_parser  # here: cli.swarm imports this module

    add_join_parser(commands)
    add_peers_parser(commands)
    add_dashboard_parser(commands)
    add_infer_parser(commands)
    add_serve_parser(commands)
    add_index_parser(commands)
    return parser


def run_train(args: argparse.Namespace) -> int:
    """Solo; one rank of a data-parallel run under torchrun; or, with --nproc-per-node, the ranks' launcher."""
    from tscale_p2p.distributed import RankEnvironment, check_sync_config, train_data_parallel
    from tscale_p2p.solo import train_solo
    from tscale_p2p.device import resolve_device

    env = RankEnvironment.from_environ()
    if env is not None and launch_flags_given(args):
        raise UserError("--nproc-per-node starts ranks itself: drop it when running under torchrun")
    # Under torchrun the config file's [launch] table is left out: the launcher hands its ranks its command line
    # without its own flags (`rank_argv`) but with the same --config file, and ranks that read [launch] from it
    # would each launch ranks of their own.
    loaded = TRAIN.load(args, ignore=("launch",) if env is not None else ())
    cfg, launcher = train_config(loaded), loaded["launch"]
    if launcher.starts_ranks:
        check_sync_config(cfg, launcher.world_size, resolve_device(cfg.device).type)
        return launch(launcher, args.argv, args.verbose)
    if env is not None:
        return train_data_parallel(cfg, env)
    check_sync_config(cfg, 1, "cpu")
    return train_solo(cfg)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    args.argv = sys.argv[1:] if argv is None else list(argv)  # the launcher hands it on to the ranks
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(message)s",
        datefmt="%H:%M:%S",
    )
    try:
        return args.handler(args)
    except UserError as error:
        print(f"{PROG}: error: {error}", file=sys.stderr)
        return 2

