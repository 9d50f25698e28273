"""Atomic, verified training checkpoints: safetensors for tensors, one JSON manifest for the rest.

One checkpoint is one directory, so that it appears or disappears as a whole::

    OUT/step-00000100/
        model.safetensors       model weights by state-dict name
        optimizer.safetensors   the optimizer state_dict's tensors (state.<i>.<name>, param_groups.<g>.<name>)
        rng.safetensors         RNG states: capture_rng_state(), plus any generator state the caller adds
        meta.json               format version, step, model config, the caller's meta, the optimizer's
                                non-tensor state (param_groups), size and sha256 of every file, its own checksum
        ...                     files the caller adds (a BPE tokenizer, a swarm peer's outer state), listed in
                                meta.json and verified like the others

`save_checkpoint` builds it in ``OUT/.tmp-*`` (`atomic.atomic_directory`), fsyncs every file and the
directory, renames it to ``step-NNNNNNNN``, fsyncs OUT, and only then deletes checkpoints beyond the newest
``keep``. Saving a step that already has a checkpoint adds ``step-NNNNNNNN.1`` (``.2``, ...), newer than the first: no
name is reused, so no rename ever replaces a checkpoint. A crash at any point leaves the previous
checkpoints intact and no partial ``step-*`` directory; the next save removes leftover ``.tmp-*``
entries. One writer per OUT directory.

`load_checkpoint` refuses (with a one-line `UserError` naming the path and the problem) a checkpoint
whose files do not match its manifest, whose manifest holds a field of the wrong type, whose model config
differs from the expected one, whose tensors do not fit the expected state dict or hold NaN or infinity
(`save_checkpoint` refuses to write those too). Loading never writes, moves or deletes anything.
`resume_from` takes a run's OUT directory (newest valid checkpoint, corrupt ones skipped with a
warning) or one checkpoint directory.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, StringConstraints, ValidationError, model_validator
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from tscale_p2p.atomic import TMP_PREFIX, atomic_directory, fsync_path
from tscale_p2p.errors import UserError
from tscale_p2p.schema import describe

log = logging.getLogger(__name__)

FORMAT = "tscale-p2p-checkpoint"
FORMAT_VERSION = 1
MODEL_FILE = "model.safetensors"
OPTIMIZER_FILE = "optimizer.safetensors"
RNG_FILE = "rng.safetensors"
META_FILE = "meta.json"

_STEP_DIR = re.compile(r"step-(\d{8,})(?:\.(\d+))?")
_HASH_CHUNK = 1 << 20


class CorruptCheckpoint(UserError):
    """A checkpoint whose files do not match its manifest: an interrupted copy, truncation, bit rot."""


class NonFiniteCheckpoint(UserError):
    """Weights or optimizer state holding NaN or infinity: never written, never loaded."""


# meta.json's shape. Its checksum only proves the file is whole, not that a tool or a person wrote sane values:
# every field is checked before use.
_Sha256 = Annotated[str, StringConstraints(pattern=r"^[0-9a-f]{64}$")]
_FileName = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9_-][A-Za-z0-9._-]{0,127}$")]  # no path, no ..


class _FileEntry(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")

    bytes: int = Field(ge=0)
    sha256: _Sha256


class _ParamGroup(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")  # an optimizer's hyperparameters, whatever they are

    params: list[Annotated[int, Field(ge=0)]]


class _OptimizerSkeleton(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")

    state: dict[Annotated[str, StringConstraints(pattern=r"^[0-9]{1,9}$")], dict[str, Any]]
    param_groups: list[_ParamGroup]


class _Manifest(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", protected_namespaces=())

    format: Literal["tscale-p2p-checkpoint"]
    format_version: int
    step: int = Field(ge=0)
    saved_model_config: dict[str, Any] = Field(alias="model_config")
    meta: dict[str, Any]
    optimizer: _OptimizerSkeleton | None
    files: dict[_FileName, _FileEntry]
    checksum: _Sha256

    @model_validator(mode="after")
    def _lists_its_tensor_files(self) -> "_Manifest":
        needed = [MODEL_FILE] + ([OPTIMIZER_FILE] if self.optimizer is not None else [])
        missing = [name for name in needed if name not in self.files]
        if missing:
            raise ValueError(f"files lists no {', '.join(missing)}")
        return self


@dataclass
class Checkpoint:
    """A loaded checkpoint; every tensor is on the CPU."""

    path: Path
    step: int
    model_config: dict
    model_state: dict[str, torch.Tensor]
    #: In ``torch.optim.Optimizer.state_dict()`` form, or None when saved without one.
    optimizer_state: dict | None
    #: ``{"cpu": ..., "cuda.<i>": ...}`` from `capture_rng_state`, plus whatever the caller added.
    rng_state: dict[str, torch.Tensor]
    #: The caller's JSON metadata (tokens seen, data sampler state, schedule, ...).
    meta: dict

    def restore(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None) -> None:
        """Load the weights into `model` and the optimizer state into `optimizer`, after checking that
        names and shapes fit (a mismatch is a `UserError`, and nothing is modified).

        The optimizer adopts this checkpoint's optimizer tensors without copying them (torch's
        ``load_state_dict`` does not copy what is already on the right device), so restore once."""
        _check_tensors_fit(self.path, self.model_state, model.state_dict())
        if optimizer is not None:
            if self.optimizer_state is None:
                raise UserError(f"checkpoint {self.path}: has no optimizer state to resume from")
            _check_optimizer_fits(self.path, self.optimizer_state, optimizer)
        model.load_state_dict(self.model_state)
        if optimizer is not None:
            optimizer.load_state_dict(self.optimizer_state)


def save_checkpoint(
    out_dir: str | os.PathLike,
    *,
    step: int,
    model_state: Mapping[str, torch.Tensor],
    model_config: Mapping[str, Any],
    optimizer_state: Mapping[str, Any] | None = None,
    rng_state: Mapping[str, torch.Tensor] | None = None,
    meta: Mapping[str, Any] | None = None,
    keep: int = 3,
    extra_files: Mapping[str, bytes | Callable[[Path], None]] | None = None,
) -> Path:
    """Write ``out_dir/step-<step>`` atomically and keep only the newest `keep` checkpoints.

    `model_state` is a state dict (any device; shared storage such as tied weights is fine),
    `optimizer_state` an optimizer's ``state_dict()``, `model_config` and `meta` JSON-able dicts;
    `extra_files` are further files by name, listed and verified like the tensor files: their bytes (a
    tokenizer.json), or a function that writes the file at the path it is given (a peer's swarm state).
    A second save of the same step becomes ``step-<step>.1`` and counts as the newer one. The
    checkpoint just written is never pruned. Returns its path.
    """
    if keep < 1:
        raise UserError(f"checkpoints to keep must be at least 1, got {keep}")
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    optimizer_tensors, optimizer_skeleton = ({}, None)
    if optimizer_state is not None:
        optimizer_tensors, optimizer_skeleton = _flatten_optimizer_state(optimizer_state)
    # A diverged run must not write a checkpoint: it would rotate a good one out.
    _check_finite(f"not saving the checkpoint of step {step} (the run diverged)", model_state, optimizer_tensors)
    manifest: dict[str, Any] = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "step": step,
        "model_config": dict(model_config),
        "meta": dict(meta or {}),
        "optimizer": optimizer_skeleton,
    }
    _canonical(manifest)  # a non-JSON-able value fails here, before anything touches the disk

    out = Path(out_dir)
    _make_dirs(out)
    _remove_leftovers(out)
    final = _new_step_dir(out, step)
    with atomic_directory(final) as tmp:
        files = {MODEL_FILE: _write_tensors(tmp / MODEL_FILE, model_state)}
        if optimizer_state is not None:
            files[OPTIMIZER_FILE] = _write_tensors(tmp / OPTIMIZER_FILE, optimizer_tensors)
        if rng_state is not None:
            files[RNG_FILE] = _write_tensors(tmp / RNG_FILE, rng_state)
        for name, data in (extra_files or {}).items():
            if callable(data):
                data(tmp / name)
                files[name] = _file_entry(tmp / name)
            else:
                (tmp / name).write_bytes(data)
                files[name] = {"bytes": len(data), "sha256": _sha256_bytes(data)}
        manifest["files"] = files
        manifest["checksum"] = _sha256_bytes(_canonical(manifest))
        (tmp / META_FILE).write_bytes(json.dumps(manifest, indent=1).encode())
    _prune(out, keep, final)
    log.info("saved checkpoint %s", final)
    return final


def load_checkpoint(
    path: str | os.PathLike,
    *,
    expected_model_config: Mapping[str, Any] | None = None,
    expected_model_state: Mapping[str, torch.Tensor] | None = None,
) -> Checkpoint:
    """Verify and load one checkpoint directory.

    Refused with a `UserError` naming `path`: a missing or damaged file (size, sha256, manifest
    checksum), a newer format version, a model config different from `expected_model_config`, and
    weights whose names or shapes differ from `expected_model_state` (e.g. ``model.state_dict()``).
    Integrity failures raise its subclass `CorruptCheckpoint`. Never changes anything on disk.
    """
    path = Path(path)
    manifest = _read_manifest(path)
    if expected_model_config is not None:
        _check_model_config(path, manifest["model_config"], expected_model_config)
    _verify_files(path, manifest)
    model_state = _read_tensors(path, MODEL_FILE)
    if expected_model_state is not None:
        _check_tensors_fit(path, model_state, expected_model_state)
    optimizer_state, optimizer_tensors = None, {}
    if manifest["optimizer"] is not None:
        optimizer_tensors = _read_tensors(path, OPTIMIZER_FILE)
        optimizer_state = _unflatten_optimizer_state(path, optimizer_tensors, manifest["optimizer"])
    _check_finite(f"checkpoint {path}", model_state, optimizer_tensors)
    rng_state = _read_tensors(path, RNG_FILE) if RNG_FILE in manifest["files"] else {}
    return Checkpoint(
        path=path,
        step=manifest["step"],
        model_config=manifest["model_config"],
        model_state=model_state,
        optimizer_state=optimizer_state,
        rng_state=rng_state,
        meta=manifest["meta"],
    )


def find_latest(out_dir: str | os.PathLike) -> Path | None:
    """The newest checkpoint in `out_dir` whose files all match its manifest, or None.

    Damaged ones are skipped with a warning (and left on disk)."""
    for candidate in _step_dirs(Path(out_dir)):
        try:
            _verify_files(candidate, _read_manifest(candidate))
        except CorruptCheckpoint as error:
            log.warning("skipping %s", error)
            continue
        return candidate
    return None


def resume_from(
    path: str | os.PathLike,
    *,
    expected_model_config: Mapping[str, Any] | None = None,
    expected_model_state: Mapping[str, torch.Tensor] | None = None,
) -> Checkpoint:
    """Load the checkpoint that ``--resume PATH`` means: PATH itself when it is a checkpoint
    directory (``step-*`` or holding meta.json), else the newest valid checkpoint inside it.

    A damaged checkpoint inside a run directory is skipped with a warning; a model mismatch is
    refused rather than skipped, so a resume never silently falls back to an unrelated checkpoint.
    """
    path = Path(path)
    if not path.is_dir():
        raise UserError(f"cannot resume from {path}: no such directory")
    expected = {"expected_model_config": expected_model_config, "expected_model_state": expected_model_state}
    if _STEP_DIR.fullmatch(path.name) or (path / META_FILE).exists():
        return load_checkpoint(path, **expected)
    candidates = _step_dirs(path)
    if not candidates:
        raise UserError(f"cannot resume from {path}: it holds no step-* checkpoint")
    for candidate in candidates:
        try:
            return load_checkpoint(candidate, **expected)
        except CorruptCheckpoint as error:
            log.warning("skipping %s", error)
    raise UserError(f"cannot resume from {path}: all {len(candidates)} checkpoints in it are damaged")


def capture_rng_state() -> dict[str, torch.Tensor]:
    """torch's global RNG states: ``cpu``, and ``cuda.<i>`` for every visible GPU when CUDA is up.

    Add the state of any other generator (``gen.get_state()``) under your own key before saving."""
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        for index, cuda_state in enumerate(torch.cuda.get_rng_state_all()):
            state[f"cuda.{index}"] = cuda_state
    return state


def restore_rng_state(state: Mapping[str, torch.Tensor]) -> None:
    """Restore what `capture_rng_state` captured. CUDA states are restored when the same number of
    GPUs is visible; otherwise a warning says that the resumed run will not be bit-identical."""
    torch.set_rng_state(state["cpu"])
    cuda = [state[key] for key in sorted((k for k in state if k.startswith("cuda.")), key=_cuda_index)]
    if not cuda:
        return
    if torch.cuda.is_available() and torch.cuda.device_count() == len(cuda):
        torch.cuda.set_rng_state_all(cuda)
    else:
        visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
        log.warning(
            "checkpoint has CUDA RNG states for %d GPUs, %d visible: not restored, the run will not be "
            "bit-identical",
            len(cuda),
            visible,
        )


# --- writing -------------------------------------------------------------------------------------


def _write_tensors(path: Path, tensors: Mapping[str, torch.Tensor]) -> dict[str, Any]:
    """save_file; returns the file's size and sha256 for the manifest."""
    prepared: dict[str, torch.Tensor] = {}
    storages: set[int] = set()
    for name, tensor in tensors.items():
        tensor = tensor.detach().to("cpu").contiguous()
        # safetensors refuses tensors that share storage (tied weights): give repeats their own copy.
        storage = tensor.untyped_storage().data_ptr()
        if storage in storages:
            tensor = tensor.clone()
        storages.add(storage)
        prepared[name] = tensor
    save_file(prepared, path)
    return _file_entry(path)


def _file_entry(path: Path) -> dict[str, Any]:
    """A written file's size and sha256, for the manifest."""
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        while chunk := file.read(_HASH_CHUNK):
            digest.update(chunk)
    return {"bytes": path.stat().st_size, "sha256": digest.hexdigest()}


def _make_dirs(out: Path) -> None:
    missing = []
    probe = out.absolute()
    while not probe.exists():
        missing.append(probe)
        probe = probe.parent
    if not probe.is_dir():
        raise UserError(f"checkpoint directory {out}: {probe} is not a directory")
    for directory in reversed(missing):
        directory.mkdir()
        fsync_path(directory.parent)


def _remove_leftovers(out: Path) -> None:
    """Delete what an interrupted save or prune left behind (the single-writer rule makes it safe)."""
    for entry in out.iterdir():
        if entry.name.startswith(TMP_PREFIX):
            log.info("removing leftover %s", entry)
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry)
            else:
                entry.unlink()


