"""The swarm's current model, fetched from a live peer for inference (`tscale-peer infer/serve --initial-peers`).

A dial-out-only DHT node reads the run's published config, then downloads what a joiner downloads (the global
weights and outer momentum of a `SwarmState`, peers/swarm_state.py, with the run's tokenizer) and keeps the weights.
Nothing is trained and nothing is shared back. `fetch_run_tokenizer` does the same for a joiner that lacks the
run's tokenizer.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Sequence

import torch

from tscale_p2p.data import ByteTokenizer
from tscale_p2p.errors import UserError
from tscale_p2p.model import ModelConfig, Transformer
from tscale_p2p.peers.averaging import SwarmAverager
from tscale_p2p.peers.network import NetworkOptions, peer_ids_in, start_dht
from tscale_p2p.peers.run_config import RunConfig, averaging_prefix, fetch_run_config
from tscale_p2p.peers.state_download import StateCheck
from tscale_p2p.peers.swarm_state import SwarmState
from tscale_p2p.progress import long_work
from tscale_p2p.tokenizer import BPETokenizer, Tokenizer, from_wire

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SwarmModel:
    """A run's model as a live peer holds it: the global weights after its last outer step."""

    run_id: str
    config: ModelConfig
    weights: dict[str, torch.Tensor]  # fp32, CPU, named as in `Transformer(config)`
    round: int
    step: int
    tokenizer: Tokenizer | None = None  # the run's; None: an unknown one (a .bin run)

    def build(self) -> Transformer:
        """A `Transformer` (fp32, CPU) holding these weights, and carrying the run's tokenizer for decoding."""
        model = Transformer(self.config)
        model.load_state_dict(self.weights)
        model.tokenizer = self.tokenizer
        return model


def fetch_swarm_model(initial_peers: Sequence[str], run_id: str, timeout: float = 60.0) -> SwarmModel:
    """Connect through `initial_peers` (validated multiaddrs), read run `run_id`'s config and download its
    current weights from the live peer that has applied the most rounds, with a progress display (`long_work`).
    UserError (one line naming the run and the peers) if that does not succeed within `timeout` seconds."""
    where = f"run {run_id!r} via {', '.join(initial_peers)}"
    deadline = time.monotonic() + timeout
    if not logging.getLogger().isEnabledFor(logging.DEBUG):
        # hivemind logs a traceback for every peer that fails to send its state; we report the outcome in one line.
        logging.getLogger("hivemind.averaging.averager").setLevel(logging.CRITICAL)
    with long_work(f"connecting to {where}") as work:
        network = NetworkOptions(
            initial_peers=tuple(initial_peers),
            host_maddrs=("/ip4/127.0.0.1/tcp/0",),  # dial-out only: nothing needs to reach us
            client_mode=True,
            retry_for_s=timeout,
        )
        try:
            dht = start_dht(network)
        except UserError as error:  # it names the peers already
            raise UserError(f"run {run_id!r}: {error}") from None
        try:
            run = _wait_for_run_config(dht, run_id, peer_ids_in(initial_peers), deadline)
            if run is None:
                raise UserError(f"{where}: no peer has published this run's config within {timeout:g} s")
            config = run.model_config
            with torch.device("meta"):  # names and shapes only
                template = dict(Transformer(config).named_parameters())
            total = 2 * 4 * sum(p.numel() for p in template.values())  # fp32 weights + fp32 outer momentum
            work.update(total=total, description=f"downloading the model of run {run_id!r} ({config.dims})")
            state = _download_state(dht, run_id, run, template, deadline)
            if state is None:
                raise UserError(f"{where}: no live peer shared the run's model within {timeout:g} s")
            model = SwarmModel(run_id, config, state.weights, state.round, state.step,
                               _tokenizer_of(run, state.tokenizer, where))
            work.update(completed=total,
                        description=f"downloaded run {run_id!r} ({config.dims}) at round {model.round}")
        finally:
            dht.shutdown()
    return model


def fetch_run_tokenizer(dht, run_id: str, run: RunConfig, timeout: float = 60.0) -> BPETokenizer:
    """The BPE tokenizer of run `run_id`, downloaded from a live peer with the state it shares (a joiner that lacks
    it needs it before it can tokenize its data) and checked against the hash in the run config."""
    with torch.device("meta"):
        template = dict(Transformer(run.model_config).named_parameters())
    log.info("fetching the tokenizer of run %r from a live peer", run_id)
    state = _download_state(dht, run_id, run, template, time.monotonic() + timeout)
    if state is None:
        raise UserError(f"run {run_id!r}: no live peer shared the run's tokenizer within {timeout:g} s")
    return _tokenizer_of(run, state.tokenizer, f"run {run_id!r}'s peer")


def _tokenizer_of(run: RunConfig, packed: str | None, where: str) -> Tokenizer | None:
    """The run's tokenizer: bytes, an unknown one (.bin runs), or the BPE that came `packed` with a downloaded
    state."""
    if run.tokenizer == "byte":
        return ByteTokenizer()
    if not run.tokenizer.startswith("bpe-"):
        return None
    if packed is None:
        raise UserError(f"{where} sent its state without the run's tokenizer ({run.tokenizer[:16]})")
    return from_wire(packed, run.tokenizer, where)


def _wait_for_run_config(dht, run_id: str, trusted: frozenset[str], deadline: float) -> RunConfig | None:
    while True:
        run = fetch_run_config(dht, run_id, trusted)
        if run is not None or time.monotonic() >= deadline:
            return run
        time.sleep(1.0)


def _download_state(
    dht, run_id: str, run: RunConfig, template: dict[str, torch.Tensor], deadline: float
) -> SwarmState | None:
    """The state most peers offer, from the first of them whose state fits the run (see peers/state_download.py),
    retrying until `deadline`; else None."""
    # Downloading needs only the averager's state RPC: one value to "average" is enough; sharing peers
    # declare themselves under the run's averaging prefix.
    check = StateCheck.of(run_id, run, list(template.values()))
    averager = SwarmAverager([torch.zeros(1)], dht, prefix=averaging_prefix(run_id), client_mode=True,
                             state_check=check)
    try:
        while time.monotonic() < deadline:
            future = averager.load_state_from_peers(wait=False, timeout=deadline - time.monotonic())
            while not future.done() and time.monotonic() < deadline:
                time.sleep(0.1)
            state = future.result() if future.done() else None
            if state is not None and check.problem(*state) is None:  # checked in the download; again, it is cheap
                return SwarmState.from_wire(*state, names=list(template))
            time.sleep(min(1.0, max(0.0, deadline - time.monotonic())))
        return None
    finally:
        averager.shutdown()
