"""`tscale-peer train` data-parallel on real gloo process groups: torchrun's launcher, DDP with each comm hook,
stop signals, a killed rank, resume on another world size, and the flags it must refuse."""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch

from tscale_p2p.checkpoint import find_latest, load_checkpoint
from tscale_p2p.cli import main
from tscale_p2p.config import TrainConfig
from tscale_p2p.data import load_corpus
from tscale_p2p.distributed import rank_seed
from tscale_p2p.solo import model_config_for
from tscale_p2p.trainer import Trainer

TINY = ["--model", "e32h2d2w32", "--batch-size", "4", "--device", "cpu", "--log-every", "5", "--eval-batches", "2"]
ENV = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}


class Job:
    """`tscale-peer ARGS` in a session of its own (as a shell starts a foreground job), stderr in a file."""

    def __init__(self, cwd: Path, *args: str, env: dict | None = None, name: str = "job") -> None:
        self.log = cwd / f"{name}.log"
        with open(self.log, "wb") as sink:
            self.popen = subprocess.Popen([sys.executable, "-m", "tscale_p2p.cli", *args], cwd=cwd, env=env or ENV,
                                          stdout=subprocess.DEVNULL, stderr=sink, start_new_session=True)

    def err(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_for(self, text: str, timeout: float = 240) -> None:
        deadline = time.monotonic() + timeout
        while text not in self.err():
            assert self.popen.poll() is None, f"exited before {text!r}:\n{self.err()[-3000:]}"
            assert time.monotonic() < deadline, f"no {text!r} within {timeout} s:\n{self.err()[-3000:]}"
            time.sleep(0.2)

    def wait(self, timeout: float = 120) -> int:
        try:
            return self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"still running after {timeout} s:\n{self.err()[-3000:]}") from None

    def ranks(self) -> list[psutil.Process]:
        """The rank processes torchrun started, by rank."""
        children = psutil.Process(self.popen.pid).children(recursive=True)
        ranks = [p for p in children if "RANK" in p.environ() and "tscale_p2p.cli" in p.cmdline()]
        return sorted(ranks, key=lambda p: int(p.environ()["RANK"]))

    def kill(self) -> None:
        if self.popen.poll() is None:
            for process in [*psutil.Process(self.popen.pid).children(recursive=True), psutil.Process(self.popen.pid)]:
                process.kill()
            self.popen.wait(10)


@pytest.fixture
def jobs():
    started: list[Job] = []
    yield started
    for job in started:
        job.kill()


def val_losses(log: str) -> list[float]:
    return [float(line.split("val loss ")[1].split()[0]) for line in log.splitlines() if "val loss" in line]


def reference_weights(corpus: Path, steps: int, argv: list[str]) -> dict[str, torch.Tensor]:
    """One process, one model, each step on the two ranks' micro-batches side by side."""
    flags = dict(zip(argv[::2], argv[1::2]))
    cfg = TrainConfig(data=str(corpus), model=flags["--model"], batch_size=2 * int(flags["--batch-size"]),
                      device="cpu", lr=float(flags["--lr"]), warmup=int(flags["--warmup"]), steps=int(flags["--steps"]))
    data = load_corpus(cfg.data)
    trainer = Trainer(model_config_for(cfg, "cpu", data.vocab_size), cfg, data, torch.device("cpu"))
    half = int(flags["--batch-size"])
    streams = [data.batches("train", half, trainer.context, seed=rank_seed(cfg.seed, r)) for r in (0, 1)]
    trainer.train_batches = (tuple(torch.cat(parts) for parts in zip(*pair)) for pair in zip(*streams))
    for _ in range(steps):
        trainer.local_step()
    return {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}


