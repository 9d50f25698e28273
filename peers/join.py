"""`tscale-peer join`: get onto the DHT, adopt (or start) the run, download the state, train in the swarm.

Order of a join, and why:

1. Start a DHT node (retrying while the initial peers are unreachable); its peer id seeds this peer's data
   sampling, so volunteers train on different windows.
2. Fetch the run config under ``{run_id}_config``, refuse contradicting flags, adopt it; a peer that
   finds none starts the run and publishes its own.
3. Build the trainer (resuming from a local checkpoint when there is one) with the run's initial weights, or
   the --init-from checkpoint's weights, optimizer state and step; start the averager, and download the current
   shared weights and outer momentum from a live peer.
4. Run `SwarmPeer` until --max-steps, the run's last step, Ctrl+C/SIGTERM, or the dashboard asks to stop;
   then save a checkpoint and leave (exit 0). A second Ctrl+C leaves at once (exit 130).
"""

from __future__ import annotations

import hashlib
import logging
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import psutil
import torch

from tscale_p2p.checkpoint import Checkpoint, find_latest, resume_from
from tscale_p2p.config import TrainConfig
from tscale_p2p.data import load_corpus
from tscale_p2p.errors import UserError
from tscale_p2p.model import ModelConfig, Transformer
from tscale_p2p.peers.averaging import SwarmAverager
from tscale_p2p.peers.codec import CODECS
from tscale_p2p.peers.metrics import SwarmMetrics
from tscale_p2p.peers.network import NetworkOptions, peer_ids_in, start_dht
from tscale_p2p.peers.progress import progress_record
from tscale_p2p.peers.records import protect, signing_key, use_identity_key
from tscale_p2p.peers.run_config import (
    RunConfig,
    SignedRun,
    averaging_prefix,
    fetch_signed_run,
    load_saved_run_config,
    load_saved_signed_run,
    publish_run_config,
    run_config_record,
    save_run_config,
)
from tscale_p2p.peers.run_tokenizer import check_explicit_tokenizer, run_tokenizer_spec, save_run_tokenizer
from tscale_p2p.peers.settings import (
    DEFAULT_CODEC,
    DEFAULT_ERROR_FEEDBACK,
    DEFAULT_INNER_STEPS,
    DEFAULT_OPENING_INNER_STEPS,
    DEFAULT_OPENING_OUTER_LR,
    DEFAULT_OUTER_LR,
    DEFAULT_OUTER_MOMENTUM,
    ERROR_FEEDBACK_CARRY,
    SwarmSettings,
    default_outer_lr_peak,
)
from tscale_p2p.peers.state_download import StateCheck, state_offer_record
from tscale_p2p.peers.status import LocalStatus
from tscale_p2p.peers.swarm import SwarmIdentity, SwarmPeer
from tscale_p2p.progress import long_work
from tscale_p2p.solo import GracefulStop, model_config_for, planned_tokens, prepare_trainer
from tscale_p2p.tokenizer import apply_tokenizer, checkpoint_tokenizer, describe, describe_id, tokenizer_id
from tscale_p2p.device import resolve_device

log = logging.getLogger(__name__)

STATE_DOWNLOAD_ATTEMPTS = 3
INTERRUPTED = "tscale-peer: interrupted; the last checkpoint written stays valid"


@dataclass(frozen=True)
class JoinOptions:
    """What `tscale-peer join` takes besides its training settings (a `TrainConfig`): where the swarm is, which run,
    and this peer's swarm section."""

    network: NetworkOptions
    run_id: str
    swarm: SwarmSettings = field(default_factory=SwarmSettings)
    publish_every_s: float = 5.0


def join(cfg: TrainConfig, explicit: dict, options: JoinOptions, status: LocalStatus | None = None) -> int:
    """Run one swarm peer to completion; returns the exit code. `explicit` holds the settings the user gave
    (flag name -> value), which must agree with the run's; `status` is updated live for a dashboard."""
    status = status or LocalStatus()
    threads = options.swarm.threads or default_threads()
    torch.set_num_threads(threads)  # before the averager process is forked: it inherits the setting
    if not logging.getLogger().isEnabledFor(logging.DEBUG):
        # hivemind logs a traceback for every round that finds no group; our loop reports it in one line.
        logging.getLogger("hivemind.averaging.averager").setLevel(logging.CRITICAL)
    package_logger, handler = logging.getLogger("tscale_p2p"), status.log_handler()
    previous_level = package_logger.level
    if not package_logger.isEnabledFor(logging.INFO):  # the status's log lines need INFO records
        package_logger.setLevel(logging.INFO)
    package_logger.addHandler(handler)
    try:
        return _join_until_stopped(cfg, explicit, options, status)
    finally:
        package_logger.removeHandler(handler)
        package_logger.setLevel(previous_level)


