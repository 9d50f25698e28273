"""`tscale-peer join` / `peers` end to end: real peer processes, hivemind DHTs and p2pd daemons on 127.0.0.1.

Each peer runs in its own session (process group), so "kill -9 a peer" kills it the way a machine dies:
the trainer, its DHT and averager processes and its p2pd together. Every group is killed at teardown.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from hangs import FAULTHANDLER, stacks
from tscale_p2p.cli import build_parser, main
from tscale_p2p.cli.swarm import join_inputs
from tscale_p2p.peers.join import join
from tscale_p2p.peers.progress import Progress, RoundClock
from tscale_p2p.peers.status import LocalStatus
from tscale_p2p.peers.swarm_state import read_state_file, saved_state_file

pytestmark = [pytest.mark.slow]

MADDR = re.compile(r"/ip4/127\.0\.0\.1/tcp/\d+/p2p/\w+")
TINY = ["--model", "e32h2d2w64", "--batch-size", "4", "--device", "cpu", "--log-every", "5", "--save-every", "0"]
FAST_ROUNDS = ["--inner-steps", "5", "--matchmaking-time", "2", "--averaging-timeout", "10"]
LOOPBACK = ["--host-maddrs", "/ip4/127.0.0.1/tcp/0"]
HIVEMIND_DHT = Path(sys.executable).with_name("hivemind-dht")


class Process:
    """A child process in its own session, its stdout+stderr in a file we can poll."""

    def __init__(self, args: list[str], log: Path, cwd: Path) -> None:
        self.log = log
        # Peers share two cores: one OpenMP thread each, or their spin-waits starve one another.
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
        with open(log, "wb") as sink:
            self.popen = subprocess.Popen(args, stdout=sink, stderr=subprocess.STDOUT, cwd=cwd, env=env,
                                          start_new_session=True)

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_for(self, pattern: str, timeout: float, count: int = 1) -> list[re.Match]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = list(re.finditer(pattern, self.output()))
            if len(found) >= count:
                return found
            if self.popen.poll() is not None:
                break
            time.sleep(0.2)
        raise AssertionError(f"{pattern!r} x{count} not seen in {self.log.name}:\n{self.summary()}")

    def summary(self) -> str:
        """What a failure message needs: the log's round, warning and error lines from the start, then its tail."""
        output = self.output()
        events = [line for line in output.splitlines() if re.search(r"round \d+:|WARN|ERROR|Traceback", line)]
        return "\n".join(events[:40]) + "\n...\n" + output[-2000:]

    def wait(self, timeout: float) -> int:
        try:
            return self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"{self.log.name} still running after {timeout} s:\n{self.summary()}\n"
                                 f"{stacks(self.popen, self.output)}") from None

    def signal_group(self, signum: int) -> None:
        try:
            os.killpg(self.popen.pid, signum)
        except ProcessLookupError:
            pass


@pytest.fixture
def spawn(tmp_path):
    """spawn(name, *args) starts a process; all of them (and their children) are SIGKILLed at teardown."""
    started: list[Process] = []

    def start(name: str, *args: str) -> Process:
        process = Process(list(args), tmp_path / f"{name}.log", tmp_path)
        started.append(process)
        return process

    yield start
    for process in started:
        process.signal_group(signal.SIGKILL)
        process.popen.wait(10)


@pytest.fixture
def text_file(tmp_path) -> Path:
    path = tmp_path / "corpus.txt"
    words = "the swarm trains one model together while every peer keeps its own data and pace ".split()
    generator = torch.Generator().manual_seed(0)
    picks = torch.randint(len(words), (30000,), generator=generator).tolist()
    path.write_text(" ".join(words[i] for i in picks))
    return path


def join_flags(out: str, data: Path, *extra: str) -> list[str]:
    """`tscale-peer` arguments of a loopback-only `join`."""
    return ["join", "--out", out, "--data", str(data), *LOOPBACK, *extra]


def join_args(out: str, data: Path, *extra: str) -> list[str]:
    """The command line of a `tscale-peer join` process."""
    # -X faulthandler: a peer that hangs is made to print every thread's stack (see `Process.wait`)
    return [sys.executable, *FAULTHANDLER, "-m", "tscale_p2p.cli", *join_flags(out, data, *extra)]


