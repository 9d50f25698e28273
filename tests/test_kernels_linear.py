"""Fp8Linear / Int8Linear against nn.Linear, the weight cache, convert_linears and resolve_precision.

Without CUDA the Triton kernels run under TRITON_INTERPRET=1 (set in conftest.py, before Triton is first imported).
Bounds: a linear layer's output and both gradients carry two quantization errors in quadrature (see
test_kernels_quantize.py): e4m3 ~3.5% RMS, int8 ~1%; the bounds below leave about 2x headroom.
"""

import logging

import pytest
import torch
from torch import nn

from tscale_p2p.config import TrainConfig
from tscale_p2p.data import load_corpus
from tscale_p2p.errors import UserError
from tscale_p2p.kernels import convert_linears, resolve_precision
from tscale_p2p.kernels.linear import Fp8Linear, Int8Linear, QuantizedLinear
from tscale_p2p.kernels.quantize import quantize_rows
from tscale_p2p.model import ModelConfig
from tscale_p2p.trainer import Trainer

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BOUND = {"fp8": 0.07, "fp8-e5m2": 0.14, "int8": 0.025}


def rel_err(out, ref) -> float:
    assert not torch.isnan(out).any()
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def make_linear(kind: str, weight: nn.Parameter) -> QuantizedLinear:
    if kind == "int8":
        return Int8Linear(weight)
    return Fp8Linear(weight, grad_fmt="e5m2" if kind == "fp8-e5m2" else "e4m3")


@pytest.mark.parametrize("kind", ["fp8", "fp8-e5m2", "int8"])
def test_forward_and_gradients_match_float64_linear(kind):
    torch.manual_seed(0)
    ref = nn.Linear(72, 40, bias=False, dtype=torch.float64, device=DEVICE)  # 72, 40: no block multiple
    x = torch.randn(3, 11, 72, dtype=torch.float64, device=DEVICE, requires_grad=True)
    grad_out = torch.randn(3, 11, 40, dtype=torch.float64, device=DEVICE)
    y_ref = ref(x)
    y_ref.backward(grad_out)
    dx_ref, dw_ref = x.grad.clone(), ref.weight.grad.clone()
    x.grad, ref.weight.grad = None, None

    lin = make_linear(kind, ref.weight)
    y = lin(x)
    assert y.shape == y_ref.shape and y.dtype == torch.float64
    y.backward(grad_out)
    bound = BOUND[kind]
    assert rel_err(y, y_ref) <= bound
    assert rel_err(x.grad, dx_ref) <= bound
    assert rel_err(ref.weight.grad, dw_ref) <= bound


def test_stochastic_gradient_rounding_and_frozen_weight():
    torch.manual_seed(1)
    w = nn.Parameter(torch.randn(40, 64, device=DEVICE) / 8)
    x = torch.randn(50, 64, device=DEVICE, requires_grad=True)
    lin = Fp8Linear(w, stochastic_grad=True)
    lin(x).square().sum().backward()
    dx_ref, dw_ref = torch.autograd.grad((x.double() @ w.double().T).square().sum(), (x, w))
    assert rel_err(x.grad, dx_ref) <= BOUND["fp8"] and rel_err(w.grad, dw_ref) <= BOUND["fp8"]
    w.requires_grad_(False)  # no weight gradient wanted: the backward skips the wgrad GEMM
    x.grad = None
    lin(x).sum().backward()
    assert w.grad is not None and x.grad is not None


@pytest.mark.parametrize("optimizer_kwargs", [{"fused": True}, {"foreach": True}])
def test_weight_quantized_once_per_optimizer_step(optimizer_kwargs):
    """Fused AdamW updates in place without moving the version counter: the cache must still refresh."""
    torch.manual_seed(2)
    w = nn.Parameter(torch.randn(32, 48, device=DEVICE))
    lin = Int8Linear(w)
    opt = torch.optim.AdamW([w], lr=1e-2, **optimizer_kwargs)
    x = torch.randn(16, 48, device=DEVICE)
    lin(x).sum().backward()
    first = lin._cache.get(w, lin.fmt)
    lin(x).sum().backward()  # a second micro-batch reuses the same quantized weight
    assert lin._cache.get(w, lin.fmt) is first
    opt.step()
    second = lin._cache.get(w, lin.fmt)
    assert second is not first
    assert torch.equal(second[0], quantize_rows(w.detach(), "int8")[0])
    with torch.no_grad():
        w.mul_(0.5)  # any other in-place update, e.g. an outer optimizer's
    assert lin._cache.get(w, lin.fmt) is not second


