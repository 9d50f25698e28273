"""Convergence effect of the 1-bit averaging choices, on a tiny problem (CPU, minutes).

    python benchmarks/swarm_return_trip.py --data PATH/tinyshakespeare.txt [--rounds 40] [--seeds 2]

Four simulated peers train a small byte-level MLP language model (8 bytes of context -> next byte) with
DiLoCo rounds: H inner AdamW steps on their own batches, then the pseudo-gradients are averaged (weights =
tokens, equal here) and a Nesterov outer step (lr 0.7, momentum 0.9; peers/outer.py) is applied. The
averaging is done in-process with the same pack/unpack and error-feedback kernels SwarmAverager uses, so
the only thing that changes between rows is what each trip of the all-reduce carries:

- fp32 both ways                   uncompressed DiLoCo
- 1-bit up (EF), fp32 down         senders compress with error feedback, the mean comes back exact
- 1-bit up (EF), 1-bit down        the reducer sends sign+scale of the mean, no reducer memory
- 1-bit up (EF), 1-bit down (EF)   the reducer keeps a residual for its span (what SwarmAverager does)
- 1-bit both ways, no EF           neither side remembers what it could not send
- "..., one round late"            the same codecs with DelayedOuterStep (asynchronous rounds)

plus one process that trains on the combined batch of all peers every step (same tokens). Reported: final
validation loss (mean over seeds) and its gap to uncompressed DiLoCo.
"""

from __future__ import annotations

import argparse
import time

import torch
from torch import nn

from tscale_p2p.peers.codec import OneBitCodec
from tscale_p2p.peers.outer import DelayedOuterStep, OuterOptimizer

CONTEXT, PEERS, BATCH, INNER_STEPS = 8, 4, 32, 10


class ByteMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(256, 32)
        self.hidden = nn.Linear(CONTEXT * 32, 256)
        self.out = nn.Linear(256, 256)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.hidden(self.embed(x).flatten(1))))


