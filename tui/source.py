"""Where the dashboard's numbers come from: this peer's `LocalStatus` and the swarm's DHT records.

The dashboard only reads a `MetricsSource`. `local()` and `log_lines()` are cheap copies taken under a
lock and are called on the UI thread; `fetch_peers()` talks to the DHT, may take seconds, and is
called in a worker thread, so neither side ever waits for the other.
"""

from __future__ import annotations

import logging
import time
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable, Sequence

from hivemind import DHT

from tscale_p2p.peers.metrics import PeerRecord, SwarmMetrics
from tscale_p2p.peers.status import LocalStatus, StatusSnapshot


class MetricsSource(ABC):
    """What the dashboard shows, from wherever it comes.

    `run_id` and `model` (dims notation such as ``e384h6d6w256``, or "" while unknown) label the swarm.
    """

    run_id: str
    model: str

    @abstractmethod
    def local(self) -> StatusSnapshot | None:
        """This peer's status now, or None when the dashboard only watches a swarm."""

    @abstractmethod
    def fetch_peers(self) -> list[PeerRecord]:
        """The live peer records of the run; may block on the network (called in a worker thread)."""

    @abstractmethod
    def log_lines(self) -> Sequence[str]:
        """Recent log lines, oldest first."""

    @abstractmethod
    def set_paused(self, paused: bool) -> None:
        """Pause or resume local training (the peer stays in the swarm)."""

    @abstractmethod
    def request_stop(self) -> None:
        """Ask the local peer to save a checkpoint and leave."""

    @abstractmethod
    def finished(self) -> bool:
        """True once there is nothing more to watch (local training ended on its own)."""

    def now(self) -> float:
        """Unix time used to age peer records ("last seen")."""
        return time.time()

    def log_handler(self) -> logging.Handler | None:
        """A handler that feeds `log_lines()` from `logging`, for as long as the dashboard is shown."""
        return None


class SwarmMetricsSource(MetricsSource):
    """The real source: a running `hivemind.DHT` for the swarm, plus `LocalStatus` when this peer trains.

    Without a `LocalStatus` (``tscale-peer dashboard``) it only watches, and collects its own log lines.
    """

    def __init__(
        self,
        dht: DHT,
        run_id: str,
        model: str = "",
        local_status: LocalStatus | None = None,
        is_training: Callable[[], bool] | None = None,
        log_history: int = 500,
    ) -> None:
        """`is_training` (e.g. a training thread's ``is_alive``) tells when local training has ended."""
        self.run_id, self.model = run_id, model
        self.metrics = SwarmMetrics(dht, run_id)
        self.local_status = local_status
        self._is_training = is_training
        self._own_log = _RecentLines(log_history)

    def local(self) -> StatusSnapshot | None:
        return None if self.local_status is None else self.local_status.snapshot()

    def fetch_peers(self) -> list[PeerRecord]:
        return self.metrics.fetch()

    def log_lines(self) -> Sequence[str]:
        if self.local_status is not None:
            return self.local().log_lines
        with self._own_log.lock:  # the handler appends from other threads
            return tuple(self._own_log.lines)

    def set_paused(self, paused: bool) -> None:
        if self.local_status is not None:
            (self.local_status.paused.set if paused else self.local_status.paused.clear)()

    def request_stop(self) -> None:
        if self.local_status is not None:
            self.local_status.stop_requested.set()

    def finished(self) -> bool:
        return self._is_training is not None and not self._is_training()

    def log_handler(self) -> logging.Handler:
        return self._own_log if self.local_status is None else self.local_status.log_handler()


class _RecentLines(logging.Handler):
    """Keeps the last formatted log lines of a watch-only dashboard (a training peer has `LocalStatus`)."""

    def __init__(self, history: int) -> None:
        super().__init__(logging.INFO)
        self.lines: deque[str] = deque(maxlen=history)
        self.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s", datefmt="%H:%M:%S"))

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(self.format(record))
