"""Which stream the dashboard draws on, and so whether it can run.

Textual's Linux driver draws on stderr (and reads keys from stdin). Then `tscale-peer join 2>errors.log`
sends the whole dashboard into the file and leaves the terminal blank, and the choice "dashboard or log lines"
made on stdout would not match where it draws. The dashboard draws on stdout instead: redirecting stderr keeps
it on the terminal and leaves the file plain text; redirecting stdout (or stdin) gives log lines on stderr.
"""

from __future__ import annotations

import sys


def dashboard_can_run() -> bool:
    """Whether stdout (where the dashboard draws) and stdin (where its keys come from) are terminals."""
    return all(stream is not None and stream.isatty() for stream in (sys.__stdout__, sys.__stdin__))


def stdout_driver(driver_class: type) -> type:
    """`driver_class` (what Textual picked for this platform), drawing on stdout if it is Textual's Linux driver."""
    if sys.platform == "win32":  # Textual's Windows driver; its Linux one cannot even be imported there
        return driver_class
    from textual.drivers.linux_driver import LinuxDriver

    if driver_class is not LinuxDriver:  # Windows, or a driver named in $TEXTUAL_DRIVER: left as it is
        return driver_class

    class StdoutLinuxDriver(LinuxDriver):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            # The stream its writer thread writes to (a private attribute: tests/test_tui.py checks on a real
            # pseudo-terminal that the screen arrives on stdout, and nothing on stderr).
            self._file = sys.__stdout__

    return StdoutLinuxDriver
