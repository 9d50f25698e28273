"""Where the dashboard's numbers come from: this peer's `LocalStatus` and the swarm's DHT records.

The dashboard only reads a `MetricsSource`. `local()` and `log_lines()` are cheap copies taken under a
lock and are called on the UI thread; `fetch_peers()` may talk to the DHT and take seconds, so it is
called in a worker thread, and neither side ever waits for the other. A training peer's dashboard
(`TrainingPeerSource`) reads everything from the peer's `LocalStatus`; ``tscale-peer dashboard``
(`SwarmWatchSource`) watches through a DHT node of its own.
"""

from __future__ import annotations

import logging
import threading
import time
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable, Sequence
from functools import cached_property

from tscale_p2p.peers.metrics import PeerRecord, SwarmMetrics
from tscale_p2p.peers.network import NetworkOptions, peer_ids_in, start_dht
from tscale_p2p.peers.run_config import fetch_run_config
from tscale_p2p.peers.status import LocalStatus, StatusSnapshot
from tscale_p2p.progress import ProgressBoard, WorkProgress

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

    @cached_property
    def progress_board(self) -> ProgressBoard:
        """Where this process's long work (`tscale_p2p.progress.long_work`) reports while the dashboard is
        shown: `run_dashboard` routes it here instead of to a rich bar on the terminal."""
        return ProgressBoard()

    def long_work(self) -> Sequence[WorkProgress]:
        """Long work in progress (the state download, tokenizing...), oldest first."""
        return self.progress_board.snapshot()

    def close(self) -> None:
        """Release network resources once the dashboard has closed."""


class TrainingPeerSource(MetricsSource):
    """A training peer's dashboard: everything comes from its `LocalStatus`, the swarm's records included
    (the peer's publish loop reads them every few seconds through its own DHT node).

    It starts no DHT node of its own: hivemind's DHT is a forked process, and a fork from the dashboard's
    thread while the training thread runs `subprocess` (Triton and torch.compile build with compilers) would
    hand the child the pipe through which Popen waits for the exec, and training would hang until the
    dashboard closed.
    """

    def __init__(self, status: LocalStatus, is_training: Callable[[], bool] | None = None) -> None:
        """`is_training` (e.g. the training thread's ``is_alive``) tells when local training has ended."""
        self.status = status
        self._is_training = is_training

    @property
    def run_id(self) -> str:
        return self.status.snapshot().run_id

    @property
    def model(self) -> str:
        return self.status.snapshot().model

    def local(self) -> StatusSnapshot:
        return self.status.snapshot()

    def fetch_peers(self) -> list[PeerRecord]:
        return list(self.status.snapshot().swarm_records)

    def log_lines(self) -> Sequence[str]:
        return self.status.snapshot().log_lines

    def set_paused(self, paused: bool) -> None:
        (self.status.paused.set if paused else self.status.paused.clear)()

    def request_stop(self) -> None:
        self.status.stop_requested.set()

    def finished(self) -> bool:
        return self._is_training is not None and not self._is_training()

    def log_handler(self) -> logging.Handler:
        handler = self.status.log_handler()
        # `join` already copies the tscale_p2p loggers' records into LocalStatus: take only the others.
        handler.addFilter(lambda record: not record.name.startswith("tscale_p2p"))
        return handler


class SwarmWatchSource(MetricsSource):
    """``tscale-peer dashboard``: a swarm watched through a client-mode DHT node of the dashboard's own,
    which the first `fetch_peers()` starts (in the worker thread). Nothing trains here; it keeps its own
    log lines."""

    def __init__(
        self, run_id: str, initial_peers: Sequence[str], connect_for_s: float = 30.0, log_history: int = 500
    ) -> None:
        """`connect_for_s` bounds one attempt to reach the swarm (the next refresh tries again)."""
        self.run_id, self.model = run_id, ""
        self.initial_peers = tuple(initial_peers)
        self._connect_for_s = connect_for_s
        self._metrics: SwarmMetrics | None = None
        self._closed = threading.Event()
        self._lock = threading.Lock()  # close() may race the worker thread that starts the node
        self._own_log = _RecentLines(log_history)

    def local(self) -> None:
        return None

    def fetch_peers(self) -> list[PeerRecord]:
        metrics = self._metrics or self._connect()
        if metrics is None or self._closed.is_set():
            return []
        if not self.model:
            run = fetch_run_config(metrics.dht, self.run_id, peer_ids_in(self.initial_peers))
            self.model = run.model_config.dims if run is not None else ""
        return metrics.fetch()

    def _connect(self) -> SwarmMetrics | None:
        """Start the dashboard's DHT node; None if closed meanwhile."""
        options = NetworkOptions(
            initial_peers=self.initial_peers,
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
        with self._own_log.lock:  # the handler appends from other threads
            return tuple(self._own_log.lines)

    def set_paused(self, paused: bool) -> None:
        """Nothing trains here."""

    def request_stop(self) -> None:
        """Nothing trains here."""

    def finished(self) -> bool:
        return False

    def log_handler(self) -> logging.Handler:
        return self._own_log

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