@pytest.mark.slow
def test_two_ranks_equal_one_process_on_the_combined_batch_and_onebit_learns_like_none(corpus, tmp_path, jobs):
    run = ["--data", str(corpus), "--steps", "40", "--lr", "1e-2", "--warmup", "5", "--eval-every", "20",
           "--save-every", "5", "--keep", "20", *TINY, "--nproc-per-node", "2"]
    for compression in ("none", "onebit"):
        jobs.append(Job(tmp_path, "train", *run, "--out", compression, "--sync-compression", compression,
                        "--sync-warmup-steps", "10", name=compression))
    assert [job.wait(400) for job in jobs] == [0, 0], jobs[0].err()[-2000:] + jobs[1].err()[-2000:]
    uncompressed = load_checkpoint(tmp_path / "none" / "step-00000005").model_state
    expected = reference_weights(corpus, 5, run)
    for name, value in expected.items():
        torch.testing.assert_close(uncompressed[name], value, rtol=1e-4, atol=1e-5, msg=name)
    none, onebit = val_losses(jobs[0].err()), val_losses(jobs[1].err())
    assert len(none) == len(onebit) == 2
    # Both fall from ln(256) = 5.5, and 1 bit per value keeps learning about as fast: by step 40 it is past
    # where the uncompressed run was at step 20, and not far behind where it is now.
    assert onebit[-1] < none[0] and onebit[-1] < 1.5 * none[-1], (none, onebit)
    assert "gradients exchanged with onebit" in jobs[1].err()


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
@pytest.mark.parametrize("compression", ["bf16", "onebit"])
def test_two_gpus_train_over_nccl_and_learn(compression, corpus, tmp_path, jobs):
    """One rank per GPU: NCCL, and for onebit the Triton pack; both learn as the CPU ranks do."""
    on_gpu = [flag if flag != "cpu" else "cuda" for flag in TINY]
    jobs.append(Job(tmp_path, "train", "--data", str(corpus), "--steps", "40", "--lr", "1e-2", "--warmup", "5",
                    "--eval-every", "20", "--save-every", "0", *on_gpu, "--nproc-per-node", "2", "--out", compression,
                    "--sync-compression", compression, "--sync-warmup-steps", "5", name=compression))
    assert jobs[0].wait(400) == 0, jobs[0].err()[-3000:]
    losses = val_losses(jobs[0].err())
    assert len(losses) == 2 and losses[-1] < losses[0] < 5.5, losses
    assert f"gradients exchanged with {compression}" in jobs[0].err()


@pytest.mark.slow
def test_ctrl_c_saves_once_stops_every_rank_and_resumes_on_another_world_size(corpus, tmp_path, jobs):
    job = Job(tmp_path, "train", "--data", str(corpus), "--out", "run", "--steps", "100000", "--eval-every", "0",
              "--save-every", "0", *TINY, "--nproc-per-node", "2")
    jobs.append(job)
    job.wait_for("step 5/")
    ranks = job.ranks()
    assert len(ranks) == 2
    os.killpg(job.popen.pid, signal.SIGINT)  # what a terminal sends: the ranks sit in sessions of their own
    assert job.wait() == 0, job.err()[-3000:]
    _, alive = psutil.wait_procs(ranks, timeout=10)
    assert not alive
    assert "Traceback" not in job.err()
    saved = [p for p in (tmp_path / "run").iterdir() if p.name.startswith("step-")]
    assert len(saved) == 1  # rank 0 alone saved, once
    step = load_checkpoint(saved[0]).step
    assert step >= 5
    # The same run continued by one process: rank 0's data stream picks up where it was.
    assert main(["train", "--data", str(corpus), "--out", str(tmp_path / "run"), "--resume", "--steps", str(step + 3),
                 "--eval-every", "0", *TINY]) == 0
    assert load_checkpoint(find_latest(tmp_path / "run")).step == step + 3


