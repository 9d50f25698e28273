"""Convergence of the real swarm at a fixed token budget (minutes on a CPU or one GPU).

    python benchmarks/swarm_convergence.py --data PATH/tinyshakespeare.txt [--peers 4] [--steps 300]
        [--device cuda] [--tune-outer-lrs 0.35,0.5] [--apply-after 10,40] [--out DIR]

Three ways to spend the same tokens on the same transformer, each peer drawing its own batches:

- swarm, 1-bit async     `--peers` real `tscale-peer join` processes on 127.0.0.1 (hivemind DHT, p2pd,
                         SwarmAverager's 1-bit all-reduce both ways, sender error feedback as
                         `--error-feedback` says (off unless given), each average applied as soon as it
                         arrives), each `--steps` local steps, all started together against a stock
                         `hivemind-dht` bootstrap node. Scored: the global weights each peer saved on exit.
- DiLoCo, uncompressed   the same rounds in one process, exact mean of the pseudo-gradients, the same
                         outer Nesterov SGD (peers/outer.py): applied one round late, `--apply-after` steps
                         into the next round (the swarm applies an average when it arrives), and
                         synchronously. What the swarm would reach with a perfect network (every peer in
                         every round) and no compression.
- one process            a single trainer with a `--peers` times larger batch, every step.

Reported: validation loss (nats/token, the trainer's fixed eval windows) and the gap to the last row, plus
the traffic ratio against a per-step bf16 gradient all-reduce. The in-process rows run in their own
processes while the swarm trains (on the same device); `--tune-outer-lrs` adds one-round-late DiLoCo rows
at other outer learning rates; `--from-step N` starts every row (the swarm's peers too, by `join
--init-from`) from a run N steps in; `--peer-lr` sets the peers' inner lr (the swarm takes the first). With
`--out`, peer logs and the table are kept there.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import itertools
import json
import multiprocessing
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import torch
from tscale_p2p.peers.swarm_state import SwarmState, read_state_file, saved_state_file

from tscale_p2p.checkpoint import resume_from
from tscale_p2p.config import TrainConfig
from tscale_p2p.data import load_corpus
from tscale_p2p.model import ModelConfig
from tscale_p2p.peers.codec import CODECS, E8StagesCodec
from tscale_p2p.peers.join import initial_weights
from tscale_p2p.peers.settings import (DEFAULT_CODEC, DEFAULT_OPENING_OUTER_LR, DEFAULT_OUTER_LR, DEFAULT_OUTER_MOMENTUM,
                                       ERROR_FEEDBACK_CARRY, OPENING_OUTER_LR_PEAK_RATIO,
                                       OPENING_RESIDUAL_CARRY, default_outer_lr_peak)
from tscale_p2p.peers.outer import DelayedOuterStep, OuterOptimizer
from tscale_p2p.peers.run_config import RunConfig
from tscale_p2p.trainer import Trainer

# Several peers share this machine's cores: one OpenMP thread each, or their spin-waits starve one another.
PEER_ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
SEED_STRIDE = 100  # --seed S moves every in-process trainer's seed by S * SEED_STRIDE


def settings(args, batch_size: int, seed: int = 0) -> TrainConfig:
    # With --from-step the compared steps continue one learning-rate schedule that began at step 0.
    return TrainConfig(
        data=args.data, model=args.model, device=args.device, steps=args.from_step + args.steps,
        batch_size=batch_size, lr=args.lr,
        warmup=args.warmup, eval_batches=args.eval_batches, eval_every=0, save_every=0,
        seed=SEED_STRIDE * args.seed + seed, compile=False,
    )


def run_config(args) -> RunConfig:
    cfg = settings(args, args.batch_size)
    model = ModelConfig.from_dims(args.model, vocab_size=load_corpus(args.data).vocab_size)
    return RunConfig.from_settings(cfg, model, "byte", args.inner_steps, args.outer_lr, args.outer_momentum)


def outer_lr_peak(args) -> float | None:
    """join's --outer-lr-peak for these settings: as given, else join's default (with opening rounds, a multiple of
    the outer lr; without them none)."""
    if args.outer_lr_peak is not None:
        return args.outer_lr_peak
    return default_outer_lr_peak(args.outer_lr, len(args.first_rounds) if args.first_rounds_plain else 0)


def outer_lr_label(args) -> str:
    """The outer lr as the tables' headers give it."""
    peak = outer_lr_peak(args)
    return f"outer lr {args.outer_lr}{f' (from {peak:g} with the inner lr)' if peak is not None else ''}"


def opening_flags(args) -> list[str]:
    """join's --opening-rounds and --opening-inner-steps for --first-rounds-plain (whose rounds must then be of one
    length, as join's opening rounds are)."""
    if not (args.first_rounds_plain and args.first_rounds):
        return []
    if len(set(args.first_rounds)) > 1:
        raise SystemExit(f"the swarm's opening rounds are of one length; --first-rounds has {sorted(set(args.first_rounds))}")
    return ["--opening-rounds", str(len(args.first_rounds)), "--opening-inner-steps", str(args.first_rounds[0]),
            "--opening-outer-lr", str(args.opening_outer_lr)]


