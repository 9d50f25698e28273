"""The outer step of DiLoCo-style rounds, and its asynchronous form (the average applied during the next round).

Every H inner steps a peer forms its pseudo-gradient (weights at round start minus weights now) and the
swarm averages it. The outer optimizer turns the average into a step on the *global* weights: Nesterov
momentum SGD (DiLoCo: lr 0.7, momentum 0.9). Its input is the same on every peer of a round, so every peer
holds the same global weights without ever sending them.

Asynchronous rounds (`DelayedOuterStep`): averaging round k runs in the background while round k+1 trains.
Its average is applied as soon as it arrives, a few steps into round k+1 (`apply_average`): the peer takes
the outer step with it and re-adds the progress it made locally since round k+1 began:

    weights = global_weights_after_step - (round_start - weights_now)

so no local work is thrown away, and a peer's weights are always the swarm's global weights plus its own
latest (not yet averaged) progress. Round k+1's pseudo-gradient then counts all of round k+1's steps, before
and after the average arrived. The sooner it arrives the better: applied at the end of round k+1 (one
whole round late) it cost +10% validation loss uncompressed and +25% with the 1-bit codec at H=200
(benchmarks/RESULTS.md); applied at round k+1's first step it is synchronous DiLoCo. Weights are dicts of
fp32 CPU tensors, as `Trainer.snapshot()` gives them.
"""

from __future__ import annotations

import copy
import logging
from typing import Mapping

import torch

log = logging.getLogger(__name__)

Weights = dict[str, torch.Tensor]

# An average longer than this times the outer momentum is taken as it is (lr 1, momentum untouched): usual rounds'
# averages are 0.2-0.5 of it (4 peers, H=50, in process), one of a 400-step round 1.75. Such a round (a stalled
# average, the trainer going on meanwhile) carries many rounds' progress at once: through Nesterov momentum it moves
# the weights 1.7x that and carries it into the next steps too, which wrecked a clean swarm (benchmarks/RESULTS.md).
OVERSIZED_AVERAGE = 1.0
# Rounds the momentum must hold before the rule above applies: a momentum of one round is that round's average,
# which the next one outgrows while the learning rate still warms up (it fired there, and again, the momentum
# left as it was, the round after).
MOMENTUM_ROUNDS_FOR_THE_RULE = 2


class OuterOptimizer:
    """Nesterov-momentum SGD on averaged pseudo-gradients, applied to the global weights it holds.

    Uses `torch.optim.SGD(nesterov=True)`: momentum <- mu * momentum + g; weights -= lr * (g + mu * momentum),
    except for an average longer than `OVERSIZED_AVERAGE` times a momentum of two rounds or more: weights -= g.
    Every peer of a group holds the same average, momentum and round, so all take the same step.
    """

    def __init__(self, weights: Mapping[str, torch.Tensor], lr: float = 0.7, momentum: float = 0.9,
                 plain_lr: float | None = None):
        """`plain_lr`: the lr of a plain step (`step(plain=True)`; None: `lr`)."""
        self.weights: Weights = {name: w.detach().float().cpu().clone() for name, w in weights.items()}
        self.plain_lr = lr if plain_lr is None else plain_lr
        # (momentum 0 is plain SGD; torch refuses nesterov=True without momentum)
        self._optimizer = torch.optim.SGD(
            list(self.weights.values()), lr=lr, momentum=momentum, nesterov=momentum > 0
        )

    @torch.no_grad()
    def step(self, pseudo_gradient: Mapping[str, torch.Tensor], momentum_rounds: int | None = None,
             plain: bool = False, plain_lr: float | None = None) -> Weights:
        """Apply one outer step with the averaged pseudo-gradient; return the new global weights (not copies).
        `momentum_rounds`: the rounds the momentum holds (the swarm's round number, the same on every peer in step;
        None: enough for the oversized-average rule). `plain`: `plain_lr` (None: the optimizer's) times the average,
        the momentum neither used nor gathered (an opening round's step, `RunConfig.opening_rounds`)."""
        if set(pseudo_gradient) != set(self.weights):
            missing, extra = set(self.weights) - set(pseudo_gradient), set(pseudo_gradient) - set(self.weights)
            raise ValueError(f"pseudo-gradient names differ: missing {sorted(missing)[:3]}, extra {sorted(extra)[:3]}")
        if plain:
            for name, weight in self.weights.items():
                weight.sub_(pseudo_gradient[name].detach().to(weight.dtype).cpu(),
                            alpha=self.plain_lr if plain_lr is None else plain_lr)
            return self.weights
        mature = momentum_rounds is None or momentum_rounds >= MOMENTUM_ROUNDS_FOR_THE_RULE
        ratio = self._length_against_momentum(pseudo_gradient) if mature else 0.0
        if ratio > OVERSIZED_AVERAGE:
            log.info("outer step: the average is %.1fx the outer momentum's length (a round many times H long, as "
                     "after a stalled one): applied as it is, without momentum", ratio)
            for name, weight in self.weights.items():
                weight.sub_(pseudo_gradient[name].detach().to(weight.dtype).cpu())
            return self.weights
        for name, weight in self.weights.items():
            weight.grad = pseudo_gradient[name].detach().to(weight.dtype).cpu()
        self._optimizer.step()
        for weight in self.weights.values():
            weight.grad = None
        return self.weights

    def set_lr(self, lr: float) -> None:
        """The lr of the steps with momentum from now on."""
        for group in self._optimizer.param_groups:
            group["lr"] = lr

    def _length_against_momentum(self, pseudo_gradient: Mapping[str, torch.Tensor]) -> float:
        """|average| / |momentum| (0 before the first step, or without momentum)."""
        buffers = [self._optimizer.state[w].get("momentum_buffer") for w in self.weights.values()]
        if any(buffer is None for buffer in buffers):
            return 0.0
        momentum = sum(float(buffer.double().square().sum()) for buffer in buffers) ** 0.5
        length = sum(float(g.detach().double().square().sum()) for g in pseudo_gradient.values()) ** 0.5
        return length / momentum if momentum > 0 else 0.0

    def state_dict(self) -> dict:
        """A copy of the global weights and momentum: what a joining peer downloads to continue the run."""
        return copy.deepcopy(dict(weights=self.weights, optimizer=self._optimizer.state_dict()))

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        if set(state["weights"]) != set(self.weights):
            raise ValueError("outer state is for a different set of weights")
        for name, weight in self.weights.items():
            weight.copy_(state["weights"][name])
        self._optimizer.load_state_dict(state["optimizer"])


