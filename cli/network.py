"""The network section: how `join`, `peers`, `dashboard`, `infer` and `serve` reach a swarm, declared and checked
once for all of them (each command takes the fields it needs; `cli.options.Command`).

The checks import the network stack only for a value to check, so `infer --checkpoint` loads no hivemind.
"""

from __future__ import annotations

import pydantic
from pydantic.dataclasses import dataclass

from tscale_p2p.errors import UserError
from tscale_p2p.settings import SECTION_CONFIG, option

DEFAULT_RUN_ID = "tscale"
# What each command that only reads the swarm leaves out of the section (it dials out only, from any port).
LISTENING = frozenset(f"network.{name}" for name in ("host_maddrs", "announce_maddrs", "port", "client_mode",
                                                     "identity_path"))


@dataclass(config=SECTION_CONFIG)
class NetworkSettings:
    """Where the swarm is, and how this peer is reached."""

    initial_peers: tuple[str, ...] = option(
        (), "multiaddrs of running peers, e.g. /ip4/203.0.113.7/tcp/31337/p2p/12D3KooW... (join without them "
        "founds a new run)", metavar="MADDR")
    run_id: str = option(DEFAULT_RUN_ID, "which run; DHT keys are namespaced by it", metavar="NAME")
    host_maddrs: tuple[str, ...] = option((), "where to listen (default: /ip4/0.0.0.0/tcp/PORT)", metavar="MADDR")
    announce_maddrs: tuple[str, ...] = option(
        (), "addresses to tell other peers, e.g. the public address in front of a port forward", metavar="MADDR")
    port: int | None = option(None, "TCP port to listen on, all interfaces (default: any)", ge=0, le=65535)
    client_mode: bool = option(False, "behind NAT/firewall: only dial out (reached through relays); serves no state")
    identity_path: str | None = option(
        None, "private key file that keeps this peer's id across restarts (default: OUT/identity.key)",
        metavar="FILE")

    @pydantic.field_validator("initial_peers")
    @classmethod
    def _initial_peers(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        return _multiaddrs(value, "--initial-peers", need_peer_id=True)

    @pydantic.field_validator("host_maddrs", "announce_maddrs")
    @classmethod
    def _maddrs(cls, value: tuple[str, ...], info: pydantic.ValidationInfo) -> tuple[str, ...]:
        return _multiaddrs(value, "--" + info.field_name.replace("_", "-"))

    @pydantic.field_validator("run_id")
    @classmethod
    def _run_id(cls, value: str) -> str:
        if value == DEFAULT_RUN_ID:  # valid, and checking it would load the network stack for nothing
            return value
        from tscale_p2p.peers.run_config import check_run_id

        return check_run_id(value)

    def __post_init__(self) -> None:
        if self.port is not None and self.host_maddrs:
            raise UserError("give either --port or --host-maddrs, not both")

    @property
    def listen_on(self) -> tuple[str, ...]:
        """--host-maddrs as given, else all interfaces on --port (0: any free port), so volunteers are reachable."""
        return self.host_maddrs or (f"/ip4/0.0.0.0/tcp/{self.port or 0}",)

    def need_initial_peers(self) -> tuple[str, ...]:
        """The initial peers, for a command that cannot start a swarm of its own."""
        if not self.initial_peers:
            raise UserError("give --initial-peers MADDR... (the address a running peer printed)")
        return self.initial_peers


def _multiaddrs(values: tuple[str, ...], flag: str, need_peer_id: bool = False) -> tuple[str, ...]:
    if not values:
        return values
    from tscale_p2p.peers.network import parse_multiaddrs

    return parse_multiaddrs(values, flag, need_peer_id=need_peer_id)
