"""Malicious swarm peers that speak the real protocol, for the robustness tests and benchmarks/swarm_attacks.py.

Senders attack through what they hand `start_round` (`SENDER_ATTACKS` maps a pseudo-gradient to what is
sent); reducers through the averages they send back (`LyingReducer`). Run as a script, this module is
`tscale-peer` with the attack named by the environment (`TSCALE_ATTACK=name`; `TSCALE_ATTACK_DIR` for the
colluders' shared folder) built into `join`'s averager:

    TSCALE_ATTACK=sign_flip python tests/attacks.py join --initial-peers ...
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
from pathlib import Path
from typing import Callable, Sequence

import torch
from hivemind.averaging.partition import TensorPartReducer
from hivemind.proto import averaging_pb2

from tscale_p2p.peers.averaging import SwarmAverager, _OneBitAllReduceRunner
from tscale_p2p.peers.span_agreement import DIGEST_BYTES, NO_AVERAGE, digest_message, signature_message, span_digest

ALIE_Z = 1.0  # "A Little Is Enough": shift each coordinate by this many standard deviations of the honest ones
PATIENT_ROUNDS = 3  # a patient attacker sends honest updates for this many rounds first
STALL_ROUND, STALL_S = 5, 15.0  # a stalling peer's averager hangs this long at the start of this all-reduce


def alie(honest: Sequence[torch.Tensor]) -> torch.Tensor:
    """The "A Little Is Enough" vector (Baruch et al. 2019) for honest contributions `honest`: their mean
    minus ALIE_Z standard deviations, per coordinate; colluders all send it."""
    stacked = torch.stack(list(honest))
    return stacked.mean(dim=0) - ALIE_Z * stacked.std(dim=0)


SENDER_ATTACKS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "sign_flip": lambda g: -10.0 * g,  # its update, sign-flipped and 10x
    "short_sign_flip": lambda g: -2.0 * g,  # sign-flipped and 2x: too short for the far test
    "scaled": lambda g: 90.0 * g,  # its update 90x, just under the contribution norm bound (100x)
}
CLAIMED_TOKENS = {"heavy_sign_flip": 1e12}  # a token claim to pair with an attack
SENDER_ATTACKS["heavy_sign_flip"] = SENDER_ATTACKS["sign_flip"]


class _LyingRunner(_OneBitAllReduceRunner):
    """Reduces honestly, then answers each sender with `factor(runner, sender)` times the average, and signs
    what each sender got, as an honest reducer signs its one answer."""

    factor: Callable = staticmethod(lambda runner, sender: -50.0)
    sign_lies: bool = True  # False: every sender gets the signature of the true average, valid for none of the lies

    async def accumulate_parts_streaming(self, stream, sender_index: int):
        factor = self.factor(self, self.sender_peer_ids[sender_index])
        sent = []
        async for message in super().accumulate_parts_streaming(stream, sender_index):
            if len(sent) == self.tensor_part_reducer.num_parts:  # the signature of the span, last
                yield signature_message(self._sign(span_digest(sent))) if self.sign_lies else message
                return
            if factor != 1.0:
                answers = self.codec.return_trip  # a reducer answers in the return trip's code (e8s: stages)
                lie = answers.compress(answers.extract(message.tensor_part) * factor, info=None)
                message = averaging_pb2.AveragingData(code=message.code, tensor_part=lie)
            sent.append(message.tensor_part.buffer)
            yield message

    def _sign(self, digest: bytes) -> bytes:
        if self.signer is None:
            return b""
        return self.signer.sign(self.group_id, self.ordered_peer_ids.index(self.peer_id), digest)


def _truth_to_one(runner: _LyingRunner, sender) -> float:
    """The true average to the groupmate with the smallest peer id, 50x it to the others."""
    others = sorted(str(peer) for peer in runner.sender_peer_ids if peer != runner.peer_id)
    return 1.0 if str(sender) == others[0] else 50.0


class LyingReducer(SwarmAverager):
    """A reducer that sends -50x the true average of its span to everyone."""

    factor: Callable = staticmethod(lambda runner, sender: -50.0)
    sign_lies: bool = True

    async def _refused_pair(self, group_info) -> None:
        return None  # an attacker takes any pair: it gains most there

    def _make_runner(self, **kwargs):
        attack = {"factor": staticmethod(self.factor), "sign_lies": self.sign_lies}
        return type("_LyingRunner", (_LyingRunner,), attack)(**kwargs)


LyingReducer.__name__ = "SwarmAverager"  # hivemind names a peer's RPC handlers after its class


class FlippingReducer(LyingReducer):
    """A reducer that sends minus the true average of its span: every norm bound passes."""

    factor = staticmethod(lambda runner, sender: -1.0)


FlippingReducer.__name__ = "SwarmAverager"


class TwoFacedReducer(LyingReducer):
    """Different averages to different peers: the truth to one groupmate, 50x it to the others."""

    factor = staticmethod(_truth_to_one)


TwoFacedReducer.__name__ = "SwarmAverager"


class UnsignedTwoFacedReducer(TwoFacedReducer):
    """A two-faced reducer that signs only the truth: those it lies to hold no valid signature of what they got,
    so it leaves no evidence (peers/span_agreement.py)."""

    sign_lies = False


UnsignedTwoFacedReducer.__name__ = "SwarmAverager"

class DisputingPeer(SwarmAverager):
    """Averages honestly, then tells every groupmate it got other averages of the spans `disputed` picks (of
    the group size): by default all of them, to make its group drop every span."""

    disputed: Callable[[int], range] = staticmethod(lambda group_size: range(group_size))
    forged_digest: bytes = b"\xff" * DIGEST_BYTES

    async def _refused_pair(self, group_info) -> None:
        return None  # an attacker takes any pair

    async def _agree_on_spans(self, runner, group_id, sent):
        disputed = self.disputed(len(runner.reply_digests))
        forged = [self.forged_digest if i in disputed else d for i, d in enumerate(runner.reply_digests)]
        for peer in runner.ordered_peer_ids:
            if peer != runner.peer_id:
                await self._send_digests(peer, digest_message(group_id, forged))
        return {}, {}


DisputingPeer.__name__ = "SwarmAverager"


class DisputingOnePeer(DisputingPeer):
    """Disputes the first span only: the most a disputer can make its group drop."""

    disputed = staticmethod(lambda group_size: range(1))


DisputingOnePeer.__name__ = "SwarmAverager"


class LosingOnePeer(DisputingPeer):
    """Reports the first span lost (no average of it), as a peer whose reducer timed out for it does."""

    disputed = staticmethod(lambda group_size: range(1))
    forged_digest = NO_AVERAGE


LosingOnePeer.__name__ = "SwarmAverager"


class _MeanRunner(_OneBitAllReduceRunner):
    part_reducer_type = TensorPartReducer


class PlainMean(SwarmAverager):
    """An honest peer reducing with hivemind's weighted mean instead of the robust rule (a benchmark baseline)."""

    def _make_runner(self, **kwargs):
        return _MeanRunner(**kwargs)


