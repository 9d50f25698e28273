"""What a swarm peer tells others: its live status (the dashboard reads it), its log lines, and its signed metrics
record in the DHT (`tscale-peer peers` and other peers' dashboards read those).

`SwarmReport` keeps the peer's traffic and token counters. `SwarmPeer` (peers/swarm.py) calls `step()` once per
reporting window and `round()` once per applied round; a thread of its own publishes the record every few
seconds, reads everyone's into the status, re-announces the state offer, exchanges the peers' bans (then, and
after each round: `share_bans_soon`), and every hour re-publishes the run config (it outlives its founder).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable

import torch

from tscale_p2p import __version__
from tscale_p2p.peers.averaging import RoundOutcome
from tscale_p2p.peers.metrics import PeerRecord
from tscale_p2p.peers.run_config import SignedRun, publish_run_config
from tscale_p2p.peers.status import AveragingRecord, LocalStatus

log = logging.getLogger(__name__)

CONFIG_REFRESH_S = 3600.0


class SwarmReport:
    """Status, log lines and the published record of one peer (`identity`, a `SwarmIdentity`) of `numel` weights.

    `metrics` is its `SwarmMetrics`; `banned_count()` how many peers it has banned; `announce_state()` re-offers
    its state (peers/state_download.py); `share_bans()` exchanges the peers' bans (peers/ban_notes.py)."""

    def __init__(self, status: LocalStatus, metrics, identity, precision: str, numel: int, *,
                 banned_count: Callable[[], int], announce_state: Callable[[], None],
                 share_bans: Callable[[], None], signed_run: SignedRun | None = None,
                 publish_every_s: float = 5.0) -> None:
        self.status, self.metrics, self.identity, self.precision, self.numel = status, metrics, identity, precision, numel
        self.banned_count, self.announce_state, self.share_bans = banned_count, announce_state, share_bans
        self.signed_run, self.publish_every_s = signed_run, publish_every_s
        self.bytes_sent = self.bytes_received = 0
        self.last_averaging: float | None = None
        self.tokens_contributed = 0
        self._stop = threading.Event()
        self._bans_due = threading.Event()
        self._wake = threading.Event()  # stop, or bans to share (`share_bans_soon`)
        self._config_published = -float("inf")
        self._thread = threading.Thread(target=self._publish_loop, name="swarm-metrics", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout=10)

    def step(self, *, step: int, round_number: int, loss: float, tokens_per_s: float, device: torch.device,
             seconds_to_next_averaging: float | None, in_flight: bool, log_line: bool) -> None:
        """The status after a window of steps, and a log line when `log_line`."""
        self.status.update(
            step=step,
            loss=loss,
            tokens_per_s=tokens_per_s,
            tokens_contributed=self.tokens_contributed,
            gpu_memory_bytes=torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None,
            seconds_to_next_averaging=seconds_to_next_averaging,
        )
        if log_line:
            log.info("step %d  round %d  loss %.4f  %.0f tok/s%s", step, round_number, loss, tokens_per_s,
                     "  (averaging in the background)" if in_flight else "")

    def round(self, number: int, outcome: RoundOutcome, weights: str, steps_late: int | None = None) -> None:
        """Round `number` applied with `outcome`, leaving global weights of fingerprint `weights`, `steps_late`
        local steps into the next round (None: on leaving)."""
        self.bytes_sent += outcome.bytes_sent
        self.bytes_received += outcome.bytes_received
        if outcome.averaged is not None:
            self.last_averaging = time.time()
        bits_per_value = 8 * outcome.bytes_sent / outcome.values_sent if outcome.values_sent else 0.0
        self.status.record_averaging(
            AveragingRecord(
                round=number,
                group_size=outcome.group_size,
                bytes_up=outcome.bytes_sent,
                bytes_down=outcome.bytes_received,
                duration_s=outcome.seconds,
                bits_per_param=8 * outcome.bytes_sent / self.numel,
                dropped_peers=outcome.dropped_peers,
                bits_per_value=bits_per_value,
            )
        )
        self.status.update(round=number, averaging_in_flight=False)
        if outcome.averaged is None:
            log.info("round %d: averaged with nobody (%s)%s", number, outcome.error or "no peers",
                     "; continuing alone" if steps_late is not None else "")
            return
        # A groupmate lost mid-round leaves a span of our average zero (a reducer) or without its part (a sender):
        # say so, since that round then carried less than the group's whole update.
        lost = f", lost {outcome.dropped_peers} of them mid-round" if outcome.dropped_peers else ""
        # The steps trained meanwhile on the previous global weights: what a slow round costs (they are kept, but
        # were computed from older weights than the swarm's).
        late = f", applied {steps_late} steps into round {number + 1}" if steps_late is not None else ""
        log.info("round %d: averaged with %d peer(s)%s in %.1f s, sent %.1f KiB (%.2f bits a value), received %.1f "
                 "KiB%s, weights %s", number, outcome.group_size - 1, lost, outcome.seconds, outcome.bytes_sent / 1024,
                 bits_per_value, outcome.bytes_received / 1024, late, weights)

    def record(self) -> PeerRecord:
        """This peer's metrics record, as published."""
        snap = self.status.snapshot()
        return PeerRecord(
            peer_id=self.identity.peer_id,
            name=self.identity.name,
            device=self.identity.device,
            precision=self.precision,
            offload=snap.offload,
            tokens_per_s=float(snap.tokens_per_s),
            loss=snap.loss,
            round=snap.round,
            step=snap.step,
            tokens_contributed=snap.tokens_contributed,
            bytes_sent=self.bytes_sent,
            bytes_received=self.bytes_received,
            last_averaging=self.last_averaging,
            version=__version__,
            relayed=self.identity.relayed,
            updated_at=time.time(),
            dropped_peers=snap.averaging[-1].dropped_peers if snap.averaging else 0,
            banned_peers=self.banned_count(),
        )

    def share_bans_soon(self) -> None:
        """Exchange the peers' bans now, not at the next record: a peer that banned on its partners' word and a
        strike of its own (peers/ban_notes.py) followed the attacker into refused pairs while the note was on its
        way, a round of 2.5 s against a record every 5 s (benchmarks/RESULTS.md). `SwarmPeer` calls it each round."""
        self._bans_due.set()
        self._wake.set()

    def _publish_loop(self) -> None:
        next_record = time.monotonic()
        while not self._stop.is_set():
            try:
                if time.monotonic() >= next_record:
                    next_record = time.monotonic() + self.publish_every_s
                    self._publish_record()
                elif self._bans_due.is_set():
                    self._bans_due.clear()
                    self.share_bans()
            except Exception as error:  # the DHT may be shutting down; metrics must never stop training
                log.debug("publishing metrics failed: %s", error)
            self._wake.wait(max(0.0, next_record - time.monotonic()))
            self._wake.clear()  # a wake set after this is still seen: `_bans_due` is read before the next wait

    def _publish_record(self) -> None:
        """Publish our record, the state offer and our bans; read everyone's records and bans; re-publish the run
        config when it is due."""
        self._bans_due.clear()
        self.metrics.publish(self.record())
        self.announce_state()
        self.share_bans()
        self.status.update(swarm_records=tuple(self.metrics.fetch()))
        if self.signed_run is not None and time.monotonic() - self._config_published > CONFIG_REFRESH_S:
            publish_run_config(self.metrics.dht, self.identity.run_id, self.signed_run)
            self._config_published = time.monotonic()
