"""The swarm section of `tscale-peer join`: its flags, its `[swarm]` TOML table and `JoinOptions.swarm`, declared
once (`tscale_p2p.settings`).

A light module: the command line builds its flags from it without loading the network stack.
"""

from __future__ import annotations

from typing import Literal

import pydantic
from pydantic.dataclasses import dataclass

from tscale_p2p.settings import SECTION_CONFIG, option

# A new run's settings where its founder gives none (joiners adopt the run's).
DEFAULT_INNER_STEPS = 200  # ~3000x less traffic than a per-step bf16 gradient all-reduce (benchmarks/RESULTS.md)
# Not DiLoCo's 0.7 and 0.9: a swarm makes tens of outer steps, not thousands, and a momentum that remembers ~3
# rounds instead of ~10 measured 5 points closer to one-process training at 12 rounds, at H=100 and H=200, with a
# smaller effective outer step (lr / (1 - momentum): 3.3 against 7) (benchmarks/RESULTS.md).
DEFAULT_OUTER_LR = 1.0
DEFAULT_OPENING_INNER_STEPS = 10
# An opening round's plain step (lr x the average): a ~1-bit code's decoded average is shorter than the exact one, so
# a step of 1.0 undershoots; 1.5 read 0.7-1.3 points closer to one process from a cold start than 1.0 (two corpora),
# 2.0 no closer (benchmarks/RESULTS.md, "Opening rounds").
DEFAULT_OPENING_OUTER_LR = 1.5
# A new run with opening rounds and no --outer-lr-peak starts its outer lr at this many times --outer-lr, falling with
# the inner lr to it: beside 60 opening rounds that read half a point closer to one process from a cold start on two
# corpora and level later in a run; without them it gained nothing (benchmarks/RESULTS.md, "Opening rounds").
OPENING_OUTER_LR_PEAK_RATIO = 1.5
# A sender's residual going into an opening round is carried whole, whatever --error-feedback's share (unless off):
# 60 opening rounds read 0.28 points closer to one process from a cold start than at damped's 0.5, on four seeds of
# five, and 1.4 closer than with none on one (benchmarks/RESULTS.md, "Opening rounds").
OPENING_RESIDUAL_CARRY = 1.0
DEFAULT_OUTER_MOMENTUM = 0.7
# The share of its 1-bit residual a peer carries into its next round, per --error-feedback (None: no residual).
# Full feedback cost 1-3 points of val loss from a cold start and won up to 0.9 later in a run on the H200;
# half of it was level with none from a cold start and the best of the three later in a run (benchmarks/RESULTS.md).
ERROR_FEEDBACK_CARRY = {"off": None, "damped": 0.5, "full": 1.0}
# --error-feedback left out: per codec. A top-k message carries a few percent of the values, so without full
# feedback most of an update would never be sent.
DEFAULT_ERROR_FEEDBACK = {"sign": "damped", "e8": "damped", "e8s": "damped", "topk": "full"}
# E8 words take the sign code's bytes and lose less: ahead in 14 of 15 paired runs in process, from a run in progress
# and cold; their return trip in stages (e8s) ahead of them cold on every seed and level from a run in progress
# (benchmarks/RESULTS.md, "Swarm codecs").
DEFAULT_CODEC = "e8s"


def default_outer_lr_peak(outer_lr: float, opening_rounds: int) -> float | None:
    """A new run's outer lr at the inner lr's peak where its founder gives no --outer-lr-peak (None: `outer_lr`
    throughout): `OPENING_OUTER_LR_PEAK_RATIO` times it with opening rounds."""
    return OPENING_OUTER_LR_PEAK_RATIO * outer_lr if opening_rounds else None


