"""`Fp8Linear` / `Int8Linear`: nn.Linear (no bias) whose three matmuls run in fp8 or int8.

Every matmul contracts along the last axis of both quantized operands, with one scale per row:

    forward  Y  = X  W^T :  X  [M, K] row-scaled (per token),  W   [N, K] row-scaled
    dgrad    dX = dY W   :  dY [M, N] row-scaled,              W^T [K, N] scaled per column of W
    wgrad    dW = dY^T X :  (dY * sx)^T [N, M] per column,     Xq^T [K, M] unscaled

The weight gradient reuses the forward's quantized X: its per-token scales sx vary along the contraction, so
they are folded into dY (dW[n, k] = sum_m dY[m, n] sx[m] Xq[m, k]) and Xq only needs a byte transpose. So the
forward reads X once, and the backward keeps X in fp8/int8 (a quarter of an fp32 activation). The transposed
(dY * sx)^T is re-quantized from the row-quantized dY, so dY is quantized once from bf16 and read back as bytes.

The master weight stays a full-precision nn.Parameter; its two quantized copies are cached and rebuilt only
when the parameter may have changed (after an optimizer step, or when its version counter moves), i.e. once
per optimizer step however many micro-batches run.

The matmuls are torch custom ops inside an autograd Function, so torch.compile traces a whole model through
these layers (no graph breaks: the reshapes and copies around them fuse into the compiled kernels) while the
Triton launches and the weight cache stay opaque Python. Each layer's cache is found through an integer id,
which the compiler treats as a constant of the call site. In a compiled graph the per-token quantization of
the input, and in the backward of dY, are plain torch ops, which the compiler fuses into the kernels that produce
those tensors (the norm, the activation, their backward): neither the bf16 input nor the bf16 dY then goes to
memory and back.
"""

from __future__ import annotations

import itertools
import weakref

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook

from tscale_p2p.kernels.gemm import scaled_mm
from tscale_p2p.kernels.quantize import (FORMATS, QuantFormat, quantize_cols_t, quantize_rows, quantize_rows_torch,
                                         quantize_with_transpose, transpose)


_optimizer_steps = 0


def _count_optimizer_step(optimizer, args, kwargs) -> None:
    global _optimizer_steps
    _optimizer_steps += 1


# Fused optimizers (AdamW(fused=True)) update parameters in place without moving their version counter, so
# every optimizer step, of any optimizer, also invalidates the caches.
register_optimizer_step_post_hook(_count_optimizer_step)


class QuantizedWeightCache:
    """The quantized copies of one weight, rebuilt when the weight changed: after any optimizer step, or any
    other in-place update (load_state_dict, an outer update), which moves the tensor's version counter."""

    def __init__(self) -> None:
        self._key: tuple | None = None
        self._value: tuple | None = None

    def get(self, weight: torch.Tensor, fmt: QuantFormat):
        key = (_optimizer_steps, weight._version, weight.data_ptr(), weight.device, fmt.name)
        if key != self._key:
            with torch.no_grad():
                self._value = quantize_with_transpose(weight.detach(), fmt)
            self._key = key
        return self._value


# The live layers' caches, by id: custom ops take tensors and plain values, not Python objects.
_caches: weakref.WeakValueDictionary[int, QuantizedWeightCache] = weakref.WeakValueDictionary()
_cache_ids = itertools.count()


def _cache_for(cache_id: int) -> QuantizedWeightCache:
    """The layer's cache; a fresh one if the layer is gone (a backward may outlive a temporary layer)."""
    return _caches.get(cache_id) or QuantizedWeightCache()


def _as_2d(t: torch.Tensor) -> torch.Tensor:
    t = t.reshape(-1, t.shape[-1])
    return t if t.stride(-1) == 1 else t.contiguous()


