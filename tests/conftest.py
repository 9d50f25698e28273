"""Test-session set-up shared by every module."""

import os
import signal
from pathlib import Path

import pytest
import torch

# Without CUDA the Triton kernels run under Triton's interpreter. Triton reads this when a kernel is defined,
# i.e. when a kernels module is first imported, so it is set here, before any test module is collected.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


# Several tests press Ctrl+C on the programs they start, as a terminal would on a foreground program. A shell
# without job control starts background commands with SIGINT ignored, and started programs inherit that, so
# a suite run in the background would see them shrug Ctrl+C off. Catching it here gives them the default.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    """Tokenized-data caches go to the test's own folder, never to the user's ~/.cache."""
    monkeypatch.setenv("TSCALE_CACHE_DIR", str(tmp_path / "cache"))


@pytest.fixture
def corpus(tmp_path) -> Path:
    """A small, very regular text file: a tiny model learns it in a few dozen steps."""
    path = tmp_path / "corpus.txt"
    lines = [f"the {animal} sat on the {thing}.\n" for animal in ("cat", "dog", "cow", "fox") for thing in ("mat", "log", "hat")]
    path.write_text("".join(lines) * 60)
    return path
