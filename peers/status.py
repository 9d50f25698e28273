"""What this peer is doing right now, for the dashboard: one thread-safe object the join loop writes.

The swarm loop (`tscale_p2p.peers.swarm`) calls `LocalStatus.update()` after every step and
`record_averaging()` after every round; the dashboard (another thread) reads `snapshot()`, an immutable
copy, and may set `paused` (local training stops, the peer stays in the swarm and keeps serving its state)
or `stop_requested` (the peer saves a checkpoint and leaves). Nothing here touches the network.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field, fields, replace
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tscale_p2p.peers.metrics import PeerRecord


@dataclass(frozen=True)
class AveragingRecord:
    """One finished averaging round as this peer saw it."""

    round: int
    group_size: int  # peers whose contribution was averaged, this one included (1: nobody else was found)
    bytes_up: int  # bytes this peer sent during the round
    bytes_down: int  # bytes this peer received during the round
    duration_s: float  # matchmaking + all-reduce wall time
    bits_per_param: float  # this peer's uplink in the round: bytes_up x 8 / model parameters, both trips and
    # scales included (2(n-1)/n trips' worth of the model in a group of n: see benchmarks/swarm_bytes.py groups)
    dropped_peers: int  # peers that joined the group but whose part was lost or rejected
    finished_at: float = field(default_factory=time.time)  # unix time
    bits_per_value: float = 0.0  # wire bits per value of one trip (a part sent, or an average answered)


@dataclass(frozen=True)
class StatusSnapshot:
    """An immutable copy of `LocalStatus` at one moment; safe to keep and read from any thread."""

    peer_id: str = ""
    name: str = ""
    run_id: str = ""
    model: str = ""  # the run's model in dims notation, e.g. e384h6d6w256
    device: str = ""
    visible_maddrs: tuple[str, ...] = ()  # where other peers can reach this one
    step: int = 0  # local optimizer steps taken
    max_steps: int | None = None  # the --max-steps limit, if any
    loss: float | None = None  # latest training loss (nats/token)
    tokens_per_s: float = 0.0
    tokens_contributed: int = 0  # tokens this peer trained on since it joined
    gpu_memory_bytes: int | None = None  # peak allocated on the GPU; None on CPU
    precision: str = ""
    offload: bool = False
    round: int = 0  # averaging rounds completed (the swarm's outer step as this peer knows it)
    inner_steps: int = 0  # local steps per round (H)
    seconds_to_next_averaging: float | None = None  # estimate from the current step rate
    averaging_in_flight: bool = False  # a round's all-reduce is running in the background
    swarm_records: tuple[PeerRecord, ...] = ()  # the run's peer records as this peer last read them
    paused: bool = False
    stop_requested: bool = False
    averaging: tuple[AveragingRecord, ...] = ()  # oldest first
    log_lines: tuple[str, ...] = ()  # oldest first
    updated_at: float = 0.0  # unix time of the last update


_UPDATABLE = frozenset(f.name for f in fields(StatusSnapshot)) - {"paused", "stop_requested", "averaging", "log_lines"}


class LocalStatus:
    """Thread-safe live status of the local peer, written by the join loop and read by the dashboard.

    `paused` and `stop_requested` are `threading.Event`s: the dashboard sets them, the loop obeys.
    """

    def __init__(self, averaging_history: int = 200, log_history: int = 500) -> None:
        self._lock = threading.Lock()
        self._values = StatusSnapshot()
        self._averaging: deque[AveragingRecord] = deque(maxlen=averaging_history)
        self._log_lines: deque[str] = deque(maxlen=log_history)
        self.paused = threading.Event()
        self.stop_requested = threading.Event()

    def update(self, **values) -> None:
        """Set some fields of the snapshot (names as in `StatusSnapshot`); unknown names are a bug."""
        unknown = set(values) - _UPDATABLE
        if unknown:
            raise TypeError(f"LocalStatus has no field(s) {sorted(unknown)}")
        with self._lock:
            self._values = replace(self._values, **values, updated_at=time.time())

    def record_averaging(self, record: AveragingRecord) -> None:
        with self._lock:
            self._averaging.append(record)

    def log(self, line: str) -> None:
        with self._lock:
            self._log_lines.append(line)

    def snapshot(self) -> StatusSnapshot:
        with self._lock:
            return replace(
                self._values,
                paused=self.paused.is_set(),
                stop_requested=self.stop_requested.is_set(),
                averaging=tuple(self._averaging),
                log_lines=tuple(self._log_lines),
            )

    def log_handler(self, level: int = logging.INFO) -> logging.Handler:
        """A `logging.Handler` that copies formatted records into this status's log lines."""
        return _StatusLogHandler(self, level)


class _StatusLogHandler(logging.Handler):
    def __init__(self, status: LocalStatus, level: int) -> None:
        super().__init__(level)
        self.status = status
        self.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s", datefmt="%H:%M:%S"))

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.status.log(self.format(record))
        except Exception:  # a broken log line must never take the training loop down
            self.handleError(record)
