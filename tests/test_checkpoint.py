"""Checkpoints: round trip, bit-identical resume, keep-last-K, crash safety, refusal of bad checkpoints."""

from __future__ import annotations

import hashlib
import os
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tscale_p2p import checkpoint as ckpt
from tscale_p2p.checkpoint import (
    CorruptCheckpoint,
    capture_rng_state,
    find_latest,
    load_checkpoint,
    restore_rng_state,
    resume_from,
    save_checkpoint,
)
from tscale_p2p.errors import UserError

VOCAB, WIDTH = 32, 16
CONFIG = {"vocab_size": VOCAB, "width": WIDTH, "dims": "e16h2d1w8"}


class TinyLM(nn.Module):
    """Small, but with what matters: an embedding, a norm with bias, dropout (uses the RNG), a head."""

    def __init__(self, width: int = WIDTH):
        super().__init__()
        self.tok_emb = nn.Embedding(VOCAB, width)
        self.norm = nn.LayerNorm(width)
        self.fc = nn.Linear(width, width, bias=False)
        self.drop = nn.Dropout(0.2)
        self.lm_head = nn.Linear(width, VOCAB, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.drop(torch.relu(self.fc(self.norm(self.tok_emb(idx))))))


def make_optimizer(model: TinyLM) -> torch.optim.AdamW:
    no_decay = [model.norm.weight, model.norm.bias]
    decay = [p for p in model.parameters() if all(p is not q for q in no_decay)]
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}], lr=1e-2
    )


def train(model: TinyLM, optimizer: torch.optim.Optimizer, steps: int) -> None:
    """Batches come from torch's global RNG, as does dropout: a resume must restore it."""
    for _ in range(steps):
        tokens = torch.randint(0, VOCAB, (4, 9))
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()


def trained(steps: int = 3, seed: int = 0) -> tuple[TinyLM, torch.optim.AdamW]:
    torch.manual_seed(seed)
    model = TinyLM()
    optimizer = make_optimizer(model)
    train(model, optimizer, steps)
    return model, optimizer


def save(out: Path, model: TinyLM, optimizer: torch.optim.Optimizer, step: int, **kwargs) -> Path:
    return save_checkpoint(
        out,
        step=step,
        model_state=model.state_dict(),
        model_config=CONFIG,
        optimizer_state=optimizer.state_dict(),
        rng_state=capture_rng_state(),
        meta={"tokens_seen": step * 32, "sampler": {"seed": 7, "cursor": step}},
        **kwargs,
    )


def tree(root: Path) -> dict[str, str]:
    """Every path under root with its content hash: compared before and after to prove nothing moved."""
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir"
        for p in sorted(root.rglob("*"))
    }


def assert_states_equal(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].dtype == b[name].dtype and torch.equal(a[name], b[name]), name


def assert_refused(path: Path, call, *needles: str, error=UserError) -> str:
    """The call raises `error` with one line naming `path` and the problem, and changes nothing on disk."""
    before = tree(path.parent)
    with pytest.raises(error) as info:
        call()
    message = str(info.value)
    assert "\n" not in message and str(path) in message, message
    for needle in needles:
        assert needle in message, message
    assert tree(path.parent) == before
    return message


# --- round trip and resume -----------------------------------------------------------------------


def test_round_trip_restores_weights_optimizer_rng_and_meta(tmp_path):
    model, optimizer = trained()
    optimizer.param_groups[0]["lr"] = 3e-3  # a schedule's change must survive too
    rng = capture_rng_state()
    path = save(tmp_path, model, optimizer, step=3)

    assert path == tmp_path / "step-00000003"
    assert sorted(p.name for p in path.iterdir()) == [
        "meta.json", "model.safetensors", "optimizer.safetensors", "rng.safetensors"
    ]
    loaded = load_checkpoint(path, expected_model_config=CONFIG, expected_model_state=model.state_dict())
    assert loaded.path == path and loaded.step == 3 and loaded.model_config == CONFIG
    assert loaded.meta == {"tokens_seen": 96, "sampler": {"seed": 7, "cursor": 3}}
    assert_states_equal(loaded.model_state, model.state_dict())
    assert_states_equal(loaded.rng_state, rng)

    saved = optimizer.state_dict()
    assert loaded.optimizer_state["param_groups"] == saved["param_groups"]  # betas come back a tuple
    assert loaded.optimizer_state["state"].keys() == saved["state"].keys()
    for index, entries in saved["state"].items():
        assert_states_equal(loaded.optimizer_state["state"][index], entries)


