"""`tscale-peer infer --initial-peers ... --run-id ...`: the swarm's model fetched from a real peer on 127.0.0.1.

One swarm for the module: a peer trains a tiny model for two rounds and stops (so its swarm state is on disk and
differs from the run's initial weights), then restarts from that state with --min-peers 2, so it serves the
state without training on while the tests fetch it.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import torch
from tscale_p2p.peers.swarm_state import SwarmState, read_state_file, saved_state_file

from tscale_p2p.cli import main
from tscale_p2p.errors import UserError
from tscale_p2p.generate import GenerationEngine, SamplingParams, generate, prepare_for_inference
from tscale_p2p.model import ModelConfig, Transformer
from tscale_p2p.peers.fetch import fetch_swarm_model
from tscale_p2p.peers.network import NetworkOptions, start_dht
from tscale_p2p.peers.run_config import load_saved_run_config, publish_run_config

pytestmark = [pytest.mark.slow]

RUN = "fetch"
MADDR = re.compile(r"/ip4/127\.0\.0\.1/tcp/\d+/p2p/\w+")
NOBODY = "/ip4/127.0.0.1/tcp/9/p2p/QmX2jXBEjUG1a4Na2zp8icDAy92brp2EMDNKFt1eJp2gQS"
PROMPT = "the swarm "
# One OpenMP thread per process: the peer and the tests share two cores.
CHILD_ENV = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}


def tscale_peer(*args: str) -> list[str]:
    return [sys.executable, "-m", "tscale_p2p.cli", *args]


def kill_session(process: subprocess.Popen) -> None:
    """SIGKILL a child started with start_new_session=True and whatever of its session is left."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    process.wait(10)


def join_args(out: Path, data: Path, *extra: str) -> list[str]:
    return tscale_peer("join", "--out", str(out), "--data", str(data), "--run-id", RUN, "--no-tui",
                       "--host-maddrs", "/ip4/127.0.0.1/tcp/0", "--device", "cpu", *extra)


@pytest.fixture(scope="module")
def swarm(tmp_path_factory):
    """(the serving peer's multiaddr, its --out directory)."""
    root = tmp_path_factory.mktemp("swarm")
    data = root / "corpus.txt"
    words = "the swarm trains one model together while every peer keeps its own data and pace ".split()
    picks = torch.randint(len(words), (20000,), generator=torch.Generator().manual_seed(0)).tolist()
    data.write_text(" ".join(words[i] for i in picks))
    out = root / "peer"
    trained = subprocess.run(
        join_args(out, data, "--model", "e32h2d2w64", "--batch-size", "4", "--save-every", "0", "--max-steps", "10",
                  "--inner-steps", "5", "--matchmaking-time", "0.5", "--averaging-timeout", "1"),
        env=CHILD_ENV, capture_output=True, text=True, timeout=60,
    )
    assert trained.returncode == 0, trained.stderr[-3000:]
    log = root / "serving.log"
    with open(log, "wb") as sink:  # its own session: the teardown kills it with its DHT, averager and p2pd
        peer = subprocess.Popen(join_args(out, data, "--min-peers", "2"), stdout=sink, stderr=subprocess.STDOUT,
                                env=CHILD_ENV, start_new_session=True)
    try:
        deadline = time.monotonic() + 40
        while "waiting for 2 peers" not in log.read_text() and peer.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        text = log.read_text()
        assert "waiting for 2 peers" in text and "continuing from the saved swarm state" in text, text[-3000:]
        yield MADDR.search(text).group(0), out
    finally:
        kill_session(peer)


def saved_model(out: Path) -> tuple[Transformer, int]:
    """The peer's global weights from the swarm state in its checkpoint, and their round."""
    config = ModelConfig.from_dict(load_saved_run_config(out).model)
    model = Transformer(config)
    state = SwarmState.from_wire(*read_state_file(saved_state_file(out)), names=[n for n, _ in model.named_parameters()])
    model.load_state_dict(state.weights)
    return prepare_for_inference(model, "cpu", "fp32"), state.round


def greedy(model: Transformer, prompt: str, tokens: int) -> str:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the same reductions as the one-thread child process
    try:
        [seq] = generate(GenerationEngine(model), [prompt], SamplingParams(max_tokens=tokens, temperature=0))
    finally:
        torch.set_num_threads(threads)
    return seq.text