PlainMean.__name__ = "SwarmAverager"

class StallingPeer(SwarmAverager):
    """Honest, but its averager hangs `stall_s` seconds as its `stall_round`-th all-reduce begins (a laptop lid
    closed, a long pause), then touches the file `woke` if one is named: its groupmates drop it after their chunk
    timeout while every trainer runs on, so the round that follows is several rounds long."""

    stall_round, stall_s, woke = STALL_ROUND, STALL_S, ""
    allreduces = 0

    async def run_allreduce(self, *args, **kwargs):
        self.allreduces += 1
        if self.allreduces == self.stall_round:
            await asyncio.sleep(self.stall_s)
            if self.woke:
                Path(self.woke).touch()
        return await super().run_allreduce(*args, **kwargs)


StallingPeer.__name__ = "SwarmAverager"

REDUCER_ATTACKS = {"lying_reducer": LyingReducer, "two_faced_reducer": TwoFacedReducer,
                   "two_faced_unsigned": UnsignedTwoFacedReducer, "plain_mean": PlainMean,
                   "stall": StallingPeer}


class _Colluder:
    """An "A Little Is Enough" attacker in a `join`: trains honestly, and sends `alie` of the honest updates it
    knows: its colluders' and its own (shared through files in one folder, keyed by round), or, alone, its own
    update and its previous one (two samples of an honest update)."""

    def __init__(self, folder: Path | None, wait_s: float = 5.0):
        self.folder, self.wait_s, self.previous = folder, wait_s, None

    def __call__(self, pseudo_gradient: list[torch.Tensor], metadata) -> list[torch.Tensor]:
        flat = torch.cat([t.reshape(-1) for t in pseudo_gradient])
        samples = [flat] if self.previous is None else [flat, self.previous]
        if self.folder is not None:
            samples = [flat, *self._colluders(flat, metadata)]
        self.previous = flat
        if len(samples) < 2:
            return pseudo_gradient
        shifted = alie(samples)
        return [view.view_as(t) for view, t in zip(shifted.split([t.numel() for t in pseudo_gradient]), pseudo_gradient)]

    def _colluders(self, flat: torch.Tensor, metadata) -> list[torch.Tensor]:
        round_key = metadata.get("round") if isinstance(metadata, dict) else None
        mine = self.folder / f"{round_key}-{os.getpid()}.pt"
        torch.save(flat, mine.with_suffix(".tmp"))
        mine.with_suffix(".tmp").rename(mine)
        deadline, others = time.monotonic() + self.wait_s, []
        while time.monotonic() < deadline:
            others = [p for p in self.folder.glob(f"{round_key}-*.pt") if p != mine]
            if others:
                break
            time.sleep(0.1)
        return [torch.load(p) for p in others]


