"""The Textual dashboard app, and `run_dashboard`, which shows it while training runs in another thread."""

from __future__ import annotations

import logging
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from textual import events, work
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal
from textual.message import Message
from textual.widgets import Footer

from tscale_p2p.peers.metrics import PeerRecord
from tscale_p2p.peers.status import LocalStatus, StatusSnapshot
from tscale_p2p.progress import showing_progress_on
from tscale_p2p.tui.averaging_log import AveragingLog
from tscale_p2p.tui.charts import Chart, ChartsPanel
from tscale_p2p.tui.help import HelpScreen
from tscale_p2p.tui.local_panel import LocalPanel
from tscale_p2p.tui.log_pane import LogPane
from tscale_p2p.tui.peers_table import PeersTable
from tscale_p2p.tui.source import MetricsSource, TrainingPeerSource
from tscale_p2p.tui.summary import SwarmSummary, SwarmTotals
from tscale_p2p.tui.terminal import stdout_driver
from tscale_p2p.tui.work_progress import WorkProgressLine

log = logging.getLogger(__name__)
# What other code prints while the dashboard owns the terminal (a founder's join line, say) is logged here.
printed = logging.getLogger("stdout")


class PeersFetched(Message):
    """Posted from the worker thread with the swarm's live peer records."""

    def __init__(self, records: list[PeerRecord]) -> None:
        super().__init__()
        self.records = records


class Dashboard(App[None]):
    """Swarm summary, long work in progress, peers, this peer, charts, averaging log and log lines of one run.

    Local status is read on a timer (a cheap copy); peer records are fetched in a worker thread, so a
    slow DHT never freezes the screen and the screen never holds up training.
    """

    CSS_PATH = "dashboard.tcss"
    TITLE = "tscale-peer"
    ENABLE_COMMAND_PALETTE = False
    HORIZONTAL_BREAKPOINTS = [(0, "-narrow"), (120, "-wide")]
    VERTICAL_BREAKPOINTS = [(0, "-short"), (36, "-tall")]
    BINDINGS = [
        Binding("p", "pause", "Pause"),
        Binding("p", "resume", "Resume"),
        Binding("s", "sort", "Sort peers"),
        Binding("question_mark", "help", "Help", key_display="?"),
        Binding("q", "quit", "Quit"),
        Binding("ctrl+c", "quit", "Quit", show=False, priority=True),
    ]

    def __init__(self, source: MetricsSource, local_interval_s: float = 1.0, swarm_interval_s: float = 3.0) -> None:
        super().__init__()
        self.source = source
        self.local_interval_s, self.swarm_interval_s = local_interval_s, swarm_interval_s
        self.records: list[PeerRecord] = []
        self.status: StatusSnapshot | None = None

    def get_driver_class(self):
        return stdout_driver(super().get_driver_class())  # see tui/terminal.py

    def compose(self) -> ComposeResult:
        yield SwarmSummary(id="summary")
        yield WorkProgressLine(id="work")
        with Horizontal(id="top"):
            yield LocalPanel(id="local")
            yield ChartsPanel(id="charts")
        yield PeersTable(id="peers")
        with Horizontal(id="bottom"):
            yield AveragingLog(id="averaging")
            yield LogPane(id="log")
        yield Footer()

    def on_mount(self) -> None:
        for widget_id, title in (("charts", "charts"), ("averaging", "averaging"), ("log", "log")):
            self.query_one(f"#{widget_id}").border_title = title
        self.query_one(PeersTable).focus()
        self.begin_capture_print(self)
        self.refresh_local()
        self.refresh_swarm()
        self.set_interval(self.local_interval_s, self.refresh_local)
        self.set_interval(self.swarm_interval_s, self.refresh_swarm)

    def on_print(self, event: events.Print) -> None:
        for line in event.text.splitlines():
            if line.strip():
                printed.info(line.rstrip())

    @property
    def watching_only(self) -> bool:
        return self.status is None

    def refresh_local(self) -> None:
        """Show this peer's status now (a lock-protected copy: never waits on training)."""
        self.status = self.source.local()
        self.set_class(self.watching_only, "-watching")
        local_panel = self.query_one(LocalPanel)
        if self.status is None:
            local_panel.show_watching()
            self.query_one("#loss-chart", Chart).title = "mean loss"  # of the peers, as nothing trains here
        else:
            local_panel.show(self.status)
            if self.status.loss is not None:
                self.query_one("#loss-chart", Chart).push(self.status.loss)
            self.query_one("#local-chart", Chart).push(0.0 if self.status.paused else self.status.tokens_per_s)
            self.query_one(AveragingLog).show(self.status.averaging)
            self.refresh_bindings()
        self.query_one(LogPane).show(self.source.log_lines())
        self.query_one(WorkProgressLine).show(self.source.long_work())
        self._show_swarm_summary()
        if self.source.finished():
            self.exit()

    def refresh_swarm(self) -> None:
        """Start fetching peer records unless a fetch is still running."""
        if not any(w.name == "fetch_peers" and w.is_running for w in self.workers):
            self.fetch_peers()

    @work(thread=True, exit_on_error=False)
    def fetch_peers(self) -> None:
        try:
            records = self.source.fetch_peers()
        except Exception as error:  # a flaky DHT must not take the dashboard down; try again next tick
            log.warning("could not read peer records: %s", error)
            return
        self.post_message(PeersFetched(records))

    def on_peers_fetched(self, message: PeersFetched) -> None:
        self.records = message.records
        own_id = None if self.status is None else self.status.peer_id
        self.query_one(PeersTable).show(self.records, self.source.now(), own_id)
        totals = self._show_swarm_summary()
        self.query_one("#swarm-chart", Chart).push(totals.tokens_per_s)
        if self.watching_only:
            losses = [r.loss for r in self.records if r.loss is not None]
            if losses:
                self.query_one("#loss-chart", Chart).push(sum(losses) / len(losses))

    def _show_swarm_summary(self) -> SwarmTotals:
        totals = SwarmTotals.of(self.records, self.status, self.source.now())
        run_id = self.source.run_id or (self.status.run_id if self.status else "")
        self.query_one(SwarmSummary).show(run_id, self.source.model, totals)
        self.query_one(PeersTable).border_title = f"peers · {totals.peers} online"
        return totals

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        if action in ("pause", "resume"):
            if self.status is None:
                return False
            return self.status.paused == (action == "resume")
        return True

    def action_pause(self) -> None:
        self._set_paused(True)

    def action_resume(self) -> None:
        self._set_paused(False)

    def _set_paused(self, paused: bool) -> None:
        self.source.set_paused(paused)
        self.refresh_local()

    def action_sort(self) -> None:
        self.query_one(PeersTable).sort_by_next_column()

    def action_help(self) -> None:
        self.push_screen(HelpScreen())

    async def action_quit(self) -> None:
        """Ask the peer to checkpoint and leave, then close the screen (the join loop finishes the rest)."""
        self.source.request_stop()
        self.exit()


