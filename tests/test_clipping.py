"""Clipping through fused AdamW's grad_scale takes the same step as torch's clip_grad_norm_."""

import pytest
import torch

from tscale_p2p.clipping import clip_in_optimizers


def step(clip, grad_multiplier: float) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """One fused AdamW step on random gradients; the new weights and first moments."""
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(64, 32)), torch.nn.Parameter(torch.randn(32))]
    for p in params:
        p.grad = torch.randn_like(p) * grad_multiplier
    optimizer = torch.optim.AdamW(params, lr=0.1, fused=True)
    clip(optimizer, params)
    optimizer.step()
    return [p.detach().clone() for p in params], [optimizer.state[p]["exp_avg"] for p in params]


@pytest.mark.parametrize("grad_multiplier", [100.0, 1e-3])  # norm far above the limit of 1, and below it
def test_clip_in_optimizer_takes_torchs_clipped_step(grad_multiplier):
    ours, ours_moment = step(lambda opt, ps: clip_in_optimizers([opt], torch.nn.utils.get_total_norm([p.grad for p in ps]), 1.0), grad_multiplier)
    torchs, torchs_moment = step(lambda opt, ps: torch.nn.utils.clip_grad_norm_(ps, 1.0), grad_multiplier)
    for a, b in zip(ours + ours_moment, torchs + torchs_moment):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-8)  # divided, not multiplied: last-bit differences
    # the first moment is (1 - beta1) times the gradient AdamW saw: clipped to norm 1, or left alone
    seen = torch.linalg.vector_norm(torch.cat([m.flatten() for m in ours_moment])) / 0.1
    expected = 1.0 if grad_multiplier > 1 else grad_multiplier * 45.6  # ~sqrt(2080) for unit normal values
    assert seen == pytest.approx(expected, rel=0.05)
