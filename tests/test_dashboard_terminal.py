"""The dashboard on a real pseudo-terminal: it draws on stdout, so redirecting stderr keeps it on the screen, and
long work shows in it rather than as a rich bar."""

from __future__ import annotations

import fcntl
import os
import pty
import select
import struct
import subprocess
import sys
import termios
import time

import pytest

# A well-formed multiaddr of a peer that is not there: the dashboard shows an empty swarm meanwhile.
NOBODY = "/ip4/127.0.0.1/tcp/9/p2p/QmXWjCt4KiQhsNnkr7E8L3uW2vQMyDWthLGEY4zuVfUYJP"
DASHBOARD = [sys.executable, "-m", "tscale_p2p.cli", "dashboard", "--initial-peers", NOBODY]


def terminal(columns: int = 100, rows: int = 30) -> tuple[int, int]:
    """(master, slave) of a new pseudo-terminal of that size."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", rows, columns, 0, 0))
    return master, slave


def read_until(master: int, wanted: list[bytes], timeout: float) -> bytes:
    """What the terminal received until every one of `wanted` has appeared (or the timeout passed)."""
    seen = b""
    deadline = time.monotonic() + timeout
    while not all(w in seen for w in wanted) and time.monotonic() < deadline:
        ready, _, _ = select.select([master], [], [], 0.2)
        if ready:
            try:
                seen += os.read(master, 65536)
            except OSError:  # the other side closed
                break
    return seen


# `join`'s path to the dashboard, with a stand-in for training that reports long work until `q` stops it.
TRAINING_BEHIND_THE_DASHBOARD = """
from tscale_p2p.peers.status import LocalStatus
from tscale_p2p.progress import long_work
from tscale_p2p.tui.app import run_dashboard_while
from tscale_p2p.tui.terminal import dashboard_can_run

print("dashboard can run:", dashboard_can_run(), flush=True)
status = LocalStatus()

def train():
    status.update(run_id="pty-run", model="e32h2d2w64")
    with long_work("downloading the swarm's state", total=4096) as work:
        work.advance(1024)
        status.stop_requested.wait(60)
    return 0

raise SystemExit(run_dashboard_while(train, status))
"""


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_with_stderr_in_a_file_the_dashboard_and_its_progress_stay_on_the_terminal_and_the_file_stays_plain(tmp_path):
    master, slave = terminal()
    errors_path = tmp_path / "errors.log"
    with open(errors_path, "wb") as errors:
        process = subprocess.Popen([sys.executable, "-c", TRAINING_BEHIND_THE_DASHBOARD], stdin=slave, stdout=slave,
                                   stderr=errors, start_new_session=True)
    os.close(slave)
    try:
        screen = read_until(master, [b"pty-run", b"downloading the swarm's state", b"Quit"], timeout=60)
        assert b"dashboard can run: True" in screen
        assert b"pty-run" in screen and b"downloading the swarm's state" in screen and b"Quit" in screen, screen[-3000:]
        assert b"\x1b[" in screen  # drawn here, by Textual
        os.write(master, b"q")
        deadline = time.monotonic() + 60
        while process.poll() is None and time.monotonic() < deadline:
            read_until(master, [b"never"], timeout=0.5)  # keep the terminal drained while it closes
        assert process.wait(timeout=1) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        os.close(master)
    errors = errors_path.read_bytes()
    assert b"\x1b" not in errors and b"downloading" not in errors  # no screen, no rich bar: plain text only


def test_with_stdout_in_a_file_the_dashboard_refuses_in_one_line(tmp_path):
    master, slave = terminal()
    out_path = tmp_path / "out.txt"
    try:
        with open(out_path, "wb") as out:
            result = subprocess.run(DASHBOARD, stdin=slave, stdout=out, stderr=subprocess.PIPE, timeout=60)
    finally:
        os.close(slave)
        os.close(master)
    assert result.returncode == 2
    assert result.stderr.decode().strip().splitlines() == [
        "tscale-peer: error: the dashboard needs a terminal on stdin and stdout; for plain output use "
        "'tscale-peer peers'"
    ]
    assert out_path.read_bytes() == b""
