"""Getting onto the network: multiaddr checks, the persistent identity, and a DHT start that retries.

hivemind vendors its own Multiaddr class; we validate what users type with py-multiaddr (one clear line
for a malformed address) and hand hivemind plain strings.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import logging
import multiprocessing
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import multiaddr
from hivemind import DHT
from hivemind.p2p import P2PDaemonError

from tscale_p2p.errors import UserError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class NetworkOptions:
    """How this peer joins the DHT (built from the command line's network section, `cli/network.py`)."""

    initial_peers: tuple[str, ...] = ()
    host_maddrs: tuple[str, ...] = ("/ip4/0.0.0.0/tcp/0",)
    announce_maddrs: tuple[str, ...] = ()
    client_mode: bool = False
    identity_path: str | None = None
    # Reconnect schedule while the initial peers are unreachable: doubling delays, capped, for at most this long.
    retry_first_delay_s: float = 1.0
    retry_max_delay_s: float = 30.0
    retry_for_s: float = 600.0


def parse_multiaddrs(values: Sequence[str], flag: str, need_peer_id: bool = False) -> tuple[str, ...]:
    """Validate multiaddrs with py-multiaddr; UserError (one line) for the first bad one."""
    parsed = []
    for value in values:
        try:
            address = multiaddr.Multiaddr(value)
        except (multiaddr.exceptions.Error, ValueError, TypeError) as error:
            raise UserError(f"{flag}: {value!r} is not a valid multiaddr ({_first_line(error)})") from None
        if need_peer_id and "p2p" not in [protocol.name for protocol in address.protocols()]:
            raise UserError(
                f"{flag}: {value!r} has no /p2p/<peer id> part; copy the full address a running peer printed"
            )
        parsed.append(str(address))
    return tuple(parsed)


def peer_ids_in(maddrs: Sequence[str]) -> frozenset[str]:
    """The peer ids (the /p2p/ parts) of validated multiaddrs: the peers a joiner chose to trust."""
    ids = set()
    for value in maddrs:
        try:
            ids.add(multiaddr.Multiaddr(value).value_for_protocol("p2p"))
        except (multiaddr.exceptions.Error, ValueError):
            continue  # no /p2p/ part
    return frozenset(ids)


_PR_SET_PDEATHSIG = 1
_children_detached = False


def keep_children_off_the_terminal() -> None:
    """Make every process forked from now on (hivemind's DHT and averager processes, and the p2pd daemon the
    DHT spawns) leave Ctrl+C to this process, which shuts them down in order; idempotent.

    A terminal sends Ctrl+C to its whole foreground process group. Ignoring SIGINT is not enough for p2pd:
    uvloop's spawn runs the fork hooks but then resets every signal to its default before exec, so p2pd would
    exit at once and hivemind's shutdown would trip over its missing socket (a FileNotFoundError traceback).
    A process group of its own survives exec. The Python children leave SIGTERM to this process too, which
    shuts them down through hivemind; as hivemind's last resort (SIGTERM after a grace period) then does
    nothing, a child still alive when this process exits gets SIGKILL instead (multiprocessing would wait on it
    for ever). Each child dies with its parent (PR_SET_PDEATHSIG), so `kill -9` of this process still takes
    all of them down.
    """
    global _children_detached
    if not _children_detached:
        os.register_at_fork(after_in_child=_detach_from_terminal)
        atexit.register(_kill_leftover_children)  # runs before multiprocessing's own exit hook (registered earlier)
        _children_detached = True


def _kill_leftover_children() -> None:
    for child in multiprocessing.active_children():
        if child.daemon:
            child.kill()


def _leave_to_the_parent(signum, frame) -> None:
    """A child's SIGTERM handler: nothing to do (the parent shuts the child down)."""


@contextlib.contextmanager
def ctrl_c_held_while_forking():
    """Hold a Ctrl+C that comes while a child process is forked and deliver it once the fork is done.

    The fork runs Python's at-fork hooks (logging's lock release among them) as Python code, and a
    KeyboardInterrupt raised inside one is printed as "Exception ignored" and dropped: this process would go on
    as if Ctrl+C had never been pressed. Off the main thread there is no Ctrl+C to hold (Python delivers it to
    the main thread alone)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    held = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: held.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if held:
            signal.raise_signal(signal.SIGINT)  # to the handler this process had, as if it came now


def _detach_from_terminal() -> None:
    os.setpgid(0, 0)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # SIGTERM too is the parent's to act on: a service manager or `pkill -f tscale-peer` sends it to every
    # process, and a hivemind child killed midway can leave its parent blocked for good on a shared lock or a
    # reply (seen: SIGTERM to all of a peer's processes hung it before its checkpoint). A no-op handler, not
    # SIG_IGN, so that p2pd, exec'd from the DHT process, gets the default back.
    signal.signal(signal.SIGTERM, _leave_to_the_parent)
    if sys.platform == "linux":
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def start_dht(options: NetworkOptions, should_stop: Callable[[], bool] = lambda: False) -> DHT | None:
    """Start a hivemind DHT node. While the initial peers cannot be reached, log one line and retry with
    backoff; UserError when they stay unreachable for `retry_for_s`. None if `should_stop()` while waiting.
    Processes it starts ignore Ctrl+C (`keep_children_off_the_terminal`): shut it down to end them."""
    keep_children_off_the_terminal()
    if options.identity_path:
        Path(options.identity_path).expanduser().parent.mkdir(parents=True, exist_ok=True)
    delay, deadline, attempt = options.retry_first_delay_s, time.monotonic() + options.retry_for_s, 0
    while True:
        attempt += 1
        try:
            dht = DHT(
                initial_peers=list(options.initial_peers),
                host_maddrs=list(options.host_maddrs),
                announce_maddrs=list(options.announce_maddrs) or None,
                client_mode=options.client_mode,
                identity_path=str(Path(options.identity_path).expanduser()) if options.identity_path else None,
                use_relay=True,
                use_auto_relay=options.client_mode,
                start=False,
            )
            with ctrl_c_held_while_forking():
                dht.start()
            dht.wait_until_ready()
            return dht
        except (P2PDaemonError, RuntimeError) as error:
            reason = _first_line(error)
            if "already taken" in reason:
                raise UserError(
                    f"identity {options.identity_path} is in use by another running peer; "
                    f"give this one its own --identity-path"
                ) from None
            if "address already in use" in reason.lower() or "failed to listen" in reason.lower():
                raise UserError(f"cannot listen on {', '.join(options.host_maddrs)}: {reason}") from None
            if not options.initial_peers:
                raise
            if time.monotonic() + delay > deadline:
                raise UserError(
                    f"cannot reach any initial peer ({', '.join(options.initial_peers)}) after {attempt} attempts: "
                    f"{reason}"
                ) from None
            log.warning(
                "cannot reach the initial peers yet (%s); retrying in %.0f s (attempt %d)", reason, delay, attempt
            )
            if _sleep_unless(delay, should_stop):
                return None
            delay = min(delay * 2, options.retry_max_delay_s)


def _sleep_unless(seconds: float, should_stop: Callable[[], bool]) -> bool:
    """Sleep `seconds` in short naps; True (early) as soon as `should_stop()`."""
    end = time.monotonic() + seconds
    while not should_stop():
        left = end - time.monotonic()
        if left <= 0:
            return False
        time.sleep(min(0.2, left))
    return True


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__
