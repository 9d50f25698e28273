"""Fake peers for tests and benchmarks: many signed metrics records published from one hivemind DHT node.

A real peer signs its record with its own RSA key (hivemind's `RSASignatureValidator`, one key per node). An
attacker can make as many keys as it likes and sign a record with each: `ManyOwnersSigner` does that from one
node, so that a test can flood a run with thousands of well-signed fake peers without starting thousands of
nodes.
"""

from __future__ import annotations

import dataclasses
import time

from cryptography.hazmat.primitives.asymmetric import rsa
from hivemind import DHT
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.validation import DHTRecord
from hivemind.utils.crypto import RSAPrivateKey

from tscale_p2p.peers.metrics import PeerRecord, peer_records_key


def fast_rsa_key() -> RSAPrivateKey:
    """An RSA key hivemind accepts, of 1024 bits: ten times quicker to make than the 2048 bits it makes itself."""
    key = RSAPrivateKey.__new__(RSAPrivateKey)
    key._private_key = rsa.generate_private_key(public_exponent=65537, key_size=1024)
    return key


def owner_subkey(key: RSAPrivateKey) -> bytes:
    """The ``[owner:...]`` subkey under which `key` owns a record."""
    return RSASignatureValidator.PUBLIC_KEY_FORMAT.replace(b"_key_", key.get_public_key().to_bytes())


class ManyOwnersSigner(RSASignatureValidator):
    """Signs each record with whichever of its keys owns the record's subkey (validates as hivemind's does)."""

    def __init__(self, keys: list[RSAPrivateKey]) -> None:
        super().__init__(keys[0])
        self._keys = {key.get_public_key().to_bytes(): key for key in keys}

    def sign_value(self, record: DHTRecord) -> bytes:
        owners = self._PUBLIC_KEY_RE.findall(record.subkey or b"")
        if len(owners) != 1 or owners[0] not in self._keys:
            return record.value
        signature = self._keys[owners[0]].sign(self._serialize_record(record))
        return record.value + self.SIGNATURE_FORMAT.replace(b"_value_", signature)


def fake_record(number: int, **changes) -> PeerRecord:
    """A well-formed record of a fake peer, fresh now."""
    values = dict(
        peer_id=f"12D3KooWFake{number:08d}", name=f"fake-{number}", device="cpu", precision="fp32", offload=False,
        tokens_per_s=1000.0, loss=2.5, round=1, step=10, tokens_contributed=4096, bytes_sent=100, bytes_received=100,
        last_averaging=None, version="0.1.0", relayed=False, updated_at=time.time(),
    )
    return dataclasses.replace(PeerRecord(**values), **changes)


def flood(host_maddrs: list[str], run_id: str, wires: list[dict], keys: list[RSAPrivateKey]) -> DHT:
    """A DHT node that has stored each wire value (a record's dict, however malformed) signed by its own key of
    `keys`; shut it down when done (its records stay with the node it stored them on until they expire)."""
    node = DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=host_maddrs,
               record_validators=[ManyOwnersSigner(keys)])
    expiration = time.time() + 300
    pending = list(zip(wires, keys, strict=True))
    for _ in range(5):  # a node under a burst of stores drops some: send those again, a few hundred at a time
        failed = []
        for start in range(0, len(pending), 200):
            futures = [(wire, key, node.store(peer_records_key(run_id), wire, expiration, subkey=owner_subkey(key),
                                              return_future=True)) for wire, key in pending[start : start + 200]]
            failed += [(wire, key) for wire, key, future in futures if not future.result()]
        pending = failed
        if not pending:
            return node
    node.shutdown()
    raise AssertionError(f"{len(pending)} of {len(wires)} fake records could not be stored")