def trainer_for(args, batch_size: int, seed: int) -> Trainer:
    run = run_config(args)
    device = torch.device(args.device)
    trainer = Trainer(run.model_config, settings(args, batch_size, seed), load_corpus(args.data), device)
    if args.start_state:  # a run in progress: its weights, AdamW moments and place in the schedule
        trainer.start_from(resume_from(args.start_state))
    else:
        trainer.apply_outer_update(initial_weights(run))
    return trainer


def pretrain(args, out: Path) -> Path:
    """--from-step: one process on the combined batch trains the first steps; every row (and every swarm peer,
    through `join --init-from`) starts from the checkpoint it writes, whose path is returned."""
    trainer = trainer_for(args, args.peers * args.batch_size, seed=0)
    for _ in range(args.from_step):
        trainer.local_step()
    path = trainer.save(out)
    print(f"start state after {args.from_step} steps of one process: val loss {trainer.evaluate().loss:.4f}",
          flush=True)
    return path


def val_loss(args, weights: dict[str, torch.Tensor]) -> float:
    trainer = trainer_for(args, args.batch_size, 0)
    trainer.apply_outer_update(weights)
    return trainer.evaluate().loss


def one_process(args) -> tuple[float, int]:
    trainer = trainer_for(args, args.peers * args.batch_size, seed=1)
    for _ in range(args.steps):
        trainer.local_step()
    return trainer.evaluate().loss, trainer.tokens_seen


def carried(codec, x: torch.Tensor, residual: torch.Tensor | None, error_scale: float = 1.0) -> torch.Tensor:
    """What one of SwarmAverager's trips carries of x with `codec` (+ the residual, which keeps the rest).
    `error_scale` scales the code's error (0: the trip is exact), a dial for how much a code's error costs, not a
    code: what is not delivered stays in the residual, scaled alike."""
    coded = codec.carried(x.contiguous(), None if residual is None else residual.view(-1))
    if error_scale == 1.0:
        return coded
    if residual is None:
        return x + error_scale * (coded - x)
    owed = coded + residual.view_as(coded)  # the update plus the residual carried into this trip
    residual.mul_(error_scale)
    return owed - residual.view_as(coded)


def round_lengths(total: int, inner_steps: int, first_rounds: list[int]) -> list[tuple[int, int]]:
    """(first step, steps) of each round: rounds of `first_rounds` steps first (shorter rounds where a cold start
    changes fastest), then rounds of `inner_steps`; the last one takes what is left."""
    rounds, start = [], 0
    while start < total:
        steps = first_rounds[len(rounds)] if len(rounds) < len(first_rounds) else inner_steps
        rounds.append((start, min(steps, total - start)))
        start += steps
    return rounds


def span_slices(update: dict, span: int, spans: int):
    """(name, a, b): the flat slices [a, b) of each tensor of `update` inside span `span` of `spans` equal spans
    of the flat update (hivemind's butterfly cut)."""
    total = sum(t.numel() for t in update.values())
    lo, hi, offset = span * total // spans, (span + 1) * total // spans, 0
    for name, tensor in update.items():
        a, b = max(lo - offset, 0), min(hi - offset, tensor.numel())
        if a < b:
            yield name, a, b
        offset += tensor.numel()


def send_own_span_exactly(exact: dict, sent: dict, residual: dict, span: int, spans: int, feedback: bool) -> None:
    """As a reducer of span `span` (of `spans` equal spans of the flat update) a peer adds its own part there
    uncoded: `sent` gets what it owed there (the exact update, plus its residual with error feedback) and the
    residual keeps nothing of it."""
    for name, a, b in span_slices(exact, span, spans):
        owed = sent[name].view(-1)[a:b]
        if feedback:
            owed.add_(residual[name].view(-1)[a:b])
            residual[name].view(-1)[a:b] = 0
        else:
            owed.copy_(exact[name].reshape(-1)[a:b])


def add_on_span(into: dict, values: dict, span: int, spans: int) -> None:
    """into += values on span `span` of `spans` equal spans of the flat update."""
    for name, a, b in span_slices(into, span, spans):
        into[name].view(-1)[a:b] += values[name].reshape(-1)[a:b]


def bits_per_value(codec) -> tuple[float, float]:
    """Bits per value of the codec's trip out and of its return trip, on a 2^20-value part (peers/codec.py)."""
    x = torch.randn(2**20)
    return tuple(8 * len(c.compress(x, None).buffer) / x.numel() for c in (codec, codec.return_trip))


