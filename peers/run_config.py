"""The run: settings every peer of a swarm must share, published once in the DHT and adopted by joiners.

The first peer of a run builds a `RunConfig` from its flags (model, tokenizer, the optimizer schedule,
inner steps, outer optimizer) and stores it with its hash under ``{run_id}_config``. A joiner fetches it
and trains with it, so ``tscale-peer join --initial-peers X`` needs no model flags; a flag the joiner
gives explicitly that contradicts the run is refused with a message naming the difference. Per-peer
settings (data, device, precision, batch size, checkpoints) stay local: they do not change what the
shared weights mean.

A joiner adopts only a config the run's founder signed: the founder signs its config's hash with its identity key
(the key its peer id comes from: the join line it prints carries that id), and a joiner checks the signature
against the peer ids of its --initial-peers (`fetch_signed_run`). Every live peer re-publishes the founder's
signed config in a DHT record of its own (signed and expiry-capped, see peers/records.py), so the run outlives
its founder and a forged or far-expiring record of another peer cannot displace it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Collection

import pydantic
from hivemind import DHT
from hivemind.utils.crypto import RSAPrivateKey

from tscale_p2p.atomic import write_atomically
from tscale_p2p.config import TrainConfig
from tscale_p2p.errors import UserError
from tscale_p2p.peers.codec import CODECS
from tscale_p2p.model import ModelConfig
from tscale_p2p.peers.records import (
    ProtectedKey,
    RecordModel,
    peer_id_of,
    protect,
    read_signed,
    signing_key,
    store_signed,
    verify,
)
from tscale_p2p.peers.settings import DEFAULT_OPENING_INNER_STEPS, DEFAULT_OPENING_OUTER_LR

log = logging.getLogger(__name__)

# TrainConfig fields that shape the shared optimisation: every peer must use the run's values.
SHARED_TRAIN_FIELDS = (
    "context",
    "lr",
    "min_lr_ratio",
    "warmup",
    "schedule",
    "cooldown_fraction",
    "weight_decay",
    "beta2",
    "grad_clip",
    "steps",
    "embedding_weight_decay",
)
# Shared fields added later, with the value that trains as the code did before them: a run config leaves them
# out at that value, so its hash, and the runs already published, stay as they were.
LATER_TRAIN_FIELDS = {"embedding_weight_decay": 0.0}
# TrainConfig fields that are part of the model config (compared through it).
MODEL_TRAIN_FIELDS = ("model", "window_schedule", "mlp", "dropout", "attention_dropout", "tie_embeddings")

# RunConfig keys a published config may leave out (at their defaults; see `RunConfig._hashed`).
OPTIONAL_KEYS = {"codec", "opening_rounds", "opening_inner_steps", "opening_outer_lr", "outer_lr_peak"}
RUN_ID_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,63}")
RUN_CONFIG_FILE = "run-config.json"
CONFIG_TTL_S = 24 * 3600.0  # refreshed by every live peer, so the run outlives its first peer


@dataclass(frozen=True)
class RunConfig:
    """What makes two peers' weights the same model being trained the same way."""

    model: dict  # ModelConfig.to_dict()
    tokenizer: str  # "byte" (vocab 256), "bpe-<sha256 of its tokenizer.json>", or "external-<vocab>" (a bare .bin)
    inner_steps: int  # local steps between averaging rounds (H)
    outer_lr: float  # Nesterov outer SGD on the averaged pseudo-gradient (DiLoCo: 0.7)
    outer_momentum: float  # (DiLoCo: 0.9)
    seed: int  # initial weights: every peer builds the same ones, so even simultaneous starters agree
    train: dict  # the SHARED_TRAIN_FIELDS of TrainConfig
    codec: str = "sign"  # the averaging rounds' codec (peers/codec.py CODECS): every peer must speak the same
    # The run's first rounds: opening_rounds rounds of opening_inner_steps steps, each average applied before the
    # next step and without outer momentum (peers/progress.py RoundClock), where a cold start changes fastest, as
    # weights -= opening_outer_lr x the average.
    opening_rounds: int = 0
    opening_inner_steps: int = DEFAULT_OPENING_INNER_STEPS
    opening_outer_lr: float = DEFAULT_OPENING_OUTER_LR
    # The outer lr while the inner lr is at its peak, falling with it to `outer_lr` (`outer_lr_at`); None: `outer_lr`
    # throughout.
    outer_lr_peak: float | None = None

    def __post_init__(self) -> None:
        if self.codec not in CODECS:
            raise UserError(f"codec must be one of {', '.join(CODECS)}, got {self.codec!r}")
        for name, least in (("inner_steps", 1), ("opening_inner_steps", 1), ("opening_rounds", 0)):
            if getattr(self, name) < least:  # (a TypeError for a non-number: from_wire calls it malformed)
                raise UserError(f"{name.replace('_', '-')} must be at least {least}, got {getattr(self, name)}")
        lrs = ("outer_lr", "opening_outer_lr") + (("outer_lr_peak",) if self.outer_lr_peak is not None else ())
        for name in lrs:
            if not getattr(self, name) > 0:
                raise UserError(f"{name.replace('_', '-')} must be positive, got {getattr(self, name)}")
        if not 0 <= self.outer_momentum < 1:
            raise UserError(f"outer-momentum must be in [0, 1), got {self.outer_momentum}")

    @classmethod
    def from_settings(
        cls,
        cfg: TrainConfig,
        model_cfg: ModelConfig,
        tokenizer: str,
        inner_steps: int,
        outer_lr: float,
        outer_momentum: float,
        codec: str = "sign",
        opening_rounds: int = 0,
        opening_inner_steps: int = DEFAULT_OPENING_INNER_STEPS,
        opening_outer_lr: float = DEFAULT_OPENING_OUTER_LR,
        outer_lr_peak: float | None = None,
    ) -> "RunConfig":
        return cls(
            model=model_cfg.to_dict(),
            tokenizer=tokenizer,
            inner_steps=inner_steps,
            outer_lr=outer_lr,
            outer_momentum=outer_momentum,
            seed=cfg.seed,
            train={
                name: getattr(cfg, name) for name in SHARED_TRAIN_FIELDS
                if LATER_TRAIN_FIELDS.get(name, object()) != getattr(cfg, name)
            },
            codec=codec,
            opening_rounds=opening_rounds,
            opening_inner_steps=opening_inner_steps,
            opening_outer_lr=opening_outer_lr,
            outer_lr_peak=outer_lr_peak,
        )

    @property
    def model_config(self) -> ModelConfig:
        return ModelConfig.from_dict(self.model)

    @property
    def hash(self) -> str:
        return hashlib.sha256(_canonical(self._hashed())).hexdigest()

    def _hashed(self) -> dict:
        # A run on the sign codec, or without opening rounds, hashes as it did before runs could choose them, so its
        # records and saved configs (which lack those keys) still match their hashes.
        fields_ = asdict(self)
        if fields_["codec"] == "sign":
            del fields_["codec"]
        if not fields_["opening_rounds"]:
            del fields_["opening_rounds"], fields_["opening_inner_steps"], fields_["opening_outer_lr"]
        if fields_["outer_lr_peak"] is None:
            del fields_["outer_lr_peak"]
        return fields_

    def outer_lr_at(self, inner_lr_ratio: float) -> float:
        """The outer lr of a round that begins where the inner lr is `inner_lr_ratio` of its peak."""
        if self.outer_lr_peak is None:
            return self.outer_lr
        return self.outer_lr + (self.outer_lr_peak - self.outer_lr) * inner_lr_ratio

    def apply_to(self, cfg: TrainConfig) -> TrainConfig:
        """`cfg` with the run's shared settings (and its model, by dims and kinds) in place of its own."""
        model = self.model_config
        return replace(
            cfg,
            **{**LATER_TRAIN_FIELDS, **self.train},
            model=model.dims,
            window_schedule=model.window_schedule,
            mlp=model.mlp,
            dropout=model.dropout,
            attention_dropout=model.attention_dropout,
            tie_embeddings=model.tie_embeddings,
        )

    def check_flags(self, run_id: str, explicit: dict) -> None:
        """Refuse explicitly given settings (flag name -> value) that contradict this run."""
        model = self.model_config
        run_values = {
            **LATER_TRAIN_FIELDS,
            **self.train,
            "model": model.dims,
            "window_schedule": model.window_schedule,
            "mlp": model.mlp,
            "dropout": model.dropout,
            "attention_dropout": model.attention_dropout,
            "tie_embeddings": model.tie_embeddings,
            "inner_steps": self.inner_steps,
            "outer_lr": self.outer_lr,
            "outer_momentum": self.outer_momentum,
            "codec": self.codec,
            "opening_rounds": self.opening_rounds,
            "opening_inner_steps": self.opening_inner_steps,
            "opening_outer_lr": self.opening_outer_lr,
            "outer_lr_peak": self.outer_lr_peak,
        }
        for name, value in explicit.items():
            if name not in run_values:
                continue
            ours = value
            if name == "model":
                ours = ModelConfig.from_dims(value).dims  # compare normalised dims ("w256e128..." == "e128...w256")
            if ours != run_values[name]:
                flag = "--" + name.replace("_", "-")
                raise UserError(
                    f"{flag} {value} contradicts run {run_id!r}, which uses {name.replace('_', '-')} "
                    f"{run_values[name]}; drop the flag to adopt the run's setting, or start another --run-id"
                )

    def to_wire(self) -> dict:
        return {"config": self._hashed(), "hash": self.hash}

    @classmethod
    def from_wire(cls, value: object) -> "RunConfig":
        """Parse a published run config; raises UserError if it is malformed or its hash does not match."""
        if not isinstance(value, dict) or not isinstance(value.get("config"), dict):
            raise UserError("the run config published in the DHT is malformed")
        data = value["config"]
        names = {f.name for f in fields(cls)}
        if not set(data) <= names or not names - set(data) <= OPTIONAL_KEYS:  # left out at their defaults (`_hashed`)
            raise UserError(f"the run config published in the DHT has keys {sorted(data)}, expected {sorted(names)}")
        try:
            config = cls(**data)
            config.model_config  # noqa: B018 - validates the model dict
        except (TypeError, ValueError) as error:
            raise UserError(f"the run config published in the DHT is malformed: {error}") from None
        if config.hash != value.get("hash"):
            raise UserError("the run config published in the DHT does not match its hash")
        return config