def _join_until_stopped(cfg: TrainConfig, explicit: dict, options: JoinOptions, status: LocalStatus) -> int:
    # Loaded before going online (a bad one costs no DHT start), and handed over in a list that _join_swarm
    # empties: nothing here keeps the checkpoint's tensors (weights, AdamW moments) alive after they are copied.
    start = [starting_checkpoint(cfg, options)]
    with GracefulStop() as stop:
        _leave_at_once_on_second_ctrl_c(stop)
        should_stop = lambda: stop.requested or status.stop_requested.is_set()  # noqa: E731
        dht = start_dht(options.network, should_stop)
        if dht is None:
            return 0
        try:
            return _join_swarm(dht, cfg, explicit, options, status, should_stop, start)
        finally:
            dht.shutdown()


def starting_checkpoint(cfg: TrainConfig, options: JoinOptions) -> Checkpoint | None:
    """--init-from's checkpoint, loaded and verified; None without the flag, or when --out already holds this
    peer's own checkpoint (a restart with the same command line resumes that instead)."""
    if options.swarm.init_from is None:
        return None
    if not Path(options.swarm.init_from).is_dir():
        raise UserError(f"--init-from {options.swarm.init_from!r}: no such checkpoint folder")
    if find_latest(Path(cfg.out)) is not None:
        log.info("%s holds this peer's checkpoint: resuming from it, not from --init-from %s", cfg.out,
                 options.swarm.init_from)
        return None
    return resume_from(options.swarm.init_from)