# How the in-process rows average: each trip (sender -> reducer, reducer -> senders) is exact or 1-bit;
# "swarm" is what SwarmAverager computes (1-bit up with the sender's error feedback, each reducer's own part of
# its span exact, the mean sent back as one 1-bit message without a reducer residual).
TRIPS = {"exact": ("exact", "exact"), "swarm": ("ef", "1bit"), "1-bit up only": ("ef", "exact"),
         "1-bit both ways, both with error feedback": ("ef", "ef"), "1-bit both ways, no error feedback": ("1bit", "1bit"),
         "1-bit both ways, a damped sender residual": ("damped-ef", "1bit")}
DAMPING = ERROR_FEEDBACK_CARRY["damped"]  # "damped-ef": the share of its residual a sender carries (default of --carry)
# --onebit-variants: key -> (row label, timing, TRIPS key)
VARIANTS = {
    "sync": ("1-bit both ways as SwarmAverager", "synchronous", "swarm"),
    "up-only": ("1-bit up only (exact mean back)", "one round late", "1-bit up only"),
    "reducer-ef": ("1-bit both ways, with a reducer residual too", "one round late", "1-bit both ways, both with error feedback"),
    "no-ef": ("1-bit both ways, no error feedback", "one round late", "1-bit both ways, no error feedback"),
    "no-ef-sync": ("1-bit both ways, no error feedback", "synchronous", "1-bit both ways, no error feedback"),
}

# --apply-after-trips: a row's numeric settings -> the argument they override
TRIP_FIELDS = {"carry": "carry", "momentum": "outer_momentum", "rcarry": "reducer_carry",
               "up_error": "up_error", "down_error": "down_error", "opening_lr": "opening_outer_lr",
               "lr_peak": "outer_lr_peak", "opening_carry": "opening_carry", "opening_rcarry": "opening_reducer_carry",
               "opening_rfold": "opening_reducer_fold", "opening_down_error": "opening_down_error",
               "opening_up_error": "opening_up_error"}
# --apply-after-trips: key -> (row label, TRIPS key)
APPLY_AFTER_TRIPS = {
    "exact": ("exact mean", "exact"),
    "swarm": ("1-bit both ways as SwarmAverager", "swarm"),
    "no-ef": ("1-bit both ways, no error feedback", "1-bit both ways, no error feedback"),
    "up-only": ("1-bit up with error feedback, exact mean back", "1-bit up only"),
    "both-ef": ("1-bit both ways, a reducer residual too", "1-bit both ways, both with error feedback"),
    "damped-ef": ("1-bit both ways, sender residual damped a round (--carry)", "1-bit both ways, a damped sender residual"),
}


def diloco_in_process(args, delay: int, outer_lr: float, averaging: str, peer_lr: float,
                      overrides: dict | None = None, on_round=None) -> tuple[float, int]:
    """In-process DiLoCo rounds; each round's average is applied `delay` steps into the next round (0:
    synchronous; H: one round late); `averaging`: see TRIPS; `peer_lr`: the peers' inner peak lr; `overrides`:
    this row's codec, carry, outer_momentum (see --apply-after-trips). `on_round(steps, weights)`, if given, sees
    each round's steps per peer so far and the global weights once that round's average is applied (a copy); a
    true answer ends training there."""
    up, down = TRIPS[averaging]
    args = argparse.Namespace(**{**vars(args), "outer_lr": outer_lr, "lr": peer_lr, "up_error": 1.0,
                                 "down_error": 1.0, **(overrides or {})})
    codec = CODECS[args.codec](**getattr(args, "codec_options", {}))
    out_codec = E8StagesCodec(codec.block_size) if getattr(args, "out_stages", False) else codec
    peers = [trainer_for(args, args.batch_size, seed=1 + i) for i in range(args.peers)]
    outers = [OuterOptimizer(t.snapshot(), args.outer_lr, args.outer_momentum, plain_lr=args.opening_outer_lr)
              for t in peers]  # identical copies
    rounds = [DelayedOuterStep(outer) for outer in outers]
    residuals = [{n: torch.zeros_like(w) for n, w in outers[0].weights.items()} for _ in range(len(peers) + 1)]
    previous, plain = None, False  # plain: the last round was an opening round (--first-rounds-plain)
    peak = outer_lr_peak(args)
    falling = None if peak is None else dataclasses.replace(run_config(args), outer_lr_peak=peak)
    for round_number, (start, steps) in enumerate(round_lengths(args.steps, args.inner_steps, args.first_rounds)):
        deltas, opening = [], args.first_rounds_plain and round_number < len(args.first_rounds)
        reduced = [(i + round_number) % len(peers) for i in range(len(peers))]  # the span each peer reduces
        for trainer, bookkeeping in zip(peers, rounds):
            for step in range(steps + 1):
                if previous is not None and step == min(0 if plain else delay, steps):
                    weights = bookkeeping.apply_average(trainer.snapshot(), previous, plain=plain)
                    trainer.apply_outer_update(weights)
                if step < steps:
                    trainer.local_step()
            deltas.append(bookkeeping.finish_round(trainer.snapshot()))
        if up == "damped-ef":
            carry = getattr(args, "opening_carry", OPENING_RESIDUAL_CARRY) if opening else None  # join's, by default
            for residual in residuals[:-1]:
                for tensor in residual.values():
                    tensor.mul_(args.carry if carry is None else carry)
        if up != "exact":
            up_error = getattr(args, "opening_up_error", args.up_error) if opening else args.up_error
            coded = [{n: carried(out_codec, d[n], residual[n] if up in ("ef", "damped-ef") else None, up_error)
                      for n in d}
                     for d, residual in zip(deltas, residuals)]
            if getattr(args, "own", codec.own_part_exact):  # as SwarmAverager, unless the row says otherwise
                for exact, sent, residual, span in zip(deltas, coded, residuals, reduced):
                    send_own_span_exactly(exact, sent, residual, span, len(peers), up in ("ef", "damped-ef"))
            deltas = coded
        previous = {n: torch.stack([d[n] for d in deltas]).mean(0) for n in deltas[0]}
        plain = opening
        if falling is not None:  # join --outer-lr-peak: the outer lr where the inner schedule ended the round
            for outer in outers:
                outer.set_lr(falling.outer_lr_at(peers[0].lr_at(peers[0].step) / peers[0].cfg.lr))
        if down != "exact":
            reducer_carry = 1.0 if down == "ef" else getattr(args, "reducer_carry", None)
            if opening and getattr(args, "opening_reducer_carry", None) is not None:
                reducer_carry = args.opening_reducer_carry
            if reducer_carry is not None:  # one residual for the whole model: as if each span kept its reducer
                for tensor in residuals[-1].values():
                    tensor.mul_(reducer_carry)
            exact_mean = previous  # as the reducers see it, for opening_rfold
            down_error = getattr(args, "opening_down_error", args.down_error) if opening else args.down_error
            previous = {n: carried(codec.return_trip, m, residuals[-1][n] if reducer_carry is not None else None,
                                   down_error) for n, m in previous.items()}
            fold = getattr(args, "opening_reducer_fold", None) if opening else None
            if fold:  # each reducer owes its span's return-trip error: into its own next update, x the group
                error = {n: (exact_mean[n] - previous[n]) * (fold * len(peers)) for n in previous}
                for residual, span in zip(residuals, reduced):
                    add_on_span(residual, error, span, len(peers))
        if on_round is not None and on_round(start + steps, copy.deepcopy(outers[0]).step(previous, plain=plain)):
            break
    outers[0].step(previous, plain=plain)  # the last average arrives after training: apply it
    return val_loss(args, outers[0].weights), sum(t.tokens_seen for t in peers)