def _prune(out: Path, keep: int, newest: Path) -> None:
    for old in _step_dirs(out)[keep:]:
        if old == newest:
            continue
        # Rename first, so that a crash halfway through rmtree leaves no half-deleted step-* dir.
        doomed = out / f"{TMP_PREFIX}delete-{old.name}"
        os.rename(old, doomed)
        shutil.rmtree(doomed)
        log.info("deleted old checkpoint %s", old)


def _flatten_optimizer_state(state_dict: Mapping[str, Any]) -> tuple[dict[str, torch.Tensor], dict]:
    """Split an optimizer state_dict into named tensors and a JSON skeleton of everything else."""
    tensors: dict[str, torch.Tensor] = {}
    skeleton: dict[str, Any] = {"state": {}, "param_groups": []}
    for index, entries in state_dict["state"].items():
        plain = {}
        for name, value in entries.items():
            if isinstance(value, torch.Tensor):
                tensors[f"state.{index}.{name}"] = value
            else:
                plain[name] = value
        skeleton["state"][str(index)] = plain
    for number, group in enumerate(state_dict["param_groups"]):
        plain = {}
        for name, value in group.items():
            if isinstance(value, torch.Tensor):
                tensors[f"param_groups.{number}.{name}"] = value
            else:
                plain[name] = value
        skeleton["param_groups"].append(plain)
    return tensors, skeleton