def test_autocast_output_is_bf16():
    torch.manual_seed(3)
    w = nn.Parameter(torch.randn(24, 40, device=DEVICE))
    x = torch.randn(5, 40, device=DEVICE, requires_grad=True)
    with torch.autocast(DEVICE, dtype=torch.bfloat16):
        y = Fp8Linear(w)(x)
    assert y.dtype == torch.bfloat16
    y.float().sum().backward()
    assert x.grad.dtype == torch.float32 and w.grad.dtype == torch.float32


class Tiny(nn.Module):
    def __init__(self, depth: int = 2):
        super().__init__()
        self.tok_emb = nn.Embedding(16, 32)
        self.blocks = nn.ModuleList(nn.ModuleDict({"fc": nn.Linear(32, 64, bias=False),
                                                   "proj": nn.Linear(64, 32, bias=False)}) for _ in range(depth))
        self.lm_head = nn.Linear(32, 16, bias=False)

    def forward(self, idx):
        h = self.tok_emb(idx)
        for b in self.blocks:
            h = h + b["proj"](torch.relu(b["fc"](h)).square())
        return self.lm_head(h)


@pytest.mark.parametrize("precision,cls,head", [("fp8", Fp8Linear, Fp8Linear), ("int8", Int8Linear, nn.Linear)])
def test_convert_linears_keeps_parameters_and_names(precision, cls, head):
    """Every linear changes class, the output head too in fp8 (int8 keeps it in bf16), and nothing else changes:
    the same Parameters under the same names, all of them trained."""
    model = Tiny().to(DEVICE)
    names = list(model.state_dict())
    weights = {n: p for n, p in model.named_parameters()}
    assert convert_linears(model, precision) is model
    assert list(model.state_dict()) == names
    assert all(p is weights[n] for n, p in model.named_parameters())
    assert type(model.blocks[0]["fc"]) is cls and type(model.blocks[1]["proj"]) is cls
    assert type(model.lm_head) is head and type(model.tok_emb) is nn.Embedding
    model(torch.randint(0, 16, (2, 5), device=DEVICE)).sum().backward()
    assert all(p.grad is not None for p in model.parameters())


def test_convert_linears_leaves_the_layers_it_is_told_to_skip():
    model = Tiny()
    convert_linears(model, "fp8", skip=("lm_head", "blocks.1.fc"))
    assert type(model.lm_head) is nn.Linear and type(model.blocks[1]["fc"]) is nn.Linear
    assert type(model.blocks[0]["fc"]) is Fp8Linear and type(model.blocks[1]["proj"]) is Fp8Linear
    convert_linears(model, "int8", skip=())  # already converted layers stay; the others convert now
    assert type(model.lm_head) is Int8Linear and type(model.blocks[0]["fc"]) is Fp8Linear


def test_convert_linears_bf16_and_fp32_change_nothing():
    model = Tiny()
    convert_linears(model, "bf16")
    convert_linears(model, "fp32")
    assert all(type(b["fc"]) is nn.Linear for b in model.blocks)
    with pytest.raises(UserError, match="fp4"):
        convert_linears(model, "fp4")


