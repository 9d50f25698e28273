"""The peers table: one row per live peer record, sortable by any column, this peer highlighted."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

from rich.text import Text
from textual import events
from textual.widgets import DataTable

from tscale_p2p.peers.metrics import PeerRecord
from tscale_p2p.tui import format as fmt

_VENDOR_PREFIXES = ("NVIDIA ", "GeForce ", "AMD ", "Radeon ", "Intel ")


def short_peer_id(peer_id: str) -> str:
    """The tail of a libp2p peer id: the head is the same multihash prefix for every peer."""
    return "…" + peer_id[-5:]


def short_device(device: str) -> str:
    """`NVIDIA GeForce RTX 4090` -> `RTX 4090`: the vendor is implied by the model name."""
    for prefix in _VENDOR_PREFIXES:
        if device.startswith(prefix):
            device = device[len(prefix) :]
    return device


def _clip(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 1] + "…"


@dataclass(frozen=True)
class PeerColumn:
    """How one column shows and sorts a record. `numeric` columns align right; `high_first` columns
    sort in descending order on the first click (the best value of tokens/s is the highest, of loss
    the lowest)."""

    key: str
    label: str
    cell: Callable[[PeerRecord, float], str]  # (record, now) -> text
    sort_key: Callable[[PeerRecord, float], Any]
    numeric: bool = False
    high_first: bool = False


def _loss_key(record: PeerRecord, now: float) -> float:
    return math.inf if record.loss is None else record.loss


def _number(key: str, label: str, cell, sort_key, high_first: bool = True) -> PeerColumn:
    return PeerColumn(key, label, cell, sort_key, numeric=True, high_first=high_first)


_PEER = PeerColumn("peer", "peer", lambda r, now: short_peer_id(r.peer_id), lambda r, now: r.peer_id)
_NAME = PeerColumn("name", "name", lambda r, now: _clip(r.name, 10), lambda r, now: r.name.lower())
_WIDE_NAME = PeerColumn("name", "name", lambda r, now: _clip(r.name, 24), lambda r, now: r.name.lower())
_LINK = PeerColumn("link", "link", lambda r, now: "relay" if r.relayed else "direct", lambda r, now: r.relayed)
_DEVICE = PeerColumn("device", "device", lambda r, now: _clip(short_device(r.device), 12), lambda r, now: r.device)
_DEVICE_AND_PRECISION = PeerColumn(
    "device", "device", lambda r, now: f"{_clip(short_device(r.device), 7)} {r.precision}", lambda r, now: r.device
)
_PRECISION = PeerColumn("precision", "prec", lambda r, now: r.precision, lambda r, now: r.precision)
_OFFLOAD = PeerColumn("offload", "offload", lambda r, now: "cpu" if r.offload else "-", lambda r, now: r.offload)
_TOKENS_PER_S = _number("tokens_per_s", "tok/s", lambda r, now: fmt.count(r.tokens_per_s), lambda r, now: r.tokens_per_s)
_TOKENS = _number(
    "tokens", "tokens", lambda r, now: fmt.count(r.tokens_contributed), lambda r, now: r.tokens_contributed
)
_LOSS = _number("loss", "loss", lambda r, now: fmt.loss(r.loss), _loss_key, high_first=False)
_ROUND = _number("round", "round", lambda r, now: str(r.round), lambda r, now: r.round)
_STEP = _number("step", "step", lambda r, now: str(r.step), lambda r, now: r.step)
_SENT = _number("sent", "sent", lambda r, now: fmt.size(r.bytes_sent), lambda r, now: r.bytes_sent)
_RECEIVED = _number("received", "recv", lambda r, now: fmt.size(r.bytes_received), lambda r, now: r.bytes_received)
_BANNED = _number("banned", "bans", lambda r, now: str(r.banned_peers), lambda r, now: r.banned_peers)
_VERSION = PeerColumn("version", "version", lambda r, now: r.version, lambda r, now: r.version)
_SEEN = _number(  # the most recently seen first
    "seen", "seen", lambda r, now: fmt.age(now - r.updated_at), lambda r, now: now - r.updated_at, False
)

# Narrow terminals fold precision into the device column; wide ones add traffic, step and version.
COMPACT_COLUMNS = (_PEER, _NAME, _LINK, _DEVICE_AND_PRECISION, _TOKENS_PER_S, _TOKENS, _LOSS, _ROUND, _SEEN)
WIDE_COLUMNS = (
    _PEER, _WIDE_NAME, _LINK, _DEVICE, _PRECISION, _OFFLOAD, _TOKENS_PER_S, _TOKENS, _LOSS,
    _ROUND, _STEP, _SENT, _RECEIVED, _BANNED, _VERSION, _SEEN,
)  # fmt: skip
WIDE_FROM = 120  # table width (cells) at which the wide column set fits
DEFAULT_SORT = ("tokens_per_s", True)  # the busiest peers first
STALE_AFTER_S = 20.0  # peers republish every few seconds: a record this old is probably from a peer gone


class PeersTable(DataTable):
    """Live peers, re-sorted on every update. Click a header (or press `s`) to sort; again to reverse."""

    COMPONENT_CLASSES: ClassVar[set[str]] = DataTable.COMPONENT_CLASSES | {"peers-table--self", "peers-table--stale"}

    def __init__(self, **kwargs) -> None:
        # No cursor: it would hide the highlight of this peer's row, and rows have no action to select.
        super().__init__(cursor_type="none", zebra_stripes=True, **kwargs)
        self.records: list[PeerRecord] = []
        self.now = 0.0
        self.self_peer_id: str | None = None
        self.columns_shown: tuple[PeerColumn, ...] = COMPACT_COLUMNS
        self.sort_column, self.sort_reverse = DEFAULT_SORT

    def show(self, records: list[PeerRecord], now: float, self_peer_id: str | None) -> None:
        self.records, self.now, self.self_peer_id = list(records), now, self_peer_id
        self._fill()

    def sorted_records(self) -> list[PeerRecord]:
        column = next(c for c in self.columns_shown if c.key == self.sort_column)
        # Ties keep a stable order by peer id, so rows do not jump between refreshes.
        by_id = sorted(self.records, key=lambda r: r.peer_id)
        return sorted(by_id, key=lambda r: column.sort_key(r, self.now), reverse=self.sort_reverse)

    def sort_by(self, key: str) -> None:
        """Sort by a column; the same column again reverses the order."""
        if key == self.sort_column:
            self.sort_reverse = not self.sort_reverse
        else:
            self.sort_column = key
            self.sort_reverse = next(c for c in self.columns_shown if c.key == key).high_first
        self._fill(columns=True)

    def sort_by_next_column(self) -> None:
        keys = [c.key for c in self.columns_shown]
        self.sort_by(keys[(keys.index(self.sort_column) + 1) % len(keys)])

    def on_data_table_header_selected(self, event: DataTable.HeaderSelected) -> None:
        event.stop()
        self.sort_by(str(event.column_key.value))

    def on_resize(self, event: events.Resize) -> None:
        wanted = WIDE_COLUMNS if event.size.width >= WIDE_FROM else COMPACT_COLUMNS
        if wanted is not self.columns_shown:
            self.columns_shown = wanted
            if self.sort_column not in {c.key for c in wanted}:
                self.sort_column, self.sort_reverse = DEFAULT_SORT
            self._fill(columns=True)

    def on_mount(self) -> None:
        self._fill(columns=True)

    def _fill(self, columns: bool = False) -> None:
        # Rebuilding is simpler than patching rows in place, but `clear()` scrolls to the top: keep the
        # reader's place in a long table (restored once the new rows are measured).
        scrolled_to = self.scroll_offset
        self.clear(columns=columns)
        if columns:
            for column in self.columns_shown:
                arrow = ("▼" if self.sort_reverse else "▲") if column.key == self.sort_column else ""
                justify = "right" if column.numeric else "left"
                self.add_column(Text(column.label + arrow, justify=justify), key=column.key)
        self_style = self.get_component_rich_style("peers-table--self", partial=True)
        stale_style = self.get_component_rich_style("peers-table--stale", partial=True)
        for record in self.sorted_records():
            if record.peer_id == self.self_peer_id:
                style = self_style
            else:
                style = stale_style if self.now - record.updated_at > STALE_AFTER_S else ""
            cells = [
                Text(column.cell(record, self.now), style=style, justify="right" if column.numeric else "left")
                for column in self.columns_shown
            ]
            self.add_row(*cells, key=record.peer_id)
        if scrolled_to != (0, 0):
            self.call_after_refresh(self.scroll_to, scrolled_to.x, scrolled_to.y, animate=False, immediate=True)
