"""Signed, bounded DHT records: the ones that steer a run (its config, the peers' progress, their state offers).

Anyone can write to a DHT, so a record that changes what peers do must say who wrote it, must not outlive its
purpose, and must be small and well-formed:

- **Signed.** A record lives under a subkey that is its writer's RSA public key in hivemind's ``[owner:...]``
  form, and hivemind's `RSASignatureValidator` makes every node refuse a record not signed by that owner: one
  record per key, and nobody can write another peer's. A `join` peer signs with its libp2p identity key (the
  one its peer id is the hash of, `use_identity_key`), so a record's owner *is* a peer id (`peer_id_of`).
- **Bounded.** `RunRecordValidator` makes every node of this process's DHT refuse, when storing them and when
  another node returns them, records under a protected key that have no owner, expire further ahead than the
  key allows, are larger than it allows, or do not parse into the key's pydantic model (finite numbers, bounded
  strings). Readers parse again (`read_signed`): a hostile node answers with whatever it likes.
"""

from __future__ import annotations

import hashlib
import logging
import math
import re
import weakref
from dataclasses import dataclass
from typing import Type, TypeVar

import base58
import multihash
import pydantic
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from hivemind import DHT
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord, RecordValidatorBase
from hivemind.proto import crypto_pb2
from hivemind.utils import MSGPackSerializer, get_dht_time
from hivemind.utils.crypto import RSAPrivateKey, RSAPublicKey

from tscale_p2p.errors import UserError

log = logging.getLogger(__name__)

CLOCK_SKEW_S = 60.0  # how far ahead of our clock another peer's expiry may lie beyond a key's TTL
MAX_RECORDS_READ = 256  # records of one key a reader considers; a swarm of more peers is not expected

_OWNER = re.compile(RSASignatureValidator.PUBLIC_KEY_REGEX)  # hivemind's "[owner:<key>]" pattern

Model = TypeVar("Model", bound=pydantic.BaseModel)


class RecordModel(pydantic.BaseModel):
    """Base of the records' pydantic models: strict types (no "3" for 3), no extra fields, finite floats."""

    model_config = pydantic.ConfigDict(strict=True, extra="forbid", frozen=True, allow_inf_nan=False)


@dataclass(frozen=True)
class ProtectedKey:
    """A DHT key whose records must be signed, expire within `max_ttl_s`, fit `max_bytes` and parse as `model`."""

    key: str
    model: Type[pydantic.BaseModel]
    max_ttl_s: float
    max_bytes: int = 4096


class RunRecordValidator(RecordValidatorBase):
    """Refuses ill-formed records under the `ProtectedKey`s it knows (see the module's docstring). Runs after
    `RSASignatureValidator` (lower priority), so it sees values with their signature checked and stripped."""

    def __init__(self, keys: list[ProtectedKey]) -> None:
        self._keys = {DHTID.generate(source=k.key).to_bytes(): k for k in keys}

    def validate(self, record: DHTRecord) -> bool:
        protected = self._keys.get(record.key)
        if protected is None:
            return True
        if not _OWNER.search(record.subkey):
            log.debug("refusing an unsigned record under %s", protected.key)
            return False
        if not record.expiration_time <= get_dht_time() + protected.max_ttl_s + CLOCK_SKEW_S:
            log.debug("refusing a record under %s that expires too late", protected.key)
            return False
        if len(record.value) > protected.max_bytes:
            log.debug("refusing a record of %d bytes under %s", len(record.value), protected.key)
            return False
        return parse(protected.model, _loads(record.value)) is not None

    def merge_with(self, other: RecordValidatorBase) -> bool:
        if not isinstance(other, RunRecordValidator):
            return False
        self._keys.update(other._keys)
        return True


def parse(model: Type[Model], value: object) -> Model | None:
    """`value` as a `model`, or None if it does not fit (remote data: never raises)."""
    try:
        return model.model_validate(value)
    except (pydantic.ValidationError, TypeError, ValueError, RecursionError):
        return None


def _loads(data: bytes) -> object:
    try:
        return MSGPackSerializer.loads(data)
    except Exception:  # msgpack raises many kinds on garbage
        return None


# ---- identities ----


class IdentityKey(RSAPrivateKey):
    """An RSA key loaded from a libp2p identity file (hivemind's format: a protobuf-wrapped DER key)."""

    def __init__(self, path: str) -> None:  # noqa: D107 - no new key is generated, unlike RSAPrivateKey()
        with open(path, "rb") as handle:
            wrapped = crypto_pb2.PrivateKey.FromString(handle.read())
        if wrapped.key_type != crypto_pb2.KeyType.RSA:
            raise ValueError(f"{path} holds no RSA key")
        self.__setstate__({"_private_key": wrapped.data})  # RSAPrivateKey's own unpickling


def owner_subkey(key: RSAPrivateKey) -> bytes:
    """The ``[owner:ssh-rsa ...]`` subkey under which `key` signs its records."""
    return RSASignatureValidator.PUBLIC_KEY_FORMAT.replace(b"_key_", key.get_public_key().to_bytes())


