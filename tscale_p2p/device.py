"""`--device` and `--precision`: one meaning for train, join, infer and serve."""

from __future__ import annotations

import torch

from tscale_p2p.errors import UserError
from tscale_p2p.kernels.precision import PRECISIONS, resolve_precision

PRECISION_CHOICES = ("auto", *PRECISIONS)  # auto: bf16 on a GPU, fp32 on the CPU


def resolve_device(name: str) -> torch.device:
    """`auto` is CUDA where this machine has it, else the CPU; cpu, cuda and cuda:N are checked against the
    machine, so a bad value is one clear UserError instead of a failure at the first tensor."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        device = None
    if device is None or device.type not in ("cpu", "cuda"):
        raise UserError(f"unknown device {name!r}; choose auto, cpu, cuda or cuda:N")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UserError(f"device {name!r}: no CUDA GPU is available on this machine (use --device cpu)")
    if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
        raise UserError(f"device {name!r}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    return device


def choose_precision(precision: str, device: torch.device) -> str:
    """The precision that will run on `device`: `auto` is bf16 on CUDA and fp32 on the CPU; fp8/int8 fall back
    to bf16 (one warning) where the device or the install lacks their kernels."""
    if precision == "auto":
        return "bf16" if device.type == "cuda" else "fp32"
    return resolve_precision(precision, device)
