"""This peer: step, loss, tokens/s, GPU memory, precision, offload, time to the next averaging."""

from __future__ import annotations

from rich.table import Table
from rich.text import Text
from textual.widgets import Static

from tscale_p2p.peers.status import StatusSnapshot
from tscale_p2p.tui import format as fmt
from tscale_p2p.tui.peers_table import short_peer_id


def _step(status: StatusSnapshot) -> str:
    return f"{status.step:,}" if status.max_steps is None else f"{status.step}/{status.max_steps}"


def _next_averaging(status: StatusSnapshot) -> str:
    if status.paused:
        return "paused"
    if status.seconds_to_next_averaging is None:
        return "-"
    return fmt.duration(max(0.0, status.seconds_to_next_averaging))


class LocalPanel(Static):
    """A two-column grid of this peer's figures; the border title says training, averaging or paused.

    Four rows fit an 80x24 terminal; a taller panel also shows device, tokens, peer id and address.
    """

    status: StatusSnapshot | None = None

    def show(self, status: StatusSnapshot) -> None:
        self.status = status
        gpu = "cpu" if status.gpu_memory_bytes is None else fmt.size(status.gpu_memory_bytes)
        pairs = [
            ("step", _step(status), "round", str(status.round)),
            ("loss", fmt.loss(status.loss), "tok/s", fmt.count(0.0 if status.paused else status.tokens_per_s)),
            ("GPU mem", gpu, "prec", status.precision or "-"),
            ("offload", "cpu" if status.offload else "off", "next avg", _next_averaging(status)),
        ]
        if self.content_size.height >= 7:
            address = status.visible_maddrs[0] if status.visible_maddrs else "-"
            pairs += [
                ("device", status.device or "-", "tokens", fmt.count(status.tokens_contributed)),
                ("peer id", short_peer_id(status.peer_id), "H", str(status.inner_steps)),
                ("address", address, "", ""),
            ]
        grid = Table.grid(padding=(0, 1), expand=True)
        grid.add_column(style="dim", no_wrap=True)
        grid.add_column(style="bold", no_wrap=True, ratio=1)
        grid.add_column(style="dim", no_wrap=True)
        grid.add_column(style="bold", no_wrap=True, ratio=1)
        for label, value, label2, value2 in pairs:
            grid.add_row(label, value, label2, value2)
        self.update(grid)
        if status.paused:
            state = "paused"
        elif not status.peer_id:
            state = "joining"  # the DHT, the run config or the state download is still on its way
        else:
            state = "averaging" if status.averaging_in_flight else "training"
        self.border_title = f"this peer · {state}"
        self.border_subtitle = status.name or None
        self.set_class(status.paused, "-paused")

    def on_resize(self) -> None:
        if self.status is not None:
            self.show(self.status)

    def show_watching(self) -> None:
        self.update(Text("watching only: this dashboard does not train", style="dim italic"))
        self.border_title = "this peer"
