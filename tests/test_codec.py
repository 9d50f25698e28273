"""OneBitCodec and the 1-bit pack kernels: wire size, round trip, error feedback, Triton vs torch."""


import pytest
import torch

from hivemind.compression import deserialize_torch_tensor, serialize_torch_tensor
from hivemind.proto import runtime_pb2

from tscale_p2p.kernels.onebit import (
    error_feedback_pack,
    error_feedback_pack_triton,
    pack,
    unpack,
    unpack_triton,
)
from tscale_p2p.peers.codec import (
    BLOCK_SIZE,
    ONEBIT_COMPRESSION_TYPE,
    MalformedTensorError,
    OneBitCodec,
    register_swarm_codecs,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def wire_round_trip(tensor: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Serialize through hivemind's registry, to bytes and back, as a peer would; return (decoded, bytes)."""
    wire = serialize_torch_tensor(tensor, ONEBIT_COMPRESSION_TYPE).SerializeToString()
    message = runtime_pb2.Tensor()
    message.ParseFromString(wire)
    return deserialize_torch_tensor(message), len(wire)


def reference_onebit(x: torch.Tensor, block: int) -> torch.Tensor:
    """sign(x) * mean|x| per block (bf16-rounded), written the obvious way."""
    flat = x.reshape(-1).float()
    out = torch.empty_like(flat)
    for start in range(0, flat.numel(), block):
        chunk = flat[start : start + block]
        scale = chunk.abs().mean().to(torch.bfloat16).float()
        out[start : start + block] = torch.where(chunk < 0, -scale, scale)
    return out.view(x.shape)


def test_round_trip_through_hivemind_is_sign_times_block_mean():
    torch.manual_seed(0)
    x = torch.randn(37, 1000)  # 37000 values: the last block is short
    decoded, _ = wire_round_trip(x)
    assert decoded.shape == x.shape and decoded.dtype == torch.float32
    torch.testing.assert_close(decoded, reference_onebit(x, BLOCK_SIZE), rtol=0, atol=0)


def test_wire_size_is_at_most_1_1_bits_per_value():
    x = torch.randn(2**20)  # one all-reduce part of SwarmAverager's default size (part_size_bytes=2**17)
    _, n_bytes = wire_round_trip(x)
    bits_per_value = 8 * n_bytes / x.numel()
    assert bits_per_value <= 1.1
    assert bits_per_value >= 1 + 16 / BLOCK_SIZE  # signs and scales really are all in there


def test_other_float_dtypes_come_back_in_their_dtype():
    x = torch.randn(500).to(torch.bfloat16)
    decoded, _ = wire_round_trip(x)
    assert decoded.dtype == torch.bfloat16
    torch.testing.assert_close(decoded.float(), reference_onebit(x.float(), BLOCK_SIZE), rtol=1e-2, atol=0)


def test_registration_is_idempotent_and_leaves_hivemind_types_alone():
    register_swarm_codecs()
    register_swarm_codecs()
    assert runtime_pb2.CompressionType.Name(runtime_pb2.FLOAT16) == "FLOAT16"
    x = torch.randn(100)
    assert torch.equal(deserialize_torch_tensor(serialize_torch_tensor(x, runtime_pb2.NONE)), x)
    with pytest.raises(ValueError):
        runtime_pb2.CompressionType.Name(63)


def corrupt(message: runtime_pb2.Tensor, **fields) -> runtime_pb2.Tensor:
    bad = runtime_pb2.Tensor()
    bad.CopyFrom(message)
    for name, value in fields.items():
        if name == "size":
            del bad.size[:]
            bad.size.extend(value)
        else:
            setattr(bad, name, value)
    return bad


def malformed_variants(codec: OneBitCodec = OneBitCodec(), scales_at: int = 4) -> dict[str, runtime_pb2.Tensor]:
    """Messages of a 1000-value tensor broken in each way a peer could break one (for `codec`'s layout: a block
    size header, then bf16 scales from byte `scales_at`; E8Codec shares it, E8StagesCodec has its counts between)."""
    good = codec.compress(torch.randn(1000), info=None)
    buffer = good.buffer

    def first_scale(value: float) -> bytes:
        scale = torch.tensor([value], dtype=torch.bfloat16).view(torch.int16).numpy().tobytes()
        return buffer[:scales_at] + scale + buffer[scales_at + 2 :]

    return {
        "truncated": corrupt(good, buffer=buffer[:-1]),
        "too long": corrupt(good, buffer=buffer + b"\0"),
        "shape lie": corrupt(good, size=[1001]),
        "nan scale": corrupt(good, buffer=first_scale(float("nan"))),
        "inf scale": corrupt(good, buffer=first_scale(float("inf"))),
        "negative scale": corrupt(good, buffer=first_scale(-1.0)),
        "block size 3": corrupt(good, buffer=(3).to_bytes(4, "little") + buffer[4:]),
        "int dtype": corrupt(good, dtype="int64"),
        "no header": corrupt(good, buffer=b"\1"),
    }


@pytest.mark.parametrize("variant", sorted(malformed_variants()))
def test_extract_refuses_malformed_bytes(variant):
    with pytest.raises(MalformedTensorError):
        OneBitCodec().extract(malformed_variants()[variant])


def test_error_feedback_makes_the_cumulative_sum_track_the_true_sum():
    torch.manual_seed(1)
    n, rounds = 4096, 100
    residual = torch.zeros(n)
    true_sum, sent_with_feedback, sent_without = torch.zeros(n), torch.zeros(n), torch.zeros(n)
    for _ in range(rounds):
        x = torch.randn(n) * torch.linspace(0.1, 3.0, n)  # uneven magnitudes, as across layers
        true_sum += x
        signs, scales = error_feedback_pack(x, residual, BLOCK_SIZE)
        sent_with_feedback += unpack(signs, scales, n, BLOCK_SIZE)
        signs, scales = pack(x, BLOCK_SIZE)
        sent_without += unpack(signs, scales, n, BLOCK_SIZE)
    # Error feedback: what was sent plus what is still owed is exactly what there was to send.
    torch.testing.assert_close(sent_with_feedback + residual, true_sum, rtol=1e-4, atol=1e-3)
    error_with = (sent_with_feedback - true_sum).norm() / true_sum.norm()
    error_without = (sent_without - true_sum).norm() / true_sum.norm()
    assert error_with < 0.15
    assert error_with < error_without / 4


@pytest.mark.parametrize("numel,block", [(1, 8), (1000, 64), (4096, 256), (70001, 256), (5000, 1024)])
def test_triton_kernels_match_the_torch_path(numel, block):
    check_triton_against_torch(numel, block)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_triton_kernels_match_the_torch_path_at_model_size():
    check_triton_against_torch(7 * 2**20 + 3, BLOCK_SIZE)


def check_triton_against_torch(numel: int, block: int) -> None:
    torch.manual_seed(numel)
    x, residual = torch.randn(numel), torch.randn(numel) * 0.1
    torch_residual, triton_residual = residual.clone(), residual.to(DEVICE, copy=True)
    torch_signs, torch_scales = error_feedback_pack(x, torch_residual, block)
    triton_signs, triton_scales = error_feedback_pack_triton(x.to(DEVICE), triton_residual, block)
    decoded = unpack_triton(triton_signs, triton_scales, numel, block).cpu()
    triton_signs, triton_scales, triton_residual = triton_signs.cpu(), triton_scales.cpu(), triton_residual.cpu()
    assert torch.equal(triton_signs, torch_signs)
    # Sums in a different order may round a scale to the neighbouring bf16 value, never further.
    torch.testing.assert_close(triton_scales.float(), torch_scales.float(), rtol=2**-7, atol=0)
    # Each path's residual is exactly what its own packed form lost.
    torch.testing.assert_close(triton_residual, x + residual - decoded, rtol=0, atol=1e-6)
    assert torch.equal(decoded, unpack(triton_signs, triton_scales, numel, block))


def test_triton_pack_without_residual_matches_pack():
    x = torch.randn(3000, device=DEVICE)  # a CPU tensor only under TRITON_INTERPRET=1: a GPU kernel needs it on the GPU
    signs, scales = error_feedback_pack_triton(x, None, 256)
    reference_signs, reference_scales = pack(x.cpu(), 256)  # the torch path
    assert torch.equal(signs.cpu(), reference_signs)
    torch.testing.assert_close(scales.float().cpu(), reference_scales.float(), rtol=2**-7, atol=0)


def test_bad_block_sizes_and_residuals_are_refused():
    with pytest.raises(ValueError):
        OneBitCodec(block_size=100)
    with pytest.raises(ValueError):
        pack(torch.randn(10), 4)
    with pytest.raises(ValueError):
        error_feedback_pack(torch.randn(10), torch.zeros(9), 8)
