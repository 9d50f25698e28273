"""The swarm summary bar: run, model, peers online, swarm tokens/s, round, tokens trained."""

from __future__ import annotations

from dataclasses import dataclass

from textual.content import Content
from textual.widgets import Static

from tscale_p2p.peers.metrics import PeerRecord
from tscale_p2p.peers.status import StatusSnapshot
from tscale_p2p.tui import format as fmt


@dataclass(frozen=True)
class SwarmTotals:
    """Swarm-wide figures from the live peer records, with this peer's live status taking the place
    of its own (possibly seconds old, or not yet published) record."""

    peers: int
    tokens_per_s: float
    round: int
    tokens: int

    @classmethod
    def of(cls, records: list[PeerRecord], local: StatusSnapshot | None, now: float) -> "SwarmTotals":
        """Totals at unix time `now`: a peer whose record has gone stale (killed, or stopped) no longer adds to
        the swarm's tokens/s, though it stays listed until its record expires."""
        others = [r for r in records if local is None or r.peer_id != local.peer_id]
        tokens_per_s = sum(r.live_tokens_per_s(now) for r in others)
        tokens = sum(r.tokens_contributed for r in others)
        rounds = [r.round for r in others]
        if local is not None:
            tokens_per_s += 0.0 if local.paused else local.tokens_per_s
            tokens += local.tokens_contributed
            rounds.append(local.round)
        return cls(len(others) + (local is not None), tokens_per_s, max(rounds, default=0), tokens)


class SwarmSummary(Static):
    """One line of swarm-wide figures (it wraps rather than hides anything on a narrow terminal)."""

    def show(self, run_id: str, model: str, totals: SwarmTotals) -> None:
        self.update(
            Content.from_markup(
                "[b]$run[/] [dim]model[/] $model [dim]·[/] [b]$peers[/] $noun [dim]·[/] [b]$speed[/] tok/s"
                " [dim]·[/] round [b]$round[/] [dim]·[/] [b]$tokens[/] tokens",
                run=run_id or "?",
                model=model or "?",
                peers=str(totals.peers),
                noun="peer" if totals.peers == 1 else "peers",
                speed=fmt.count(totals.tokens_per_s),
                round=str(totals.round),
                tokens=fmt.count(totals.tokens),
            )
        )