@pytest.mark.timeout(90)
def test_infer_fetches_the_swarms_model_and_generates_as_with_its_weights(swarm):
    maddr, out = swarm
    infer = subprocess.run(
        tscale_peer("infer", "--initial-peers", maddr, "--run-id", RUN, "--prompt", PROMPT, "--max-tokens", "8",
                    "--temperature", "0", "--device", "cpu"),
        env=CHILD_ENV, capture_output=True, timeout=60,
    )
    stderr = infer.stderr.decode(errors="replace")
    assert infer.returncode == 0 and "Traceback" not in stderr, stderr[-3000:]
    saved, round_ = saved_model(out)
    assert round_ >= 1  # trained: not the run's initial weights
    assert f"downloaded run '{RUN}' (e32h2d2w64) at round {round_}" in stderr
    assert re.search(r"\[8 tokens, [\d.]+ tokens/s", stderr)
    assert infer.stdout.decode() == greedy(saved, PROMPT, 8) != ""

    fetched = fetch_swarm_model([maddr], RUN, timeout=30)
    assert (fetched.run_id, fetched.round, fetched.config) == (RUN, round_, saved.cfg)
    expected = dict(saved.named_parameters())
    assert list(fetched.weights) == list(expected)
    assert all(torch.equal(fetched.weights[name], expected[name]) for name in expected)


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "flags, message",
    [
        (["--initial-peers", "/ip4/1.2.3/tcp/5", "--run-id", RUN], "is not a valid multiaddr"),
        (["--initial-peers", "/ip4/127.0.0.1/tcp/5"], "has no /p2p/<peer id> part"),
        (["--initial-peers", NOBODY, "--run-id", "bad id!"], "invalid --run-id"),
        (["--initial-peers", NOBODY, "--checkpoint", "runs/x"], "give exactly one of --checkpoint"),
        ([], "give exactly one of --checkpoint"),
        (["--checkpoint", "runs/x", "--run-id", RUN], "--run-id goes with --initial-peers"),
        (["--initial-peers", NOBODY, "--fetch-timeout", "0"], "--fetch-timeout must be positive"),
        # nothing listens there: the DHT start is retried until the timeout, then one line
        (["--initial-peers", NOBODY, "--run-id", RUN, "--fetch-timeout", "2"],
         f"run '{RUN}': cannot reach any initial peer ({NOBODY})"),
    ],
)
def test_bad_model_sources_are_refused_in_one_line(flags, message, capsys):
    assert main(["infer", *flags, "--prompt", "hi", "--device", "cpu"]) == 2
    error = capsys.readouterr().err.splitlines()[-1]
    assert error.startswith("tscale-peer: error:") and message in error


@pytest.mark.timeout(60)
def test_a_run_nobody_serves_is_named_in_one_line(swarm, capsys):
    maddr, _ = swarm
    assert main(["serve", "--initial-peers", maddr, "--run-id", "nosuch", "--fetch-timeout", "2"]) == 2
    err = capsys.readouterr().err
    assert f"tscale-peer: error: run 'nosuch' via {maddr}: no peer has published this run's config within 2 s\n" in err
    assert "Traceback" not in err


@pytest.mark.timeout(90)
def test_serve_answers_with_the_swarms_model(swarm):
    maddr, out = swarm
    serve = subprocess.Popen(
        tscale_peer("serve", "--initial-peers", maddr, "--run-id", RUN, "--port", "0", "--device", "cpu"),
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=CHILD_ENV, text=True, start_new_session=True,
    )
    try:
        lines = []
        while not (lines and lines[-1].startswith("serving")) and serve.poll() is None:
            lines.append(serve.stderr.readline())
        url = re.match(rf"serving '{RUN}' at (\S+) ", lines[-1]).group(1)  # the model is named after the run
        body = json.dumps({"prompt": PROMPT, "max_tokens": 8, "temperature": 0}).encode()
        with urllib.request.urlopen(urllib.request.Request(f"{url}/completions", data=body), timeout=30) as reply:
            completion = json.load(reply)
        assert completion["model"] == RUN
        assert completion["choices"][0]["text"] == greedy(saved_model(out)[0], PROMPT, 8)
        serve.send_signal(signal.SIGINT)
        assert serve.wait(30) == 0
    finally:
        kill_session(serve)


@pytest.mark.timeout(60)
def test_a_run_whose_peers_share_no_state_is_named_in_one_line(swarm, capsys):
    """The run's config is published, but no live peer serves its state (a stand-in for peers that all left)."""
    maddr, out = swarm
    dht = start_dht(NetworkOptions(initial_peers=(maddr,), host_maddrs=("/ip4/127.0.0.1/tcp/0",), client_mode=True))
    try:
        assert publish_run_config(dht, "orphan", load_saved_run_config(out))
        with pytest.raises(UserError) as refused:
            fetch_swarm_model([maddr], "orphan", timeout=3)
    finally:
        dht.shutdown()
    assert str(refused.value) == f"run 'orphan' via {maddr}: no live peer shared the run's model within 3 s"
