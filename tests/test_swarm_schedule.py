"""What the swarm's clock decides in-process (no DHT, no processes): the learning-rate schedule every peer
follows, and when this peer's next averaging is due."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import torch

from tscale_p2p.config import TrainConfig
from tscale_p2p.data import load_corpus
from tscale_p2p.model import ModelConfig
from tscale_p2p.peers.progress import Progress, RoundClock
from tscale_p2p.peers.swarm import SwarmPeer
from tscale_p2p.trainer import Trainer

H = 10


def clock_seeing(*others: Progress) -> RoundClock:
    clock = RoundClock(dht=None, run_id="schedule", peer_id="me", inner_steps=H)
    clock.observe(list(others))
    return clock


def test_fast_slow_and_late_peers_follow_one_schedule_set_by_the_swarms_progress():
    """Three peers in round 3 (they have ended 3 rounds): a fast one 8 steps in, a slow one 2 steps in, and one
    that has just downloaded the state. Each sees the others' published progress, and all stand at the same
    place in the schedule, 3 x H + the mean of their steps in the round, whatever their own step counters say."""
    now = time.time()
    fast, slow, joiner = Progress(3, 8, 0.0, now), Progress(3, 2, 0.0, now), Progress(3, 0, 0.0, now)
    places = [
        clock_seeing(slow, joiner).schedule_step(0, 3, 8),
        clock_seeing(fast, joiner).schedule_step(0, 3, 2),
        clock_seeing(fast, slow).schedule_step(0, 3, 0),
    ]
    assert places == [33, 33, 33]  # 30 + (8 + 2 + 0) / 3
    # A run started from a checkpoint at step 500 (--init-from) carries on that schedule.
    assert clock_seeing(slow, joiner).schedule_step(500, 3, 8) == 533
    # Alone, a peer's place is its own progress: H per round ended plus its steps in this one ...
    assert clock_seeing().schedule_step(0, 3, 4) == 34
    # ... and a round that lasts longer than H steps (the last average is late) holds the schedule at the round's
    # end instead of running ahead of the rounds the swarm has made.
    assert clock_seeing().schedule_step(0, 3, 25) == 40
    # A peer that finds most of the swarm a round ahead (it is late) stands at that round's end too.
    ahead = Progress(4, 1, 0.0, now)
    assert clock_seeing(ahead, ahead).schedule_step(0, 3, 1) == 40


def test_the_trainer_takes_its_learning_rate_from_the_schedule_step_when_one_is_set(corpus, tmp_path):
    cfg = TrainConfig(data=str(corpus), out=str(tmp_path / "run"), device="cpu", batch_size=2, steps=100,
                      warmup=10, lr=1e-2)
    trainer = Trainer(ModelConfig.from_dims("e32h2d1w32"), cfg, load_corpus(str(corpus)), torch.device("cpu"))
    assert trainer.local_step().lr == trainer.lr_at(0)  # a solo run: its own step
    trainer.schedule_step = 60
    stats = trainer.local_step()
    assert stats.lr == trainer.lr_at(60) != trainer.lr_at(1) and stats.step == 2  # the count itself is its own


def test_next_averaging_is_due_when_the_swarm_ends_the_round_not_after_this_peers_own_h_steps():
    """A slow peer 2 steps into a round of H = 10 (1 step/s) beside two fast ones 8 steps in (4 steps/s each):
    the swarm's 30 steps are 12 short at 9 steps/s, so the round ends in 1.3 s, not in the 8 s this peer alone
    would take for its remaining 8 steps (the dashboard's 'next avg' used to say the latter)."""
    now = time.time()
    clock = clock_seeing(Progress(3, 8, 4.0, now), Progress(3, 8, 4.0, now))
    peer = SimpleNamespace(round=3, _in_flight=None, clock=clock)
    assert SwarmPeer._seconds_to_next_averaging(peer, 2, step_s=1.0) == pytest.approx(12 / 9, rel=0.05)
    idle = SimpleNamespace(round=3, _in_flight=None, clock=clock_seeing(Progress(3, 8, 0.0, now)))
    assert SwarmPeer._seconds_to_next_averaging(idle, 2, step_s=0.0) is None  # nobody trains: no estimate

