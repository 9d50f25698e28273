"""How many CPU threads a `join` peer gives torch: --threads, $OMP_NUM_THREADS, or the cores shared among the
peers running on this machine."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import psutil
import pytest
import torch

from tscale_p2p.cli import main
from tscale_p2p.peers.join import default_threads, other_local_peers

# A stand-in for another peer: a process with a `tscale-peer join` command line that forks once, as hivemind's
# DHT and averager processes are forks of their peer. Only the parent says "up" (once the fork exists): with both
# printing, the two words could meet on one line under load.
FAKE_PEER = "import os, time\nif os.fork(): print('up', flush=True)\ntime.sleep(60)"


def test_threads_flag_is_documented_and_checked(capsys):
    with pytest.raises(SystemExit):
        main(["join", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "--threads N" in help_text and "OMP_NUM_THREADS" in help_text
    assert main(["join", "--threads", "0"]) == 2
    assert "--threads must be at least 1, got 0" in capsys.readouterr().err


def test_default_threads_share_the_cores_among_local_peers(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert default_threads() == torch.get_num_threads()
    monkeypatch.delenv("OMP_NUM_THREADS")
    cores = len(os.sched_getaffinity(0))
    assert 1 <= default_threads() <= cores
    fake = subprocess.Popen([sys.executable, "-c", FAKE_PEER, "tscale_p2p.cli", "join"], stdout=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        assert fake.stdout.readline() == "up\n"
        deadline = time.monotonic() + 5
        while not psutil.Process(fake.pid).children():
            assert time.monotonic() < deadline
            time.sleep(0.05)
        (fork,) = psutil.Process(fake.pid).children()
        peers = other_local_peers()
        assert fake.pid in peers and fork.pid not in peers  # a peer's forks are part of that peer
        assert os.getpid() not in peers
    finally:
        os.killpg(fake.pid, 9)
        fake.wait()
