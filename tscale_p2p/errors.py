"""The one exception type for bad user input.

Anything a user can get wrong (a flag, a file, a checkpoint, a multiaddr) raises `UserError` with a
one-line message that names the bad value; the CLI prints it as ``tscale-peer: error: ...`` and exits 2.
"""


class UserError(Exception):
    """Bad input from the user: shown as one line, exit code 2, nothing on disk changed."""