# --- reading -------------------------------------------------------------------------------------


def _step_dirs(out: Path) -> list[Path]:
    """Checkpoint directories in `out`, newest first: by step, then by repeat number."""
    if not out.is_dir():
        return []
    found = [
        ((int(m.group(1)), int(m.group(2) or 0)), entry)
        for entry in out.iterdir()
        if (m := _STEP_DIR.fullmatch(entry.name))
    ]
    return [entry for _, entry in sorted(found, reverse=True) if entry.is_dir()]


def _new_step_dir(out: Path, step: int) -> Path:
    name = f"step-{step:08d}"
    repeats = [
        int(m.group(2) or 0)
        for entry in out.iterdir()
        if (m := _STEP_DIR.fullmatch(entry.name)) and int(m.group(1)) == step
    ]
    return out / (f"{name}.{max(repeats) + 1}" if repeats else name)


def _read_manifest(path: Path) -> dict:
    if not path.is_dir():
        raise CorruptCheckpoint(f"checkpoint {path}: not a directory")
    meta_path = path / META_FILE
    try:
        manifest = json.loads(meta_path.read_bytes())
    except FileNotFoundError:
        raise CorruptCheckpoint(f"checkpoint {path}: {META_FILE} is missing (incomplete or not a checkpoint)") from None
    except (ValueError, UnicodeDecodeError):
        raise CorruptCheckpoint(f"checkpoint {path}: {META_FILE} is not valid JSON (damaged or truncated)") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CorruptCheckpoint(f"checkpoint {path}: {META_FILE} is not a tscale-p2p checkpoint manifest")
    version = manifest.get("format_version")
    if not isinstance(version, int) or version > FORMAT_VERSION:
        raise UserError(
            f"checkpoint {path}: format version {version!r} is newer than this tscale-p2p reads ({FORMAT_VERSION})"
        )
    body = {key: value for key, value in manifest.items() if key != "checksum"}
    if manifest.get("checksum") != _sha256_bytes(_canonical(body)):
        raise CorruptCheckpoint(f"checkpoint {path}: {META_FILE} checksum mismatch (damaged)")
    try:
        _Manifest.model_validate(manifest)
    except ValidationError as error:
        raise CorruptCheckpoint(f"checkpoint {path}: {META_FILE} {describe(error)}") from None
    return manifest


