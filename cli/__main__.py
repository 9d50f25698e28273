"""`python -m tscale_p2p.cli`: the `tscale-peer` command (how torchrun starts the ranks of `train`)."""

import sys

from tscale_p2p.cli import main

sys.exit(main())
