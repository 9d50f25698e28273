"""E8Codec: what it decodes to, its bytes against the sign code's, re-encoding, refusal of malformed bytes,
error feedback, the same bits on every device."""

import itertools

import pytest
import torch
from hivemind.compression import deserialize_torch_tensor, serialize_torch_tensor
from hivemind.proto import runtime_pb2

from tscale_p2p.peers.codec import BLOCK_SIZE, E8_COMPRESSION_TYPE, E8Codec, MalformedTensorError, OneBitCodec
from test_codec import malformed_variants, reference_onebit

SIZES = [1, 5, 256, 3 * 256, 10 * 256 + 77]  # a short block alone, whole blocks, whole blocks and a short tail


def reference_words() -> torch.Tensor:
    """The 240 shortest vectors of E8 and the 16 axes, each scaled to length 1 (any order)."""
    roots = [v for v in itertools.product((-1, 0, 1), repeat=8) if sum(map(abs, v)) == 2]
    halves = [v for v in itertools.product((-0.5, 0.5), repeat=8) if sum(x < 0 for x in v) % 2 == 0]
    axes = [tuple(s * (i == j) for j in range(8)) for i in range(8) for s in (1, -1)]
    words = torch.tensor(roots + halves + axes, dtype=torch.float64)
    return (words / words.norm(dim=1, keepdim=True)).float()


def reference_e8(x: torch.Tensor, block: int = BLOCK_SIZE) -> torch.Tensor:
    """The codec's decoded vector the obvious way: each full block rotated by a Hadamard matrix after the codec's
    signs, each 8 values replaced by the word of largest inner product, scaled by the block's mean inner product
    (bf16-rounded as the rms it is sent as), rotated back; a short last block sign-coded."""
    from tscale_p2p.peers.codec import _rotation_signs

    hadamard = torch.ones(1, 1)
    while hadamard.shape[0] < block:
        hadamard = torch.cat([torch.cat([hadamard, hadamard], 1), torch.cat([hadamard, -hadamard], 1)], 0)
    rotation = hadamard / block**0.5 * _rotation_signs(block, torch.device("cpu"))  # H @ diag(signs)
    words, flat = reference_words(), x.reshape(-1).float()
    full = flat.numel() // block
    out = []
    for start in range(0, full * block, block):
        vectors = (rotation @ flat[start : start + block]).view(-1, 8)
        fit, picked = (vectors @ words.T).max(dim=1)
        rms = (fit.mean() * 8**-0.5).to(torch.bfloat16).float()
        out.append(rotation.T @ (rms * 8**0.5 * words[picked]).reshape(-1))
    out.append(reference_onebit(flat[full * block :], block))
    return torch.cat(out).view(x.shape)


def test_the_words_are_found_by_their_shape_as_a_search_of_all_256_would():
    from tscale_p2p.peers.codec import _E8_WORDS, _nearest_words

    torch.manual_seed(4)
    vectors = torch.cat([torch.randn(20000, 8), torch.randn(20000, 8) ** 3, torch.zeros(1, 8)])
    fit, index = _nearest_words(vectors)
    assert sorted(map(tuple, _E8_WORDS.tolist())) == sorted(map(tuple, reference_words().tolist()))
    torch.testing.assert_close(fit, (vectors @ reference_words().T).max(dim=1).values, rtol=0, atol=1e-5)
    torch.testing.assert_close((vectors * _E8_WORDS[index]).sum(dim=1), fit, rtol=0, atol=1e-5)  # its own word


def through_hivemind(x: torch.Tensor) -> tuple[torch.Tensor, runtime_pb2.Tensor]:
    wire = serialize_torch_tensor(x, E8_COMPRESSION_TYPE).SerializeToString()
    message = runtime_pb2.Tensor()
    message.ParseFromString(wire)
    return deserialize_torch_tensor(message), message


