"""`--precision` handling: which precision a device can run, and swapping a model's linears in place.

Imports nothing from Triton at module load, so the CLI and CPU-only code stay cheap; the kernels are
imported only when a model is actually converted to fp8 or int8.
"""

from __future__ import annotations

import logging
from collections.abc import Container

import torch
from torch import nn

from tscale_p2p.errors import UserError

log = logging.getLogger(__name__)

PRECISIONS = ("fp32", "bf16", "fp8", "int8")
_MIN_CAPABILITY = {"fp8": (8, 9), "int8": (8, 0)}  # fp8 tensor cores: Ada and Hopper; int8 ones: Ampere on


def resolve_precision(precision: str, device: torch.device) -> str:
    """The precision that will actually run on `device`: fp8/int8 fall back to bf16 (one warning) if unsupported."""
    if precision not in PRECISIONS:
        raise UserError(f"unknown precision {precision!r}; choose one of {', '.join(PRECISIONS)}")
    if precision not in _MIN_CAPABILITY:
        return precision
    device = torch.device(device)
    need = _MIN_CAPABILITY[precision]
    if device.type != "cuda" or not torch.cuda.is_available():
        reason = f"no CUDA device ({device})"
    elif torch.cuda.get_device_capability(device) < need:
        have = torch.cuda.get_device_capability(device)
        reason = f"compute capability {have[0]}.{have[1]} < {need[0]}.{need[1]}"
    else:
        try:
            import triton  # noqa: F401  (the kernels are Triton; it is absent on some platforms)
        except ImportError:
            reason = "Triton is not installed"
        else:
            return precision
    log.warning("precision %s needs a CUDA GPU of compute capability >= %d.%d and Triton: %s; using bf16",
                precision, need[0], need[1], reason)
    return "bf16"


# Linears each precision leaves in bf16 by default. The output head is in fp8 too: 2000 steps of the 85M model
# with it ended 0.43% below bf16 and 0.27% below fp8 with a bf16 head (benchmarks/RESULTS.md, "Kernels and
# low-precision training", Loss). int8 keeps the head in bf16: with an int8 head the same comparison ended 3.74%
# above bf16.
DEFAULT_SKIP = {"fp8": (), "int8": ("lm_head",)}


def convert_linears(model: nn.Module, precision: str, skip: Container[str] | None = None,
                    stochastic_grad: bool = False, fp8_grad_format: str = "e4m3") -> nn.Module:
    """Replace, in place, every nn.Linear (by qualified name, not in `skip`; default `DEFAULT_SKIP`) with
    Fp8Linear / Int8Linear.

    The replacement keeps the very same `weight` Parameter, so optimizer state, checkpoints and state_dict
    names are unchanged. Biased linears are left alone (the model has none). fp32/bf16: nothing changes.
    `stochastic_grad` rounds the gradient casts stochastically; `fp8_grad_format` is "e4m3" or "e5m2".
    """
    if precision in ("fp32", "bf16"):
        return model
    if precision not in ("fp8", "int8"):
        raise UserError(f"unknown precision {precision!r}; choose one of {', '.join(PRECISIONS)}")
    if skip is None:
        skip = DEFAULT_SKIP[precision]
    from tscale_p2p.kernels.linear import Fp8Linear, Int8Linear

    targets = [(name, module) for name, module in model.named_modules()
               if type(module) is nn.Linear and module.bias is None and name not in skip]
    for name, linear in targets:
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        if precision == "fp8":
            new = Fp8Linear(linear.weight, grad_fmt=fp8_grad_format, stochastic_grad=stochastic_grad)
        else:
            new = Int8Linear(linear.weight, stochastic_grad=stochastic_grad)
        setattr(parent, attr, new)
    log.info("converted %d linear layers to %s", len(targets), precision)
    return model