@dataclass(config=SECTION_CONFIG)
class SwarmSettings:
    """This peer in the swarm (a new run's settings are adopted by its joiners)."""

    name: str | None = option(None, "the name other peers see (default: peer-<id suffix>)", metavar="PUBLIC_NAME")
    inner_steps: int | None = option(
        None, f"local steps between averaging rounds (a new run's setting; default {DEFAULT_INNER_STEPS})",
        metavar="H", ge=1)
    outer_lr: float | None = option(None, f"outer Nesterov SGD learning rate (new run; {DEFAULT_OUTER_LR})",
                                    metavar="LR", gt=0)
    outer_lr_peak: float | None = option(
        None, "the outer lr while the inner lr is at its peak, falling with it to --outer-lr (new run; default: "
        f"{OPENING_OUTER_LR_PEAK_RATIO:g}x --outer-lr with --opening-rounds, else --outer-lr throughout)",
        metavar="LR", gt=0)
    outer_momentum: float | None = option(None, f"outer Nesterov momentum (new run; {DEFAULT_OUTER_MOMENTUM})",
                                          metavar="M", ge=0, lt=1)
    opening_rounds: int | None = option(
        None, "start a new run with N short rounds of --opening-inner-steps, each averaged before the next step and "
        "applied without outer momentum (a new run's setting; default 0: none)", metavar="N", ge=0)
    opening_inner_steps: int | None = option(
        None, f"local steps in each of the --opening-rounds (a new run's setting; default {DEFAULT_OPENING_INNER_STEPS})",
        metavar="H", ge=1)
    opening_outer_lr: float | None = option(
        None, f"the plain step's lr in the --opening-rounds: LR x the average (a new run's setting; default "
        f"{DEFAULT_OPENING_OUTER_LR})", metavar="LR", gt=0)
    max_steps: int | None = option(None, "stop after N local steps (for scripts)", metavar="N", ge=1)
    init_from: str | None = option(
        None, "start from a checkpoint of another run (e.g. `tscale-peer train`'s step-* folder, or its --out for the "
        "newest): its weights, optimizer state and step; a new run takes its model. Ignored when --out already "
        "holds this peer's own checkpoint", metavar="CHECKPOINT")
    min_peers: int = option(1, "wait until N peers (this one included) are online before training (for scripts)",
                            metavar="N", ge=1)
    matchmaking_time: float = option(5.0, "seconds a round waits to gather peers", metavar="S", gt=0)
    averaging_timeout: float = option(
        30.0, "a round that finds no group in S seconds is applied alone (default: 30; with no other peer training, "
        "after two matchmaking windows)", metavar="S", gt=0)
    codec: Literal["sign", "e8", "e8s", "topk"] | None = option(
        None, "how averaging rounds compress updates (a new run's setting; joiners adopt the run's): sign (1 bit a "
        "value), e8 (one of 256 directions per 8 values: the same bytes, less error), e8s (e8 out; back, the same "
        "bytes spent in up to 3 stages a block where the error is) or topk (each 4096 values' 64 largest out, 256 "
        "back; ~0.2 and ~0.8 bits a value) "
        f"(default: {DEFAULT_CODEC})")
    error_feedback: Literal["off", "damped", "full"] | None = option(
        None, "what a compressed update could not carry: 'off' drops it, 'full' (the flag alone) adds it to the next "
        "round's, 'damped' adds half of it (default: "
        + ", ".join(f"{mode} for {codec}" for codec, mode in DEFAULT_ERROR_FEEDBACK.items()) + ")", const="full")
    threads: int | None = option(
        None, "CPU threads for this peer's tensor math (CPU training, offloaded optimizer, packing updates). Default: "
        "$OMP_NUM_THREADS if set, else this machine's cores divided by the join peers running on it (peers that "
        "each use every core starve one another)", metavar="N", ge=1)
    tui: bool = option(True, "the dashboard (--no-tui: plain log lines)")

    @pydantic.field_validator("name")
    @classmethod
    def _public_name(cls, value: str | None) -> str | None:
        if value is None:
            return value
        from tscale_p2p.peers.metrics import check_public_name  # loads hivemind: only for a name to check

        return check_public_name(value)
