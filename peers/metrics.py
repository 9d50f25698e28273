"""Swarm metrics: every peer publishes a signed `PeerRecord` in the DHT; anyone can read them all.

Records live under one DHT key per run (``{run_id}_peers``), one subkey per peer. The subkey is the
peer's RSA public key in hivemind's ``[owner:...]`` form, so hivemind's `RSASignatureValidator` signs
the value and every node refuses changes not signed by that owner: nobody can overwrite another peer's
record. Records expire after a TTL, so a peer that leaves (or is killed) drops off the list on its own.
What other peers publish is untrusted input: `PeerRecord.from_wire` checks every field's type.
"""

from __future__ import annotations

import logging
import time
import typing
from dataclasses import asdict, dataclass, fields

from hivemind import DHT
from hivemind.dht.crypto import RSASignatureValidator

log = logging.getLogger(__name__)

RECORD_TTL_S = 60.0  # a peer republishes well within this; a silent peer vanishes after it
# A record not refreshed for this long (three of a peer's 5 s publish periods) is from a peer that has most likely
# stopped or died: it stays listed until the TTL, but its tokens/s no longer counts as the swarm's.
RATE_FRESH_S = 15.0


@dataclass(frozen=True)
class PeerRecord:
    """What one peer tells the swarm about itself (published every few seconds)."""

    peer_id: str  # libp2p peer id (base58)
    name: str  # public name chosen with --name
    device: str  # e.g. "NVIDIA H200" or "cpu"
    precision: str  # fp32, bf16, fp8, int8
    offload: bool  # master weights and optimizer state live in CPU memory
    tokens_per_s: float
    loss: float | None  # latest training loss, nats/token
    round: int  # averaging rounds completed
    step: int  # local optimizer steps taken
    tokens_contributed: int  # tokens trained on since joining
    bytes_sent: int  # averaging traffic, all rounds
    bytes_received: int
    last_averaging: float | None  # unix time of the last successful averaging, None before the first
    version: str  # tscale-p2p version
    relayed: bool  # reachable only through a libp2p relay (behind NAT, --client-mode)
    updated_at: float  # unix time of publication
    # groupmates this peer lost in its last averaging round (contribution refused, or failed mid all-reduce)
    dropped_peers: int = 0

    def to_wire(self) -> dict:
        return asdict(self)

    def live_tokens_per_s(self, now: float) -> float:
        """Its tokens/s while the record is fresh (see RATE_FRESH_S); 0 once the peer has gone silent."""
        return self.tokens_per_s if now - self.updated_at <= RATE_FRESH_S else 0.0

    @classmethod
    def from_wire(cls, value: object) -> "PeerRecord | None":
        """A record from a DHT value, or None if it is malformed (wrong keys or types)."""
        if not isinstance(value, dict) or set(value) != _FIELD_TYPES.keys():
            return None
        for name, accepted in _FIELD_TYPES.items():
            item = value[name]
            if float in accepted and isinstance(item, int) and not isinstance(item, bool):
                item = value[name] = float(item)
            # bool is a subclass of int: an int field must not accept True.
            if not isinstance(item, accepted) or (isinstance(item, bool) and bool not in accepted):
                return None
        return cls(**value)


def _field_types() -> dict[str, tuple[type, ...]]:
    hints = typing.get_type_hints(PeerRecord)
    return {f.name: typing.get_args(hints[f.name]) or (hints[f.name],) for f in fields(PeerRecord)}


_FIELD_TYPES = _field_types()


def peer_records_key(run_id: str) -> str:
    return f"{run_id}_peers"


class SwarmMetrics:
    """Publishes this peer's record and reads everyone's for one run, through a running `hivemind.DHT`."""

    def __init__(self, dht: DHT, run_id: str, ttl_s: float = RECORD_TTL_S) -> None:
        self.dht, self.key, self.ttl_s = dht, peer_records_key(run_id), ttl_s
        self._validator = RSASignatureValidator()
        dht.add_validators([self._validator])

    def publish(self, record: PeerRecord) -> bool:
        """Store (or refresh) this peer's record; False if no DHT node accepted it."""
        return bool(
            self.dht.store(
                self.key,
                record.to_wire(),
                expiration_time=time.time() + self.ttl_s,
                subkey=self._validator.local_public_key,
            )
        )

    def fetch(self) -> list[PeerRecord]:
        """Every live, well-formed record of the run, one per peer id (the newest), sorted by name."""
        found = self.dht.get(self.key, latest=True)
        if found is None or not isinstance(found.value, dict):
            return []
        newest: dict[str, PeerRecord] = {}
        for entry in found.value.values():
            record = PeerRecord.from_wire(entry.value)
            if record is None:
                log.debug("ignoring a malformed peer record in %s", self.key)
                continue
            # A restarted peer signs with a new key: keep only its latest record until the old one expires.
            if record.peer_id not in newest or record.updated_at > newest[record.peer_id].updated_at:
                newest[record.peer_id] = record
        return sorted(newest.values(), key=lambda r: (r.name, r.peer_id))
