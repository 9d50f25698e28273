"""`Fp8Linear` / `Int8Linear`: nn.Linear (no bias) whose three matmuls run in fp8 or int8.

Every matmul contracts along the last axis of both quantized operands, with one scale per row:

    forward  Y  = X  W^T :  X  [M, K] row-scaled,            W   [N, K] row-scaled
    dgrad    dX = dY W   :  dY [M, N] row-scaled,            W^T [K, N] scaled per column of W
    wgrad    dW = dY^T X :  dY^T [N, M] per column of dY,    X^T [K, M] per column of X

The column scales come from an amax gathered during the row pass (one extra read for the transposed copy).
The forward keeps X^T in fp8/int8 for the backward, which also halves the saved activation. The master
weight stays a full-precision nn.Parameter; its two quantized copies are cached and rebuilt only when the
parameter may have changed (after an optimizer step, or when its version counter moves), i.e. once per
optimizer step however many micro-batches run.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook

from tscale_p2p.kernels.gemm import scaled_mm
from tscale_p2p.kernels.quantize import QuantFormat, FORMATS, quantize_cols_t, quantize_rows


def quantize_with_transpose(x: torch.Tensor, fmt: QuantFormat, stochastic: bool = False):
    """(q, row scales, q^T, column scales) of a 2-D tensor: both layouts a linear layer needs."""
    q, s, col_amax = quantize_rows(x, fmt, stochastic=stochastic, col_amax=True)
    q_t, s_t = quantize_cols_t(x, fmt, col_amax=col_amax, stochastic=stochastic)
    return q, s, q_t, s_t


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


class _QuantizedLinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, cache, fmt, grad_fmt, stochastic_grad, out_dtype):
        lead = x.shape[:-1]
        x2 = x.reshape(-1, x.shape[-1])
        if x2.stride(-1) != 1:
            x2 = x2.contiguous()
        w_q, w_s, w_q_t, w_s_t = cache.get(weight, fmt)
        if ctx.needs_input_grad[1]:
            x_q, x_s, x_q_t, x_s_t = quantize_with_transpose(x2, fmt)
        else:
            x_q, x_s = quantize_rows(x2, fmt)
            x_q_t = x_s_t = None
        y = scaled_mm(x_q, w_q, x_s, w_s, out_dtype=out_dtype)
        ctx.save_for_backward(x_q_t, x_s_t, w_q_t, w_s_t)
        ctx.grad_fmt, ctx.stochastic_grad, ctx.x_shape, ctx.x_dtype = grad_fmt, stochastic_grad, x.shape, x.dtype
        ctx.weight_dtype = weight.dtype
        return y.view(*lead, y.shape[-1])

    @staticmethod
    def backward(ctx, grad_y):
        x_q_t, x_s_t, w_q_t, w_s_t = ctx.saved_tensors
        g2 = grad_y.reshape(-1, grad_y.shape[-1])
        if g2.stride(-1) != 1:
            g2 = g2.contiguous()
        need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_x = grad_w = None
        if need_w:
            g_q, g_s, g_q_t, g_s_t = quantize_with_transpose(g2, ctx.grad_fmt, ctx.stochastic_grad)
            grad_w = scaled_mm(g_q_t, x_q_t, g_s_t, x_s_t, out_dtype=torch.float32).to(ctx.weight_dtype)
        else:
            g_q, g_s = quantize_rows(g2, ctx.grad_fmt, stochastic=ctx.stochastic_grad)
        if need_x:
            grad_x = scaled_mm(g_q, w_q_t, g_s, w_s_t, out_dtype=ctx.x_dtype).view(ctx.x_shape)
        return grad_x, grad_w, None, None, None, None, None


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

    @property
    def in_features(self) -> int:
        return self.weight.shape[1]

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    # torch.compile traces around this layer instead of into it: the weight cache and the Triton launches are
    # plain Python, and the rest of the model (norms, rotary, activations) still gets compiled and fused.
    @torch.compiler.disable
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        device_type = x.device.type
        if torch.is_autocast_enabled(device_type):
            out_dtype = torch.get_autocast_dtype(device_type)
        else:
            out_dtype = x.dtype
        return _QuantizedLinearFunction.apply(x, self.weight, self._cache, self.fmt, self.grad_fmt,
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