def _join_swarm(dht, cfg: TrainConfig, explicit: dict, options: JoinOptions, status: LocalStatus, should_stop,
                handed_over: list[Checkpoint | None]) -> int:
    start = handed_over.pop()
    peer_id = str(dht.peer_id)
    if options.network.identity_path:  # our records, and a run we found, are signed by our peer id
        use_identity_key(dht, str(Path(options.network.identity_path).expanduser()))
    # This node refuses unsigned, far-expiring or malformed records of the run's steering keys, from anybody.
    protect(dht, run_config_record(options.run_id), progress_record(options.run_id),
            state_offer_record(options.run_id))
    maddrs = _sorted_maddrs(dht)
    device = resolve_device(cfg.device)
    corpus = load_corpus(cfg.data)
    signed_run = resolve_run(dht, cfg, explicit, options, corpus, device, start)
    run = signed_run.config
    cfg = replace(cfg, tokenizer=run_tokenizer_spec(dht, run, options.run_id, cfg.out, explicit.get("tokenizer")))

    resume = find_latest(Path(cfg.out)) is not None
    if resume:
        log.info("resuming from the checkpoint in %s", cfg.out)
    cfg = replace(run.apply_to(cfg), seed=peer_seed(peer_id, cfg.seed), resume=resume)
    if start is not None and start.step >= cfg.steps:
        raise UserError(f"--init-from {start.path} is at step {start.step}, not before the run's last step {cfg.steps}")
    trainer = prepare_trainer(cfg)
    if tokenizer_id(trainer.corpus.tokenizer, trainer.corpus.vocab_size) != run.tokenizer:
        raise UserError(
            f"--data {cfg.data!r} is tokenized with {describe(trainer.corpus.tokenizer)}, but run {options.run_id!r} "
            f"uses {describe_id(run.tokenizer, run.model_config.vocab_size)}"
        )
    if trainer.model_cfg != run.model_config:
        raise UserError(f"the model built here ({trainer.model_cfg}) differs from run {options.run_id!r}'s ({run.model_config})")
    if start is not None:
        trainer.start_from(start)
        log.info("starting from %s at step %d", start.path, trainer.step)
        del start
    elif not resume:
        trainer.apply_outer_update(initial_weights(run))
    if not options.network.initial_peers:
        _print_join_line(maddrs, options.run_id)
    name = options.swarm.name or f"peer-{peer_id[-6:]}"
    identity = SwarmIdentity(
        peer_id=peer_id,
        name=name,
        run_id=options.run_id,
        device=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        relayed=options.network.client_mode,
        visible_maddrs=tuple(maddrs),
    )
    status.update(
        peer_id=peer_id,
        name=name,
        run_id=options.run_id,
        model=run.model_config.dims,
        device=identity.device,
        visible_maddrs=identity.visible_maddrs,
        precision=trainer.precision,
        offload=cfg.offload != "none",
        inner_steps=run.inner_steps,
        max_steps=options.swarm.max_steps,
        step=trainer.step,
    )
    client_mode = options.network.client_mode

    def make_averager(template, state_source):
        averager = SwarmAverager(
            template,
            dht,
            prefix=averaging_prefix(options.run_id),
            matchmaking_time=options.swarm.matchmaking_time,
            round_timeout=options.swarm.averaging_timeout,
            codec=CODECS[run.codec](),
            residual_carry=ERROR_FEEDBACK_CARRY[options.swarm.error_feedback or DEFAULT_ERROR_FEEDBACK[run.codec]],
            state_source=state_source,
            state_check=StateCheck.of(options.run_id, run, template),
            identity=signing_key(dht),  # our span's averages go out signed with our peer id's key
            client_mode=client_mode,
            allow_state_sharing=False,  # switched on once this peer holds the swarm's state
        )
        return averager

    peer = SwarmPeer(
        trainer,
        make_averager,
        SwarmMetrics(dht, options.run_id),
        identity,
        status,
        run=run,
        signed_run=signed_run,
        max_steps=options.swarm.max_steps,
        publish_every_s=options.publish_every_s,
    )
    try:
        downloaded = bool(options.network.initial_peers) and download_state(peer, should_stop)
        if resume and not downloaded and peer.load_saved_state():
            log.info("continuing from the saved swarm state of round %d", peer.round)
        if not client_mode:
            peer.averager.allow_state_sharing = True
            peer.announce_state()
        log.info("%s (%s) training on %s, %s, %d CPU threads; peer id %s", name, options.run_id, identity.device,
                 trainer.precision, torch.get_num_threads(), peer_id)
        if options.swarm.min_peers > 1:
            peer.clock.live_at_start = wait_for_peers(peer, options.swarm.min_peers, should_stop)
        if not should_stop():
            peer.run(should_stop)
        if peer.wall_s > 0:
            log.info(
                "trainer busy %.1f%% of %.0f s in the swarm loop; %.1f s to average the last round on leaving; "
                "%d tokens contributed",
                100 * peer.training_s / peer.wall_s, peer.wall_s, peer.drain_s, peer.report.tokens_contributed,
            )
        path = peer.save()
        log.info("checkpoint written to %s", path)
    finally:
        peer.shutdown()
    return 0


def _leave_at_once_on_second_ctrl_c(stop: GracefulStop) -> None:
    """The first Ctrl+C asks `stop` to finish the round, save and leave; a second one exits at once (130).

    GracefulStop raises KeyboardInterrupt then, wherever the main thread is: in the middle of a call to
    hivemind's DHT or averager process that leaves them with half a message and a traceback. Exiting without
    unwinding is clean instead: those processes, and p2pd, die with this one (PR_SET_PDEATHSIG, see
    peers/network.py), and every checkpoint on disk is whole (writes are atomic)."""
    if threading.current_thread() is not threading.main_thread():
        return  # under the dashboard: it has its own stop button
    first = signal.getsignal(signal.SIGINT)

    def handle(signum, frame):
        if not stop.requested:
            first(signum, frame)
            return
        print(INTERRUPTED, file=sys.stderr, flush=True)
        os._exit(130)

    signal.signal(signal.SIGINT, handle)


