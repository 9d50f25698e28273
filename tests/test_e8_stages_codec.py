"""E8StagesCodec (the return trip of `--codec e8s`): what it decodes to, where its stages go, its bytes against
E8 words', refusal of malformed bytes, the same bits on every device."""

import pytest
import torch
from hivemind.compression import deserialize_torch_tensor, serialize_torch_tensor
from hivemind.proto import runtime_pb2

from tscale_p2p.peers.codec import (
    BLOCK_SIZE, CODECS, E8_STAGES_COMPRESSION_TYPE, MAX_STAGES, STAGE_WEIGHTING, E8Codec, E8StagesCodec,
    MalformedTensorError,
)
from test_codec import corrupt, malformed_variants

SIZES = [0, 5, 256, 3 * 256, 10 * 256 + 77]  # nothing, a short block alone, whole blocks, whole blocks and a tail


def uneven(numel: int, seed: int, spread: float = 1.5) -> torch.Tensor:
    """Gaussian values whose scale changes from block to block (log-normal), as across a model's tensors."""
    torch.manual_seed(seed)
    scales = torch.exp(spread * torch.randn(numel // BLOCK_SIZE + 1)).repeat_interleave(BLOCK_SIZE)[:numel]
    return torch.randn(numel) * scales


def stage_counts(message: runtime_pb2.Tensor, full: int) -> list[int]:
    raw = message.buffer[4 : 4 + (full + 3) // 4]
    return [(raw[i // 4] >> (2 * (i % 4))) & 3 for i in range(full)]


def reference_stages(x: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """Block i as E8 words in counts[i] stages, each coding what the ones before left (a short tail sign-coded)."""
    e8, block, out = E8Codec(), BLOCK_SIZE, torch.zeros_like(x)
    for i, count in enumerate(counts):
        left = x[i * block : (i + 1) * block]
        for _ in range(count):
            stage = e8.carried(left)
            out[i * block : (i + 1) * block] += stage
            left = left - stage
    tail = x.numel() - len(counts) * block
    if tail:
        out[-tail:] = e8.carried(x[-tail:])
    return out


@pytest.mark.parametrize("numel", SIZES)
def test_round_trip_through_hivemind_is_each_block_in_its_stages(numel):
    x = uneven(numel, seed=numel)
    wire = serialize_torch_tensor(x, E8_STAGES_COMPRESSION_TYPE).SerializeToString()
    message = runtime_pb2.Tensor()
    message.ParseFromString(wire)
    decoded = deserialize_torch_tensor(message)
    full = numel // BLOCK_SIZE
    counts = stage_counts(message, full)
    assert sum(counts) <= full and max(counts, default=0) <= MAX_STAGES
    torch.testing.assert_close(decoded, reference_stages(x, counts), rtol=0, atol=1e-4)
    torch.testing.assert_close(E8StagesCodec().carried(x), decoded, rtol=0, atol=0)
    assert E8StagesCodec().norm(message) == pytest.approx(float(decoded.norm()), rel=1e-5)


def test_stages_go_to_loud_blocks_and_cut_the_error_at_e8s_bytes_and_two_bits_a_block():
    x = uneven(64 * BLOCK_SIZE + 77, seed=1)
    stages, e8 = E8StagesCodec(), E8Codec()
    message = stages.compress(x, None)
    assert len(message.buffer) == len(e8.compress(x, None).buffer) + (64 + 3) // 4
    counts = torch.tensor(stage_counts(message, 64))
    energy = x[: 64 * BLOCK_SIZE].view(64, -1).square().sum(dim=1)
    assert float(energy[counts == 0].max()) < float(energy[counts == MAX_STAGES].min())
    errors = [float((c.extract(c.compress(x, None)) - x).norm() / x.norm()) for c in (stages, e8)]
    assert errors[0] < 0.7 * errors[1], errors
    # Even blocks leave nothing to move: about E8 words' error
    even = torch.randn(64 * BLOCK_SIZE)
    assert float((stages.carried(even) - even).norm() / even.norm()) < 0.6


def test_stages_are_the_largest_claims_among_every_stage_of_every_block():
    """The encoder codes a later stage only where it could make the cut; it picks what coding all would."""
    blocks, e8 = 300, E8Codec()
    x = uneven(blocks * BLOCK_SIZE, seed=7)
    left = x.view(blocks, BLOCK_SIZE)
    errors = [left.square().sum(dim=1)]
    for _ in range(MAX_STAGES):
        left = left - e8.carried(left.reshape(-1)).view_as(left)
        errors.append(left.square().sum(dim=1))
    claims = (torch.stack(errors[:-1]) - torch.stack(errors[1:])) * errors[0] ** -STAGE_WEIGHTING
    owners = claims.reshape(-1).topk(blocks).indices % blocks
    expected = torch.zeros(blocks, dtype=torch.long).index_add_(0, owners, torch.ones_like(owners))
    counts = torch.tensor(stage_counts(E8StagesCodec().compress(x, None), blocks))
    assert torch.equal(counts, expected) and int((counts == MAX_STAGES).sum()) > 0


def test_error_feedback_balances_the_books():
    codec, n = E8StagesCodec(), 4096 + 100
    residual, sent, true_sum = torch.zeros(n), torch.zeros(n), torch.zeros(n)
    for round_number in range(50):
        x = uneven(n, seed=round_number)
        true_sum += x
        sent += codec.carried(x, residual)
    torch.testing.assert_close(sent + residual, true_sum, rtol=1e-4, atol=1e-3)
    assert float(residual.norm()) < 0.2 * float(true_sum.norm())


def test_e8s_sends_e8_words_and_answers_in_stages():
    codec = CODECS["e8s"]()
    assert type(codec.return_trip) is E8StagesCodec and codec.compression_type == E8Codec.compression_type


def malformed_stage_messages() -> dict[str, runtime_pb2.Tensor]:
    """A 1000-value message (3 full blocks: one byte of counts) broken in each way a reducer could break one."""
    good = E8StagesCodec().compress(uneven(1000, seed=5), None)
    buffer = good.buffer
    header, counts = buffer[:4], buffer[4]
    stages = sum((counts >> (2 * i)) & 3 for i in range(3))
    more = bytes([0b111111]) + buffer[5:] + bytes(34 * (9 - stages))  # 9 stages for 3 blocks, bytes to match
    return {
        **malformed_variants(E8StagesCodec(), scales_at=5),
        "no counts": corrupt(good, buffer=header),
        "count padding set": corrupt(good, buffer=header + bytes([counts | 0b11000000]) + buffer[5:]),
        "more stages than blocks": corrupt(good, buffer=header + more),
    }


@pytest.mark.parametrize("variant", sorted(malformed_stage_messages()))
def test_extract_refuses_malformed_bytes(variant):
    with pytest.raises(MalformedTensorError):
        E8StagesCodec().extract(malformed_stage_messages()[variant])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_gpu_decodes_the_same_bits_as_a_cpu():
    """Every peer applies the decoded average: a GPU peer and a CPU peer must get the very same weights."""
    codec, x = E8StagesCodec(), uneven(2**20 + 77, seed=3)
    message = codec.compress(x, None)
    counts, scales, words = codec._parse(message)
    on_gpu = codec._decode_stages(counts.cuda(), scales.cuda(), words.cuda(), x.numel()).cpu()
    assert torch.equal(codec.extract(message), on_gpu)