def _verify_files(path: Path, manifest: dict) -> None:
    for name, expected in manifest["files"].items():
        file = path / name
        try:
            size = file.stat().st_size
        except FileNotFoundError:
            raise CorruptCheckpoint(f"checkpoint {path}: {name} is missing") from None
        if size != expected["bytes"]:
            raise CorruptCheckpoint(
                f"checkpoint {path}: {name} has {size} bytes, expected {expected['bytes']} (truncated or damaged)"
            )
        digest = hashlib.sha256()
        with open(file, "rb") as handle:
            while chunk := handle.read(_HASH_CHUNK):
                digest.update(chunk)
        if digest.hexdigest() != expected["sha256"]:
            raise CorruptCheckpoint(f"checkpoint {path}: {name} sha256 mismatch (damaged)")


def _read_tensors(path: Path, name: str) -> dict[str, torch.Tensor]:
    try:
        return load_file(path / name)
    except (SafetensorError, OSError) as error:
        reason = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise CorruptCheckpoint(f"checkpoint {path}: {name} cannot be read: {reason}") from None


def _unflatten_optimizer_state(path: Path, tensors: dict[str, torch.Tensor], skeleton: dict) -> dict:
    state = {int(index): dict(entries) for index, entries in skeleton["state"].items()}
    # torch optimizers take sequence hyperparameters (betas) as tuples; JSON only has lists.
    groups = [
        {key: tuple(value) if isinstance(value, list) and key != "params" else value for key, value in group.items()}
        for group in skeleton["param_groups"]
    ]
    for key, tensor in tensors.items():
        kind, _, rest = key.partition(".")
        index, _, name = rest.partition(".")
        if kind == "state" and index.isdigit() and int(index) in state:
            state[int(index)][name] = tensor
        elif kind == "param_groups" and index.isdigit() and int(index) < len(groups):
            groups[int(index)][name] = tensor
        else:
            raise CorruptCheckpoint(f"checkpoint {path}: {OPTIMIZER_FILE} holds unexpected tensor {key!r}")
    return {"state": state, "param_groups": groups}


