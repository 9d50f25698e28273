"""The `?` screen: what each panel shows and which keys do what."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Markdown

HELP = """\
# tscale-peer dashboard

| key | action |
| --- | --- |
| `p` | pause / resume local training (the peer stays in the swarm and keeps serving its state) |
| `s` | sort the peers table by the next column (or click a column header; again to reverse) |
| `q` | quit: save a checkpoint and leave the swarm |
| `?` | this help (`escape` closes it) |

**Swarm**: peers with a live record, their summed tokens/s, the latest averaging round and the tokens
trained by the peers online.

**Peers**: one row per peer, this one in bold. *link*: `direct` or through a libp2p `relay` (NAT).
*tokens*: tokens trained since the peer joined. *seen*: age of its last record (records expire
after a minute of silence).

**This peer**: local step, training loss, tokens/s, peak GPU memory, precision, whether weights and
optimizer state are offloaded to CPU, and time until the next averaging round.

**Averaging**: one row per round: peers in the group, bytes sent and received, duration, wire bits
per parameter (scales included) and peers dropped from the round.
"""


class HelpScreen(ModalScreen[None]):
    """Keys and the meaning of each panel, over the dashboard."""

    BINDINGS = [
        Binding("escape,question_mark,q", "dismiss", "Close"),
    ]

    def compose(self) -> ComposeResult:
        with VerticalScroll(id="help"):
            yield Markdown(HELP)