def swarm(args, work: Path) -> tuple[list[float], list[float], int, list[str], bool]:
    """All peers start together against a stock `hivemind-dht` bootstrap node, with the same flags."""
    bootstrap = start_bootstrap(work / "bootstrap.log")
    flags = [
        "--data", args.data, "--tokenizer", "byte", "--device", args.device, "--no-compile", "--batch-size", str(args.batch_size),
        "--max-steps", str(args.steps),
        "--host-maddrs", "/ip4/127.0.0.1/tcp/0", "--matchmaking-time", str(args.matchmaking_time),
        "--averaging-timeout", "30", "--eval-every", "0", "--save-every", "0", "--log-every", "50", "--run-id", "bench",
        "--model", args.model, "--steps", str(args.from_step + args.steps), "--lr", str(args.peer_lrs[0]),
        "--warmup", str(args.warmup), *(["--init-from", args.start_state] if args.start_state else []),
        "--inner-steps", str(args.inner_steps), "--outer-lr", str(args.outer_lr),
        "--outer-momentum", str(args.outer_momentum), "--eval-batches", str(args.eval_batches),
        "--min-peers", str(args.peers), "--error-feedback", args.error_feedback, "--codec", args.codec,
        "--seed", str(SEED_STRIDE * args.seed),  # the run's initial weights: those of the in-process rows
        *opening_flags(args),
        *(["--outer-lr-peak", str(args.outer_lr_peak)] if args.outer_lr_peak is not None else []),
    ]
    logs = [work / f"peer{i}.log" for i in range(args.peers)]
    processes = [bootstrap]
    try:
        address = bootstrap_address(work / "bootstrap.log", bootstrap)
        for i in range(args.peers):
            command = [sys.executable, "-m", "tscale_p2p.cli", "join", "--out", str(work / f"peer{i}"),
                       "--initial-peers", address, *flags]
            processes.append(subprocess.Popen(command, stdout=open(logs[i], "wb"), stderr=subprocess.STDOUT, env=PEER_ENV))
        for process in processes[1:]:
            if process.wait(timeout=args.timeout) != 0:
                raise SystemExit(f"a peer failed; logs in {work}")
    finally:
        for process in processes[1:]:
            process.kill()
        stop_bootstrap(bootstrap)
    weights = [_global_weights(work / f"peer{i}", args) for i in range(args.peers)]
    identical = all(torch.equal(w[n], weights[0][n]) for w in weights for n in w)
    global_losses = [val_loss(args, w) for w in weights]
    local_losses = [_local_loss(work / f"peer{i}", args) for i in range(args.peers)]
    tokens = sum(_tokens(log.read_text()) for log in logs)
    return global_losses, local_losses, tokens, [log.read_text() for log in logs], identical


