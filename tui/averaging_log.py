"""The averaging log: one row per finished round, newest first."""

from __future__ import annotations

from rich.text import Text
from textual.widgets import DataTable

from tscale_p2p.peers.status import AveragingRecord
from tscale_p2p.tui import format as fmt

_COLUMNS = ("round", "group", "up", "down", "time", "bits", "drop")


class AveragingLog(DataTable):
    """Round, group size, bytes up/down, duration, wire bits per parameter (`bits`) and dropped peers."""

    def __init__(self, **kwargs) -> None:
        super().__init__(cursor_type="none", zebra_stripes=True, show_cursor=False, **kwargs)
        self._shown: tuple[AveragingRecord, ...] = ()

    def on_mount(self) -> None:
        for label in _COLUMNS:
            self.add_column(Text(label, justify="right"), key=label)

    def show(self, records: tuple[AveragingRecord, ...]) -> None:
        if records == self._shown:
            return
        self._shown = records
        self.clear()
        for record in reversed(records):
            dropped = Text(str(record.dropped_peers), "bold red" if record.dropped_peers else "dim", justify="right")
            cells = (
                str(record.round),
                str(record.group_size),
                fmt.size(record.bytes_up),
                fmt.size(record.bytes_down),
                fmt.duration(record.duration_s),
                f"{record.bits_per_param:.2f}",
            )
            self.add_row(*(Text(c, justify="right") for c in cells), dropped)
