"""Hostile DHT writers for tests/test_trust.py and benchmarks/swarm_fake_progress.py: many made-up identities,
each signing records of its own (signing is cheap; only averaging with real peers is not)."""

from __future__ import annotations

import time

from cryptography.hazmat.primitives.asymmetric import rsa
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.validation import DHTRecord
from hivemind.utils import get_dht_time
from hivemind.utils.crypto import RSAPrivateKey

from tscale_p2p.peers.progress import progress_record
from tscale_p2p.peers.records import owner_subkey


class CheapKey(RSAPrivateKey):
    """A 1024-bit RSA key: what an attacker minting many identities would use (and quick to make in a test)."""

    def __init__(self):  # noqa: D107
        self._private_key = rsa.generate_private_key(public_exponent=65537, key_size=1024)


class ManyKeys(RSASignatureValidator):
    """An attacker's signer: signs each record with whichever of its many keys the record's subkey names."""

    def __init__(self, keys: list[RSAPrivateKey]):
        super().__init__(keys[0])
        self.owners = {owner_subkey(key): key for key in keys}

    def sign_value(self, record: DHTRecord) -> bytes:
        for owner, key in self.owners.items():
            if owner in record.subkey:
                signature = key.sign(self._serialize_record(record))
                return record.value + self.SIGNATURE_FORMAT.replace(b"_value_", signature)
        return record.value

    def merge_with(self, other) -> bool:
        if isinstance(other, ManyKeys):
            self.owners.update(other.owners)
        return isinstance(other, RSASignatureValidator)


class FakePeers:
    """`count` made-up peers writing through `dht` (a node with no signer of its own yet)."""

    def __init__(self, dht, count: int) -> None:
        self.dht = dht
        keys = [CheapKey() for _ in range(count)]
        self.owners = [owner_subkey(key) for key in keys]
        for batch in range(0, count, 10):  # small messages to the DHT's process: large ones can stall its pipe
            dht.add_validators([ManyKeys(keys[batch:batch + 10])])

    def claim_progress(self, run_id: str, epoch: int, steps: int = 0, steps_per_s: float = 0.0) -> bool:
        """Every fake peer publishes a signed progress record: in round `epoch`, `steps` steps made."""
        key = progress_record(run_id).key
        value = {"epoch": epoch, "steps": steps, "steps_per_s": steps_per_s, "time": time.time()}
        stores = [self.dht.store(key, value, get_dht_time() + 30, subkey=owner, return_future=True)
                  for owner in self.owners]
        return all(store.result() for store in stores)
