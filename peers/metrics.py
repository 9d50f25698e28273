"""Swarm metrics: every peer publishes a signed `PeerRecord` in the DHT; anyone can read them all.

Records live under one DHT key per run (``{run_id}_peers``), one subkey per peer. The subkey is the
peer's RSA public key in hivemind's ``[owner:...]`` form, so hivemind's `RSASignatureValidator` signs
the value and every node refuses changes not signed by that owner: nobody can overwrite another peer's
record. Records expire after a TTL, so a peer that leaves (or is killed) drops off the list on its own.
What other peers publish is untrusted input: `PeerRecord.from_wire` checks every field with pydantic (types,
finite numbers, string sizes), and `SwarmMetrics.fetch` keeps only signed, current records, a bounded number.
"""

from __future__ import annotations

import logging
import math
import re
import time
from dataclasses import asdict, dataclass, replace
from typing import Annotated

from hivemind import DHT
from hivemind.dht.crypto import RSASignatureValidator
from pydantic import ConfigDict, Field, Strict, StringConstraints, TypeAdapter, ValidationError, with_config

from tscale_p2p.errors import UserError
from tscale_p2p.peers.records import signer_for

log = logging.getLogger(__name__)

RECORD_TTL_S = 60.0  # a peer republishes well within this; a silent peer vanishes after it
# A record not refreshed for this long (three of a peer's 5 s publish periods) is from a peer that has most likely
# stopped or died: it stays listed until the TTL, but its tokens/s no longer counts as the swarm's.
RATE_FRESH_S = 15.0
# Bounds on what other peers publish. Clocks differ a little between peers; a record stamped further in the future,
# or older than its TTL (stored with a far expiry, never refreshed), is not a live peer's.
MAX_CLOCK_SKEW_S = 120.0
MAX_PEER_RECORDS = 1000  # the freshest this many are read; a run of more peers shows these
MAX_NAME_CHARS = 64


def _text(max_chars: int):
    """A short printable string: no control characters, which would move a terminal's cursor or break a TSV."""
    return Annotated[str, Strict(), StringConstraints(max_length=max_chars, pattern=r"^[^\x00-\x1f\x7f-\x9f]*$")]


_PeerId = _text(64)
_Name = _text(MAX_NAME_CHARS)
_Device = _text(64)
_Precision = _text(16)
_Version = _text(32)
_Count = Annotated[int, Strict(), Field(ge=0, lt=2**63)]
_Rate = Annotated[float, Strict(), Field(ge=0, le=1e15)]  # finite (no NaN, no infinity), and sums stay finite
_Loss = Annotated[float, Strict(), Field(ge=-1e6, le=1e6)]  # means over many peers stay finite
_Time = Annotated[float, Strict(), Field(ge=0)]  # unix time
_Flag = Annotated[bool, Strict()]


@with_config(ConfigDict(extra="forbid", allow_inf_nan=False))
@dataclass(frozen=True)
class PeerRecord:
    """What one peer tells the swarm about itself (published every few seconds). The field types bound what a
    record read from the DHT may hold (`from_wire`); a new field needs a default, so older records still read."""

    peer_id: _PeerId  # libp2p peer id (base58)
    name: _Name  # public name chosen with --name
    device: _Device  # e.g. "NVIDIA H200" or "cpu"
    precision: _Precision  # fp32, bf16, fp8, int8
    offload: _Flag  # master weights and optimizer state live in CPU memory
    tokens_per_s: _Rate
    loss: _Loss | None  # latest training loss, nats/token
    round: _Count  # averaging rounds completed
    step: _Count  # local optimizer steps taken
    tokens_contributed: _Count  # tokens trained on since joining
    bytes_sent: _Count  # averaging traffic, all rounds
    bytes_received: _Count
    last_averaging: _Time | None  # unix time of the last successful averaging, None before the first
    version: _Version  # tscale-p2p version
    relayed: _Flag  # reachable only through a libp2p relay (behind NAT, --client-mode)
    updated_at: _Time  # unix time of publication
    # groupmates this peer lost in its last averaging round (contribution refused, or failed mid all-reduce)
    dropped_peers: _Count = 0
    banned_peers: _Count = 0  # peers this one has banned for the run (caught sending or answering bad averages)

    def to_wire(self) -> dict:
        """The record as published: a loss that is not a number (a diverged step) goes out as none."""
        record = self if self.loss is None or math.isfinite(self.loss) else replace(self, loss=None)
        return asdict(record)

    def live_tokens_per_s(self, now: float) -> float:
        """Its tokens/s while the record is fresh (see RATE_FRESH_S); 0 once the peer has gone silent."""
        return self.tokens_per_s if now - self.updated_at <= RATE_FRESH_S else 0.0

    @classmethod
    def from_wire(cls, value: object) -> "PeerRecord | None":
        """A record from a DHT value, or None if it is malformed (wrong keys, types, sizes, a non-finite number)."""
        try:
            return _WIRE.validate_python(value)
        except ValidationError:
            return None


_WIRE = TypeAdapter(PeerRecord)
_NAME = TypeAdapter(_Name)
_OWNED_SUBKEY = re.compile(RSASignatureValidator.PUBLIC_KEY_REGEX, re.DOTALL)


def check_public_name(name: str | None) -> str | None:
    """`--name` as other peers will accept it in this peer's record; UserError otherwise."""
    try:
        return name if name is None else _NAME.validate_python(name)
    except ValidationError:
        raise UserError(f"--name must be at most {MAX_NAME_CHARS} printable characters, got {name[:80]!r}") from None


def peer_records_key(run_id: str) -> str:
    return f"{run_id}_peers"


class SwarmMetrics:
    """Publishes this peer's record and reads everyone's for one run, through a running `hivemind.DHT`."""

    def __init__(self, dht: DHT, run_id: str, ttl_s: float = RECORD_TTL_S) -> None:
        self.dht, self.key, self.ttl_s = dht, peer_records_key(run_id), ttl_s
        self._validator = signer_for(dht)

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
        """Every live, well-formed record of the run, one per peer id (the newest), sorted by name: at most
        MAX_PEER_RECORDS of them, the freshest. Only records signed by their owner count (anyone can store
        unsigned ones under the run's key), and only those stamped within the TTL of now."""
        found = self.dht.get(self.key, latest=True)
        if found is None or not isinstance(found.value, dict):
            return []
        now = time.time()
        newest: dict[str, PeerRecord] = {}
        for subkey, entry in found.value.items():
            if not (isinstance(subkey, bytes) and _OWNED_SUBKEY.fullmatch(subkey)):
                continue
            record = PeerRecord.from_wire(entry.value)
            if record is None or not now - self.ttl_s - MAX_CLOCK_SKEW_S <= record.updated_at <= now + MAX_CLOCK_SKEW_S:
                log.debug("ignoring a malformed or stale peer record in %s", self.key)
                continue
            # A restarted peer signs with a new key: keep only its latest record until the old one expires.
            if record.peer_id not in newest or record.updated_at > newest[record.peer_id].updated_at:
                newest[record.peer_id] = record
        freshest = sorted(newest.values(), key=lambda r: r.updated_at, reverse=True)[:MAX_PEER_RECORDS]
        return sorted(freshest, key=lambda r: (r.name, r.peer_id))
