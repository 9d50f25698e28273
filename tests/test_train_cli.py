"""`tscale-peer train` end to end: learning, resume, signals, and every bad input it must refuse."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tscale_p2p.checkpoint import find_latest, load_checkpoint
from tscale_p2p.cli import main

TINY = ["--model", "e32h2d2w32", "--batch-size", "4", "--device", "cpu", "--log-every", "5", "--eval-batches", "2"]


def snapshot_tree(root: Path) -> dict:
    return {str(p.relative_to(root)): p.stat().st_mtime_ns for p in sorted(root.rglob("*"))} if root.exists() else {}


def weights(out: Path) -> dict[str, torch.Tensor]:
    return load_checkpoint(find_latest(out)).model_state


def test_loss_falls_on_a_small_corpus(corpus, tmp_path, caplog):
    caplog.set_level("INFO")
    out = tmp_path / "run"
    assert main(["train", "--data", str(corpus), "--out", str(out), "--steps", "60", "--lr", "1e-2", "--warmup", "5", *TINY]) == 0
    val = [float(r.getMessage().split("val loss ")[1].split()[0]) for r in caplog.records if "val loss" in r.getMessage()]
    assert val and val[-1] < 2.0  # from ln(256) = 5.5 at the start
    assert find_latest(out).name == "step-00000060"


def test_resume_continues_bit_for_bit(corpus, tmp_path):
    common = ["--data", str(corpus), "--steps", "8", "--save-every", "4", "--eval-every", "0", *TINY]
    straight, split = tmp_path / "straight", tmp_path / "split"
    assert main(["train", "--out", str(straight), *common]) == 0
    assert main(["train", "--out", str(split), *common[:-len(TINY)], *TINY, "--steps", "4"]) == 0
    assert main(["train", "--out", str(split), "--resume", *common]) == 0
    a, b = weights(straight), weights(split)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_toml_config_is_read_and_flags_override_it(corpus, tmp_path):
    config = tmp_path / "run.toml"
    config.write_text(f'data = "{corpus}"\nsteps = 3\nbatch-size = 2\nmodel = "e32h2d2w32"\ndevice = "cpu"\neval_every = 0\n')
    out = tmp_path / "run"
    assert main(["train", "--config", str(config), "--steps", "2", "--out", str(out)]) == 0
    assert find_latest(out).name == "step-00000002"


def _refused(argv, capsys, fragment: str, watched: Path) -> None:
    before = snapshot_tree(watched)
    with pytest.raises(SystemExit) as exit_info:
        code = main(argv)
        raise SystemExit(code)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("tscale-peer: error:"), err
    assert fragment in err, err
    assert snapshot_tree(watched) == before


def test_bad_model_dims(corpus, tmp_path, capsys):
    _refused(["train", "--data", str(corpus), "--model", "e5h2", "--out", str(tmp_path / "o")], capsys, "e5h2", tmp_path)


def test_unknown_flag(tmp_path, capsys):
    _refused(["train", "--bogus-flag", "3"], capsys, "--bogus-flag", tmp_path)


def test_missing_data_path(tmp_path, capsys):
    _refused(["train", "--data", str(tmp_path / "nope.txt"), "--out", str(tmp_path / "o")], capsys, "nope.txt", tmp_path)


def test_empty_data_file(tmp_path, capsys):
    (tmp_path / "empty.txt").write_text("")
    _refused(["train", "--data", str(tmp_path / "empty.txt"), "--out", str(tmp_path / "o")], capsys, "empty.txt", tmp_path)


def test_bin_with_odd_byte_count(tmp_path, capsys):
    (tmp_path / "tokens.bin").write_bytes(b"\x01\x00\x02")
    _refused(["train", "--data", str(tmp_path / "tokens.bin"), "--out", str(tmp_path / "o")], capsys, "tokens.bin", tmp_path)


@pytest.mark.parametrize("body, fragment", [('colour = "blue"\n', "colour"), ('steps = "many"\n', "steps"), ("steps = [", "not valid TOML")])
def test_bad_toml(tmp_path, capsys, body, fragment):
    (tmp_path / "bad.toml").write_text(body)
    _refused(["train", "--config", str(tmp_path / "bad.toml"), "--out", str(tmp_path / "o")], capsys, fragment, tmp_path)


def test_checkpoint_from_another_model_is_refused(corpus, tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["train", "--data", str(corpus), "--out", str(out), "--steps", "2", "--eval-every", "0", *TINY]) == 0
    capsys.readouterr()
    other = [a if a != "e32h2d2w32" else "e64h2d2w32" for a in TINY]
    _refused(["train", "--data", str(corpus), "--out", str(out), "--resume", "--steps", "4", *other], capsys, "e64h2d2w32", tmp_path)


def test_fresh_run_into_an_existing_run_folder_is_refused(corpus, tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["train", "--data", str(corpus), "--out", str(out), "--steps", "2", "--eval-every", "0", *TINY]) == 0
    capsys.readouterr()
    _refused(["train", "--data", str(corpus), "--out", str(out), "--steps", "2", *TINY], capsys, "--resume", tmp_path)


def test_help_at_every_level():
    for argv in (["--help"], ["train", "--help"]):
        result = subprocess.run([sys.executable, "-m", "tscale_p2p.cli", *argv], capture_output=True, text=True, timeout=60)
        assert result.returncode == 0 and "usage: tscale-peer" in result.stdout


def test_sigterm_saves_a_checkpoint_and_exits_zero(corpus, tmp_path):
    out = tmp_path / "run"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "tscale_p2p.cli", "train", "--data", str(corpus), "--out", str(out), "--steps", "100000",
         "--eval-every", "0", "--save-every", "0", *TINY],
        stderr=subprocess.PIPE, text=True, env=env,
    )
    try:
        for line in proc.stderr:  # wait until it is really training
            if "step 5/" in line:
                break
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    finally:
        proc.kill()
    checkpoint = load_checkpoint(find_latest(out))
    assert 5 <= checkpoint.step < 100000


def test_resuming_a_finished_run_says_nothing_to_do_and_writes_nothing(corpus, tmp_path, caplog):
    out = tmp_path / "run"
    common = ["train", "--data", str(corpus), "--out", str(out), "--steps", "4", "--save-every", "2", *TINY]
    assert main(common) == 0
    before = snapshot_tree(out)
    caplog.set_level("INFO")
    assert main([*common, "--resume"]) == 0
    assert snapshot_tree(out) == before  # no step-4.1, no older checkpoint rotated out
    assert any("nothing to do" in r.getMessage() and "step 4 of --steps 4" in r.getMessage() for r in caplog.records)


NANOGPT_REGULARISERS = ["--tie-embeddings", "--embedding-weight-decay", "0.1", "--attention-dropout", "0.1", "--dropout", "0.1"]


def test_tied_decayed_run_records_its_options_and_resumes_bit_for_bit(corpus, tmp_path):
    common = ["--data", str(corpus), "--steps", "8", "--save-every", "4", "--eval-every", "0", *NANOGPT_REGULARISERS]
    straight, split = tmp_path / "straight", tmp_path / "split"
    assert main(["train", "--out", str(straight), *common, *TINY]) == 0
    assert main(["train", "--out", str(split), *common, *TINY, "--steps", "4"]) == 0
    assert main(["train", "--out", str(split), "--resume", *common, *TINY]) == 0
    a, b = weights(straight), weights(split)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert torch.equal(a["lm_head.weight"], a["tok_emb.weight"])
    saved = load_checkpoint(find_latest(straight))
    assert saved.model_config["tie_embeddings"] is True and saved.model_config["attention_dropout"] == 0.1
    assert [g["weight_decay"] for g in saved.optimizer_state["param_groups"]] == [0.1, 0.0, 0.1]


def test_tied_embeddings_are_refused_with_offload(corpus, tmp_path, capsys):
    argv = ["train", "--data", str(corpus), "--out", str(tmp_path / "o"), "--tie-embeddings", "--offload", "optimizer", *TINY]
    _refused(argv, capsys, "tied embeddings", tmp_path)


def test_negative_embedding_weight_decay_is_refused(corpus, tmp_path, capsys):
    argv = ["train", "--data", str(corpus), "--out", str(tmp_path / "o"), "--embedding-weight-decay", "-1", *TINY]
    _refused(argv, capsys, "embedding-weight-decay must not be negative, got -1.0", tmp_path)