def test_short_training_tracks_fp32():
    """A small MLP fits a fixed random batch: the fp8 and int8 losses follow the fp32 loss step for step."""
    losses = {}
    for precision in ("fp32", "fp8", "int8"):
        torch.manual_seed(4)
        model = Tiny(depth=1).to(DEVICE)
        convert_linears(model, precision, skip=())
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        idx = torch.randint(0, 16, (4, 16), device=DEVICE)
        target = torch.randint(0, 16, (4, 16), device=DEVICE)
        curve = []
        for _ in range(10):
            loss = nn.functional.cross_entropy(model(idx).flatten(0, 1).float(), target.flatten())
            opt.zero_grad()
            loss.backward()
            opt.step()
            curve.append(loss.item())
        losses[precision] = torch.tensor(curve)
    assert losses["fp32"][-1] < 0.8 * losses["fp32"][0]  # it does learn
    for precision in ("fp8", "int8"):
        assert (losses[precision] - losses["fp32"]).abs().max() <= 0.01 * losses["fp32"][0], precision


@pytest.mark.parametrize("precision", ["fp8", "int8"])
@pytest.mark.parametrize("backend", [
    "aot_eager",  # the traced graph, run op by op: the input quantization as torch ops
    pytest.param("inductor", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                                        reason="needs a CUDA GPU")]),
])
def test_torch_compile_traces_through_quantized_linears(precision, backend):
    """The quantized matmuls are custom ops: a whole model compiles as one graph (fullgraph=True fails on any
    graph break) and computes what the eager model computes, also where the compiler fuses the input
    quantization into the kernels before it (inductor)."""
    torch.manual_seed(8)
    model = convert_linears(Tiny().to(DEVICE), precision, skip=())
    idx = torch.randint(0, 16, (2, 9), device=DEVICE)
    eager_loss = model(idx).float().square().mean()
    eager_grads = torch.autograd.grad(eager_loss, list(model.parameters()))
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    loss = compiled(idx).float().square().mean()
    grads = torch.autograd.grad(loss, list(model.parameters()))
    torch.testing.assert_close(loss, eager_loss)
    for g, ref in zip(grads, eager_grads):
        torch.testing.assert_close(g, ref)


def test_resolve_precision_falls_back_with_one_warning(caplog):
    with caplog.at_level(logging.WARNING):
        assert resolve_precision("fp32", torch.device("cpu")) == "fp32"
        assert resolve_precision("bf16", torch.device("cpu")) == "bf16"
        assert not caplog.records
        assert resolve_precision("fp8", torch.device("cpu")) == "bf16"
        assert len(caplog.records) == 1 and "fp8" in caplog.records[0].getMessage()
        assert resolve_precision("int8", torch.device("cpu")) == "bf16"
        assert len(caplog.records) == 2
    with pytest.raises(UserError, match="fp16"):
        resolve_precision("fp16", torch.device("cpu"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("kind", ["fp8", "fp8-e5m2", "int8"])
def test_linear_at_model_size(kind):
    torch.manual_seed(5)
    assert resolve_precision(kind.split("-")[0], torch.device("cuda")) == kind.split("-")[0]
    ref = nn.Linear(2048, 3072, bias=False, device="cuda")
    x = torch.randn(4, 1024, 2048, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn(4, 1024, 3072, device="cuda", dtype=torch.bfloat16)
    dx_ref, dw_ref = torch.autograd.grad(x.double() @ ref.weight.double().T, (x, ref.weight), g.double())
    y_ref = x.double() @ ref.weight.double().T
    lin = make_linear(kind, ref.weight)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        y = lin(x)
    dx, dw = torch.autograd.grad(y, (x, ref.weight), g)
    assert rel_err(y, y_ref) <= BOUND[kind]
    assert rel_err(dx, dx_ref) <= BOUND[kind]
    assert rel_err(dw, dw_ref) <= BOUND[kind]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_trainer_rounds_the_gradients_as_asked(corpus, rounding):
    """`--grad-rounding` reaches every converted linear, and a step trains with it."""
    cfg = TrainConfig(data=str(corpus), device="cuda", precision="fp8", grad_rounding=rounding, batch_size=4,
                      compile=False)
    trainer = Trainer(ModelConfig.from_dims("e64h2d2w32"), cfg, load_corpus(str(corpus)), torch.device("cuda"))
    linears = [m for m in trainer.model.modules() if isinstance(m, QuantizedLinear)]
    assert linears and all(m.stochastic_grad == (rounding == "stochastic") for m in linears)
    assert torch.isfinite(trainer.local_step().loss)