@pytest.mark.parametrize("numel", SIZES)
def test_round_trip_through_hivemind_is_the_nearest_words_rotated_back(numel):
    torch.manual_seed(numel)
    x = torch.randn(numel)
    decoded, message = through_hivemind(x)
    assert decoded.shape == x.shape and decoded.dtype == torch.float32
    torch.testing.assert_close(decoded, reference_e8(x), rtol=0, atol=1e-5)
    assert E8Codec().norm(message) == pytest.approx(float(decoded.norm()), rel=1e-4)


def test_other_float_dtypes_come_back_in_their_dtype():
    x = torch.randn(700).to(torch.bfloat16)
    decoded, _ = through_hivemind(x)
    assert decoded.dtype == torch.bfloat16
    torch.testing.assert_close(decoded.float(), reference_e8(x.float()), rtol=1e-2, atol=1e-2)


def test_it_takes_the_sign_codes_bytes_and_loses_less():
    torch.manual_seed(0)
    x = torch.randn(2**16) * torch.linspace(0.1, 3.0, 2**16)  # uneven magnitudes, as across layers
    for size in SIZES:
        assert len(E8Codec().compress(x[:size], None).buffer) == len(OneBitCodec().compress(x[:size], None).buffer)
    errors = {type(c).__name__: float((c.extract(c.compress(x, None)) - x).norm() / x.norm())
              for c in (E8Codec(), OneBitCodec())}
    assert errors["E8Codec"] < 0.58 < 0.6 < errors["OneBitCodec"], errors  # sqrt(1 - 2/pi) = 0.603 for a sign


@pytest.mark.parametrize("numel", SIZES)
def test_re_encoding_a_decoded_vector_gives_the_same_bytes(numel):
    """A sender computes what its message carries (`carried`) before hivemind encodes that for the wire: the
    books of error feedback hold only if that encoding decodes to the same values."""
    torch.manual_seed(numel)
    codec = E8Codec()
    message = codec.compress(torch.randn(numel), None)
    again = codec.compress(codec.extract(message), None)
    assert again.buffer == message.buffer
    payload = 4 + 2 * ((numel + 255) // 256)  # after the header and the scales
    tripled = codec.compress(3.0 * codec.extract(message), None)
    assert tripled.buffer[payload:] == message.buffer[payload:]  # the words do not depend on the scale


def test_error_feedback_balances_the_books_and_tracks_the_true_sum():
    torch.manual_seed(2)
    codec, n = E8Codec(), 4096 + 100
    residual, sent, sent_without, true_sum = torch.zeros(n), torch.zeros(n), torch.zeros(n), torch.zeros(n)
    for _ in range(100):
        x = torch.randn(n) * torch.linspace(0.1, 3.0, n)
        true_sum += x
        sent += codec.carried(x, residual)
        sent_without += codec.carried(x)
    torch.testing.assert_close(sent + residual, true_sum, rtol=1e-4, atol=1e-3)
    assert float((sent - true_sum).norm()) < float((sent_without - true_sum).norm()) / 4


@pytest.mark.parametrize("variant", sorted(malformed_variants()))
def test_extract_refuses_malformed_bytes(variant):
    with pytest.raises(MalformedTensorError):
        E8Codec().extract(malformed_variants(E8Codec())[variant])


def test_another_block_size_is_refused_by_the_settings_check():
    message = E8Codec(block_size=128).compress(torch.randn(1000), info=None)
    E8Codec(block_size=128).check_settings(message)
    with pytest.raises(MalformedTensorError, match="blocks of 256"):
        E8Codec().check_settings(message)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_gpu_decodes_the_same_bits_as_a_cpu():
    """Every peer applies the decoded average: a GPU peer and a CPU peer must get the very same weights."""
    torch.manual_seed(3)
    codec, x = E8Codec(), torch.randn(2**20 + 77)
    payload, scales = codec._encode(x)
    on_cpu = codec._decode(payload, scales, x.numel())
    on_gpu = codec._decode(payload.cuda(), scales.cuda(), x.numel()).cpu()
    assert torch.equal(on_cpu, on_gpu)
