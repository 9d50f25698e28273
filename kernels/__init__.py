"""Triton fp8/int8 and 1-bit kernels with their torch autograd wrappers.

Importing this package is cheap and needs neither CUDA nor Triton: the Triton modules (`quantize`, `gemm`,
`linear`) load on first use, e.g. `from tscale_p2p.kernels import Fp8Linear` or `convert_linears(...)`.
"""

from __future__ import annotations

import importlib

from tscale_p2p.kernels.precision import PRECISIONS, convert_linears, resolve_precision

_LAZY = {"Fp8Linear": "linear", "Int8Linear": "linear", "QuantizedLinear": "linear",
         "quantize_rows": "quantize", "quantize_cols_t": "quantize", "scaled_mm": "gemm"}

__all__ = ["PRECISIONS", "convert_linears", "resolve_precision", *_LAZY]


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(f"tscale_p2p.kernels.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
