"""The outer Nesterov step and the bookkeeping of asynchronous rounds (averages applied during the next round)."""

import pytest
import torch

from tscale_p2p.peers.outer import DelayedOuterStep, OuterOptimizer


def test_outer_step_is_nesterov_sgd():
    generator = torch.Generator().manual_seed(0)
    w0, g1 = torch.randn(5, generator=generator), torch.randn(5, generator=generator)
    g2 = 0.3 * torch.randn(5, generator=generator)  # a usual round's average: shorter than the momentum
    lr, mu = 0.7, 0.9
    outer = OuterOptimizer({"w": w0}, lr=lr, momentum=mu)
    outer.step({"w": g1})
    w1 = w0 - lr * (g1 + mu * g1)
    torch.testing.assert_close(outer.weights["w"], w1)
    outer.step({"w": g2})
    momentum = mu * g1 + g2
    torch.testing.assert_close(outer.weights["w"], w1 - lr * (g2 + mu * momentum))


def test_an_average_much_longer_than_the_momentum_is_taken_as_it_is_and_leaves_the_momentum_alone():
    """A round many times H long (its average stalled while the trainer went on) carries many rounds' progress:
    taken with Nesterov momentum it would move the weights 1.7x that, and on into the next steps."""
    generator = torch.Generator().manual_seed(1)
    w0, g1 = torch.randn(5, generator=generator), torch.randn(5, generator=generator)
    lr, mu = 1.0, 0.7
    outer = OuterOptimizer({"w": w0}, lr=lr, momentum=mu)
    w1 = outer.step({"w": g1})["w"].clone()
    oversized = 3 * g1.norm() * torch.nn.functional.normalize(torch.randn(5, generator=generator), dim=0)
    w2 = outer.step({"w": oversized}, momentum_rounds=5)["w"].clone()
    torch.testing.assert_close(w2, w1 - oversized)
    g3 = 0.3 * g1
    outer.step({"w": g3}, momentum_rounds=6)
    torch.testing.assert_close(outer.weights["w"], w2 - lr * (g3 + mu * (mu * g1 + g3)))  # the momentum of g1 alone


def test_the_second_round_outgrowing_the_first_is_a_nesterov_step():
    """A momentum of one round is that round's average; the next one may be longer (a learning rate warming up)
    without being a stalled round."""
    w0, g1 = torch.zeros(5), torch.ones(5)
    lr, mu = 1.0, 0.7
    outer = OuterOptimizer({"w": w0}, lr=lr, momentum=mu)
    w1 = outer.step({"w": g1}, momentum_rounds=0)["w"].clone()
    g2 = 1.5 * g1
    outer.step({"w": g2}, momentum_rounds=1)
    torch.testing.assert_close(outer.weights["w"], w1 - lr * (g2 + mu * (mu * g1 + g2)))


def test_a_plain_step_takes_its_lr_times_the_average_and_leaves_the_momentum_to_the_rounds_after():
    """An opening round's average is applied at the plain lr without momentum; the first momentum round then
    starts its own at the outer lr."""
    w0, g1, g2 = torch.zeros(5), torch.ones(5), torch.full((5,), 0.5)
    lr, mu, plain_lr = 1.0, 0.7, 1.5
    assert OuterOptimizer({"w": w0}, lr=lr).plain_lr == lr  # by default the outer lr
    outer = OuterOptimizer({"w": w0}, lr=lr, momentum=mu, plain_lr=plain_lr)
    w1 = outer.step({"w": g1}, momentum_rounds=0, plain=True)["w"].clone()
    torch.testing.assert_close(w1, w0 - plain_lr * g1)
    outer.step({"w": g2}, momentum_rounds=1)
    torch.testing.assert_close(outer.weights["w"], w1 - lr * (g2 + mu * g2))  # momentum of g2 alone


def test_state_dict_lets_a_joiner_continue_identically():
    weights = {"a": torch.randn(3, 4), "b": torch.randn(7)}
    veteran = OuterOptimizer(weights)
    veteran.step({name: torch.randn_like(w) for name, w in weights.items()})
    joiner = OuterOptimizer({name: torch.zeros_like(w) for name, w in weights.items()})
    joiner.load_state_dict(veteran.state_dict())
    average = {name: torch.randn_like(w) for name, w in weights.items()}
    veteran.step(average)
    joiner.step(average)
    for name in weights:
        assert torch.equal(veteran.weights[name], joiner.weights[name])


