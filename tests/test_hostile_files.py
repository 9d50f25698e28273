"""Files that lie: checkpoints whose checksums were recomputed over NaN weights or fields of the wrong type, a
training run that diverges. Each is refused in one line with exit code 2, and no bad checkpoint is ever written."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tscale_p2p.checkpoint import NonFiniteCheckpoint, find_latest, load_checkpoint, save_checkpoint
from tscale_p2p.cli import main

TINY = ["--model", "e32h2d2w32", "--batch-size", "4", "--device", "cpu", "--log-every", "5", "--eval-batches", "2"]


def reseal(checkpoint: Path, change=lambda manifest: None) -> None:
    """Recompute every size and sha256 in meta.json, apply `change` to it, and recompute its own checksum: the
    checkpoint looks intact."""
    meta_path = checkpoint / "meta.json"
    manifest = json.loads(meta_path.read_text())
    for name, entry in manifest["files"].items():
        data = (checkpoint / name).read_bytes()
        entry.update(bytes=len(data), sha256=hashlib.sha256(data).hexdigest())
    change(manifest)
    body = {key: value for key, value in manifest.items() if key != "checksum"}
    manifest["checksum"] = hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()
    meta_path.write_text(json.dumps(manifest))


def refused(argv: list[str], capsys, fragment: str) -> str:
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("tscale-peer: error:") and "Traceback" not in err, err
    assert fragment in err, err
    return err


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> tuple[Path, Path]:
    """(corpus, run folder) of a tiny run with checkpoints at steps 2 and 4."""
    root = tmp_path_factory.mktemp("trained")
    corpus = root / "corpus.txt"
    corpus.write_text("the cat sat on the mat. the dog sat on the log.\n" * 200)
    out = root / "run"
    argv = ["train", "--data", str(corpus), "--out", str(out), "--steps", "4", "--save-every", "2", *TINY]
    assert main(argv) == 0
    return corpus, out


@pytest.fixture
def run_copy(trained, tmp_path) -> tuple[Path, Path]:
    """A fresh copy of the trained run's newest checkpoint, alone in its run folder."""
    corpus, out = trained
    newest = find_latest(out)
    copy = tmp_path / "run" / newest.name
    copy.mkdir(parents=True)
    for file in newest.iterdir():
        (copy / file.name).write_bytes(file.read_bytes())
    return corpus, copy


def test_a_resealed_checkpoint_with_nan_weights_is_refused_to_resume_and_to_infer(run_copy, capsys):
    corpus, checkpoint = run_copy
    weights = load_file(checkpoint / "model.safetensors")
    name = sorted(weights)[0]
    weights[name][0] = float("nan")
    save_file(weights, checkpoint / "model.safetensors")
    reseal(checkpoint)
    with pytest.raises(NonFiniteCheckpoint, match=f"weight {name} holds NaN"):
        load_checkpoint(checkpoint)
    resume = ["train", "--data", str(corpus), "--out", str(checkpoint.parent), "--resume", "--steps", "8", *TINY]
    refused(resume, capsys, "holds NaN or infinite values")
    refused(["infer", "--checkpoint", str(checkpoint), "--prompt", "the", "--device", "cpu"], capsys, "holds NaN")


def test_a_checkpoint_of_non_finite_weights_is_never_written(tmp_path):
    save_checkpoint(tmp_path, step=1, model_state={"w": torch.ones(3)}, model_config={})
    with pytest.raises(NonFiniteCheckpoint, match="not saving the checkpoint of step 2.*weight w"):
        save_checkpoint(tmp_path, step=2, model_state={"w": torch.tensor([1.0, float("inf"), 0.0])}, model_config={})
    state = {"state": {0: {"exp_avg": torch.tensor([float("nan")])}}, "param_groups": [{"params": [0], "lr": 1.0}]}
    with pytest.raises(NonFiniteCheckpoint, match="optimizer state state.0.exp_avg"):
        save_checkpoint(tmp_path, step=3, model_state={"w": torch.ones(3)}, model_config={}, optimizer_state=state)
    assert [p.name for p in tmp_path.iterdir()] == ["step-00000001"]


def _set(path: str, value):
    def change(manifest: dict) -> None:
        *parents, last = path.split("/")
        node = manifest
        for part in parents:
            node = node[part]
        node[last] = value
    return change


@pytest.mark.parametrize(
    "change, fragment",
    [
        (_set("step", "4"), "field step"),
        (_set("step", -1), "field step"),
        (_set("files", ["model.safetensors"]), "field files"),
        (_set("files/model.safetensors", 5), "field files.model.safetensors"),
        (_set("files/model.safetensors/bytes", "many"), "field files.model.safetensors.bytes"),
        (_set("files/model.safetensors/sha256", 123), "field files.model.safetensors.sha256"),
        (lambda m: m["files"].update({"../../etc/passwd": {"bytes": 1, "sha256": "0" * 64}}), "field files"),
        (lambda m: m["files"].pop("model.safetensors"), "files lists no model.safetensors"),
        (_set("optimizer", "adamw"), "field optimizer"),
        (_set("optimizer/state", {"first": {}}), "field optimizer.state"),
        (_set("optimizer/param_groups", [{"params": ["w"]}]), "field optimizer.param_groups.0.params.0"),
        (_set("model_config", 5), "field model_config"),
        (_set("model_config/width", "32"), "meta.json model_config: field width"),
        (_set("model_config/vocab_size", "many"), "meta.json model_config: field vocab_size"),
        (_set("model_config/dropout", None), "meta.json model_config: field dropout"),
        (_set("meta/tokenizer", 5), "unknown tokenizer entry 5"),
        (_set("meta", []), "field meta"),
        (_set("meta/tokens_seen", "lots"), "field tokens_seen"),
        (_set("meta/data", {"seed": 0}), "field data.batches_drawn"),
        (_set("meta/data/batches_drawn", 1.5), "field data.batches_drawn"),
    ],
    ids=lambda value: value if isinstance(value, str) else None,
)
def test_every_malformed_meta_json_field_is_one_line_and_exit_2(run_copy, capsys, change, fragment):
    corpus, checkpoint = run_copy
    reseal(checkpoint, change)
    argv = ["train", "--data", str(corpus), "--out", str(checkpoint), "--resume", "--steps", "8", *TINY]
    refused(argv, capsys, fragment)


@pytest.mark.parametrize("save_every, fragment", [("2", "the run diverged"), ("0", "the training loss is no longer a finite number")])
def test_a_diverging_run_stops_and_keeps_its_good_checkpoints(trained, tmp_path, capsys, save_every, fragment):
    corpus, out = trained
    run = tmp_path / "run"
    run.mkdir()
    for checkpoint in out.iterdir():
        (run / checkpoint.name).mkdir()
        for file in checkpoint.iterdir():
            (run / checkpoint.name / file.name).write_bytes(file.read_bytes())
    before = sorted(p.name for p in run.iterdir())
    # A learning rate of 1e30 turns the weights, then the loss, non-finite within a few steps: a checkpoint due
    # every 2 steps is refused, or else the loss seen at the next log line (every 5) stops the run.
    argv = ["train", "--data", str(corpus), "--out", str(run), "--resume", "--steps", "40", "--save-every",
            save_every, "--lr", "1e30", *TINY]
    refused(argv, capsys, fragment)
    assert sorted(p.name for p in run.iterdir()) == before
    assert load_checkpoint(find_latest(run)).step == 4
