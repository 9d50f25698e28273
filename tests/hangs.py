"""Telling where a child process hangs, for a failing test's message."""

from __future__ import annotations

import signal
import subprocess
from collections.abc import Callable

# Put before `-m module` on a child's command line: the child then prints every thread's stack on SIGABRT.
FAULTHANDLER = ("-X", "faulthandler")


def stacks(popen: subprocess.Popen, output: Callable[[], str]) -> str:
    """Where the threads of `popen` (started with FAULTHANDLER) stand now; `output` reads what it has printed
    so far. The process dies of the SIGABRT."""
    before = len(output())
    popen.send_signal(signal.SIGABRT)
    try:
        popen.wait(10)
    except subprocess.TimeoutExpired:
        pass
    dump = output()[before:].splitlines()
    return "\n".join(line for line in dump if not line.startswith("Extension modules:"))[-6000:]