def start_bootstrap(log: Path) -> subprocess.Popen:
    """A stock `hivemind-dht` node on 127.0.0.1 for peers that all start together (none of them the founder)."""
    # In its own session: hivemind-dht forks its DHT process and p2pd, and all of them must go at the end.
    # hivemind's own `hivemind-dht` CLI, run as a module: its console script is missing where hivemind was
    # installed with `pip --target` (the GPU machine)
    return subprocess.Popen([sys.executable, "-m", "hivemind.hivemind_cli.run_dht", "--host_maddrs",
                             "/ip4/127.0.0.1/tcp/0"], stdout=open(log, "wb"), stderr=subprocess.STDOUT,
                            start_new_session=True)


def bootstrap_address(log: Path, bootstrap: subprocess.Popen) -> str:
    """The multiaddr `start_bootstrap`'s node prints once it listens."""
    return _wait_for(log, r"(/ip4/127\.0\.0\.1/tcp/\d+/p2p/\w+)", bootstrap)


def stop_bootstrap(bootstrap: subprocess.Popen) -> None:
    os.killpg(bootstrap.pid, signal.SIGKILL)
    bootstrap.wait()


def _wait_for(log: Path, pattern: str, process: subprocess.Popen, timeout: float = 120) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and process.poll() is None:
        found = re.search(pattern, log.read_text(errors="replace"))
        if found:
            return found.group(1)
        time.sleep(0.2)
    raise SystemExit(f"{pattern!r} never appeared in {log}")


def _global_weights(out: Path, args) -> dict[str, torch.Tensor]:
    names = [n for n, _ in trainer_for(args, args.batch_size, 0).model.named_parameters()]
    return SwarmState.from_wire(*read_state_file(saved_state_file(out)), names=names).weights


def _local_loss(out: Path, args) -> float:
    """Val loss of a peer's own last weights (its checkpoint: global weights + its unaveraged last round)."""
    trainer = trainer_for(args, args.batch_size, 0)
    resume_from(out).restore(trainer.model)
    return trainer.evaluate().loss


def _tokens(log: str) -> int:
    found = re.search(r"(\d+) tokens contributed", log)
    return int(found.group(1)) if found else 0


def baseline(kind: str, args, outer_lr: float, peer_lr: float) -> tuple[float, int]:
    """One in-process row (runs in a worker process)."""
    torch.set_num_threads(1)
    if kind == "one process":
        return one_process(args)
    timing, averaging, *overrides = kind.split(":", 2)
    return diloco_in_process(args, delay_steps(timing, args.inner_steps), outer_lr, averaging, peer_lr,
                             json.loads(overrides[0]) if overrides else None)


def trip_spec(spec: str) -> tuple[str, str, dict]:
    """An --apply-after-trips entry `KEY[@CODEC][;carry=X][;rcarry=X][;momentum=Y][;k=K][;return_k=K][;own=0|1]
    [;stage_weighting=X][;out_stages=0|1][;up_error=X][;down_error=X][;opening_lr=X][;lr_peak=X][;opening_carry=X]
    [;opening_rcarry=X][;opening_rfold=X][;opening_up_error=X][;opening_down_error=X]` (rcarry: a reducer residual
    on the return trip, damped by X each round; stage_weighting: e8s's return trip's, see E8StagesCodec;
    out_stages=1: the trip out in E8 stages too, as a sender's books would see it (join cannot send it so: hivemind
    encodes each part again, and a stage code is not idempotent); up_error, down_error: the trip's code error
    scaled by X, see `carried`; opening_lr: the plain step's lr in --first-rounds-plain rounds, as
    --opening-outer-lr; lr_peak: join's --outer-lr-peak; opening_carry: damped-ef's carry into those rounds, join's
    by default; opening_rcarry, opening_up_error, opening_down_error: rcarry, up_error, down_error for those rounds
    alone; opening_rfold: in those rounds each reducer adds X x the group size x its span's return-trip error to
    its own sender residual):
    (row label, TRIPS key, overrides). ValueError, naming the entry, where it is not one."""
    key, *options = spec.split(";")
    key, _, codec = key.partition("@")
    if key not in APPLY_AFTER_TRIPS or (codec and codec not in CODECS):
        raise ValueError(f"{spec!r}: KEY[@CODEC] with KEY one of {', '.join(APPLY_AFTER_TRIPS)} and CODEC one of "
                         f"{', '.join(CODECS)}")
    name, averaging = APPLY_AFTER_TRIPS[key]
    overrides = {"codec": codec} if codec else {}
    for option in options:
        field, _, value = option.partition("=")
        try:
            if field in ("k", "return_k", "levels"):  # TopKCodec's
                overrides.setdefault("codec_options", {})[field] = int(value)
            elif field == "stage_weighting":  # E8StagedReturnCodec's (e8s)
                overrides.setdefault("codec_options", {})[field] = float(value)
            elif field == "own":  # own=0: each reducer codes its own part too, as SwarmAverager once did
                overrides["own"] = bool(int(value))
            elif field == "out_stages":  # out_stages=1: the trip out in E8 stages too, as the return trip of e8s
                overrides["out_stages"] = bool(int(value))
            else:
                overrides[TRIP_FIELDS[field]] = float(value)
        except (KeyError, ValueError):
            raise ValueError(f"{spec!r}: {option!r} is not one of k=, return_k=, levels=, stage_weighting=, "
                             f"own=0|1, out_stages=0|1, {'=, '.join(TRIP_FIELDS)}= with a number") from None
    try:  # k=, return_k=, levels= belong to topk, stage_weighting= to e8s: refused here, not in a row's worker
        CODECS[codec or DEFAULT_CODEC](**overrides.get("codec_options", {}))
    except (TypeError, ValueError) as e:
        raise ValueError(f"{spec!r}: not settings of codec {codec or DEFAULT_CODEC}: {e}") from None
    label = ", ".join([name, *(f"{k} {v}" for k, v in overrides.items())])
    return label, averaging, overrides