def peer_id_of(public_key: bytes | str) -> str | None:
    """The libp2p peer id (base58) of an RSA public key, given as ``ssh-rsa ...`` or in an ``[owner:...]``
    subkey; None if it is not one. (A peer id is the sha256 multihash of the protobuf-wrapped DER key.)"""
    if isinstance(public_key, str):
        public_key = public_key.encode()
    found = _OWNER.search(public_key)
    try:
        key = serialization.load_ssh_public_key(found.group(1) if found else public_key)
    except (ValueError, TypeError):
        return None
    if not isinstance(key, rsa.RSAPublicKey):
        return None
    der = key.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    wrapped = crypto_pb2.PublicKey(key_type=crypto_pb2.RSA, data=der).SerializeToString()
    digest = multihash.encode(hashlib.sha256(wrapped).digest(), multihash.coerce_code("sha2-256"))
    return base58.b58encode(digest).decode()


def verify(public_key: str, message: bytes, signature: str) -> bool:
    """Whether `signature` (base64, as `RSAPrivateKey.sign` makes it) signs `message` with `public_key` (ssh-rsa)."""
    try:
        return RSAPublicKey.from_bytes(public_key.encode()).verify(message, signature.encode())
    except (ValueError, TypeError):
        return False


# ---- one signer per DHT ----

_signers: "weakref.WeakKeyDictionary[DHT, RSASignatureValidator]" = weakref.WeakKeyDictionary()
_keys: "weakref.WeakKeyDictionary[DHT, RSAPrivateKey]" = weakref.WeakKeyDictionary()
_protected: "weakref.WeakKeyDictionary[DHT, set[ProtectedKey]]" = weakref.WeakKeyDictionary()


def use_identity_key(dht: DHT, identity_path: str) -> None:
    """Sign this DHT's records with its libp2p identity key (the file its peer id comes from), so that every
    record it writes names its peer id. Call before anything else signs through `dht` (`signer_for`)."""
    if dht in _signers:
        raise RuntimeError("this DHT signs with another key already")
    try:
        key = IdentityKey(identity_path)
    except (OSError, ValueError) as error:  # hivemind made it an RSA key; somebody else made this one
        raise UserError(f"identity {identity_path}: cannot sign with it ({error})") from None
    if peer_id_of(owner_subkey(key)) != str(dht.peer_id):
        raise UserError(f"identity {identity_path} is not the key of this peer's id {dht.peer_id}")
    _keys[dht] = key


def signer_for(dht: DHT) -> RSASignatureValidator:
    """The one `RSASignatureValidator` of `dht` (hivemind keeps only the first one a DHT is given): with the
    identity key of `use_identity_key`, else a fresh key of this DHT's own, so that DHT nodes of one process
    (tests, tools) are different owners."""
    signer = _signers.get(dht)
    if signer is None:
        key = _keys.setdefault(dht, RSAPrivateKey())
        signer = _signers[dht] = RSASignatureValidator(key)
        dht.add_validators([signer])
    return signer


def signing_key(dht: DHT) -> RSAPrivateKey:
    """The private key `signer_for(dht)` signs with (e.g. to sign a run config with the founder's identity)."""
    signer_for(dht)
    return _keys[dht]


def protect(dht: DHT, *keys: ProtectedKey) -> None:
    """Make `dht`'s node sign our records under `keys` and refuse ill-formed ones from anybody (idempotent)."""
    signer_for(dht)
    known = _protected.setdefault(dht, set())
    new = [k for k in keys if k not in known]
    if new:
        dht.add_validators([RunRecordValidator(new)])
        known.update(new)


def store_signed(dht: DHT, protected: ProtectedKey, value: RecordModel, ttl_s: float, wait: bool = True) -> bool:
    """Store `value` under `protected.key`, in this peer's own signed subkey, for `ttl_s` seconds; whether some
    node took it (True at once with `wait=False`: the store goes on in the background)."""
    expiration = get_dht_time() + min(ttl_s, protected.max_ttl_s)
    stored = dht.store(protected.key, value.model_dump(), expiration_time=expiration,
                       subkey=signer_for(dht).local_public_key, return_future=not wait)
    return True if not wait else bool(stored)


@dataclass(frozen=True)
class SignedEntry:
    """One well-formed record of a protected key: who wrote it (peer id of its owner key), what, until when."""

    peer_id: str
    owner: bytes
    value: pydantic.BaseModel
    expiration_time: float


def read_signed(dht: DHT, protected: ProtectedKey, *, latest: bool = True) -> list[SignedEntry]:
    """Every well-formed signed record under `protected.key` (at most MAX_RECORDS_READ, the latest-expiring
    first); malformed ones are skipped. The DHT's validators have checked the signatures."""
    found = dht.get(protected.key, latest=latest)
    if found is None or not isinstance(found.value, dict):
        return []
    entries = []
    now = get_dht_time()
    for subkey, item in found.value.items():
        expiration = getattr(item, "expiration_time", None)
        if not isinstance(subkey, bytes) or not isinstance(expiration, float) or not math.isfinite(expiration):
            continue
        if expiration > now + protected.max_ttl_s + CLOCK_SKEW_S:
            continue
        peer_id = peer_id_of(subkey)
        value = parse(protected.model, getattr(item, "value", None))
        if peer_id is None or value is None:
            log.debug("ignoring a malformed record under %s", protected.key)
            continue
        entries.append(SignedEntry(peer_id, subkey, value, expiration))
    entries.sort(key=lambda entry: -entry.expiration_time)
    return entries[:MAX_RECORDS_READ]