def resolve_run(dht, cfg: TrainConfig, explicit: dict, options: JoinOptions, corpus, device,
                start: Checkpoint | None = None) -> SignedRun:
    """The run this peer trains, with its founder's signature: the one published in the DHT (signed by a founder
    that --initial-peers or --out vouch for, see `fetch_signed_run`), else the one saved in --out by an earlier
    session, else a new one from this peer's flags (signed by this peer and published for others) with the model
    and tokenizer of `start` (the --init-from checkpoint) if given. Saved in --out in every case, with a BPE's
    tokenizer.json."""
    saved = load_saved_run_config(cfg.out)
    saved_signed = load_saved_signed_run(cfg.out, options.run_id) if saved is not None else None
    trusted = set(peer_ids_in(options.network.initial_peers))
    if saved_signed is not None:
        trusted.add(saved_signed.founder_id)
    published_signed = fetch_signed_run(dht, options.run_id, trusted) if options.network.initial_peers else None
    published = published_signed.config if published_signed else None
    if published is not None and saved is not None and published.hash != saved.hash:
        raise UserError(
            f"{cfg.out!r} holds checkpoints of another configuration than run {options.run_id!r}; choose another --out"
        )
    run = published or saved
    if run is not None:
        run.check_flags(options.run_id, explicit)
        if explicit.get("tokenizer") is not None:
            check_explicit_tokenizer(explicit["tokenizer"], run, options.run_id)
        log.info("%s run %r (config %s): model %s, %s, codec %s", "joined" if published else "continuing",
                 options.run_id, run.hash[:12], run.model_config.dims, rounds_text(run), run.codec)
        if start is not None and ModelConfig.from_dict(start.model_config) != run.model_config:
            raise UserError(f"--init-from {start.path} holds model {ModelConfig.from_dict(start.model_config).dims}, "
                            f"but run {options.run_id!r} trains {run.model_config.dims}")
    else:
        of_start = {} if start is None else {"saved": checkpoint_tokenizer(
            start.path, start.meta, int(start.model_config.get("vocab_size", 0)))}
        corpus = apply_tokenizer(corpus, cfg.tokenizer, seed=cfg.seed, planned_tokens=planned_tokens(cfg, device.type),
                                 **of_start)
        save_run_tokenizer(cfg.out, corpus.tokenizer)
        swarm = options.swarm
        outer_lr = swarm.outer_lr or DEFAULT_OUTER_LR
        run = RunConfig.from_settings(
            cfg,
            model_config_for(cfg, device.type, corpus.vocab_size, start.model_config if start else None),
            tokenizer_id(corpus.tokenizer, corpus.vocab_size),
            inner_steps=swarm.inner_steps or DEFAULT_INNER_STEPS,
            outer_lr=outer_lr,
            outer_momentum=swarm.outer_momentum if swarm.outer_momentum is not None else DEFAULT_OUTER_MOMENTUM,
            codec=swarm.codec or DEFAULT_CODEC,
            opening_rounds=swarm.opening_rounds or 0,
            opening_inner_steps=swarm.opening_inner_steps or DEFAULT_OPENING_INNER_STEPS,
            opening_outer_lr=swarm.opening_outer_lr or DEFAULT_OPENING_OUTER_LR,
            outer_lr_peak=(swarm.outer_lr_peak if swarm.outer_lr_peak is not None
                           else default_outer_lr_peak(outer_lr, swarm.opening_rounds or 0)),
        )
        log.info("started run %r (config %s): model %s, %s, codec %s", options.run_id, run.hash[:12],
                 run.model_config.dims, rounds_text(run), run.codec)
    if cfg.index is not None or run.model_config.index is not None:
        from tscale_p2p.index import check_index_flag

        check_index_flag(run.model_config.index, cfg.index, f"run {options.run_id!r}")
    signed = published_signed or (saved_signed if saved_signed and saved_signed.config == run else None)
    if signed is None:  # a new run, or one saved before runs were signed: this peer founds it
        signed = SignedRun.sign(run, options.run_id, signing_key(dht))
    if published is None:
        publish_run_config(dht, options.run_id, signed)
    save_run_config(cfg.out, run, signed)
    return signed


