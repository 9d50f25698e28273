"""tscale-p2p: peer-to-peer volunteer training of transformer language models."""

__version__ = "0.1.0"