def trip_specs(text: str) -> str:
    """--apply-after-trips, each entry checked (argparse type)."""
    try:
        for spec in filter(None, text.split(",")):
            trip_spec(spec)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def delay_steps(timing: str, inner_steps: int) -> int:
    """Steps into the next round at which a row applies a round's average: "synchronous", "one round late",
    "applied after N steps"."""
    if timing == "synchronous":
        return 0
    if timing == "one round late":
        return inner_steps
    return int(re.fullmatch(r"applied after (\d+) steps", timing).group(1))


def step_counts(text: str) -> list[int]:
    """`N,N,...` of positive step counts (argparse type)."""
    try:
        counts = [int(x) for x in text.split(",") if x]
    except ValueError:
        counts = [0]
    if any(count < 1 for count in counts):
        raise argparse.ArgumentTypeError(f"step counts >= 1 separated by commas, got {text!r}")
    return counts


def add_run_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of the run every row trains (model, data, peers, schedule, outer step, codec); benchmarks that
    reuse this module's rows take them too."""
    parser.add_argument("--data", required=True, help="a text file, e.g. tinyshakespeare.txt")
    parser.add_argument("--model", default="e64h4d2w128")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--peers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=200, help="local steps per peer")
    parser.add_argument("--batch-size", type=int, default=8, help="per peer")
    parser.add_argument("--inner-steps", type=int, default=25)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--warmup", type=int, default=30)
    parser.add_argument("--outer-lr", type=float, default=DEFAULT_OUTER_LR, help="(default: join's)")
    parser.add_argument("--outer-momentum", type=float, default=DEFAULT_OUTER_MOMENTUM, help="(default: join's)")
    parser.add_argument("--outer-lr-peak", type=float, default=None, metavar="LR",
                        help="join's --outer-lr-peak: the outer lr falls from LR to --outer-lr with the inner lr, "
                        "in the swarm and every in-process DiLoCo row (a row's lr_peak=X wins; default: join's, "
                        f"{OPENING_OUTER_LR_PEAK_RATIO:g}x the row's outer lr with --first-rounds-plain, else none; "
                        "give the outer lr to keep it level)")
    parser.add_argument("--eval-batches", type=int, default=40)
    parser.add_argument("--first-rounds", default="", type=step_counts,
                        metavar="N,N,...", help="the in-process rows' first rounds, in steps each (e.g. 25,50,100: "
                        "shorter rounds where a cold start changes fastest); the rest are --inner-steps long")
    parser.add_argument("--first-rounds-plain", action="store_true",
                        help="each --first-rounds average applied before the next step, without outer momentum: "
                        "synchronous plain averaging while a cold start changes fastest")
    parser.add_argument("--opening-outer-lr", type=float, default=DEFAULT_OPENING_OUTER_LR,
                        help="the plain step's lr in --first-rounds-plain rounds (default: join's)")
    parser.add_argument("--codec", default=DEFAULT_CODEC, choices=sorted(CODECS),
                        help="the codec of the compressed trips, in process and the swarm's (join --codec)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_run_arguments(parser)
    parser.add_argument("--peer-lr", help="the peers' inner peak lr (default: --lr), for peers whose batch is "
                        "--peers times smaller than the one process's; several (comma-separated) repeat every "
                        "in-process DiLoCo row for each, and the swarm takes the first")
    parser.add_argument("--tune-outer-lrs", default="", help="comma-separated outer lrs of extra one-round-late rows")
    parser.add_argument("--matchmaking-time", type=float, default=3.0)
    parser.add_argument("--timeout", type=float, default=1800)
    parser.add_argument("--skip-swarm", action="store_true")
    parser.add_argument("--error-feedback", nargs="?", const="full", default="off", choices=sorted(ERROR_FEEDBACK_CARRY),
                        help="the swarm's peers' join --error-feedback (default: off, as in the commands recorded "
                        "before join had the choice; the flag alone: full)")
    parser.add_argument("--carry", type=float, default=DAMPING,
                        help="the damped-ef rows' share of its residual a sender carries into the next round")
    parser.add_argument("--skip-diloco", action="store_true", help="no exact-mean DiLoCo rows")
    parser.add_argument("--onebit-outer-lrs", default="", help="comma-separated outer lrs of in-process 1-bit "
                        "one-round-late rows (the swarm's arithmetic without the network)")
    parser.add_argument("--onebit-variants", default="", help="comma-separated keys of in-process rows at "
                        f"--outer-lr that tell the codec's trips and the one-round delay apart: {', '.join(VARIANTS)}")
    parser.add_argument("--apply-after", default="", help="comma-separated step counts: in-process rows "
                        "(see --apply-after-trips and --apply-after-lrs) that apply each average that many steps into the next round, "
                        "as the swarm does when an average arrives mid-round")
    parser.add_argument("--apply-after-trips", default="exact,swarm", type=trip_specs,
                        help=f"the --apply-after rows' averaging, comma-separated: {', '.join(APPLY_AFTER_TRIPS)}; each may "
                        "name its own codec and settings, e.g. swarm@topk;carry=0.9;momentum=0")
    parser.add_argument("--apply-after-lrs", default="", help="comma-separated outer lrs of the --apply-after rows "
                        "(default: --outer-lr)")
    parser.add_argument("--from-step", type=int, default=0, metavar="N",
                        help="compare the --steps that follow N steps of one process on the combined batch (a run "
                             "in progress, as a swarm is after its first rounds), every row and swarm peer "
                             "starting from its weights, AdamW state and place in the schedule")
    parser.add_argument("--seed", type=int, default=0, help="a repeat of the same comparison with other random "
                        "draws: the run's initial weights (the swarm's too: its founder's --seed), the start "
                        "state's and every in-process row's batches (the swarm's peers draw theirs from their "
                        "peer ids)")
    parser.add_argument("--out", help="folder for the peer logs, the table and results.json")
    args = parser.parse_args()
    if args.from_step < 0:
        parser.error(f"--from-step must be >= 0, got {args.from_step}")
    if args.seed < 0:
        parser.error(f"--seed must be >= 0, got {args.seed}")
    try:
        args.peer_lrs = [float(x) for x in args.peer_lr.split(",")] if args.peer_lr else [args.lr]
    except ValueError:
        parser.error(f"--peer-lr takes comma-separated numbers, got {args.peer_lr!r}")
    if any(not lr > 0 for lr in args.peer_lrs):  # also refuses nan
        parser.error(f"--peer-lr must be > 0, got {args.peer_lr}")
    torch.set_num_threads(1)
    out = Path(args.out) if args.out else None
    if out:
        out.mkdir(parents=True, exist_ok=True)

    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as scratch:
        args.start_state = None
        if args.from_step:
            args.start_state = str(pretrain(args, Path(scratch) / "start"))
        compare(args, out, started)


def compare(args, out: Path | None, started: float) -> None:
    """Train every row (in worker processes; the swarm's peers as processes of their own) and print the table."""
    late_lrs = sorted({args.outer_lr, *(float(x) for x in args.tune_outer_lrs.split(",") if x)})
    jobs = [] if args.skip_diloco else [
        *((f"DiLoCo, exact mean, one round late, outer lr {lr} (one process)", "one round late:exact", lr)
          for lr in late_lrs),
        (f"DiLoCo, exact mean, synchronous, outer lr {args.outer_lr} (one process)", "synchronous:exact", args.outer_lr),
    ]
    jobs += [(f"DiLoCo, 1-bit both ways as SwarmAverager, one round late, outer lr {float(lr)} (one process)",
              "one round late:swarm", float(lr)) for lr in args.onebit_outer_lrs.split(",") if lr]
    apply_after_lrs = [float(x) for x in args.apply_after_lrs.split(",") if x] or [args.outer_lr]
    for steps in filter(None, args.apply_after.split(",")):
        for spec, lr in itertools.product(args.apply_after_trips.split(","), apply_after_lrs):
            name, averaging, overrides = trip_spec(spec)
            jobs.append((f"DiLoCo, {name}, applied after {int(steps)} steps, outer lr {lr} (one process)",
                         f"applied after {int(steps)} steps:{averaging}:{json.dumps(overrides)}", lr))
    for key in filter(None, args.onebit_variants.split(",")):
        name, timing, averaging = VARIANTS[key]
        jobs.append((f"DiLoCo, {name}, {timing}, outer lr {args.outer_lr} (one process)", f"{timing}:{averaging}",
                     args.outer_lr))
    if args.peer_lr:  # every DiLoCo row once per peers' lr
        jobs = [(f"{name}, peers' lr {peer_lr}", kind, lr, peer_lr) for name, kind, lr in jobs for peer_lr in args.peer_lrs]
    else:
        jobs = [(name, kind, lr, args.lr) for name, kind, lr in jobs]
    jobs.append((f"one process, batch {args.peers * args.batch_size}, every step", "one process", 0.0, args.lr))
    rows = []
    # The in-process rows train in worker processes while the swarm runs (spawn: CUDA cannot be forked).
    with ProcessPoolExecutor(len(jobs), mp_context=multiprocessing.get_context("spawn")) as pool:
        futures = [(name, pool.submit(baseline, kind, args, lr, peer_lr)) for name, kind, lr, peer_lr in jobs]
        for name, future in futures:  # each row as soon as it is known, in case the swarm never ends
            future.add_done_callback(lambda f, name=name: print(f"{name}: {f.result()[0]:.4f}", flush=True))
        if not args.skip_swarm:
            rows += swarm_rows(args, out)
            for name, loss, _, notes in rows:
                print(f"{name}: {loss:.4f} ({notes})", flush=True)
        for name, future in futures:
            loss, tokens = future.result()
            rows.append((name, loss, tokens, ""))
    reference = rows[-1][1]
    lines = [
        f"model {args.model} on {args.device}, seed {args.seed}, {args.peers} peers x {args.steps} steps x "
        f"batch {args.batch_size}, "
        f"H={args.inner_steps}, inner lr {args.lr}{f' (in-process peers {args.peer_lr})' if args.peer_lr else ''} "
        f"(warm-up {args.warmup}, cosine"
        f"{f' over {args.from_step + args.steps} steps, rows from step {args.from_step}' if args.from_step else ''}), "
        f"swarm {outer_lr_label(args)} "
        f"momentum {args.outer_momentum}, matchmaking {args.matchmaking_time} s, codec {args.codec}"
        f"{f' (damped-ef carry {args.carry})' if 'damped-ef' in args.apply_after_trips else ''}; "
        f"{time.perf_counter() - started:.0f} s",
        "| run | val loss | gap to one process | tokens | notes |",
        "| --- | --- | --- | --- | --- |",
    ]
    for name, value, tokens, notes in rows:
        lines.append(f"| {name} | {value:.4f} | {100 * (value / reference - 1):+.2f}% | {tokens:,} | {notes} |")
    # Per-step bf16 all-reduce moves 16 bits/param each way every step; the codec moves these every H steps.
    # (at --codec's defaults; a row that names its own codec or k says so in its label)
    out_bits, back_bits = bits_per_value(CODECS[args.codec]())
    lines.append(f"traffic of --codec {args.codec} vs per-step bf16 gradient all-reduce: "
                 f"{16 * args.inner_steps / out_bits:.0f}x less out, {16 * args.inner_steps / back_bits:.0f}x less "
                 f"back ({out_bits:.3f} and {back_bits:.3f} bits/value)")
    print("\n".join(lines), flush=True)
    if out:
        (out / "table.md").write_text("\n".join(lines) + "\n")
        (out / "results.json").write_text(json.dumps(
            {"args": vars(args), "rows": [dict(run=n, val_loss=v, tokens=t, notes=x) for n, v, t, x in rows]}, indent=1))


def swarm_rows(args, out: Path | None) -> list[tuple[str, float, int, str]]:
    with tempfile.TemporaryDirectory() as work:
        try:
            global_losses, local_losses, tokens, logs, identical = swarm(args, Path(work))
        finally:
            if out:
                for log in Path(work).glob("*.log"):
                    (out / log.name).write_bytes(log.read_bytes())
    full = sum(len(re.findall(rf"averaged with {args.peers - 1} peer", log)) for log in logs) / args.peers
    rounds = sum(len(re.findall(r"round \d+: averaged", log)) for log in logs) / args.peers
    resyncs = sum(len(re.findall(r"back in step with the swarm", log)) for log in logs)
    # how late each average came, against the in-process rows' --apply-after
    late = sorted(int(n) for log in logs for n in re.findall(r"applied (\d+) steps into round", log))
    name = f"swarm, 1-bit async, error feedback {args.error_feedback}, outer lr {args.outer_lr} ({args.peers} processes)"
    notes = (f"{full:.1f} of {rounds:.1f} rounds/peer with all {args.peers}, {args.steps / max(rounds, 1):.0f} "
             f"steps/round, {resyncs} state re-downloads, global weights {'identical' if identical else 'differ'}"
             + (f", averages applied {late[len(late) // 2]} steps into the next round (median; {late[0]}-{late[-1]})"
                if late else ""))
    return [
        (f"{name}: global weights", sum(global_losses) / args.peers, tokens,
         f"{notes}; per peer {', '.join(f'{x:.4f}' for x in global_losses)}"),
        (f"{name}: each peer's last weights", sum(local_losses) / args.peers, tokens,
         f"per peer {', '.join(f'{x:.4f}' for x in local_losses)}"),
    ]


if __name__ == "__main__":
    main()