def bootstrap_with_hivemind_dht(spawn) -> str:
    """hivemind's own `hivemind-dht` (not our code) as the swarm's first node; returns its multiaddr."""
    dht = spawn("hivemind-dht", str(HIVEMIND_DHT), "--host_maddrs", "/ip4/127.0.0.1/tcp/0")
    return dht.wait_for(MADDR.pattern, timeout=30)[0].group(0)


def shared_weights(out: Path) -> list[torch.Tensor]:
    """theta (the swarm's weights after the last outer step) from the swarm state in a peer's checkpoint."""
    _, tensors = read_state_file(saved_state_file(out))
    return tensors[: len(tensors) // 2]


def rounds(log: str) -> dict[int, tuple[int, str | None]]:
    """round number -> (other peers averaged with, fingerprint of the shared weights after it), from a log."""
    found = {}
    for match in re.finditer(r"round (\d+): averaged with (?:nobody|(\d+) peer).*?(?:weights (\w+))?\n", log):
        found[int(match.group(1))] = (int(match.group(2) or 0), match.group(3))
    return found


def disturbed_rounds(log: str) -> set[int]:
    """Rounds in which a peer lost a groupmate mid-round or found itself out of step with its group (both
    legitimate under load: a lost span averages to zero, a retried all-reduce can meet the next round's group)."""
    lost = re.findall(r"round (\d+): averaged with \d+ peer\(s\), lost", log)
    out_of_step = re.findall(r"round (\d+): our global weights .* differ from the group's", log)
    return {int(number) for number in lost + out_of_step}


def rounds_together(histories: list[dict], disturbed: set[int], among: set[int]) -> list[int]:
    """The rounds of `among` that every peer averaged with all the others and none reports as disturbed."""
    return [r for r in sorted(among - disturbed) if all(history[r][0] == len(histories) - 1 for history in histories)]


def stop_all(peers: list[Process], timeout: float = 60) -> None:
    """Ctrl+C (SIGINT) to the first peer, SIGTERM to the others, at once: each finishes its round, saves and
    exits 0."""
    for number, peer in enumerate(peers):
        peer.popen.send_signal(signal.SIGINT if number == 0 else signal.SIGTERM)
    for peer in peers:
        assert peer.wait(timeout) == 0, peer.summary()


@pytest.mark.timeout(150)
def test_three_peers_average_and_agree_with_a_stock_hivemind_bootstrap(spawn, tmp_path, text_file):
    bootstrap = bootstrap_with_hivemind_dht(spawn)
    names = ("a", "b", "c")
    # --min-peers: training starts once all three are up, so the first round can gather all of them. The top-k
    # codec here (the other swarm tests run the default sign codec): agreement must not depend on the codec. Two
    # opening rounds first (short, each average applied before the next step), and with them the outer lr falls with
    # the inner one: agreement must hold through both.
    peers = [
        spawn(name, *join_args(name, text_file, "--initial-peers", bootstrap, "--run-id", "agree", "--name", name,
                               "--min-peers", "3", *TINY, "--inner-steps", "5", "--matchmaking-time", "3",
                               "--averaging-timeout", "20", "--codec", "topk", "--opening-rounds", "2",
                               "--opening-inner-steps", "3"))
        for name in names
    ]
    # Every round that all three averaged together, and that no peer reports as disturbed (a groupmate lost
    # mid-round, or a base out of step with the group's, which the resync tested elsewhere repairs), must leave
    # the very same shared weights on every peer: the same averages applied in the same order. The round in
    # flight when the peers are told to stop may end differently on each (one that stops before its round ends
    # keeps those steps local, the others average without it): only rounds all of them had ended count.
    deadline = time.monotonic() + 100
    while True:
        histories = [rounds(peer.output()) for peer in peers]
        disturbed = set().union(*(disturbed_rounds(peer.output()) for peer in peers))
        ended_by_all = set.intersection(*(set(history) for history in histories))
        together = rounds_together(histories, disturbed, ended_by_all)
        if len(together) >= 2 or time.monotonic() > deadline or any(p.popen.poll() is not None for p in peers):
            break
        time.sleep(0.5)
    stop_all(peers)
    histories = [rounds(peer.output()) for peer in peers]
    disturbed = set().union(*(disturbed_rounds(peer.output()) for peer in peers))
    together = rounds_together(histories, disturbed, ended_by_all)
    assert len(together) >= 2, (disturbed, histories, [peer.summary() for peer in peers])
    # ... and up to the first disturbed round, every round ended the same way on every peer.
    clean = [r for r in sorted(ended_by_all) if r < min(disturbed, default=float("inf"))]
    for history in histories[1:]:
        assert [history[r] for r in together] == [histories[0][r] for r in together], histories
        assert [history[r] for r in clean] == [histories[0][r] for r in clean], histories
    if not disturbed:  # peers that applied the same averages saved the same shared weights
        for (name, history), (other, other_history) in itertools.combinations(zip(names, histories), 2):
            if history == other_history:
                theta, other_theta = shared_weights(tmp_path / name), shared_weights(tmp_path / other)
                assert all(torch.equal(x, y) for x, y in zip(theta, other_theta)), (name, other, histories)
    for peer in peers:
        assert "Traceback" not in peer.output()
        assert re.search(r"run 'agree' \(config \w+\): model \w+, 5 inner steps after 2 opening rounds of 3 at "
                         r"plain lr 1.5, outer lr 1.5 falling to 1 with the inner lr, codec topk", peer.output())
        # (a groupmate's span lost mid-round under load still leaves the round averaged with both)
        assert re.search(r"round 1: averaged with 2 peer\(s\)(, lost 1 of them mid-round)? in .* applied 0 steps "
                         r"into round 2", peer.output())


@pytest.mark.timeout(420)
def test_late_joiner_listing_refusals_and_a_killed_peer(spawn, tmp_path, text_file, capsys):
    """One swarm, in order: a founder prints how to join; a second peer joins; a late joiner downloads the
    state and continues; `peers --json` lists all three; a contradicting flag is refused; a peer killed
    with SIGKILL mid-round does not stall the others."""
    # A long schedule (--steps, adopted by the joiners): the run must not end while the test watches it.
    a = spawn("a", *join_args("a", text_file, "--run-id", "late", "--name", "a", "--steps", "1000000",
                              *TINY, *FAST_ROUNDS))
    founder = a.wait_for(r"tscale-peer join --initial-peers (\S+) --run-id late", timeout=60)[0].group(1)
    assert MADDR.fullmatch(founder)
    b = spawn("b", *join_args("b", text_file, "--initial-peers", founder, "--run-id", "late", "--name", "b"))
    # Numbered from the downloaded round. Under load a first round can fail on a matchmaking race (the leader gave
    # up on a group its follower had joined): the follower then waits out its 20 s reducer timeout.
    b.wait_for(r"round \d+: averaged with 1 peer", timeout=120, count=2)

    c = spawn("c", *join_args("c", text_file, "--initial-peers", founder, "--run-id", "late", "--name", "c"))
    # A third process starting (torch, p2pd, the DHT) beside two trainers and a parallel test worker on two cores
    # logged nothing past its identity for over a minute in two CI runs.
    downloaded = int(c.wait_for(r"downloaded the state of round (\d+)", timeout=150)[0].group(1))
    assert downloaded >= 2
    # The joiner's state is a round old by the time it averages (the others' round was in flight): it must
    # not stay an outer step behind, but within a few rounds (a re-download, if its base is found out of step)
    # apply the same rounds as the others, to the same global weights.
    for count in range(2, 6):
        c.wait_for(r"round \d+: averaged with 2 peer", timeout=60, count=count)
        in_step = [r for r, (others, fingerprint) in rounds(c.output()).items()
                   if others == 2 and rounds(a.output()).get(r, (0, None))[1] == fingerprint]
        if in_step:
            break
    assert in_step, (rounds(a.output()), rounds(c.output()))
    assert re.search(r"joined run 'late'.*model e32h2d2w64, 5 inner steps", c.output())  # adopted, no model flags

    capsys.readouterr()
    assert main(["peers", "--initial-peers", founder, "--run-id", "late", "--json"]) == 0
    records = {record["name"]: record for record in json.loads(capsys.readouterr().out)}
    assert set(records) == {"a", "b", "c"}
    assert records["a"]["step"] > 0 and records["a"]["device"] == "cpu" and records["a"]["precision"] == "fp32"
    assert records["a"]["offload"] is False and records["a"]["relayed"] is False
    assert records["b"]["round"] >= 2 and records["b"]["bytes_sent"] > 0 and records["b"]["last_averaging"]
    # From one of its rounds' outcomes: under load a round can lose a groupmate mid-round (a reducer's stream cut
    # short, a span the group disagrees on), which b's log counts too. Losing one is no attack: nobody is banned.
    lost = {0} | {int(count) for count in re.findall(r"lost (\d+) of them mid-round", b.output())}
    assert records["b"]["dropped_peers"] in lost
    assert all(record["banned_peers"] == 0 for record in records.values())

    # (every run setting's check is tests/test_run_config.py's; here the command's exit 2 and one line)
    out = str(tmp_path / "refused")
    assert main(join_flags(out, text_file, "--initial-peers", founder, "--run-id", "late", "--model", "e64h2d2w64")) == 2
    err = capsys.readouterr().err
    assert "--model e64h2d2w64 contradicts" in err and err.count("\n") == 1, err

    b.wait_for(r"averaging in the background", timeout=30, count=len(re.findall("in the background", b.output())) + 1)
    b.signal_group(signal.SIGKILL)
    last_round = {survivor: max(rounds(survivor.output())) for survivor in (a, c)}
    # The survivors keep completing rounds: none waits for the dead peer for good (the averaging timeout is 10 s).
    # (A survivor whose round the kill left on other weights than the other's re-downloads the state and may
    # skip a round number, hence "at least".)
    for survivor in (a, c):
        deadline = time.monotonic() + 60
        while max(rounds(survivor.output())) < last_round[survivor] + 2 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert max(rounds(survivor.output())) >= last_round[survivor] + 2, survivor.summary()
    # A survivor may refuse the other as a pair partner right after the kill ("not averaging in a pair with ...,
    # a peer not averaged with yet, or one caught or disputed", seen in CI) and take any partner only after
    # PAIR_PATIENCE rounds alone (peers/schedule.py): give them those rounds.
    def after_kill() -> list[int]:
        return [others for number, (others, _) in rounds(a.output()).items() if number > last_round[a] + 1]

    deadline = time.monotonic() + 90
    while 1 not in after_kill() and time.monotonic() < deadline:
        time.sleep(0.2)
    stop_all([a, c])
    assert 1 in after_kill()  # a and c still average together


@pytest.mark.timeout(60)
def test_unreachable_initial_peer_is_retried_with_backoff_without_a_traceback(spawn, text_file):
    nobody = "/ip4/127.0.0.1/tcp/9/p2p/QmX2jXBEjUG1a4Na2zp8icDAy92brp2EMDNKFt1eJp2gQS"
    peer = spawn("lonely", *join_args("lonely", text_file, "--initial-peers", nobody, *TINY))
    delays = [float(m.group(1)) for m in peer.wait_for(r"cannot reach the initial peers yet .*retrying in (\d+) s",
                                                         timeout=40, count=2)]
    assert delays[1] > delays[0]  # backoff
    peer.popen.send_signal(signal.SIGTERM)
    assert peer.wait(30) == 0
    assert "Traceback" not in peer.output()


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--initial-peers", "/ip4/1.2.3/tcp/5"], "is not a valid multiaddr"),
        (["--initial-peers", "garbage"], "is not a valid multiaddr"),
        (["--initial-peers", "/ip4/127.0.0.1/tcp/5"], "has no /p2p/<peer id> part"),
        (["--host-maddrs", "/ip4/127.0.0.1/tcpx/0"], "is not a valid multiaddr"),
        (["--run-id", "bad id!"], "invalid --run-id"),
        (["--inner-steps", "0"], "--inner-steps must be at least 1"),
    ],
)
def test_bad_swarm_flags_are_refused_in_one_line(flags, message, capsys):
    assert main(["join", *flags]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and err.startswith("tscale-peer: error:")


def test_a_bad_flag_gets_one_line_from_a_fresh_process_too():
    """What a user's shell shows: nothing printed while importing (a dependency's deprecation warning, say) comes
    before the error line."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONWARNINGS"}
    result = subprocess.run([sys.executable, "-m", "tscale_p2p.cli", "join", "--initial-peers", "garbage"],
                            capture_output=True, text=True, timeout=60, env=env)
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and result.stderr.startswith("tscale-peer: error:"), result.stderr


@pytest.mark.timeout(200)
def test_a_new_run_starts_from_a_solo_runs_checkpoint_and_a_restarted_peer_keeps_its_id_run_and_state(
        spawn, tmp_path, text_file, capsys):
    # A model that is not join's default, trained alone for 30 steps.
    solo = ["--model", "e32h2d1w64", "--batch-size", "8", "--device", "cpu", "--save-every", "0", "--lr", "1e-2",
            "--warmup", "0"]
    assert main(["train", "--data", str(text_file), "--out", str(tmp_path / "solo"), "--steps", "30", *solo]) == 0
    trained = tmp_path / "solo" / "step-00000030"
    # No model flags: the new run takes the checkpoint's model, weights, AdamW state and step.
    command = join_args("founder", text_file, "--run-id", "warm", "--init-from", str(tmp_path / "solo"), "--steps",
                        "40", "--max-steps", "4", "--batch-size", "4", "--device", "cpu", "--log-every", "1",
                        "--save-every", "0", "--inner-steps", "4", "--matchmaking-time", "0.5")
    founder = spawn("founder", *command, "--averaging-timeout", "1")
    assert founder.wait(100) == 0, founder.summary()
    log = founder.output()
    assert "started run 'warm'" in log and "model e32h2d1w64" in log
    assert f"starting from {trained} at step 30" in log
    first_loss = float(re.search(r"step 31  round \d+  loss ([\d.]+)", log).group(1))
    assert first_loss < 0.75 * math.log(256), log[-3000:]  # a fresh model starts at ln(vocab)
    assert re.search(r"step 34 ", log)  # 30 steps before, 4 now, on one schedule
    peer_id = re.search(r"peer id (\w+)", log).group(1)
    rounds_done = max(rounds(log))

    # The same command again: the peer resumes its own checkpoint in --out (not --init-from's), with the same
    # peer id, run and swarm state. Alone, with a long averaging timeout: the round in flight when it leaves is
    # given up after twice the matchmaking time (nobody else is looking for a group), not left to time out.
    again = spawn("again", *command, "--averaging-timeout", "60")
    assert again.wait(90) == 0, again.summary()
    log = again.output()
    assert "holds this peer's checkpoint: resuming from it, not from --init-from" in log
    assert f"peer id {peer_id}" in log
    assert "continuing run 'warm'" in log and "model e32h2d1w64" in log
    assert f"continuing from the saved swarm state of round {rounds_done}" in log
    assert re.search(r"step 38  round", log)  # 34 steps before, 4 now
    last = max(rounds(log))
    assert re.search(rf"round {last}: averaged with nobody \(nobody else looking for a group\)", log), log[-3000:]

    # Refused in one line, before anything trains: a missing folder, a checkpoint at or past the run's end.
    assert main(["join", "--out", str(tmp_path / "x"), "--init-from", str(tmp_path / "nowhere")]) == 2
    err = capsys.readouterr().err
    assert "--init-from" in err and "nowhere" in err and err.count("\n") == 1
    late = spawn("late", *join_args("late", text_file, "--init-from", str(trained), "--steps", "30", "--device", "cpu"))
    assert late.wait(60) == 2
    assert "is at step 30, not before the run's last step 30" in late.output()
    assert "Traceback" not in late.output()


@pytest.mark.timeout(120)
def test_join_in_a_thread_obeys_the_dashboards_pause_and_stop(tmp_path, text_file, monkeypatch):
    """The dashboard runs `join` in a worker thread and drives it only through `LocalStatus`."""
    monkeypatch.chdir(tmp_path)
    flags = join_flags("threaded", text_file, "--run-id", "threaded", *TINY, "--inner-steps", "5",
                       "--matchmaking-time", "0.5", "--averaging-timeout", "1")
    cfg, explicit, options = join_inputs(build_parser().parse_args(flags))
    status = LocalStatus()
    result = {}
    worker = threading.Thread(target=lambda: result.update(code=join(cfg, explicit, options, status)))
    worker.start()
    try:
        deadline = time.monotonic() + 60
        while status.snapshot().step < 10 and time.monotonic() < deadline:
            time.sleep(0.1)
        snap = status.snapshot()
        assert snap.step >= 10 and snap.run_id == "threaded" and snap.precision == "fp32" and snap.inner_steps == 5
        assert snap.loss is not None and snap.tokens_per_s > 0 and any("step" in line for line in snap.log_lines)
        status.paused.set()
        time.sleep(1.0)
        paused_at = status.snapshot().step
        time.sleep(1.5)
        assert status.snapshot().step == paused_at and status.snapshot().paused
        status.paused.clear()
        deadline = time.monotonic() + 30
        while status.snapshot().step <= paused_at and time.monotonic() < deadline:
            time.sleep(0.1)
        assert status.snapshot().step > paused_at
        assert status.snapshot().round >= 1 and status.snapshot().averaging
    finally:
        status.stop_requested.set()
        worker.join(60)
    assert not worker.is_alive() and result["code"] == 0
    assert saved_state_file(tmp_path / "threaded") is not None


@pytest.mark.timeout(60)
def test_round_clock_ends_every_peers_round_when_the_swarm_made_h_steps_per_peer():
    """Two clocks on real DHT nodes: a round ends once both peers' steps add up to 2 x H, at once if the
    other peer has already ended it, and a peer alone ends it after H steps."""
    import hivemind

    first = hivemind.DHT(host_maddrs=["/ip4/127.0.0.1/tcp/0"], start=True)
    second = hivemind.DHT(host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=first.get_visible_maddrs(), start=True)
    clocks = [RoundClock(dht, "clock", name, inner_steps=10, every_s=0.2) for dht, name in ((first, "a"), (second, "b"))]
    try:
        mine, other = clocks
        assert mine.round_done(0, 10) and not mine.round_done(0, 9)  # alone: H steps
        for clock in clocks:
            clock.start()
        other.update(epoch=0, steps=8, steps_per_s=0.0)
        mine.update(epoch=0, steps=5, steps_per_s=0.0)
        deadline = time.monotonic() + 20
        while mine.peers_in(0) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert mine.peers_in(0) == 2
        assert not mine.round_done(0, 11) and mine.round_done(0, 12)  # 12 + 8 = 2 x H
        other.update(epoch=1, steps=0, steps_per_s=0.0)  # the other peer has ended round 0
        deadline = time.monotonic() + 20
        while not mine.round_done(0, 1) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert mine.round_done(0, 1) and not mine.round_done(0, 0)
    finally:
        for clock in clocks:
            clock.stop()
        second.shutdown()
        first.shutdown()


def test_round_clock_a_minority_ahead_counts_its_share_and_a_majority_ahead_ends_the_round():
    """A peer claiming to be a round ahead (honestly first, or hostile) shortens the others' round by its own
    H steps only; once most peers have moved on, a late peer ends its round at once. A peer whose run is over
    learns whether anyone else is still training towards the round."""
    clock = RoundClock(dht=None, run_id="clock", peer_id="me", inner_steps=10)
    now = time.time()
    current, ahead = Progress(epoch=3, steps=6, steps_per_s=0.0, time=now), Progress(4, 0, 0.0, now)
    clock.observe([ahead, current, current])
    assert clock.peers_in(3) == 4
    assert not clock.round_done(3, 17) and clock.round_done(3, 18)  # 18 + 6 + 6 + 10 (the one ahead) = 4 x H
    clock.observe([ahead, ahead, current])
    assert clock.round_done(3, 1)  # two of three others are past round 3: we are late
    clock.observe([Progress(1, 50, 0.0, now), current])  # far behind: not counted at all
    assert clock.peers_in(3) == 2 and not clock.round_done(3, 13) and clock.round_done(3, 14)
    assert clock.live_peers() == 3  # ... but it is live: a round's group must expect it
    clock.observe([Progress(3, 60, 0.0, now), Progress(2, 0, 0.0, now), Progress(1, 9, 5.0, now)])
    assert clock.others_idle(3)  # everyone counted has stopped (the peer two rounds back is not counted)
    clock.observe([Progress(3, 60, 0.0, now), Progress(2, 0, 4.0, now)])
    assert not clock.others_idle(3)  # one is still training towards this round
    clock.observe([])
    assert clock.others_idle(3)  # alone: nobody to wait for


def test_round_clock_predicts_when_the_round_ends_at_the_swarms_pace():
    """The swarm loop schedules matchmaking this many seconds ahead of the round's end."""
    clock = RoundClock(dht=None, run_id="clock", peer_id="me", inner_steps=10)
    now = time.time()
    clock.observe([Progress(epoch=3, steps=4, steps_per_s=2.0, time=now), Progress(2, 9, 1.0, now)])
    # 3 x 10 steps to make; 6 (ours) + 4 (the other in round 3) made; 2 + 2 steps/s in round 3
    assert clock.seconds_to_round_end(3, 6, steps_per_s=2.0) == pytest.approx(5.0, rel=0.01)
    assert clock.seconds_to_round_end(3, 26, steps_per_s=2.0) == 0.0
    clock.observe([Progress(3, 4, 0.0, now)])
    assert clock.seconds_to_round_end(3, 6, steps_per_s=0.0) == math.inf