class DelayedOuterStep:
    """Round bookkeeping for asynchronous averaging: the average of round k is applied during (at the latest at
    the end of) round k+1.

    The swarm loop calls `apply_average(weights_now, average)` when round k's average arrives and loads the
    returned weights into the trainer; at the end of each round it calls `finish_round(weights_now)` and starts
    averaging the pseudo-gradient it returns in the background. See the module docstring.
    """

    def __init__(self, outer: OuterOptimizer):
        self.outer = outer
        self.round_start: Weights = {name: w.clone() for name, w in outer.weights.items()}

    @torch.no_grad()
    def apply_average(self, weights_now: Mapping[str, torch.Tensor], averaged: Mapping[str, torch.Tensor],
                      momentum_rounds: int | None = None, plain: bool = False, plain_lr: float | None = None,
                      kept_local: Mapping[str, torch.Tensor] | None = None) -> Weights:
        """The outer step with the previous round's average (this peer's own pseudo-gradient when it averaged with
        nobody; `momentum_rounds`, `plain` and `plain_lr` as in `OuterOptimizer.step`); returns the weights to
        continue from: the new global weights plus the progress made since this round began, plus `kept_local`: the
        part of the previous round's pseudo-gradient that nobody averaged (zero elsewhere), which the next round's
        pseudo-gradient then carries."""
        progress = self.local_progress(weights_now)
        self.outer.step(averaged, momentum_rounds, plain, plain_lr)
        self.restart_round()
        if kept_local is not None:
            progress = {name: progress[name] + kept_local[name] for name in progress}
        return {name: self.round_start[name] - progress[name] for name in progress}

    def restart_round(self) -> Weights:
        """Count the round in progress from the global weights (after one is applied or loaded, or a round's steps
        are kept local); returns that start."""
        self.round_start = {name: w.clone() for name, w in self.outer.weights.items()}
        return self.round_start

    @torch.no_grad()
    def finish_round(self, weights_now: Mapping[str, torch.Tensor]) -> Weights:
        """End a round: returns its pseudo-gradient to average. The trainer keeps its weights; the next round
        starts from them."""
        pseudo_gradient = self.local_progress(weights_now)
        self.round_start = {name: weights_now[name].float().cpu().clone() for name in pseudo_gradient}
        return pseudo_gradient

    def local_progress(self, weights_now: Mapping[str, torch.Tensor]) -> Weights:
        """Round start minus `weights_now`: what this peer's training changed since the round began."""
        return {name: self.round_start[name] - weights_now[name].float().cpu() for name in self.round_start}