# --- checks --------------------------------------------------------------------------------------


def _check_model_config(path: Path, saved: dict, expected: Mapping[str, Any]) -> None:
    expected = json.loads(json.dumps(dict(expected)))  # compare as JSON sees it (tuples are lists)
    if saved == expected:
        return
    differences = [
        f"{key}={_show(saved, key)} (expected {_show(expected, key)})"
        for key in sorted(set(saved) | set(expected))
        if key not in saved or key not in expected or saved[key] != expected[key]
    ]
    raise UserError(f"checkpoint {path}: saved for a different model: {', '.join(differences)}")


def _show(config: Mapping[str, Any], key: str) -> str:
    return repr(config[key]) if key in config else "<absent>"


def _check_tensors_fit(path: Path, saved: Mapping[str, torch.Tensor], expected: Mapping[str, torch.Tensor]) -> None:
    missing = [name for name in expected if name not in saved]
    extra = [name for name in saved if name not in expected]
    if missing or extra:
        parts = []
        if missing:
            parts.append(f"missing {_few(missing)}")
        if extra:
            parts.append(f"unexpected {_few(extra)}")
        raise UserError(f"checkpoint {path}: weights do not fit the model: {'; '.join(parts)}")
    for name, tensor in expected.items():
        if saved[name].shape != tensor.shape:
            raise UserError(
                f"checkpoint {path}: weight {name} has shape {list(saved[name].shape)}, "
                f"the model has {list(tensor.shape)}"
            )