class _Patient:
    """Sends its honest update for its first `rounds` rounds, so that honest peers take it for a pair partner,
    then `attack` of it."""

    def __init__(self, attack: Callable[[torch.Tensor], torch.Tensor], rounds: int):
        self.attack, self.rounds, self.seen = attack, rounds, 0

    def __call__(self, pseudo_gradient: list[torch.Tensor], metadata) -> list[torch.Tensor]:
        self.seen += 1
        return pseudo_gradient if self.seen <= self.rounds else [self.attack(t) for t in pseudo_gradient]


def attacking_averager(attack: str, folder: Path | None) -> type[SwarmAverager]:
    """`join`'s SwarmAverager, turned into the attacker named `attack`."""
    if attack in REDUCER_ATTACKS:
        return REDUCER_ATTACKS[attack]
    transform: Callable
    if attack in SENDER_ATTACKS:
        def transform(pseudo_gradient, metadata):
            return [SENDER_ATTACKS[attack](t) for t in pseudo_gradient]
    elif attack == "patient_sign_flip":
        transform = _Patient(SENDER_ATTACKS["short_sign_flip"], PATIENT_ROUNDS)
    elif attack in ("alie", "alie_pair"):
        transform = _Colluder(folder if attack == "alie_pair" else None)
    else:
        raise SystemExit(f"unknown attack {attack!r}")
    claimed = CLAIMED_TOKENS.get(attack)

    class SendingAttacker(SwarmAverager):
        def __init__(self, *args, **kwargs):
            kwargs["residual_carry"] = None  # it sends exactly its attack, no error feedback
            super().__init__(*args, **kwargs)

        def start_round(self, pseudo_gradient, tokens, metadata=None, group_size=None, pair_partners=None,
                        residual_carry=None):
            # an attacker takes any pair (no pair_partners): it gains most there
            return super().start_round(transform(list(pseudo_gradient), metadata), claimed or tokens, metadata,
                                       group_size)

        def schedule_round(self, seconds_to_start, tokens, metadata=None, group_size=None, pair_partners=None):
            return super().schedule_round(seconds_to_start, claimed or tokens, metadata, group_size)

    SendingAttacker.__name__ = "SwarmAverager"
    return SendingAttacker


def main() -> int:
    from tscale_p2p import cli
    from tscale_p2p.peers import join

    folder = os.environ.get("TSCALE_ATTACK_DIR")
    join.SwarmAverager = attacking_averager(os.environ["TSCALE_ATTACK"], Path(folder) if folder else None)
    sys.argv[0] = "tscale-peer"
    return cli.main()


if __name__ == "__main__":
    sys.exit(main())
