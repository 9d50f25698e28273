"""The `?` screen: what each panel shows and which keys do what."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Markdown

HELP = """\
**Keys**

- `p` pause / resume local training: the peer stays in the swarm and keeps serving its state
- `s` sort the peers by the next column (or click a column header; click again to reverse)
- `q` quit: save a checkpoint and leave the swarm
- `?` this help (`escape` closes it)

**Swarm**: peers with a live record, their summed tokens/s, the latest averaging round, and the tokens
trained by the peers online.

**Peers**: one row per peer, this one highlighted. *link*: `direct`, or through a libp2p `relay` (behind
NAT). *tokens*: tokens trained since the peer joined. *seen*: age of its last record (greyed after 20 s:
the peer has probably left; its record expires after a minute).

**This peer**: local step, training loss, tokens/s, peak GPU memory, precision, whether master weights and
optimizer state live in CPU memory (*offload*), and the time to the next averaging round.

**Charts**: loss (the mean over peers when only watching) and local and swarm tokens/s, oldest on the left.

**Averaging**: one row per round: peers in the group, bytes sent and received, duration, wire bits per
parameter (*bits*, scales included) and peers dropped from the round.
"""


class HelpScreen(ModalScreen[None]):
    """Keys and the meaning of each panel, over the dashboard."""

    BINDINGS = [
        Binding("escape,question_mark,q", "dismiss", "Close"),
    ]

    def compose(self) -> ComposeResult:
        with VerticalScroll(id="help"):
            yield Markdown(HELP)
