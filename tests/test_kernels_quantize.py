"""Quantize and scaled-GEMM kernels against float64 torch references.

Without CUDA the real Triton kernels run under TRITON_INTERPRET=1 (set in conftest.py, before Triton is first imported) at
small sizes, including shapes that are not multiples of any block; with CUDA the same checks run compiled, and
the `gpu` tests repeat them at model sizes.

Error bounds (relative Frobenius norm unless said otherwise), from the formats' precision:
* a quantized element is within half a unit in the last place: 2^-(m+1) relative for fp8 with m mantissa bits
  (e4m3: 6.25%, e5m2: 12.5% worst case; ~2.5% / ~5% RMS on Gaussian data), half a step (amax/127/2) for int8;
* the GEMM on already-quantized operands is exact products summed in fp32 (int32 for int8, exact): <= 1e-5
  against float64, and bf16 output rounding (2^-9) when the output is bf16. Exception: Hopper's fp8 tensor
  cores add into the accumulator with fewer than fp32's mantissa bits (DeepSeek-V3 report, sec. 3.3.2), so
  there the fp8 bound is 2^-8: an empirical bound, from benchmarks/kernels.py, whose error against the
  unquantized product grows by at most 0.5% in quadrature from K=768 to K=16384;
* the GEMM against the unquantized float64 product: two quantization errors that add in quadrature,
  < 6% for e4m3 and < 2% for int8 on Gaussian data.
"""

import pytest
import torch

