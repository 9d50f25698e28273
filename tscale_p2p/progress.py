"""Progress of long work (downloading the swarm's state, tokenizing a corpus, building an index, training a
tokenizer), shown where the user is looking.

Code that does long work says what it does and how far it has got; it never picks a display:

    from tscale_p2p.progress import long_work

    with long_work("tokenizing corpus.txt", total=n_bytes, unit="bytes", delay=2.0) as work:
        for chunk in chunks:
            ...
            work.advance(len(chunk))
        work.update(description="tokenized corpus.txt")  # optional: the line it ends on

`total=None` is work of unknown size (a spinner, an indeterminate bar); `update(total=...)` may set it later.
`delay` keeps quick jobs quiet: nothing is shown before that many seconds have passed (checked when the work
reports). `transient=True` removes the line when the work ends; otherwise its last description stays.
Work done by a library that draws a progress bar of its own (Hugging Face tokenizers' trainer) passes
`library_bar=True`: on a terminal `long_work` then shows nothing and `work.on_terminal` tells the caller to
switch the library's bar on; under the dashboard the library's bar stays off and the work reports as usual.

Where it shows: a rich progress bar on stderr by default (`TerminalProgress`). While the dashboard owns the
terminal it routes all long work of the process into a `ProgressBoard` (`showing_progress_on`), which its
progress line reads, because a rich bar would write raw escape codes into the dashboard's log pane.
Long work may run in any thread; reporting is cheap enough to call for every chunk.
"""

from __future__ import annotations

import logging
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

log = logging.getLogger(__name__)

UNITS = ("bytes", "items")


@dataclass(frozen=True)
class WorkProgress:
    """One piece of long work at one moment."""

    description: str
    completed: float
    total: float | None  # None: size unknown
    unit: str  # "bytes" or "items"
    elapsed_s: float


class LongWork:
    """A piece of long work in progress, as `long_work` hands it out: report with `advance` and `update`."""

    def __init__(self, description: str, total: float | None, unit: str, delay: float, transient: bool,
                 display: ProgressDisplay, on_terminal: bool = False) -> None:
        if unit not in UNITS:
            raise ValueError(f"unit must be one of {UNITS}, got {unit!r}")
        self.description, self.total, self.unit = description, total, unit
        self.delay, self.transient = delay, transient
        self.completed = 0.0
        self.started = time.monotonic()
        self._display = display
        self.on_terminal = on_terminal  # with `library_bar`: the library should draw its own bar
        self._shown = False
        self._lock = threading.Lock()  # a display may read the work from another thread

    def advance(self, amount: float = 1) -> None:
        """`amount` more units done."""
        with self._lock:
            self.completed += amount
        self._report()

    def update(self, *, completed: float | None = None, total: float | None = None,
               description: str | None = None) -> None:
        """Set how much is done, the total (once known) or what is being done."""
        with self._lock:
            if completed is not None:
                self.completed = completed
            if total is not None:
                self.total = total
            if description is not None:
                self.description = description
        self._report()

    def snapshot(self) -> WorkProgress:
        with self._lock:
            return WorkProgress(self.description, self.completed, self.total, self.unit,
                                time.monotonic() - self.started)

    def _report(self) -> None:
        if self._shown:
            self._display.refresh(self)
        elif time.monotonic() - self.started >= self.delay:
            self._shown = True
            self._display.begin(self)

    def _end(self) -> None:
        if self._shown:
            self._display.end(self)


class ProgressDisplay(ABC):
    """Somewhere long work is shown. Called from the thread that does the work."""

    @abstractmethod
    def begin(self, work: LongWork) -> None:
        """Start showing `work` (its delay has passed)."""

    @abstractmethod
    def refresh(self, work: LongWork) -> None:
        """`work` reported progress."""

    @abstractmethod
    def end(self, work: LongWork) -> None:
        """`work` is over: remove it, or leave its last line if it is not transient."""


class TerminalProgress(ProgressDisplay):
    """A rich progress bar on stderr for each piece of work (rich prints only the final line when stderr is
    not a terminal)."""

    def __init__(self) -> None:
        self._bars: dict[LongWork, tuple[object, object]] = {}

    def begin(self, work: LongWork) -> None:
        from rich.console import Console
        from rich.progress import (BarColumn, DownloadColumn, MofNCompleteColumn, Progress, SpinnerColumn,
                                   TextColumn, TimeElapsedColumn)

        amount = DownloadColumn() if work.unit == "bytes" else MofNCompleteColumn()
        bar = Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), amount, TimeElapsedColumn(),
                       console=Console(stderr=True), transient=work.transient)
        bar.start()
        now = work.snapshot()
        self._bars[work] = bar, bar.add_task(now.description, total=now.total, completed=now.completed)

    def refresh(self, work: LongWork) -> None:
        bar, task = self._bars[work]
        now = work.snapshot()
        bar.update(task, description=now.description, total=now.total, completed=now.completed)

    def end(self, work: LongWork) -> None:
        self.refresh(work)
        bar, _ = self._bars.pop(work)
        bar.stop()


class _Unseen(ProgressDisplay):
    """Shows nothing: for work whose library draws its own bar on the terminal."""

    def begin(self, work: LongWork) -> None:
        pass

    def refresh(self, work: LongWork) -> None:
        pass

    def end(self, work: LongWork) -> None:
        pass


class ProgressBoard(ProgressDisplay):
    """The long work in progress, for a display in another thread to read (the dashboard's progress line).

    Work that is not transient logs its last description when it ends, so the log keeps what the
    terminal's bar would have left on the screen."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._works: list[LongWork] = []

    def begin(self, work: LongWork) -> None:
        with self._lock:
            self._works.append(work)

    def refresh(self, work: LongWork) -> None:
        """Nothing to do: readers take a fresh `snapshot()`."""

    def end(self, work: LongWork) -> None:
        with self._lock:
            self._works.remove(work)
        if not work.transient:
            now = work.snapshot()
            log.info("%s (%.1f s)", now.description, now.elapsed_s)

    def snapshot(self) -> tuple[WorkProgress, ...]:
        """The work in progress now, oldest first."""
        with self._lock:
            works = list(self._works)
        return tuple(work.snapshot() for work in works)


_display_lock = threading.Lock()
_display: ProgressDisplay = TerminalProgress()


@contextmanager
def long_work(description: str, total: float | None = None, *, unit: str = "bytes", delay: float = 0.0,
              transient: bool = False, library_bar: bool = False) -> Iterator[LongWork]:
    """Report a piece of long work (see the module's docstring) to the display in use when it starts."""
    with _display_lock:
        display = _display
    on_terminal = library_bar and isinstance(display, TerminalProgress)
    work = LongWork(description, total, unit, delay, transient, _Unseen() if on_terminal else display, on_terminal)
    work._report()
    try:
        yield work
    finally:
        work._end()


@contextmanager
def showing_progress_on(display: ProgressDisplay) -> Iterator[None]:
    """Send the long work that starts from now on, in any thread, to `display` instead of the terminal."""
    global _display
    with _display_lock:
        previous, _display = _display, display
    try:
        yield
    finally:
        with _display_lock:
            _display = previous