def test_mismatched_pseudo_gradients_are_refused():
    outer = OuterOptimizer({"a": torch.zeros(2)})
    with pytest.raises(ValueError):
        outer.step({"b": torch.zeros(2)})
    with pytest.raises(ValueError):
        outer.load_state_dict(OuterOptimizer({"b": torch.zeros(2)}).state_dict())


def test_one_peer_with_plain_outer_step_keeps_its_trajectory_exactly():
    """lr 1 and no momentum make the outer step "take the average"; alone, the average is the peer's own
    pseudo-gradient, so applying it a round late with the correction must change nothing at all."""
    torch.manual_seed(0)
    weights = {"w": torch.randn(10)}
    rounds = DelayedOuterStep(OuterOptimizer(weights, lr=1.0, momentum=0.0))
    trajectory, previous = weights["w"].clone(), None
    for _ in range(5):
        trajectory = trajectory - 0.1 * torch.randn(10)  # a round of local training
        continue_from = {"w": trajectory} if previous is None else rounds.apply_average({"w": trajectory}, previous)
        pseudo_gradient = rounds.finish_round(continue_from)
        torch.testing.assert_close(continue_from["w"], trajectory)
        previous = pseudo_gradient


def test_peers_applying_averages_late_share_global_weights_and_converge():
    """Two peers pull towards different targets; their global weights stay identical and settle at the mean."""
    targets = [torch.tensor([1.0, -2.0]), torch.tensor([3.0, 0.0])]
    start = {"w": torch.zeros(2)}
    peers = [DelayedOuterStep(OuterOptimizer(start)) for _ in targets]
    weights = [start["w"].clone() for _ in targets]
    averaged = None
    for _ in range(60):
        pseudo_gradients = []
        for i, (peer, target) in enumerate(zip(peers, targets)):
            for _ in range(5):  # inner SGD steps on 0.5 * |w - target|^2
                weights[i] = weights[i] - 0.1 * (weights[i] - target)
            if averaged is not None:
                weights[i] = peer.apply_average({"w": weights[i]}, averaged)["w"]
            pseudo_gradient = peer.finish_round({"w": weights[i]})
            pseudo_gradients.append(pseudo_gradient["w"])
        averaged = {"w": sum(pseudo_gradients) / len(pseudo_gradients)}
    assert torch.equal(peers[0].outer.weights["w"], peers[1].outer.weights["w"])
    torch.testing.assert_close(peers[0].outer.weights["w"], sum(targets) / 2, atol=0.05, rtol=0)


def test_an_average_applied_mid_round_keeps_the_local_progress_on_both_sides_of_it():
    """The average arrives after a few steps of the next round: the outer step is taken at once, the steps made
    before and after it stay in the weights, and the round's pseudo-gradient counts both."""
    torch.manual_seed(0)
    start = {"w": torch.randn(6)}
    rounds = DelayedOuterStep(OuterOptimizer(start, lr=1.0, momentum=0.0))
    before, after, average = 0.1 * torch.randn(6), 0.1 * torch.randn(6), {"w": 0.3 * torch.randn(6)}
    continue_from = rounds.apply_average({"w": start["w"] - before}, average)
    global_weights = start["w"] - average["w"]  # lr 1, no momentum: the step is the average itself
    torch.testing.assert_close(rounds.outer.weights["w"], global_weights)
    torch.testing.assert_close(continue_from["w"], global_weights - before)
    pseudo_gradient = rounds.finish_round({"w": continue_from["w"] - after})
    torch.testing.assert_close(pseudo_gradient["w"], before + after)


def test_applying_before_the_first_step_of_a_round_is_a_synchronous_outer_step():
    """`apply_average` before any step of the round leaves the peer exactly on the new global weights."""
    torch.manual_seed(1)
    start, average = {"w": torch.randn(4)}, {"w": 0.2 * torch.randn(4)}
    synchronous = DelayedOuterStep(OuterOptimizer(start))
    assert torch.equal(synchronous.apply_average(start, average)["w"], synchronous.outer.weights["w"])