from tscale_p2p.kernels.gemm import scaled_mm, scaled_mm_reference
from tscale_p2p.kernels.quantize import (
    FORMATS,
    TILE,
    dequantize,
    quantize_cols_t,
    quantize_reference,
    quantize_rows,
    quantize_rows_torch,
    quantize_with_transpose,
    transpose,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# fp8 sums on Hopper tensor cores are not fp32-exact (see above); elsewhere (interpreter, int8) they are.
FP8_SUM_BOUND = 2.0**-8 if DEVICE == "cuda" else 1e-5
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def rel_err(out, ref) -> float:
    out, ref = out.double(), ref.double()
    assert not torch.isnan(out).any()
    return ((out - ref).norm() / ref.norm()).item()


def element_bound(x: torch.Tensor, scale_per_element: torch.Tensor, fmt: str) -> torch.Tensor:
    """Largest allowed |dequantized - x| per element (round to nearest), with slack for fp32 division."""
    f = FORMATS[fmt]
    s = scale_per_element.double()
    if f.is_int:
        return 0.5 * s * (1 + 1e-5)
    half_ulp = 2.0 ** -(f.mantissa_bits + 1)
    return (half_ulp * x.abs().double() + s * 2.0 ** (f.min_normal_exp - f.mantissa_bits - 1)) * (1 + 1e-5)


def check_quantized_rows(x, q, scale, fmt, group):
    x, q, scale = x.cpu(), q.cpu(), scale.cpu()
    q_ref, s_ref = quantize_reference(x, fmt, group)
    torch.testing.assert_close(scale, s_ref, rtol=1e-6, atol=0)
    # Same rounding as torch's float64 -> fp8/int8 cast, except within an ulp or two of a rounding boundary:
    # the kernel divides in fp32 (approximately on GPUs, div.full.f32), and bf16 inputs put many values on
    # exact ties. Measured on an H200: 0.11-0.13% of bf16 elements; such elements may be one unit off.
    differ = q.double() != q_ref.double()
    assert differ.float().mean() <= 5e-3
    deq = dequantize(q, scale, group)
    s_full = scale.double()[:, None] if group is None else \
        scale.double().repeat_interleave(group, dim=1)[:, : x.shape[1]]
    err = (deq - x.double()).abs()
    bound = element_bound(x, s_full.expand_as(err), fmt)
    if differ.any():  # a differing tie is one unit away: allow it only there
        bound = torch.where(differ, 2 * bound, bound)
    assert (err <= bound).all(), (err / bound).max()


SHAPES = [(37, 300), (1, 5), (130, 257)]


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2", "int8"])
@pytest.mark.parametrize("group", [None, TILE])
def test_quantize_rows_matches_reference(fmt, group):
    torch.manual_seed(0)
    for M, K in SHAPES:
        x = torch.randn(M, K, device=DEVICE) * 3
        x[0, : min(K, 7)] = 0.0  # a partly zero row, and an all-zero group when K is small
        q, scale = quantize_rows(x, fmt, group)
        assert q.dtype == FORMATS[fmt].dtype and q.shape == (M, K)
        check_quantized_rows(x, q, scale, fmt, group)


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2", "int8"])
def test_torch_ops_version_quantizes_exactly_like_the_kernel(fmt):
    """Compiled models quantize a layer's input with the torch-ops version (fused into the producer), eager ones
    with the kernel: the two must give the same bytes and scales."""
    torch.manual_seed(2)
    for M, K in SHAPES:
        x = (torch.randn(M, K, device=DEVICE) * 3).to(torch.bfloat16)
        x[0] = 0.0
        q, scale = quantize_rows(x, fmt)
        q_torch, scale_torch = quantize_rows_torch(x, fmt)
        assert torch.equal(scale_torch, scale)
        assert q_torch.dtype == q.dtype and torch.equal(q_torch.view(torch.int8), q.view(torch.int8))


def test_quantize_rows_reads_strided_bf16_and_zero_rows():
    torch.manual_seed(1)
    x = (torch.randn(300, 45, device=DEVICE) * 0.01).to(torch.bfloat16).T  # [45, 300], row stride 1
    x[3] = 0
    q, scale = quantize_rows(x, "e4m3")
    check_quantized_rows(x.float(), q, scale, "e4m3", None)
    assert scale[3] == 1.0 and (q[3].float() == 0).all()


@pytest.mark.parametrize("fmt", ["e4m3", "int8"])
@pytest.mark.parametrize("group", [None, TILE])
def test_quantize_cols_transposed_matches_reference(fmt, group):
    torch.manual_seed(2)
    for M, K in [(300, 37), (129, 70)]:
        x = torch.randn(M, K, device=DEVICE)
        q_t, s_t = quantize_cols_t(x, fmt, group)
        assert q_t.shape == (K, M)
        check_quantized_rows(x.T.contiguous(), q_t, s_t, fmt, group)


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2", "int8"])
def test_weight_quantization_gives_both_layouts_of_the_row_and_column_kernels(fmt):
    """The tiled two-pass quantization of a weight: the very bytes and scales of the row and transposed kernels,
    on shapes that are not multiples of its tiles, with an all-zero row and column."""
    torch.manual_seed(7)
    for M, K in [(130, 67), (1, 200), (64, 64)]:
        x = torch.randn(M, K, device=DEVICE) * torch.rand(M, 1, device=DEVICE) * 10
        x[M // 2] = 0
        x[:, K // 3] = 0
        q, s, q_t, s_t = quantize_with_transpose(x, fmt)
        q_ref, s_ref = quantize_rows(x, fmt)
        q_t_ref, s_t_ref = quantize_cols_t(x, fmt)
        for out, ref in zip((q, s, q_t, s_t), (q_ref, s_ref, q_t_ref, s_t_ref)):
            assert torch.equal(out.view(torch.uint8), ref.view(torch.uint8))


@pytest.mark.parametrize("fmt", ["e4m3", "int8"])
def test_row_multiplier_scales_the_transposed_copy(fmt):
    """quantize_cols_t(x, row_mul=r) quantizes x * r[:, None], with the column maxima of that product, over
    more rows than one program of its maxima pass covers."""
    torch.manual_seed(6)
    x = torch.randn(1500, 70, device=DEVICE)
    r = torch.rand(1500, device=DEVICE) * 4
    q_t, s_t = quantize_cols_t(x, fmt, row_mul=r)
    check_quantized_rows((x * r[:, None]).T.contiguous(), q_t, s_t, fmt, None)


@pytest.mark.parametrize("fmt", ["e4m3", "int8"])
def test_weight_gradient_operand_requantizes_the_row_quantized_gradient(fmt):
    """The weight gradient's operand, (dY * sx)^T scaled per column, made from dY already quantized per row
    (q, s): exactly the transposed quantization of the dequantized q * s * sx."""
    torch.manual_seed(8)
    g = torch.randn(300, 70, device=DEVICE) * torch.rand(300, 1, device=DEVICE) * 5
    x_s = torch.rand(300, device=DEVICE) + 0.1
    g_q, g_s = quantize_rows(g, fmt)
    q_t, s_t = quantize_cols_t(g_q, fmt, row_mul=g_s * x_s)
    dequantized = g_q.float() * (g_s * x_s)[:, None]
    q_ref, s_ref = quantize_cols_t(dequantized, fmt)
    assert torch.equal(q_t.view(torch.uint8), q_ref.view(torch.uint8)) and torch.equal(s_t, s_ref)
    check_quantized_rows(dequantized.T.contiguous(), q_t, s_t, fmt, None)


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.int8])
def test_transpose_is_exact(dtype):
    x = (torch.randn(130, 67, device=DEVICE) * 20).clamp(-100, 100).to(dtype)
    assert torch.equal(transpose(x).view(torch.uint8), x.T.contiguous().view(torch.uint8))


@pytest.mark.parametrize("fmt,value,low,high", [("e4m3", 134.4, 128.0, 144.0), ("int8", 38.1, 38.0, 39.0)])
def test_stochastic_rounding_is_unbiased(fmt, value, low, high):
    """Every 128-element tile holds one 1.0 (so amax is 1) and otherwise a value that scales to between two
    representable points; round-to-nearest always picks the lower one, stochastic rounding averages to it."""
    qmax = FORMATS[fmt].max_value
    x = torch.full((8, 4096), value / qmax, device=DEVICE)
    x[:, ::TILE] = 1.0
    rest = torch.ones_like(x, dtype=torch.bool)
    rest[:, ::TILE] = False
    assert (quantize_rows(x, fmt)[0].double()[rest] == low).all()
    sigma = (high - low) / 2 / rest.sum().item() ** 0.5
    for q in (quantize_rows(x, fmt, stochastic=True)[0], quantize_rows(x, fmt, TILE, stochastic=True)[0],
              quantize_cols_t(x.T.contiguous(), fmt, TILE, stochastic=True)[0]):
        q = q.double()[rest]
        assert ((q == low) | (q == high)).all()
        assert abs(q.mean().item() - value) < 5 * sigma


def quantized_pair(M, N, K, fmt, group, b_fmt=None):
    a = torch.randn(M, K, device=DEVICE)
    b = torch.randn(N, K, device=DEVICE)
    a_q, s_a = quantize_rows(a, fmt, group)
    b_q, s_b = quantize_rows(b, b_fmt or fmt, group)
    return a, b, a_q, b_q, s_a, s_b


@pytest.mark.parametrize("impl", ["pointer", "tma"])
@pytest.mark.parametrize("fmt,group", [("e4m3", None), ("e4m3", TILE), ("int8", None), ("int8", TILE)])
def test_scaled_mm_matches_reference(impl, fmt, group):
    torch.manual_seed(3)
    # TMA needs 16-byte aligned rows: K % 16 == 0 and, for the fp32 output, N % 4 == 0.
    M, N, K = (70, 50, 300) if impl == "pointer" else (70, 56, 304)
    a, b, a_q, b_q, s_a, s_b = quantized_pair(M, N, K, fmt, group)
    c = scaled_mm(a_q, b_q, s_a, s_b, out_dtype=torch.float32, group=group, impl=impl)
    assert rel_err(c, scaled_mm_reference(a_q, b_q, s_a, s_b, group)) <= (FP8_SUM_BOUND if fmt == "e4m3" else 1e-5)
    assert rel_err(c, a.double() @ b.double().T) <= (0.06 if fmt == "e4m3" else 0.02)


def test_scaled_mm_bf16_output_and_mixed_fp8_formats():
    torch.manual_seed(4)
    a, b, a_q, b_q, s_a, s_b = quantized_pair(33, 40, 100, "e5m2", None, b_fmt="e4m3")
    c = scaled_mm(a_q, b_q, s_a, s_b, out_dtype=torch.bfloat16)
    assert c.dtype == torch.bfloat16
    assert rel_err(c, scaled_mm_reference(a_q, b_q, s_a, s_b)) <= 2.0**-8 + FP8_SUM_BOUND


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2", "int8"])
def test_quantize_at_model_size(fmt):
    torch.manual_seed(5)
    x = torch.randn(4096, 3072, device="cuda", dtype=torch.bfloat16)
    for group in (None, TILE):
        q, scale = quantize_rows(x, fmt, group)
        check_quantized_rows(x.float(), q, scale, fmt, group)
    q_t, s_t = quantize_cols_t(x, fmt)
    check_quantized_rows(x.float().T.contiguous(), q_t, s_t, fmt, None)
    q, scale = quantize_rows(x, fmt)
    both = quantize_with_transpose(x, fmt)  # the weights' path: the same bits as the two kernels above
    assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(both, (q, scale, q_t, s_t)))


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("impl", ["pointer", "tma"])
@pytest.mark.parametrize("fmt,group", [("e4m3", None), ("e4m3", TILE), ("int8", None)])
def test_scaled_mm_at_model_size(impl, fmt, group):
    torch.manual_seed(6)
    M, N, K = 4096, 3072, 2048
    a, b, a_q, b_q, s_a, s_b = quantized_pair(M, N, K, fmt, group)
    c = scaled_mm(a_q, b_q, s_a, s_b, out_dtype=torch.float32, group=group, impl=impl)
    assert rel_err(c, scaled_mm_reference(a_q, b_q, s_a, s_b, group)) <= (FP8_SUM_BOUND if fmt == "e4m3" else 1e-5)
    assert rel_err(c, a.double() @ b.double().T) <= (0.06 if fmt == "e4m3" else 0.02)
    # a shape that is no multiple of any block
    a, b, a_q, b_q, s_a, s_b = quantized_pair(1000, 776, 1040, fmt, group)
    c = scaled_mm(a_q, b_q, s_a, s_b, out_dtype=torch.bfloat16, group=group, impl=impl)
    assert rel_err(c, scaled_mm_reference(a_q, b_q, s_a, s_b, group)) <= 2.0**-8 + FP8_SUM_BOUND
