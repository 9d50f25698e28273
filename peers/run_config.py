"""The run: settings every peer of a swarm must share, published once in the DHT and adopted by joiners.

The first peer of a run builds a `RunConfig` from its flags (model, tokenizer, the optimizer schedule,
inner steps, outer optimizer) and stores it with its hash under ``{run_id}_config``. A joiner fetches it
and trains with it, so ``tscale-peer join --initial-peers X`` needs no model flags; a flag the joiner
gives explicitly that contradicts the run is refused with a message naming the difference. Per-peer
settings (data, device, precision, batch size, checkpoints) stay local: they do not change what the
shared weights mean.
"""

from __future__ import annotations

import hashlib
import json
import re
import time
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path

from hivemind import DHT

from tscale_p2p.atomic import write_atomically
from tscale_p2p.config import TrainConfig
from tscale_p2p.errors import UserError
from tscale_p2p.model import ModelConfig

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
)
# TrainConfig fields that are part of the model config (compared through it).
MODEL_TRAIN_FIELDS = ("model", "window_schedule", "mlp", "dropout")

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

    def __post_init__(self) -> None:
        if self.inner_steps < 1:
            raise UserError(f"inner-steps must be at least 1, got {self.inner_steps}")
        if not self.outer_lr > 0:
            raise UserError(f"outer-lr must be positive, got {self.outer_lr}")
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
    ) -> "RunConfig":
        return cls(
            model=model_cfg.to_dict(),
            tokenizer=tokenizer,
            inner_steps=inner_steps,
            outer_lr=outer_lr,
            outer_momentum=outer_momentum,
            seed=cfg.seed,
            train={name: getattr(cfg, name) for name in SHARED_TRAIN_FIELDS},
        )

    @property
    def model_config(self) -> ModelConfig:
        return ModelConfig.from_dict(self.model)

    @property
    def hash(self) -> str:
        return hashlib.sha256(_canonical(asdict(self))).hexdigest()

    def apply_to(self, cfg: TrainConfig) -> TrainConfig:
        """`cfg` with the run's shared settings (and its model, by dims and kinds) in place of its own."""
        model = self.model_config
        return replace(
            cfg,
            **self.train,
            model=model.dims,
            window_schedule=model.window_schedule,
            mlp=model.mlp,
            dropout=model.dropout,
        )

    def check_flags(self, run_id: str, explicit: dict) -> None:
        """Refuse explicitly given settings (flag name -> value) that contradict this run."""
        model = self.model_config
        run_values = {
            **self.train,
            "model": model.dims,
            "window_schedule": model.window_schedule,
            "mlp": model.mlp,
            "dropout": model.dropout,
            "inner_steps": self.inner_steps,
            "outer_lr": self.outer_lr,
            "outer_momentum": self.outer_momentum,
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
        return {"config": asdict(self), "hash": self.hash}

    @classmethod
    def from_wire(cls, value: object) -> "RunConfig":
        """Parse a published run config; raises UserError if it is malformed or its hash does not match."""
        if not isinstance(value, dict) or not isinstance(value.get("config"), dict):
            raise UserError("the run config published in the DHT is malformed")
        data = value["config"]
        names = {f.name for f in fields(cls)}
        if set(data) != names:
            raise UserError(f"the run config published in the DHT has keys {sorted(data)}, expected {sorted(names)}")
        try:
            config = cls(**data)
            config.model_config  # noqa: B018 - validates the model dict
        except (TypeError, ValueError) as error:
            raise UserError(f"the run config published in the DHT is malformed: {error}") from None
        if config.hash != value.get("hash"):
            raise UserError("the run config published in the DHT does not match its hash")
        return config


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


def fetch_run_config(dht: DHT, run_id: str) -> RunConfig | None:
    """The run's published config, or None if nobody has published one yet."""
    found = dht.get(run_config_key(run_id), latest=True)
    if found is None:
        return None
    return RunConfig.from_wire(found.value)


def publish_run_config(dht: DHT, run_id: str, config: RunConfig) -> bool:
    """Store (or refresh) the run config; every live peer does this now and then."""
    return bool(dht.store(run_config_key(run_id), config.to_wire(), expiration_time=time.time() + CONFIG_TTL_S))


def save_run_config(out: str | Path, config: RunConfig) -> None:
    """Write OUT/run-config.json (atomically), so a restarted peer knows which run its checkpoints belong to."""
    write_atomically(Path(out) / RUN_CONFIG_FILE, _canonical(config.to_wire()))


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


def _canonical(value) -> bytes:
    return json.dumps(value, sort_keys=True, separators=(",", ":")).encode()
