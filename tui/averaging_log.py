"""The averaging log: one row per finished round, newest first."""

from __future__ import annotations

from rich.text import Text
from textual.widgets import DataTable

from tscale_p2p.peers.status import AveragingRecord
from tscale_p2p.tui import format as fmt

_COLUMNS = ("round", "group", "up", "down", "time", "b/trip", "up b/p", "drop")


class AveragingLog(DataTable):
    """Round, group size, bytes up/down, duration, dropped peers, and two wire rates: bits per value of one trip
    (`b/trip`: a part sent to its reducer, or an average answered; the codec's rate, ~1.07) and this peer's uplink
    in bits per model parameter (`up b/p`: both trips, 2(n-1)/n models' worth in a group of n)."""

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
                f"{record.bits_per_value:.2f}" if record.bits_per_value else "-",
                f"{record.bits_per_param:.2f}",
            )
            self.add_row(*(Text(c, justify="right") for c in cells), dropped)