def download_state(peer: SwarmPeer, should_stop, timeout_s: float = 60.0) -> bool:
    """Fetch the shared weights and outer momentum from a live peer, showing its progress (`long_work`)."""
    numel = sum(w.numel() for w in peer.outer.weights.values())
    expected = 2 * 4 * numel  # fp32 weights + fp32 momentum
    with long_work("downloading the swarm's state", total=expected) as work:
        for attempt in range(1, STATE_DOWNLOAD_ATTEMPTS + 1):
            # hivemind downloads in the averager's process and reports nothing until it is done.
            future = peer.averager.load_state_from_peers(wait=False, timeout=timeout_s)
            deadline = time.monotonic() + timeout_s
            while not future.done() and time.monotonic() < deadline and not should_stop():
                time.sleep(0.1)
            state = future.result() if future.done() else None
            if state is not None and peer.adopt_state(*state):
                work.update(completed=expected, description=f"downloaded the state of round {peer.round}")
                return True
            if should_stop() or not peer.metrics.fetch():  # nobody is training yet: we start the run's history
                break
            time.sleep(attempt)
        work.update(description="no peer shared its state; starting from the run's initial weights")
    return False


def wait_for_peers(peer: SwarmPeer, count: int, should_stop) -> int:
    """Publish our record and wait until `count` live peers (us included) have theirs (--min-peers); the peers to
    expect in the first round then: `count`, not the records seen (which anyone can publish), or 1 if stopped first."""
    log.info("waiting for %d peers before training", count)
    while not should_stop():
        peer.metrics.publish(peer.record())
        peer.announce_state()  # a waiting peer serves its state already
        fresh = time.time() - 3 * peer.publish_every_s
        live = {r.peer_id for r in peer.metrics.fetch() if r.updated_at > fresh} | {peer.identity.peer_id}
        if len(live) >= count:
            log.info("%d peers are live: training", len(live))
            return count
        time.sleep(1.0)
    return 1


def rounds_text(run: RunConfig) -> str:
    """The run's rounds as its log line gives them."""
    opening = (f" after {run.opening_rounds} opening rounds of {run.opening_inner_steps} at plain lr "
               f"{run.opening_outer_lr:g}" if run.opening_rounds else "")
    outer = (f", outer lr {run.outer_lr_peak:g} falling to {run.outer_lr:g} with the inner lr"
             if run.outer_lr_peak is not None else "")
    return f"{run.inner_steps} inner steps{opening}{outer}"


def initial_weights(run: RunConfig) -> dict[str, torch.Tensor]:
    """The run's step-0 weights, the same on every peer (built from the run's seed on the CPU)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(run.seed)
        model = Transformer(run.model_config)
    return {name: p.detach() for name, p in model.named_parameters()}


def default_threads() -> int:
    """CPU threads for one peer's torch ops: $OMP_NUM_THREADS when set, else this process's cores shared out
    among the `join` peers running on this machine. Several peers each using every core oversubscribe it, and
    OpenMP threads spin while they wait, so they starve one another instead of merely sharing."""
    if os.environ.get("OMP_NUM_THREADS"):
        return torch.get_num_threads()  # torch sized its pool from the variable
    return max(1, len(os.sched_getaffinity(0)) // (1 + len(other_local_peers())))


def other_local_peers() -> set[int]:
    """Process ids of the other `tscale-peer join` commands running on this machine."""
    me, commands = os.getpid(), {}
    for process in psutil.process_iter(["pid", "ppid", "cmdline"]):
        cmdline = process.info["cmdline"] or []
        if "join" in cmdline and any(part == "tscale_p2p.cli" or part.endswith("tscale-peer") for part in cmdline):
            commands[process.info["pid"]] = process.info["ppid"]
    # hivemind's DHT and averager processes are forks with their peer's command line: count their parent only.
    return {pid for pid, parent in commands.items() if parent not in commands and pid != me}


def peer_seed(peer_id: str, seed: int) -> int:
    """A data-sampling seed of this peer: different peers draw different windows."""
    digest = hashlib.sha256(f"{peer_id}/{seed}".encode()).digest()
    return int.from_bytes(digest[:4], "little")


def _sorted_maddrs(dht) -> list[str]:
    """Visible multiaddrs, the ones other machines can use first (loopback last)."""
    maddrs = [str(m) for m in dht.get_visible_maddrs()]
    return sorted(maddrs, key=lambda m: ("/127." in m or "/::1/" in m, m))


def _print_join_line(maddrs: list[str], run_id: str) -> None:
    print(f"Started swarm {run_id!r}. This peer's addresses:", *(f"  {m}" for m in maddrs), sep="\n")
    print("Others join with:")
    print(f"  tscale-peer join --initial-peers {' '.join(maddrs)} --run-id {run_id}", flush=True)
