"""The model: dims notation, causality, the window schedule's bounds, attention FLOPs."""

import pytest
import torch

from tscale_p2p.errors import UserError
from tscale_p2p.model import ModelConfig, Transformer, windowed_attention


def tiny(**overrides) -> ModelConfig:
    return ModelConfig.from_dims("e64h4d6w64", short_window=8, first_window=4, **overrides)


def test_dims_string_round_trip():
    cfg = ModelConfig.from_dims("e384h6d6w256")
    assert (cfg.width, cfg.heads, cfg.depth, cfg.context, cfg.head_dim) == (384, 6, 6, 256, 64)
    assert cfg.dims == "e384h6d6w256"
    assert ModelConfig.from_dict(cfg.to_dict()) == cfg


@pytest.mark.parametrize(
    "dims, fragment",
    [("e5h2", "'e5h2'"), ("e64h4x3", "'x'"), ("banana", "'banana'"), ("e64e32", "twice"), ("e0h1", "width")],
)
def test_bad_dims_name_the_value(dims, fragment):
    with pytest.raises(UserError, match=fragment):
        ModelConfig.from_dims(dims)


def test_parameter_count_formula_matches_the_module():
    for mlp in ("relu2", "swiglu"):
        cfg = tiny(mlp=mlp)
        assert cfg.parameter_count() == sum(p.numel() for p in Transformer(cfg).parameters())


def test_window_schedule_shape():
    windows = ModelConfig.from_dims("e768h12d12w1024").layer_windows()
    assert windows[:2] == [16, 16]  # first ~15% very short
    assert windows[-1] == 1024  # the last layer sees everything
    rest = windows[2:]
    assert all(w in (64, 1024) for w in rest) and rest[::2] == [64] * 5 and rest[1::2] == [1024] * 5
    assert ModelConfig.from_dims("e768h12d12w1024", window_schedule="dense").layer_windows() == [1024] * 12


def test_window_schedule_halves_attention_flops_at_1024():
    windowed = ModelConfig.from_dims("e768h12d12w1024")
    dense = windowed.with_(window_schedule="dense")
    assert dense.attention_flops_per_token() / windowed.attention_flops_per_token() >= 2.0


@pytest.mark.parametrize("schedule", ["tscale", "dense"])
def test_changing_a_later_token_never_changes_earlier_logits(schedule):
    torch.manual_seed(0)
    model = Transformer(tiny(window_schedule=schedule)).eval()
    idx = torch.randint(0, 256, (2, 64))
    t = 37
    changed = idx.clone()
    changed[:, t + 1 :] = torch.randint(0, 256, changed[:, t + 1 :].shape)
    with torch.no_grad():
        a, b = model(idx), model(changed)
    assert torch.equal(a[:, : t + 1], b[:, : t + 1])
    assert not torch.allclose(a[:, t + 1 :], b[:, t + 1 :])


def test_each_layer_respects_its_window():
    torch.manual_seed(0)
    model = Transformer(tiny()).eval()
    windows = model.cfg.layer_windows()
    assert len(set(windows)) == 3  # 4, 8 and full
    x = torch.randn(1, 64, 64)
    i = 50
    for block, window in zip(model.blocks, windows):
        if window >= 64:
            continue
        with torch.no_grad():
            base = block(x, model.rotary)
            outside, inside = x.clone(), x.clone()
            outside[:, i - window] += 1.0
            inside[:, i - window + 1] += 1.0
            assert torch.equal(block(outside, model.rotary)[:, i], base[:, i])
            assert not torch.allclose(block(inside, model.rotary)[:, i], base[:, i])


def test_windowed_attention_matches_explicit_softmax():
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 3, 20, 8, dtype=torch.float64) for _ in range(3))
    window = 5
    scores = q @ k.transpose(-1, -2) / 8**0.5
    pos = torch.arange(20)
    allowed = (pos[:, None] >= pos[None, :]) & (pos[:, None] - pos[None, :] < window)
    expected = scores.masked_fill(~allowed, float("-inf")).softmax(-1) @ v
    assert torch.allclose(windowed_attention(q, k, v, window), expected, atol=1e-10)


def test_sequence_longer_than_context_is_refused():
    model = Transformer(tiny())
    with pytest.raises(ValueError, match="exceeds the model context"):
        model(torch.zeros(1, 65, dtype=torch.long))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_flex_attention_block_mask_matches_the_exact_masked_path():
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 4, 1024, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    got = windowed_attention(q, k, v, 64).float()
    pos = torch.arange(1024, device="cuda")
    allowed = (pos[:, None] >= pos[None, :]) & (pos[:, None] - pos[None, :] < 64)
    ref = torch.nn.functional.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=allowed)
    assert ((got - ref).norm() / ref.norm()).item() < 1e-2


def test_a_tied_head_is_the_token_embedding_listed_once():
    cfg = tiny(tie_embeddings=True)
    model = Transformer(cfg)
    assert model.lm_head.weight is model.tok_emb.weight
    names = [name for name, _ in model.named_parameters()]
    assert "tok_emb.weight" in names and "lm_head.weight" not in names
    assert cfg.parameter_count() == sum(p.numel() for p in model.parameters())
    assert cfg.parameter_count() == tiny().parameter_count() - cfg.vocab_size * cfg.width


def test_configs_at_the_later_fields_defaults_keep_the_dict_older_checkpoints_hold():
    older = ModelConfig().to_dict()
    assert not {"index", "attention_dropout", "tie_embeddings"} & set(older)
    assert ModelConfig.from_dict(older) == ModelConfig()
    newer = tiny(tie_embeddings=True, attention_dropout=0.1)
    assert newer.to_dict()["tie_embeddings"] is True and newer.to_dict()["attention_dropout"] == 0.1
    assert ModelConfig.from_dict(newer.to_dict()) == newer
    with pytest.raises(UserError, match="attention-dropout must be in"):
        tiny(attention_dropout=1.0)


def test_attention_dropout_keeps_the_window_and_acts_only_in_training():
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 3, 16, 8) for _ in range(3))
    window = 4
    plain = windowed_attention(q, k, v, window)
    torch.manual_seed(1)
    dropped = windowed_attention(q, k, v, window, dropout=0.5)
    assert not torch.allclose(dropped, plain)
    far = v.clone()
    far[:, :, :8] += 100.0  # keys 0..7 lie outside the window of queries 11..15
    torch.manual_seed(1)
    moved = windowed_attention(q, k, far, window, dropout=0.5)
    torch.testing.assert_close(moved[:, :, 11:], dropped[:, :, 11:])

    cfg = tiny(attention_dropout=0.5)
    torch.manual_seed(0)
    model, reference = Transformer(cfg), Transformer(tiny())
    reference.load_state_dict(model.state_dict())
    idx = torch.randint(0, cfg.vocab_size, (2, 32))
    model.eval(), reference.eval()
    torch.testing.assert_close(model(idx), reference(idx))
    model.train()
    assert not torch.allclose(model(idx), reference(idx))