@torch.library.custom_op("tscale::quantized_matmul", mutates_args=())
def quantized_matmul(x_q: torch.Tensor, x_s: torch.Tensor, weight: torch.Tensor, cache_id: int, fmt: str,
                     out_dtype: torch.dtype) -> torch.Tensor:
    """Y = X W^T from X already quantized per token ([M, K] and its [M] scales), with the layer's cached
    quantized weight."""
    w_q, w_s, _, _ = _cache_for(cache_id).get(weight, FORMATS[fmt])
    return scaled_mm(x_q, w_q, x_s, w_s, out_dtype=out_dtype)


@quantized_matmul.register_fake
def _(x_q, x_s, weight, cache_id, fmt, out_dtype):
    return x_q.new_empty((x_q.shape[0], weight.shape[0]), dtype=out_dtype)


def _quantize_input(x2: torch.Tensor, fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token quantization of a layer's input: in torch ops inside a compiled graph, where the compiler fuses
    it into the kernel that produces the input (a norm, an activation), else with the one-pass Triton kernel."""
    if torch.compiler.is_compiling():
        return quantize_rows_torch(x2, fmt)
    return quantize_rows(x2, fmt)


@torch.library.custom_op("tscale::quantized_linear_backward", mutates_args=())
def quantized_linear_backward(g2: torch.Tensor | None, x_q: torch.Tensor, x_s: torch.Tensor, weight: torch.Tensor,
                              cache_id: int, fmt: str, grad_fmt: str, stochastic_grad: bool, need_x: bool,
                              need_w: bool, x_dtype: torch.dtype, g_q: torch.Tensor | None = None,
                              g_s: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(dX [M, K], dW) of a quantized linear layer from dY [M, N]; an empty tensor for the one not needed.

    dY comes either as `g2` (quantized per row here) or already quantized per row as `g_q`, `g_s` (see
    `_quantize_grad`).
    """
    gf = FORMATS[grad_fmt]
    if g_q is None:
        g_q, g_s = quantize_rows(g2, gf, stochastic=stochastic_grad)
    grad_x = grad_w = x_s.new_empty(0)
    if need_w:
        # wgrad contracts over tokens: (dY * sx)^T, one scale per column of dY. It is re-quantized from the
        # row-quantized dY (dY ~= g_q * g_s): 1 byte an element to read instead of 2, and in a compiled graph
        # dY itself then never goes to memory, at the cost of a second rounding of the wgrad operand.
        g_q_t, g_s_t = quantize_cols_t(g_q, gf, stochastic=stochastic_grad, row_mul=g_s * x_s)
        ones = torch.ones(x_q.shape[1], dtype=torch.float32, device=x_q.device)
        grad_w = scaled_mm(g_q_t, transpose(x_q), g_s_t, ones, out_dtype=torch.float32).to(weight.dtype)
    if need_x:
        _, _, w_q_t, w_s_t = _cache_for(cache_id).get(weight, FORMATS[fmt])
        grad_x = scaled_mm(g_q, w_q_t, g_s, w_s_t, out_dtype=x_dtype)
    return grad_x, grad_w


@quantized_linear_backward.register_fake
def _(g2, x_q, x_s, weight, cache_id, fmt, grad_fmt, stochastic_grad, need_x, need_w, x_dtype, g_q=None,
      g_s=None):
    m = (g2 if g2 is not None else g_q).shape[0]
    grad_x = x_s.new_empty((m, weight.shape[1]), dtype=x_dtype) if need_x else x_s.new_empty(0)
    grad_w = weight.new_empty(weight.shape) if need_w else x_s.new_empty(0)
    return grad_x, grad_w


def _quantize_grad(g2: torch.Tensor, grad_fmt: str, stochastic: bool):
    """(dY, None, None), or inside a compiled graph (None, q, scale): dY's row quantization as torch ops, which
    the compiler fuses into the kernels that produce dY (the norm's and the activation's backward, the attention
    gradients' concatenation), so dY itself is never written. Stochastic rounding is kernel only."""
    if stochastic or not torch.compiler.is_compiling():
        return g2, None, None
    return None, *quantize_rows_torch(g2, grad_fmt)


class _QuantizedLinearFunction(torch.autograd.Function):
    """Y = X W^T in `fmt`; the backward computes dX and dW in `grad_fmt` from the forward's quantized X."""

    @staticmethod
    def forward(ctx, x, weight, cache_id: int, fmt: str, grad_fmt: str, stochastic_grad: bool,
                out_dtype: torch.dtype):
        x_q, x_s = _quantize_input(_as_2d(x), fmt)
        y = quantized_matmul(x_q, x_s, weight, cache_id, fmt, out_dtype)
        ctx.save_for_backward(x_q, x_s, weight)
        ctx.cache_id, ctx.fmt, ctx.grad_fmt, ctx.stochastic_grad, ctx.x_dtype = (cache_id, fmt, grad_fmt,
                                                                                 stochastic_grad, x.dtype)
        return y.view(*x.shape[:-1], y.shape[-1])

    @staticmethod
    def backward(ctx, grad_y):
        x_q, x_s, weight = ctx.saved_tensors
        need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        g2 = _as_2d(grad_y)
        dy, g_q, g_s = _quantize_grad(g2, ctx.grad_fmt, ctx.stochastic_grad)
        grad_x, grad_w = quantized_linear_backward(dy, x_q, x_s, weight, ctx.cache_id, ctx.fmt, ctx.grad_fmt,
                                                   ctx.stochastic_grad, need_x, need_w, ctx.x_dtype, g_q, g_s)
        grad_x = grad_x.view(*grad_y.shape[:-1], -1) if need_x else None
        return grad_x, (grad_w if need_w else None), None, None, None, None, None


class QuantizedLinear(nn.Module):
    """A bias-free linear layer computed in `fmt` (forward) and `grad_fmt` (gradients).

    `weight` is an ordinary full-precision Parameter (it may be shared with an nn.Linear being replaced).
    Output dtype: bf16 under CUDA/CPU autocast, else the input's dtype.
    """

    def __init__(self, weight: nn.Parameter, fmt: str = "e4m3", grad_fmt: str | None = None,
                 stochastic_grad: bool = False) -> None:
        super().__init__()
        self.weight = weight
        self.fmt = FORMATS[fmt]
        self.grad_fmt = FORMATS[grad_fmt or fmt]
        if self.fmt.is_int != self.grad_fmt.is_int:
            raise ValueError(f"cannot mix an integer and a float format ({fmt}, {grad_fmt})")
        self.stochastic_grad = stochastic_grad
        self._cache = QuantizedWeightCache()
        self._cache_id = next(_cache_ids)
        _caches[self._cache_id] = self._cache

    @property
    def in_features(self) -> int:
        return self.weight.shape[1]

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        device_type = x.device.type
        if torch.is_autocast_enabled(device_type):
            out_dtype = torch.get_autocast_dtype(device_type)
        else:
            out_dtype = x.dtype
        return _QuantizedLinearFunction.apply(x, self.weight, self._cache_id, self.fmt.name, self.grad_fmt.name,
                                              self.stochastic_grad, out_dtype)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, fmt={self.fmt.name}, "
                f"grad_fmt={self.grad_fmt.name}, stochastic_grad={self.stochastic_grad}")


class Fp8Linear(QuantizedLinear):
    """fp8 linear: e4m3 operands with row-wise scales; gradients e4m3 too unless grad_fmt='e5m2'."""

    def __init__(self, weight: nn.Parameter, grad_fmt: str = "e4m3", stochastic_grad: bool = False) -> None:
        super().__init__(weight, "e4m3", grad_fmt, stochastic_grad)


class Int8Linear(QuantizedLinear):
    """int8 linear: int8 operands with row-wise scales, int32 accumulation."""

    def __init__(self, weight: nn.Parameter, stochastic_grad: bool = False) -> None:
        super().__init__(weight, "int8", "int8", stochastic_grad)