def batches(data: torch.Tensor, generator: torch.Generator, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    starts = torch.randint(0, len(data) - CONTEXT - 1, (size,), generator=generator)
    windows = torch.stack([data[s : s + CONTEXT + 1] for s in starts.tolist()])
    return windows[:, :-1], windows[:, -1]


def loss_of(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(model(x), y)


onebit = OneBitCodec().carried  # what one trip carries: sign + block scale (+ residual, which keeps the rest)


class Averaging:
    """The all-reduce of one configuration, with whatever residuals it keeps across rounds."""

    def __init__(self, names_shapes, up: str, down: str):
        self.up, self.down = up, down  # each: "fp32", "1bit" or "1bit+ef"
        self.sender = [{n: torch.zeros(s) for n, s in names_shapes} for _ in range(PEERS)]
        self.reducer = {n: torch.zeros(s) for n, s in names_shapes}

    def __call__(self, deltas: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        averaged = {}
        for name in deltas[0]:
            sent = [self._trip(self.up, d[name], self.sender[i][name]) for i, d in enumerate(deltas)]
            averaged[name] = self._trip(self.down, sum(sent) / len(sent), self.reducer[name])
        return averaged

    @staticmethod
    def _trip(kind: str, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        if kind == "fp32":
            return x
        return onebit(x.contiguous(), residual.view(-1) if kind == "1bit+ef" else None)


def run_diloco(data, val, rounds: int, seed: int, up: str, down: str, delayed: bool, outer_lr: float) -> float:
    torch.manual_seed(seed)
    model = ByteMLP()
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    peers = [ByteMLP() for _ in range(PEERS)]
    optimizers = [torch.optim.AdamW(p.parameters(), lr=3e-3, weight_decay=0.01) for p in peers]
    for peer in peers:
        peer.load_state_dict(model.state_dict())
    generators = [torch.Generator().manual_seed(seed * 100 + i) for i in range(PEERS)]
    averaging = Averaging([(n, w.shape) for n, w in weights.items()], up, down)
    outer = OuterOptimizer(weights, lr=outer_lr)
    late = [DelayedOuterStep(OuterOptimizer(weights, lr=outer_lr)) for _ in range(PEERS)] if delayed else None
    previous = None
    for _ in range(rounds):
        for peer, optimizer, generator in zip(peers, optimizers, generators):
            for _ in range(INNER_STEPS):
                optimizer.zero_grad()
                loss_of(peer, *batches(data, generator, BATCH)).backward()
                optimizer.step()
        snapshots = [{n: p.detach().clone() for n, p in peer.named_parameters()} for peer in peers]
        if delayed:
            # one round late: the previous average is applied at the very end of the round
            new_weights = [step.apply_average(s, previous) if previous else s for step, s in zip(late, snapshots)]
            previous = averaging([step.finish_round(w) for step, w in zip(late, new_weights)])
        else:
            deltas = [{n: outer.weights[n] - s[n] for n in s} for s in snapshots]
            new_weights = [outer.step(averaging(deltas))] * PEERS
        with torch.no_grad():
            for peer, w in zip(peers, new_weights):
                for n, p in peer.named_parameters():
                    p.copy_(w[n])
    # asynchronous peers still hold the last round's average: apply it, as the next round would
    final = late[0].outer.step(previous) if delayed else outer.weights
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(final[n])
        return float(loss_of(model, *val))


def run_combined_batch(data, val, rounds: int, seed: int) -> float:
    torch.manual_seed(seed)
    model = ByteMLP()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    generator = torch.Generator().manual_seed(seed * 100)
    for _ in range(rounds * INNER_STEPS):
        optimizer.zero_grad()
        loss_of(model, *batches(data, generator, BATCH * PEERS)).backward()
        optimizer.step()
    with torch.no_grad():
        return float(loss_of(model, *val))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data", required=True, help="a text file (e.g. tinyshakespeare.txt)")
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--seeds", type=int, default=2)
    parser.add_argument("--outer-lr", type=float, default=0.7)
    parser.add_argument("--only", default="", help="run only configurations whose name contains this")
    args = parser.parse_args()
    torch.set_num_threads(1)
    raw = torch.frombuffer(bytearray(open(args.data, "rb").read()), dtype=torch.uint8).long()
    split = int(0.9 * len(raw))
    data, val_data = raw[:split], raw[split:]
    val = batches(val_data, torch.Generator().manual_seed(12345), 8192)
    configs = [
        ("fp32 both ways", "fp32", "fp32", False),
        ("1-bit up (EF), fp32 down", "1bit+ef", "fp32", False),
        ("1-bit up (EF), 1-bit down", "1bit+ef", "1bit", False),
        ("1-bit up (EF), 1-bit down (EF)", "1bit+ef", "1bit+ef", False),
        ("1-bit both ways, no EF", "1bit", "1bit", False),
        ("fp32, one round late", "fp32", "fp32", True),
        ("1-bit no EF, one round late", "1bit", "1bit", True),
        ("1-bit up (EF), 1-bit down, late", "1bit+ef", "1bit", True),
        ("1-bit both (EF), one round late", "1bit+ef", "1bit+ef", True),
    ]
    started = time.perf_counter()
    print(
        f"{PEERS} peers, H={INNER_STEPS}, {args.rounds} rounds, batch {BATCH}/peer, {args.seeds} seeds, "
        f"outer lr {args.outer_lr}"
    )
    print(f"{'configuration':<34} {'val loss':>9} {'vs fp32 DiLoCo':>15}")
    seeds = range(args.seeds)
    results = {}
    for name, up, down, delayed in configs:
        if args.only not in name and name != "fp32 both ways":  # the reference always runs
            continue
        runs = [run_diloco(data, val, args.rounds, s, up, down, delayed, args.outer_lr) for s in seeds]
        results[name] = sum(runs) / len(runs)
        gap = 100 * (results[name] / results["fp32 both ways"] - 1)
        print(f"{name:<34} {results[name]:>9.4f} {gap:>+14.2f}%", flush=True)
    combined = sum(run_combined_batch(data, val, args.rounds, s) for s in seeds) / len(seeds)
    gap = 100 * (combined / results["fp32 both ways"] - 1)
    print(f"{'one process, combined batch':<34} {combined:>9.4f} {gap:>+14.2f}%")
    print(f"({time.perf_counter() - started:.0f} s)")


if __name__ == "__main__":
    main()