def test_resume_continues_bit_for_bit(tmp_path):
    model, optimizer = trained(steps=4, seed=1)
    save(tmp_path, model, optimizer, step=4)
    train(model, optimizer, 5)  # the uninterrupted run

    torch.manual_seed(123)  # a fresh process: other init, other RNG position
    fresh = TinyLM()
    fresh_optimizer = make_optimizer(fresh)
    resumed = resume_from(tmp_path, expected_model_config=CONFIG, expected_model_state=fresh.state_dict())
    resumed.restore(fresh, fresh_optimizer)
    restore_rng_state(resumed.rng_state)
    train(fresh, fresh_optimizer, 5)
    assert_states_equal(fresh.state_dict(), model.state_dict())

    # The RNG state is what makes it exact: without it, the same resume diverges.
    again = TinyLM()
    again_optimizer = make_optimizer(again)
    load_checkpoint(resumed.path).restore(again, again_optimizer)  # restore() hands its tensors over
    train(again, again_optimizer, 5)
    assert not torch.equal(again.fc.weight, model.fc.weight)


def test_tied_weights_are_saved(tmp_path):
    model = TinyLM()
    model.lm_head.weight = model.tok_emb.weight  # shares storage, which safetensors refuses as is
    path = save_checkpoint(tmp_path, step=0, model_state=model.state_dict(), model_config=CONFIG)
    loaded = load_checkpoint(path)
    assert_states_equal(loaded.model_state, model.state_dict())
    assert loaded.optimizer_state is None and loaded.rng_state == {}


# --- rotation and lookup -------------------------------------------------------------------------


def test_keeps_the_last_k(tmp_path):
    model, optimizer = trained(steps=1)
    for step in range(1, 6):
        save(tmp_path, model, optimizer, step=step * 100, keep=3)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000300", "step-00000400", "step-00000500"]
    assert find_latest(tmp_path) == tmp_path / "step-00000500"
    with pytest.raises(UserError, match="at least 1"):
        save(tmp_path, model, optimizer, step=600, keep=0)


def test_saving_a_step_again_adds_a_newer_checkpoint_and_replaces_nothing(tmp_path):
    model, optimizer = trained(steps=1)
    first = save(tmp_path, model, optimizer, step=10)
    first_files = tree(first)
    train(model, optimizer, 1)
    second = save(tmp_path, model, optimizer, step=10)
    assert second == tmp_path / "step-00000010.1"
    assert tree(first) == first_files
    assert find_latest(tmp_path) == second and resume_from(tmp_path).path == second
    assert_states_equal(load_checkpoint(second).model_state, model.state_dict())
    assert save(tmp_path, model, optimizer, step=10, keep=1) == tmp_path / "step-00000010.2"
    assert save(tmp_path, model, optimizer, step=11, keep=2).name == "step-00000011"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000010.2", "step-00000011"]


def test_latest_and_resume_skip_a_damaged_newest_and_leave_it_alone(tmp_path):
    model, optimizer = trained(steps=1)
    good = save(tmp_path, model, optimizer, step=1)
    bad = save(tmp_path, model, optimizer, step=2)
    with open(bad / "optimizer.safetensors", "r+b") as f:
        f.truncate(100)
    before = tree(tmp_path)
    assert find_latest(tmp_path) == good
    assert resume_from(tmp_path).path == good
    assert tree(tmp_path) == before
    # Named explicitly, the damaged one is refused rather than replaced by an older one.
    assert_refused(bad, lambda: resume_from(bad), "optimizer.safetensors", "truncated", error=CorruptCheckpoint)


