"""The log pane: recent log lines, warnings and errors coloured."""

from __future__ import annotations

from collections.abc import Sequence

from rich.text import Text
from textual.widgets import RichLog


class LogPane(RichLog):
    """Appends only the lines it has not shown yet; rewrites itself if the bounded history rotated."""

    def __init__(self, **kwargs) -> None:
        # Wrap at the pane's width: a clipped error message is worse than one that takes two rows.
        super().__init__(wrap=True, min_width=20, markup=False, highlight=False, max_lines=1000, **kwargs)
        self._shown: tuple[str, ...] = ()

    def show(self, lines: Sequence[str]) -> None:
        lines = tuple(lines)
        if lines == self._shown:
            return
        if lines[: len(self._shown)] == self._shown:
            new = lines[len(self._shown) :]
        else:
            self.clear()
            new = lines
        self._shown = lines
        # Wrap at the pane's width (RichLog would measure the line against the whole console).
        width = self.scrollable_content_region.width or None
        for line in new:
            self.write(self._styled(line), width=width)

    def on_resize(self) -> None:
        # RichLog wraps a line once, when it is written: wrap everything again at the new width.
        lines, self._shown = self._shown, ()
        self.clear()
        self.show(lines)

    def _styled(self, line: str) -> Text:
        colors = self.app.theme_variables
        if " ERROR " in line or " CRITICAL " in line or " FATAL " in line:
            return Text(line, style=f"bold {colors['error']}")
        if " WARN" in line:  # hivemind renames the WARNING level to WARN
            return Text(line, style=colors["warning"])
        return Text(line, style="dim")
