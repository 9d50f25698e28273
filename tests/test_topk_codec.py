"""TopKCodec: wire size, what it keeps, refusal of malformed bytes, error feedback, through hivemind's registry."""

import numpy as np
import pytest
import torch
from hivemind.compression import deserialize_torch_tensor, serialize_torch_tensor
from hivemind.proto import runtime_pb2

from tscale_p2p.peers.codec import TOPK_COMPRESSION_TYPE, MalformedTensorError, TopKCodec
from test_codec import corrupt  # one message-surgery helper for both codecs' malformed-bytes tests


def reference_topk(x: torch.Tensor, chunk: int, k: int, levels: int) -> torch.Tensor:
    """Each chunk's k largest |x|, their magnitudes replaced by the bf16 mean of their rank group, the obvious way."""
    flat, out = x.reshape(-1).float(), torch.zeros(x.numel())
    for start in range(0, flat.numel(), chunk):
        piece = flat[start : start + chunk]
        keep = min(piece.numel(), max(1, -(-k * piece.numel() // chunk)))
        order = sorted(range(piece.numel()), key=lambda i: -abs(float(piece[i])))[:keep]
        for g in range(levels):
            group = [i for r, i in enumerate(order) if r * levels // keep == g]
            if group:
                level = float(torch.tensor([abs(float(piece[i])) for i in group]).mean().to(torch.bfloat16))
                for i in group:
                    out[start + i] = -level if piece[i] < 0 else level
    return out.view(x.shape)


@pytest.mark.parametrize("numel", [1, 5, 4096, 3 * 4096 + 17])
def test_round_trip_through_hivemind_keeps_each_chunks_largest_values(numel):
    torch.manual_seed(numel)
    x = torch.randn(numel)
    wire = serialize_torch_tensor(x, TOPK_COMPRESSION_TYPE).SerializeToString()
    message = runtime_pb2.Tensor()
    message.ParseFromString(wire)
    decoded = deserialize_torch_tensor(message)
    torch.testing.assert_close(decoded, reference_topk(x, 4096, 64, 4), rtol=0, atol=0)
    codec = TopKCodec()
    assert codec.norm(message) == pytest.approx(float(decoded.norm()), rel=1e-5)
    assert torch.equal(codec.extract(codec.compress(decoded, None)), decoded)  # what a sender re-sends is exact


def test_wire_size_both_ways_is_at_most_1_1_bits_per_value():
    codec, x = TopKCodec(), torch.randn(2**20)  # one all-reduce part at SwarmAverager's default part size
    out_bits = 8 * len(codec.compress(x, None).buffer) / x.numel()
    back_bits = 8 * len(codec.return_trip.compress(x, None).buffer) / x.numel()
    assert out_bits == pytest.approx((64 * 13 + 4 * 16) / 4096, rel=1e-3)  # 12-bit index + sign; 4 bf16 levels
    assert back_bits == pytest.approx((256 * 13 + 4 * 16) / 4096, rel=1e-3)
    assert max(out_bits, back_bits) <= 1.1


def test_error_feedback_delivers_everything_eventually():
    torch.manual_seed(2)
    codec, n = TopKCodec(k=64), 4 * 4096
    residual, sent, true_sum = torch.zeros(n), torch.zeros(n), torch.zeros(n)
    for _ in range(200):
        x = torch.randn(n) * torch.linspace(0.1, 3.0, n)
        true_sum += x
        sent += codec.carried(x, residual)
    torch.testing.assert_close(sent + residual, true_sum, rtol=1e-4, atol=1e-3)  # the books balance
    assert float((sent - true_sum).norm() / true_sum.norm()) < 0.5  # against ~0.94 for one message alone


def malformed_variants() -> dict[str, runtime_pb2.Tensor]:
    codec = TopKCodec(k=64, levels=4)
    good = codec.compress(torch.randn(2 * 4096 + 100), info=None)  # 2 full chunks, a short one of 100 (2 kept)
    buffer, picks = good.buffer, 64 + 64 + 2
    index_at = 12 + 2 * 4 * 3
    sign_at = index_at + 3 * picks // 2
    assert len(buffer) == sign_at + (picks + 7) // 8

    def with_bytes(at: int, raw: bytes) -> runtime_pb2.Tensor:
        return corrupt(good, buffer=buffer[:at] + raw + buffer[at + len(raw) :])

    first_index = np.frombuffer(buffer, dtype=np.uint8, count=3, offset=index_at)
    duplicate = bytes([first_index[0], (first_index[1] & 0x0F) | ((first_index[0] & 0x0F) << 4),
                       (first_index[0] >> 4) | ((first_index[1] & 0x0F) << 4)])
    one = TopKCodec(k=1, levels=1).compress(torch.randn(4096), info=None)  # header 12, level 2, one index + pad 3
    last_chunk_index = index_at + 3 * (128 // 2)  # the short chunk's first two indices: 4095 is past its 100 values
    return {
        "truncated": corrupt(good, buffer=buffer[:-1]),
        "too long": corrupt(good, buffer=buffer + b"\0"),
        "shape lie": corrupt(good, size=[2 * 4096 + 5000]),
        "nan level": with_bytes(12, torch.tensor([float("nan")], dtype=torch.bfloat16).view(torch.int16).numpy().tobytes()),
        "negative level": with_bytes(12, torch.tensor([-1.0], dtype=torch.bfloat16).view(torch.int16).numpy().tobytes()),
        "index twice": with_bytes(index_at, duplicate),
        "index outside a short chunk": with_bytes(last_chunk_index, bytes([0xFF, 0xFF, 0xFF])),
        "k above the chunk": with_bytes(4, (5000).to_bytes(4, "little")),
        "chunk not a power of two": with_bytes(0, (4000).to_bytes(4, "little")),
        "no header": corrupt(good, buffer=b"\1"),
        "int dtype": corrupt(good, dtype="int64"),
        "odd count padded with a nonzero index": corrupt(one, buffer=one.buffer[:16] + b"\x01" + one.buffer[17:]),
        "signs cut short": corrupt(good, buffer=buffer[:sign_at] + buffer[sign_at + 1 :]),
    }


@pytest.mark.parametrize("variant", sorted(malformed_variants()))
def test_extract_refuses_malformed_bytes(variant):
    with pytest.raises(MalformedTensorError):
        TopKCodec().extract(malformed_variants()[variant])


def test_a_message_with_other_settings_is_refused_by_check_settings():
    message = TopKCodec(k=128).compress(torch.randn(4096), info=None)
    TopKCodec(k=128).check_settings(message)
    with pytest.raises(MalformedTensorError, match="k 64"):
        TopKCodec(k=64).check_settings(message)


@pytest.mark.parametrize("settings", [dict(k=0), dict(k=5000), dict(chunk=3000), dict(levels=0), dict(levels=65)])
def test_bad_settings_are_refused(settings):
    with pytest.raises(ValueError):
        TopKCodec(**settings)