def test_resume_from_a_directory_without_checkpoints_is_refused(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    assert find_latest(run) is None
    assert find_latest(tmp_path / "missing") is None
    assert_refused(run, lambda: resume_from(run), "no step-* checkpoint")
    missing = run / "missing"
    assert_refused(missing, lambda: resume_from(missing), "no such directory")


# --- refusals ------------------------------------------------------------------------------------


@pytest.fixture
def saved_checkpoint(tmp_path) -> tuple[Path, TinyLM, torch.optim.AdamW]:
    model, optimizer = trained(steps=1)
    return save(tmp_path / "run", model, optimizer, step=5), model, optimizer


def test_truncated_file_is_refused(saved_checkpoint):
    path, _, _ = saved_checkpoint
    model_file = path / "model.safetensors"
    model_file.write_bytes(model_file.read_bytes()[:-64])
    assert_refused(path, lambda: load_checkpoint(path), "model.safetensors", "truncated", error=CorruptCheckpoint)


@pytest.mark.parametrize("name", ["model.safetensors", "optimizer.safetensors", "rng.safetensors", "meta.json"])
def test_flipped_byte_is_refused(saved_checkpoint, name):
    path, _, _ = saved_checkpoint
    data = bytearray((path / name).read_bytes())
    # In meta.json flip a digit of a value, so the JSON still parses and only the checksum can tell.
    offset = data.index(b'"tokens_seen": 160') + len(b'"tokens_seen": 16') if name == "meta.json" else len(data) - 3
    data[offset] ^= 0x01
    (path / name).write_bytes(bytes(data))
    expected = "meta.json checksum mismatch" if name == "meta.json" else f"{name} sha256 mismatch"
    assert_refused(path, lambda: load_checkpoint(path), expected, error=CorruptCheckpoint)


def test_missing_or_garbled_manifest_is_refused(saved_checkpoint):
    path, _, _ = saved_checkpoint
    (path / "meta.json").write_text('{"format": "tscale-p2p-che')
    assert_refused(path, lambda: load_checkpoint(path), "not valid JSON", error=CorruptCheckpoint)
    (path / "meta.json").unlink()
    assert_refused(path, lambda: load_checkpoint(path), "meta.json is missing", error=CorruptCheckpoint)


def test_a_missing_file_is_refused(saved_checkpoint):
    path, _, _ = saved_checkpoint
    (path / "rng.safetensors").unlink()
    assert_refused(path, lambda: load_checkpoint(path), "rng.safetensors is missing", error=CorruptCheckpoint)


def test_other_model_config_is_refused(saved_checkpoint):
    path, _, _ = saved_checkpoint
    other = dict(CONFIG, width=32)
    assert_refused(
        path, lambda: load_checkpoint(path, expected_model_config=other), "different model", "width=16 (expected 32)"
    )
    # resume_from refuses it too instead of skipping to something older.
    assert_refused(path, lambda: resume_from(path.parent, expected_model_config=other), "width=16")


def test_missing_extra_or_misshapen_weights_are_refused(saved_checkpoint):
    path, model, optimizer = saved_checkpoint
    expected = model.state_dict()
    renamed = dict(expected)
    renamed["head.weight"] = renamed.pop("lm_head.weight")
    assert_refused(
        path,
        lambda: load_checkpoint(path, expected_model_state=renamed),
        "missing head.weight",
        "unexpected lm_head.weight",
    )
    wider = TinyLM(width=WIDTH * 2)
    assert_refused(
        path, lambda: load_checkpoint(path, expected_model_state=wider.state_dict()), "tok_emb.weight", "[32, 16]"
    )
    # restore() checks too, and leaves model and optimizer untouched when it refuses.
    loaded = load_checkpoint(path)
    wider_before = {k: v.clone() for k, v in wider.state_dict().items()}
    assert_refused(path, lambda: loaded.restore(wider, make_optimizer(wider)), "the model has [32, 32]")
    assert_states_equal(wider.state_dict(), wider_before)


def test_optimizer_that_does_not_fit_is_refused(saved_checkpoint):
    path, model, _ = saved_checkpoint
    loaded = load_checkpoint(path)
    one_group = torch.optim.AdamW(model.parameters())
    assert_refused(path, lambda: loaded.restore(model, one_group), "2 parameter groups, this one has 1")
    swapped = torch.optim.AdamW(  # same groups and sizes, parameters in another order
        [{"params": [model.fc.weight, model.tok_emb.weight, model.lm_head.weight]},
         {"params": [model.norm.weight, model.norm.bias]}]
    )
    assert_refused(
        path, lambda: loaded.restore(model, swapped), "optimizer state.0.exp_avg has shape [32, 16]", "has [16, 16]"
    )
    without = save_checkpoint(path.parent, step=6, model_state=model.state_dict(), model_config=CONFIG)
    assert_refused(without, lambda: load_checkpoint(without).restore(model, make_optimizer(model)), "no optimizer")


def test_newer_format_is_refused(saved_checkpoint, monkeypatch):
    path, model, optimizer = saved_checkpoint
    monkeypatch.setattr(ckpt, "FORMAT_VERSION", 2)
    newer = save(path.parent, model, optimizer, step=9)
    monkeypatch.setattr(ckpt, "FORMAT_VERSION", 1)
    assert_refused(newer, lambda: load_checkpoint(newer), "format version 2 is newer")


# --- crashes -------------------------------------------------------------------------------------


def test_a_failure_between_files_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    model, optimizer = trained(steps=1)
    previous = save(tmp_path, model, optimizer, step=1, keep=1)
    before = tree(tmp_path)
    real_save_file = ckpt.save_file

    def disk_fills_up(tensors, path, *args):
        if Path(path).name == "optimizer.safetensors":
            raise OSError(28, "No space left on device")
        real_save_file(tensors, path, *args)

    monkeypatch.setattr(ckpt, "save_file", disk_fills_up)
    with pytest.raises(OSError, match="No space left"):
        save(tmp_path, model, optimizer, step=2, keep=1)
    assert tree(tmp_path) == before  # the temp dir is gone too
    assert find_latest(tmp_path) == previous
    assert_states_equal(load_checkpoint(previous).model_state, model.state_dict())


# Runs in a helper process: imports torch once, then forks one writer per kill point. Each writer
# saves step 2 and SIGKILLs itself just before its k-th fsync/rename, which covers every stage: files
# not yet synced, temp dir complete, renamed into place, pruning the old checkpoint.
KILLED_WRITERS = textwrap.dedent(
    """
    import os, signal, sys, torch
    from tscale_p2p.checkpoint import save_checkpoint

    root, kill_points = sys.argv[1], int(sys.argv[2])
    torch.manual_seed(2)
    state = {"w": torch.randn(64, 64), "b": torch.randn(64)}
    optimizer_state = {"state": {0: {"step": torch.tensor(1.0), "exp_avg": torch.randn(64, 64)}},
                       "param_groups": [{"lr": 0.1, "params": [0]}]}
    rng_state = {"cpu": torch.get_rng_state()}
    for k in range(1, kill_points + 1):
        pid = os.fork()
        if pid == 0:
            calls = 0
            def dying(real):
                def call(*args):
                    global calls
                    calls += 1
                    if calls == k:
                        os.kill(os.getpid(), signal.SIGKILL)
                    return real(*args)
                return call
            os.fsync, os.rename = dying(os.fsync), dying(os.rename)
            save_checkpoint(os.path.join(root, str(k)), step=2, model_state=state, model_config={"n": 2},
                            optimizer_state=optimizer_state, rng_state=rng_state, meta={"writer": k}, keep=1)
            os._exit(0)
        _, status = os.waitpid(pid, 0)
        print(k, os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, flush=True)
    """
)


def count_durability_calls(out: Path, write) -> int:
    """How many fsync/rename calls one save makes (the points where a crash can land)."""
    counts = {"n": 0}

    def counted(real):
        def call(*args):
            counts["n"] += 1
            return real(*args)

        return call

    real_fsync, real_rename = os.fsync, os.rename
    os.fsync, os.rename = counted(real_fsync), counted(real_rename)
    try:
        write(out)
    finally:
        os.fsync, os.rename = real_fsync, real_rename
    return counts["n"]


def test_sigkill_in_the_middle_of_a_save_leaves_the_previous_checkpoint(tmp_path):
    model, optimizer = trained(steps=1)
    base = tmp_path / "base"
    save(base, model, optimizer, step=1, keep=1)
    scratch = tmp_path / "scratch"
    shutil.copytree(base, scratch)
    kill_points = count_durability_calls(scratch, lambda out: save(out, model, optimizer, step=2, keep=1))
    assert kill_points == 8  # 4 files + temp dir + rename + OUT dir + prune's rename
    for k in range(1, kill_points + 1):
        shutil.copytree(base, tmp_path / str(k))

    env = dict(os.environ, OMP_NUM_THREADS="1")
    result = subprocess.run(
        [sys.executable, "-c", KILLED_WRITERS, str(tmp_path), str(kill_points)],
        capture_output=True, text=True, timeout=60, env=env,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == [w for k in range(1, kill_points + 1) for w in (str(k), "True")]

    base_weights = load_checkpoint(base / "step-00000001").model_state
    survivors = []
    for k in range(1, kill_points + 1):
        out = tmp_path / str(k)
        latest = find_latest(out)
        assert latest is not None, k
        # No half-written step-* dir is ever visible: every one there loads.
        for step_dir in out.glob("step-*"):
            load_checkpoint(step_dir)
        if latest.name == "step-00000001":
            assert_states_equal(load_checkpoint(latest).model_state, base_weights)
        else:
            assert load_checkpoint(latest).meta == {"writer": k}
        survivors.append(latest.name)
        # The next save clears the leftovers.
        save(out, model, optimizer, step=3, keep=1)
        assert sorted(p.name for p in out.iterdir()) == ["step-00000003"], k
    # Early kills keep the old checkpoint, kills after the rename already show the new one.
    assert survivors[0] == "step-00000001" and survivors[-1] == "step-00000002"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_state_round_trips_into_a_fused_optimizer(tmp_path):
    torch.manual_seed(0)
    model = TinyLM().cuda()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    train_tokens = torch.randint(0, VOCAB, (4, 9), device="cuda")
    for _ in range(2):
        loss = F.cross_entropy(model(train_tokens[:, :-1]).reshape(-1, VOCAB), train_tokens[:, 1:].reshape(-1))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    rng = capture_rng_state()
    assert any(key.startswith("cuda.") for key in rng)
    path = save_checkpoint(
        tmp_path, step=2, model_state=model.state_dict(), model_config=CONFIG,
        optimizer_state=optimizer.state_dict(), rng_state=rng,
    )
    torch.rand(10, device="cuda")  # move the CUDA RNG on
    fresh = TinyLM().cuda()
    fresh_optimizer = torch.optim.AdamW(fresh.parameters(), lr=1e-2, fused=True)
    loaded = load_checkpoint(path)
    loaded.restore(fresh, fresh_optimizer)
    restore_rng_state(loaded.rng_state)
    assert torch.equal(torch.cuda.get_rng_state(), rng["cuda.0"])
    assert_states_equal(fresh.state_dict(), model.state_dict())
    for fresh_param, param in zip(fresh.parameters(), model.parameters()):
        fresh_state, state = fresh_optimizer.state[fresh_param], optimizer.state[param]
        assert fresh_state["exp_avg"].device == fresh_param.device
        assert torch.equal(fresh_state["exp_avg"], state["exp_avg"])
        assert torch.equal(fresh_state["step"].cpu(), state["step"].cpu())
