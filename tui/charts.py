"""Sparkline charts of loss and of local and swarm tokens/s over time."""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from statistics import fmean

from textual.app import ComposeResult
from textual.containers import Horizontal, Vertical
from textual.widgets import Label, Sparkline

from tscale_p2p.tui import format as fmt


class Chart(Horizontal):
    """A titled sparkline of the last `history` samples, with the latest value beside the title."""

    def __init__(self, title: str, show_value: Callable[[float], str], history: int = 3600, **kwargs) -> None:
        super().__init__(**kwargs)
        self.title, self.show_value = title, show_value
        self.samples: deque[float] = deque(maxlen=history)

    def compose(self) -> ComposeResult:
        yield Label(self.title, classes="chart-label")
        # When samples outnumber cells each bar is the mean of its bucket: spikes should not hide trends.
        yield Sparkline([], summary_function=fmean)

    def push(self, value: float) -> None:
        """Add a sample; one that is not a finite number (a diverged loss) is skipped: bars need a scale."""
        if not math.isfinite(value):
            return
        self.samples.append(value)
        low, high = min(self.samples), max(self.samples)
        label = f"{self.title} [b]{self.show_value(value)}[/]"
        if self.content_size.height >= 2:  # room for the range the bars are scaled to
            label += f"\n[dim]{self.show_value(low)}–{self.show_value(high)}[/]"
        self.query_one(Label).update(label)
        # Sparkline draws a single sample as a full-height block: wait for a second one.
        self.query_one(Sparkline).data = list(self.samples) if len(self.samples) > 1 else []


class ChartsPanel(Vertical):
    """Loss, local tokens/s and swarm tokens/s; a watch-only dashboard hides the local chart."""

    def compose(self) -> ComposeResult:
        yield Chart("loss", fmt.loss, id="loss-chart")
        yield Chart("local tok/s", fmt.count, id="local-chart")
        yield Chart("swarm tok/s", fmt.count, id="swarm-chart")
