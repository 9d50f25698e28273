"""Where the dashboard's numbers come from: this peer's `LocalStatus` and the swarm's DHT records.

The dashboard only reads a `MetricsSource`. `local()` and `log_lines()` are cheap copies taken under a
lock and are called on the UI thread; `fetch_peers()` talks to the DHT, may take seconds, and is
called in a worker thread, so neither side ever waits for the other.
"""

from __future__ import annotations

import logging
import threading
import time
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable, Sequence

from tscale_p2p.peers.metrics import PeerRecord, SwarmMetrics
from tscale_p2p.peers.network import NetworkOptions, start_dht
from tscale_p2p.peers.run_config import fetch_run_config
from tscale_p2p.peers.status import LocalStatus, StatusSnapshot

log = logging.getLogger(__name__)

LOG_FORMAT = logging.Formatter("%(asctime)s %(levelname)s %(message)s", datefmt="%H:%M:%S")


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

    def close(self) -> None:
        """Release network resources once the dashboard has closed."""


class SwarmMetricsSource(MetricsSource):
    """The real source: the swarm seen through a client-mode DHT node of the dashboard's own, plus this
    peer's `LocalStatus` when it trains.

    The node is started by the first `fetch_peers()` (in the worker thread), from `initial_peers` and,
    when training, this peer's own addresses once its DHT is up: the dashboard sees the swarm exactly as
    ``tscale-peer dashboard`` on another machine would, and shares no state with the training thread.
    Without a `LocalStatus` it only watches, and keeps its own log lines.
    """

    def __init__(
        self,
        run_id: str,
        initial_peers: Sequence[str] = (),
        local_status: LocalStatus | None = None,
        is_training: Callable[[], bool] | None = None,
        connect_for_s: float = 30.0,
        log_history: int = 500,
    ) -> None:
        """`is_training` (e.g. a training thread's ``is_alive``) tells when local training has ended;
        `connect_for_s` bounds one attempt to reach the swarm (the next refresh tries again)."""
        self.run_id, self.model = run_id, ""
        self.initial_peers = tuple(initial_peers)
        self.local_status = local_status
        self._is_training = is_training
        self._connect_for_s = connect_for_s
        self._metrics: SwarmMetrics | None = None
        self._closed = threading.Event()
        self._lock = threading.Lock()  # close() may race the worker thread that starts the node
        self._own_log = _RecentLines(log_history)

    def local(self) -> StatusSnapshot | None:
        return None if self.local_status is None else self.local_status.snapshot()

    def fetch_peers(self) -> list[PeerRecord]:
        metrics = self._metrics or self._connect()
        if metrics is None or self._closed.is_set():
            return []
        if not self.model:
            run = fetch_run_config(metrics.dht, self.run_id)
            self.model = run.model_config.dims if run is not None else ""
        return metrics.fetch()

    def _connect(self) -> SwarmMetrics | None:
        """Start the dashboard's DHT node; None while there is nobody to bootstrap from yet."""
        own = self.local_status.snapshot().visible_maddrs if self.local_status is not None else ()
        bootstrap = self.initial_peers + tuple(own)
        if not bootstrap:
            return None  # a founding peer whose own DHT is not up yet
        options = NetworkOptions(
            initial_peers=bootstrap,
            host_maddrs=("/ip4/127.0.0.1/tcp/0",),  # dial-out only: nothing needs to reach a dashboard
            client_mode=True,
            retry_for_s=self._connect_for_s,
        )
        dht = start_dht(options, should_stop=self._closed.is_set)
        with self._lock:
            if dht is not None and self._closed.is_set():
                dht.shutdown()
                return None
            if dht is not None:
                self._metrics = SwarmMetrics(dht, self.run_id)
            return self._metrics

    def log_lines(self) -> Sequence[str]:
        if self.local_status is not None:
            return self.local_status.snapshot().log_lines
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
        if self.local_status is None:
            return self._own_log
        handler = self.local_status.log_handler()
        # `join` already copies the tscale_p2p loggers' records into LocalStatus: take only the others.
        handler.addFilter(lambda record: not record.name.startswith("tscale_p2p"))
        return handler

    def close(self) -> None:
        with self._lock:
            self._closed.set()
            if self._metrics is not None:
                self._metrics.dht.shutdown()


class _RecentLines(logging.Handler):
    """Keeps the last formatted log lines of a watch-only dashboard (a training peer has `LocalStatus`)."""

    def __init__(self, history: int) -> None:
        super().__init__(logging.INFO)
        self.lines: deque[str] = deque(maxlen=history)
        self.setFormatter(LOG_FORMAT)

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(self.format(record))