def _check_finite(context: str, model_state: Mapping[str, torch.Tensor],
                  optimizer_tensors: Mapping[str, torch.Tensor]) -> None:
    """NonFiniteCheckpoint naming the first weight or optimizer tensor that holds a NaN or an infinity."""
    for kind, tensors in (("weight", model_state), ("optimizer state", optimizer_tensors)):
        for name, tensor in tensors.items():
            if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
                raise NonFiniteCheckpoint(f"{context}: {kind} {name} holds NaN or infinite values")


def _check_optimizer_fits(path: Path, saved: dict, optimizer: torch.optim.Optimizer) -> None:
    groups, saved_groups = optimizer.param_groups, saved["param_groups"]
    if len(groups) != len(saved_groups):
        raise UserError(
            f"checkpoint {path}: optimizer has {len(saved_groups)} parameter groups, this one has {len(groups)}"
        )
    for number, (group, saved_group) in enumerate(zip(groups, saved_groups)):
        if len(group["params"]) != len(saved_group["params"]):
            raise UserError(
                f"checkpoint {path}: optimizer parameter group {number} has {len(saved_group['params'])} "
                f"parameters, this one has {len(group['params'])}"
            )
        for param, index in zip(group["params"], saved_group["params"]):
            for name, value in saved["state"].get(index, {}).items():
                if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape != param.shape:
                    raise UserError(
                        f"checkpoint {path}: optimizer state.{index}.{name} has shape {list(value.shape)}, "
                        f"the parameter has {list(param.shape)}"
                    )


def _few(names: list[str], limit: int = 3) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


# --- small helpers -------------------------------------------------------------------------------


def _canonical(value: Any) -> bytes:
    return json.dumps(value, sort_keys=True, separators=(",", ":")).encode()


def _sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _cuda_index(key: str) -> int:
    return int(key.partition(".")[2])