@pytest.mark.slow
def test_sigterm_on_one_rank_stops_all_of_them_after_the_same_step(corpus, tmp_path, jobs):
    job = Job(tmp_path, "train", "--data", str(corpus), "--out", "run", "--steps", "100000", "--eval-every", "0",
              "--save-every", "0", *TINY, "--nproc-per-node", "2")
    jobs.append(job)
    job.wait_for("step 5/")
    job.ranks()[1].send_signal(signal.SIGTERM)
    assert job.wait() == 0, job.err()[-3000:]
    assert "Traceback" not in job.err()
    assert load_checkpoint(find_latest(tmp_path / "run")).step >= 5


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_a_killed_rank_makes_the_others_exit_with_one_clear_line(corpus, tmp_path, jobs):
    """Ranks started as torchrun starts them on separate hosts (its variables, no agent of ours around them):
    after SIGKILL of rank 1, rank 0's next exchange fails and it says so, in bounded time."""
    port = free_port()
    for rank in (0, 1):
        env = {**ENV, "RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(port)}
        jobs.append(Job(tmp_path, "train", "--data", str(corpus), "--out", "run", "--steps", "100000",
                        "--eval-every", "0", "--save-every", "5", *TINY, "--sync-timeout", "20", env=env,
                        name=f"rank{rank}"))
    jobs[0].wait_for("saved checkpoint")
    jobs[1].popen.kill()
    assert jobs[0].wait(60) == 1
    last = jobs[0].err().strip().splitlines()[-1]
    assert "rank 0: stopping, another rank is gone or unreachable" in last, jobs[0].err()[-3000:]
    assert "Traceback" not in jobs[0].err()
    assert load_checkpoint(find_latest(tmp_path / "run")).step % 5 == 0  # the newest checkpoint stays loadable


@pytest.mark.parametrize("argv, fragment", [
    (["--nproc-per-node", "0"], "nproc-per-node must be at least 1, got 0"),
    (["--sync-compression", "onebit"], "sync-compression onebit compresses what ranks exchange"),
    (["--sync-compression", "onebit", "--nproc-per-node", "1"], "world size 1 exchanges nothing"),
    (["--nproc-per-node", "2", "--nnodes", "2", "--rdzv-endpoint", "not an address"], "rdzv-endpoint 'not an address'"),
    (["--nproc-per-node", "2", "--nnodes", "2", "--rdzv-endpoint", "10.0.0.1:99999"], "rdzv-endpoint '10.0.0.1:99999'"),
    (["--nproc-per-node", "2", "--nnodes", "2"], "--nnodes 2 needs --rdzv-endpoint"),
    (["--nnodes", "2", "--rdzv-endpoint", "10.0.0.1:29400"], "add --nproc-per-node"),
    (["--nproc-per-node", "2", "--offload", "optimizer"], "--offload optimizer does not work with data-parallel"),
    (["--nproc-per-node", "2", "--sync-compression", "powersgd", "--sync-warmup-steps", "1"], "at least 2 with powersgd"),
    (["--nproc-per-node", "2", "--sync-timeout", "0"], "sync-timeout must be a positive number of seconds, got 0"),
    (["--nproc-per-node", "2", "--sync-compression", "twobit"], "invalid choice: 'twobit'"),
    (["--nproc-per-node", "2", "--sync-compression", "bf16"], "bf16 needs GPUs"),
])
def test_bad_flags_are_refused_in_one_line(argv, fragment, corpus, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        raise SystemExit(main(["train", "--data", str(corpus), "--out", str(tmp_path / "run"), *TINY, *argv]))
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and fragment in err, err
    assert not (tmp_path / "run").exists()


def test_nproc_per_node_under_torchrun_is_refused(corpus, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert main(["train", "--data", str(corpus), "--out", str(tmp_path / "run"), *TINY, "--nproc-per-node", "2"]) == 2
    assert "drop it when running under torchrun" in capsys.readouterr().err


def test_a_launch_table_in_the_config_file_does_not_launch_again_under_torchrun(corpus, tmp_path, caplog, monkeypatch):
    """The launcher hands its ranks the same --config file: a rank that read its [launch] table would launch ranks
    of its own. A rank of a one-rank job here, in this process. --offload, which works at world size 1 only, makes a
    rank that would launch 2 ranks fail at once instead: ranks launching ranks would multiply without end."""
    rank = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(free_port())}
    for name, value in rank.items():
        monkeypatch.setenv(name, value)
    (tmp_path / "run.toml").write_text('[launch]\nnproc-per-node = 2\n[device]\noffload = "optimizer"\n')
    caplog.set_level(logging.INFO, logger="tscale_p2p")
    assert main(["train", "--config", str(tmp_path / "run.toml"), "--data", str(corpus), "--out", str(tmp_path / "run"),
                 "--steps", "2", "--eval-every", "0", *TINY]) == 0
    assert "data-parallel: 1 ranks" in caplog.text
    assert load_checkpoint(find_latest(tmp_path / "run")).step == 2


@pytest.mark.slow
def test_the_launcher_takes_its_settings_from_the_config_file_and_its_ranks_train(corpus, tmp_path, jobs):
    (tmp_path / "run.toml").write_text("[launch]\nnproc-per-node = 2\n[optim]\nsteps = 4\n")
    job = Job(tmp_path, "train", "--config", "run.toml", "--data", str(corpus), "--out", "run", "--eval-every", "0",
              *TINY)
    jobs.append(job)
    assert job.wait(240) == 0, job.err()[-3000:]
    assert "data-parallel: 2 ranks" in job.err()
    assert load_checkpoint(find_latest(tmp_path / "run")).step == 4
