"""The progress line: long work of this process (the state download, tokenizing a corpus...) while it runs.

It reads what `tscale_p2p.progress.long_work` reports through the metrics source, and is hidden when nothing
is in progress, so the rest of the layout keeps its rows.
"""

from __future__ import annotations

from collections.abc import Sequence

from textual.app import ComposeResult
from textual.containers import Horizontal
from textual.widgets import Label, ProgressBar

from tscale_p2p.progress import WorkProgress
from tscale_p2p.tui import format as fmt


def amount(work: WorkProgress) -> str:
    """How far it has got, in its unit: 1.2MB/26MB, 310/4k, 3.4MB (total unknown)."""
    show = fmt.size if work.unit == "bytes" else fmt.count
    done = show(work.completed)
    return done if work.total is None else f"{done}/{show(work.total)}"


class WorkProgressLine(Horizontal):
    """One row: what is being done, a bar (indeterminate while the size is unknown), amount and time."""

    DEFAULT_CSS = """
    WorkProgressLine {
        height: 1;
        padding: 0 1;
        display: none;
    }
    WorkProgressLine.-busy {
        display: block;
    }
    WorkProgressLine > #work-description {
        width: auto;
        max-width: 50%;
        padding-right: 1;
        text-style: bold;
    }
    /* The bar takes what the description and the amount leave. */
    WorkProgressLine > ProgressBar, WorkProgressLine Bar {
        width: 1fr;
    }
    WorkProgressLine > #work-amount {
        width: auto;
        padding-left: 1;
        color: $text-muted;
    }
    """

    def compose(self) -> ComposeResult:
        yield Label(id="work-description")
        yield ProgressBar(show_eta=False)
        yield Label(id="work-amount")

    def show(self, works: Sequence[WorkProgress]) -> None:
        """Show the oldest piece of work in progress (and how many more there are), or hide when none."""
        self.set_class(bool(works), "-busy")
        if not works:
            return
        work = works[0]
        more = f" (+{len(works) - 1} more)" if len(works) > 1 else ""
        self.query_one("#work-description", Label).update(work.description + more)
        self.query_one(ProgressBar).update(total=work.total, progress=work.completed)
        self.query_one("#work-amount", Label).update(f"{amount(work)} · {fmt.duration(work.elapsed_s)}")