class RunConfigRecord(RecordModel):
    """A published run config: the config, its hash, and the founder's signature of both (see `SignedRun`)."""

    config: dict
    hash: str = pydantic.Field(pattern=r"^[0-9a-f]{64}$")
    founder: str = pydantic.Field(max_length=1024)  # the founder's identity public key, "ssh-rsa ..."
    signature: str = pydantic.Field(max_length=1024)  # base64 RSA-PSS signature of `signed_message`


@dataclass(frozen=True)
class SignedRun:
    """A run config with its founder's signature: what peers publish and joiners verify."""

    config: RunConfig
    founder: str  # the founder's identity public key (ssh-rsa); its peer id is `founder_id`
    signature: str

    @classmethod
    def sign(cls, config: RunConfig, run_id: str, key: RSAPrivateKey) -> "SignedRun":
        founder = key.get_public_key().to_bytes().decode()
        return cls(config, founder, key.sign(signed_message(run_id, config.hash)).decode())

    @property
    def founder_id(self) -> str | None:
        return peer_id_of(self.founder)

    def valid_for(self, run_id: str) -> bool:
        """Whether the founder's signature covers this config under `run_id`."""
        return verify(self.founder, signed_message(run_id, self.config.hash), self.signature)

    def to_record(self) -> RunConfigRecord:
        return RunConfigRecord(**self.config.to_wire(), founder=self.founder, signature=self.signature)