@contextmanager
def logging_into(source: MetricsSource) -> Iterator[None]:
    """While the dashboard owns the terminal, send log records to its log pane instead of the terminal:
    a handler writing to the real stderr would scribble over the screen."""
    root = logging.getLogger()
    hivemind_logger = logging.getLogger("hivemind")
    terminal = (sys.__stderr__, sys.__stdout__, sys.stderr, sys.stdout)
    muted = [
        (logger, handler)
        for logger in (root, hivemind_logger)
        for handler in list(logger.handlers)
        if isinstance(handler, logging.StreamHandler) and handler.stream in terminal
    ]
    for logger, handler in muted:
        logger.removeHandler(handler)
    pane_handler = source.log_handler()
    # hivemind's own handler does not propagate to the root logger; while it is muted, let it.
    propagate, hivemind_logger.propagate = hivemind_logger.propagate, True
    if pane_handler is not None:
        root.addHandler(pane_handler)
    try:
        yield
    finally:
        if pane_handler is not None:
            root.removeHandler(pane_handler)
        hivemind_logger.propagate = propagate
        for logger, handler in muted:
            logger.addHandler(handler)


def run_dashboard(source: MetricsSource) -> None:
    """Show the dashboard in this (main) thread until `q`, or until `source.finished()`; then close the
    source. Training, if any, runs in another thread and talks to the dashboard only through `source`."""
    try:
        with logging_into(source):
            Dashboard(source).run()
    finally:
        source.close()


def run_dashboard_while(train: Callable[[], int], status: LocalStatus) -> int:
    """Run `train` (e.g. a `join`) in a background thread with the dashboard in front; return its exit code.

    Closing the dashboard (`q`, Ctrl+C) sets `status.stop_requested`: the peer finishes its round in flight,
    saves a checkpoint and leaves, its closing log lines on the terminal again; Ctrl+C meanwhile quits at
    once, as a second Ctrl+C does in `train` (checkpoints are written atomically). An exception in
    `train` is raised here.
    """
    outcome: dict[str, object] = {}

    def target() -> None:
        try:
            outcome["code"] = train()
        except BaseException as error:  # handed to the main thread, which reports it
            outcome["error"] = error

    # A daemon thread, so that an impatient Ctrl+C is not held up by the checkpoint it interrupts.
    thread = threading.Thread(target=target, name="tscale-peer-training", daemon=True)
    source = TrainingPeerSource(status, is_training=thread.is_alive)
    # Signals reach only the main thread: SIGTERM asks the training thread to checkpoint and leave (the
    # dashboard closes when it has), as `join`'s own handler does when it runs in the main thread.
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: status.stop_requested.set())
    try:
        # Long work of the training thread (state download, tokenizing) shows in the dashboard, not as a rich
        # bar whose escape codes would land in the log pane; routed before that thread starts.
        with showing_progress_on(source.progress_board):
            thread.start()
            run_dashboard(source)
        if thread.is_alive():
            status.stop_requested.set()
            log.info("leaving the swarm: finishing the round in flight and saving a checkpoint")
        thread.join()
    finally:
        status.stop_requested.set()
        signal.signal(signal.SIGTERM, previous)
    if "error" in outcome:
        raise outcome["error"]
    return outcome["code"]
