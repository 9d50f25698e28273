"""The swarm's state in one format: what a peer shares, a joiner downloads, `fetch` keeps and a checkpoint holds.

A state is the global weights (what every peer agrees the model is after the last outer step), the Nesterov
momentum of the outer SGD, and where the run stands: the outer round, the step, the run's step at round 0
(`schedule_origin`), a fingerprint of the weights, and a BPE run's tokenizer. As (metadata, tensors), the
pair hivemind's state download carries: `StateMetadata`'s fields, then the weights and as many momentum
buffers, in the model's parameter order. On disk the same pair is one safetensors file (`SWARM_STATE_FILE`)
inside the step checkpoint, written with it in one atomic rename (tscale_p2p/checkpoint.py), so a restarted
peer's outer state is that of the step it resumes from.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence

import pydantic
import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from tscale_p2p.checkpoint import find_latest

STATE_FORMAT = 1
SWARM_STATE_FILE = "swarm-state.safetensors"
FINGERPRINT_VALUES = 2**20  # weights hashed per fingerprint: an outer step changes every weight, so a sample
# finds any difference between two peers' global weights at a cost that does not grow with the model
FINGERPRINT = r"^[0-9a-f]{12}$"


def fingerprint(weights: Sequence[torch.Tensor]) -> str:
    """A short digest of global weights: peers that applied the same rounds print the same one. Hashes an evenly
    spaced sample of FINGERPRINT_VALUES weights (every weight of a small model)."""
    total = sum(t.numel() for t in weights)
    stride = max(1, total // FINGERPRINT_VALUES)
    digest = hashlib.sha256()
    for tensor in weights:
        digest.update(tensor.reshape(-1)[::stride].contiguous().numpy().tobytes())
    return digest.hexdigest()[:12]


class StateMetadata(pydantic.BaseModel):
    """The metadata of a state, as a downloader accepts it (it is remote data)."""

    model_config = pydantic.ConfigDict(strict=True, extra="ignore", frozen=True)

    format: int
    run_hash: str
    round: int = pydantic.Field(ge=0, lt=2**40)
    step: int = pydantic.Field(default=0, ge=0, lt=2**40)
    weights: str = pydantic.Field(pattern=FINGERPRINT)
    schedule_origin: int = pydantic.Field(default=0, ge=0, lt=2**40)
    tokenizer: Optional[str] = None  # a BPE run's tokenizer.json, packed (`tscale_p2p.tokenizer.to_wire`)


@dataclass
class SwarmState:
    """One peer's outer state. `weights` and `momentum` are fp32 CPU tensors by parameter name, in model order."""

    run_hash: str
    round: int
    step: int
    schedule_origin: int
    weights: dict[str, torch.Tensor]
    momentum: dict[str, torch.Tensor]
    tokenizer: str | None = None
    donor: str = ""  # the peer it was downloaded from ("" for our own)
    fingerprint: str = field(default="")

    def __post_init__(self) -> None:
        if not self.fingerprint:
            self.fingerprint = fingerprint(list(self.weights.values()))

    @property
    def base(self) -> tuple[int, str]:
        """(round, fingerprint): which global weights these are."""
        return self.round, self.fingerprint

    def to_wire(self) -> tuple[dict, list[torch.Tensor]]:
        """(metadata, tensors) as a joiner downloads them."""
        metadata = {
            "format": STATE_FORMAT,
            "run_hash": self.run_hash,
            "round": self.round,
            "step": self.step,
            "weights": self.fingerprint,
            "schedule_origin": self.schedule_origin,
        }
        if self.tokenizer is not None:  # a joiner adopts the run's tokenizer from here
            metadata["tokenizer"] = self.tokenizer
        return metadata, [*self.weights.values(), *self.momentum.values()]

    @classmethod
    def from_wire(cls, metadata: dict, tensors: Sequence[torch.Tensor], names: Sequence[str]) -> "SwarmState":
        """The state of a (metadata, tensors) pair that has passed `StateCheck.problem` (peers/state_download.py),
        with parameters `names`."""
        meta = StateMetadata.model_validate(metadata)
        count = len(names)
        return cls(
            run_hash=meta.run_hash,
            round=meta.round,
            step=meta.step,
            schedule_origin=meta.schedule_origin,
            weights={n: t.float() for n, t in zip(names, tensors[:count])},
            momentum={n: t.float() for n, t in zip(names, tensors[count:])},
            tokenizer=meta.tokenizer,
            donor=metadata.get("donor", "") if isinstance(metadata.get("donor"), str) else "",
            fingerprint=meta.weights,
        )

    def write(self, path: Path) -> None:
        """Write the (metadata, tensors) pair to `path` (a checkpoint's temporary folder: the rename makes it
        atomic)."""
        metadata, tensors = self.to_wire()
        save_file({f"{i:05d}": t.contiguous() for i, t in enumerate(tensors)}, path,
                  metadata={"state": json.dumps(metadata)})


def read_state_file(path: Path) -> tuple[dict, list[torch.Tensor]]:
    """The (metadata, tensors) pair `SwarmState.write` wrote; ValueError naming the file if it cannot be read."""
    try:
        with safe_open(path, framework="pt") as handle:
            metadata = json.loads(handle.metadata()["state"])
            tensors = [handle.get_tensor(key) for key in sorted(handle.keys())]
    except (OSError, ValueError, KeyError, TypeError, SafetensorError) as error:
        raise ValueError(f"{path}: {error}") from None
    return metadata, tensors


def saved_state_file(out: str | Path) -> Path | None:
    """The swarm state in the newest valid checkpoint of a peer's --out folder, if it holds one."""
    checkpoint = find_latest(Path(out))
    if checkpoint is None or not (checkpoint / SWARM_STATE_FILE).exists():
        return None
    return checkpoint / SWARM_STATE_FILE