def signed_message(run_id: str, config_hash: str) -> bytes:
    """What a founder signs: the run id and its config's hash."""
    return f"tscale-p2p run config\n{run_id}\n{config_hash}".encode()


def check_run_id(run_id: str) -> str:
    if not RUN_ID_PATTERN.fullmatch(run_id):
        raise UserError(
            f"invalid --run-id {run_id!r}: use 1-64 letters, digits, '-' or '_', starting with a letter or digit"
        )
    return run_id


def run_config_key(run_id: str) -> str:
    return f"{run_id}_config"


def averaging_prefix(run_id: str) -> str:
    """The run's averager key prefix: peers match for rounds, and share their state, under it."""
    return f"{run_id}_grad"


def run_config_record(run_id: str) -> ProtectedKey:
    """The run config's DHT key: one signed record per publishing peer, none lasting beyond CONFIG_TTL_S."""
    return ProtectedKey(run_config_key(run_id), RunConfigRecord, max_ttl_s=CONFIG_TTL_S, max_bytes=16384)


def fetch_signed_run(dht: DHT, run_id: str, trusted: Collection[str] = ()) -> SignedRun | None:
    """The run's published config, signed by its founder; None if nobody has published one yet.

    `trusted` are peer ids the caller trusts (those of its --initial-peers, and the founder saved in --out): a
    config is taken if its founder, or the peer that published it, is one of them. Configs that are malformed,
    unsigned or signed by somebody else are ignored with a warning. If none of the trusted peers vouches for any
    config (the initial peers are plain DHT nodes), the one config all signed records agree on is taken, with a
    warning naming its founder (several founders that started at once publish the same config); UserError if
    the configs differ, or if every record is bad."""
    protected = run_config_record(run_id)
    protect(dht, protected)
    entries = read_signed(dht, protected)
    if not entries:
        return None
    good: list[tuple[SignedRun, str]] = []
    for entry in entries:
        record = entry.value
        try:
            config = RunConfig.from_wire({"config": record.config, "hash": record.hash})
        except UserError as error:
            log.warning("ignoring the config of run %r published by peer %s: %s", run_id, entry.peer_id, error)
            continue
        signed = SignedRun(config, record.founder, record.signature)
        if not signed.valid_for(run_id):
            log.warning("ignoring the config of run %r published by peer %s: its founder's signature is not valid",
                        run_id, entry.peer_id)
            continue
        good.append((signed, entry.peer_id))
    vouched = [signed for signed, publisher in good if signed.founder_id in trusted or publisher in trusted]
    for signed, publisher in good:
        if signed not in vouched and vouched:
            log.warning("ignoring a config of run %r founded by peer %s (published by %s): not the run %s "
                        "trusts", run_id, signed.founder_id, publisher, ", ".join(sorted(trusted)))
    if vouched:
        return vouched[0]  # the latest-expiring: the most recently refreshed
    if not good:
        raise UserError(f"run {run_id!r}: every config published for it in the DHT is malformed or badly signed")
    distinct = {signed.config.hash for signed, _ in good}  # peers that started at once found the same run
    if len(distinct) > 1:
        founders = sorted({str(signed.founder_id) for signed, _ in good})
        raise UserError(
            f"run {run_id!r}: the DHT holds {len(distinct)} different configs for it (founders {', '.join(founders)}) "
            "and none of --initial-peers vouches for one; join through the founder's address"
        )
    signed = good[0][0]
    if trusted:
        log.warning("none of --initial-peers has published run %r: trusting peer %s as its founder", run_id,
                    signed.founder_id)
    return signed


def fetch_run_config(dht: DHT, run_id: str, trusted: Collection[str] = ()) -> RunConfig | None:
    """`fetch_signed_run(...).config`: the run's config, or None if nobody has published one yet."""
    signed = fetch_signed_run(dht, run_id, trusted)
    return None if signed is None else signed.config


def publish_run_config(dht: DHT, run_id: str, config: SignedRun | RunConfig) -> bool:
    """Store (or refresh) the founder's signed run config in this peer's own record; every live peer does this
    now and then, so the run outlives its founder. A bare RunConfig is signed by this peer, as its founder."""
    protected = run_config_record(run_id)
    protect(dht, protected)
    signed = config if isinstance(config, SignedRun) else SignedRun.sign(config, run_id, signing_key(dht))
    return store_signed(dht, protected, signed.to_record(), CONFIG_TTL_S)


def save_run_config(out: str | Path, config: RunConfig, signed: SignedRun | None = None) -> None:
    """Write OUT/run-config.json (atomically), so a restarted peer knows which run its checkpoints belong to
    (and, with `signed`, who founded it: `load_saved_signed_run`)."""
    value = config.to_wire()
    if signed is not None:
        value.update(founder=signed.founder, signature=signed.signature)
    write_atomically(Path(out) / RUN_CONFIG_FILE, _canonical(value))


def load_saved_run_config(out: str | Path) -> RunConfig | None:
    """The run config saved in OUT by an earlier session, or None."""
    path = Path(out) / RUN_CONFIG_FILE
    try:
        value = json.loads(path.read_bytes())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as error:
        raise UserError(f"cannot read {path}: {error}") from None
    return RunConfig.from_wire(value)


def load_saved_signed_run(out: str | Path, run_id: str) -> SignedRun | None:
    """The founder-signed run config saved in OUT, or None (none saved, or saved without a valid signature)."""
    config = load_saved_run_config(out)
    if config is None:
        return None
    value = json.loads((Path(out) / RUN_CONFIG_FILE).read_bytes())
    founder, signature = value.get("founder"), value.get("signature")
    if not (isinstance(founder, str) and isinstance(signature, str)):
        return None
    signed = SignedRun(config, founder, signature)
    return signed if signed.valid_for(run_id) else None


def _canonical(value) -> bytes:
    return json.dumps(value, sort_keys=True, separators=(",", ":")).encode()
