"""Every touch of hivemind's private API, in one module: the rest of the project uses only the names below.

hivemind 1.1.12 has no extension points for what the swarm changes (its own codecs, a robust reducer, one shared
answer per part, banned peers, an ordered cancel), so the swarm overrides private methods and reads private
state. Any hivemind release may rename those, so importing this module checks that the installed hivemind is a
tested version (`check_hivemind_version`) and that every private name used here still exists, hooks with the
parameters we pass (`check_private_api`): an untested hivemind fails at import with one line naming what is
wrong, instead of misbehaving in the middle of a round.

What it offers:

- `AveragerBase`: `DecentralizedAverager` whose private hooks are renamed, for subclasses to override:
  `run_step` (hivemind's `_step`), `run_allreduce` (`_run_allreduce_inplace_`), `download_state`
  (`_load_state_from_peers`); and accessors for its private state (`p2p`, `averaged_tensors`,
  `allreduce_timeout`, `register_runner`, `runner_future`, `set_target_group_size`, `refresh_potential_leaders`,
  `skip_leaders`, `run_in_averager_process`).
- `AllReduceRunnerBase`: `AllReduceRunner` with `accumulate_parts_streaming` (its `_accumulate_parts_streaming`)
  and `communicate_with_peer` (`_communicate_with_peer`) as hooks, and `ban_sender`, `peer_stub`,
  `input_messages_for` for its private helpers.
- `parts_sent_to` and `outputs_registered`: what a `TensorPartContainer` keeps per reducer.
- `cancel_step`: a `StepControl` cancelled in an order the averager process cannot misread.
- `register_compression_type`: a codec hivemind's (de)serializer finds by a compression type its enum lacks.

`TensorPartReducer` is subclassed through public names only, but relies on its internals (`accumulate_part`,
`check_current_part_finished`, `reset_accumulators` and the counters they keep); its hooks are checked here too.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import itertools
from typing import AsyncIterator, Callable, Optional, Sequence

import hivemind
import torch
from hivemind.averaging import DecentralizedAverager
from hivemind.averaging.allreduce import AllReduceRunner
from hivemind.averaging.control import StepControl
from hivemind.averaging.group_info import GroupInfo
from hivemind.averaging.matchmaking import Matchmaking, PotentialLeaders
from hivemind.averaging.partition import TensorPartContainer, TensorPartReducer
from hivemind.compression import serialization
from hivemind.compression.base import CompressionBase
from hivemind.p2p import P2P, PeerID, StubBase
from hivemind.proto import averaging_pb2, runtime_pb2
from hivemind.utils.mpfuture import MPFuture

from tscale_p2p.errors import UserError

TESTED_HIVEMIND_VERSIONS = ("1.1.12",)


class UnsupportedHivemind(UserError, ImportError):
    """The installed hivemind is not one this project was tested with, or lacks a private name it relies on."""


def check_hivemind_version(version: str) -> None:
    """Raise UnsupportedHivemind unless `version` is a tested hivemind version."""
    if version not in TESTED_HIVEMIND_VERSIONS:
        raise UnsupportedHivemind(
            f"hivemind {version} is installed, but tscale-p2p is tested only with hivemind "
            f"{' or '.join(TESTED_HIVEMIND_VERSIONS)}, whose private API it extends: "
            f"pip install hivemind=={TESTED_HIVEMIND_VERSIONS[-1]}"
        )


# (class, method, its parameters): hivemind's private methods (and reducer internals) the classes below override
# or call. The parameters are the ones we pass or receive; a hook whose parameters changed fails the import.
PRIVATE_HOOKS: tuple[tuple[type, str, tuple[str, ...]], ...] = (
    (DecentralizedAverager, "_step", ("self", "step", "future_for_init")),
    (DecentralizedAverager, "_run_allreduce_inplace_", ("self", "tensors", "group_info", "group_id", "kwargs")),
    (DecentralizedAverager, "_load_state_from_peers", ("self", "future", "timeout")),
    (AllReduceRunner, "_accumulate_parts_streaming", ("self", "stream", "sender_index")),
    (AllReduceRunner, "_communicate_with_peer", ("self", "peer_id")),
    (AllReduceRunner, "_ban_sender", ("self", "peer_id")),
    (AllReduceRunner, "_get_peer_stub", ("self", "peer")),
    (AllReduceRunner, "_generate_input_for_peer", ("self", "peer_index")),
    (Matchmaking, "_request_join_group", ("self", "leader")),
    (TensorPartReducer, "accumulate_part", ("self", "sender_index", "part_index", "tensor_part", "weight")),
    (TensorPartReducer, "check_current_part_finished", ("self",)),
    (TensorPartReducer, "reset_accumulators", ("self",)),
)

# (class, attributes its __init__ assigns) and (class, attributes it declares): private state read or written here.
PRIVATE_ATTRIBUTES: tuple[tuple[type, tuple[str, ...]], ...] = (
    (DecentralizedAverager, ("_averaged_tensors", "_allreduce_timeout", "_running_groups", "_outer_pipe")),
    (StepControl, ("_trigger", "_cancel")),
    (TensorPartContainer, ("_input_parts_by_peer", "_outputs_registered_by_peer")),
    (Matchmaking, ("current_leader", "current_followers", "assembled_group", "potential_leaders")),  # undocumented
    (PotentialLeaders, ("update_triggered",)),
)
DECLARED_ATTRIBUTES: tuple[tuple[type, tuple[str, ...]], ...] = (
    (DecentralizedAverager, ("_p2p", "_matchmaking", "_pending_groups_registered")),
)


def check_private_api() -> None:
    """Raise UnsupportedHivemind naming the first private name of the tables above that hivemind lacks."""
    problems = []
    for cls, name, parameters in PRIVATE_HOOKS:
        method = getattr(cls, name, None)
        if method is None:
            problems.append(f"{cls.__name__}.{name} is gone")
        elif tuple(inspect.signature(method).parameters) != parameters:
            problems.append(f"{cls.__name__}.{name} takes {tuple(inspect.signature(method).parameters)}")
    for cls, names in PRIVATE_ATTRIBUTES:
        assigned = cls.__init__.__code__.co_names
        problems += [f"{cls.__name__}.{name} is never set" for name in names if name not in assigned]
    for cls, names in DECLARED_ATTRIBUTES:
        problems += [f"{cls.__name__}.{name} is not declared" for name in names if name not in cls.__annotations__]
    if not isinstance(getattr(serialization, "_BASE_COMPRESSION_TYPES", None), dict):
        problems.append("hivemind.compression.serialization._BASE_COMPRESSION_TYPES is gone")
    if problems:
        raise UnsupportedHivemind(f"hivemind {hivemind.__version__} lacks what tscale-p2p relies on: "
                                  + "; ".join(problems))


check_hivemind_version(hivemind.__version__)
check_private_api()


# ---- the averager ----


class AveragerBase(DecentralizedAverager):
    """`DecentralizedAverager` with its private hooks under names of our own, and its private state behind
    accessors. Hooks (each runs in the averager process; the default is hivemind's):

    - `run_step(step=, future_for_init=)`: one `step()`: matchmaking, the all-reduce, retries;
    - `run_allreduce(tensors, group_info, group_id=None, **kwargs)`: one all-reduce attempt, averaging `tensors`
      in place; it makes the runner and must `register_runner` it;
    - `download_state(future, timeout=None)`: `load_state_from_peers()`, result in `future`.
    """

    async def _step(self, *, step: StepControl, future_for_init: MPFuture):
        return await self.run_step(step=step, future_for_init=future_for_init)

    async def run_step(self, *, step: StepControl, future_for_init: MPFuture):
        return await DecentralizedAverager._step(self, step=step, future_for_init=future_for_init)

    async def _run_allreduce_inplace_(self, tensors: Sequence[torch.Tensor], group_info: GroupInfo,
                                      group_id: Optional[bytes] = None, **kwargs):
        return await self.run_allreduce(tensors, group_info, group_id, **kwargs)

    async def run_allreduce(self, tensors: Sequence[torch.Tensor], group_info: GroupInfo,
                            group_id: Optional[bytes] = None, **kwargs):
        return await DecentralizedAverager._run_allreduce_inplace_(self, tensors, group_info, group_id, **kwargs)

    async def _load_state_from_peers(self, future: MPFuture, timeout: Optional[float] = None):
        return await self.download_state(future, timeout=timeout)

    async def download_state(self, future: MPFuture, timeout: Optional[float] = None):
        return await DecentralizedAverager._load_state_from_peers(self, future, timeout=timeout)

    @property
    def p2p(self) -> P2P:
        """The averager process's P2P instance (set once the process runs)."""
        return self._p2p

    @property
    def averaged_tensors(self) -> tuple[torch.Tensor, ...]:
        """The shared tensors this averager averages in place (read them under `get_tensors()`)."""
        return self._averaged_tensors

    @property
    def allreduce_timeout(self) -> Optional[float]:
        return self._allreduce_timeout

    def register_runner(self, group_id: bytes, runner: AllReduceRunner) -> None:
        """Hand this attempt's runner to the groupmates' streams waiting for it (`runner_future`)."""
        self._running_groups[group_id].set_result(runner)

    async def runner_future(self, group_id: bytes, may_join: Callable[[], bool],
                            grace_s: float) -> Optional[asyncio.Future]:
        """The future of group `group_id`'s runner, once the group is registered (None: not a group of ours).

        The leader may start the all-reduce before its answer (with the group id) reached us: wait for that, but
        only while `may_join()` says this peer may yet begin a group it has not registered, and `grace_s` beyond.
        hivemind waits until this peer registers any group, and a peer whose join request failed just as its
        leader began the group (the leader counted it) looks for another one meanwhile: its groupmates waited
        for its parts until their sender timeout.
        """
        registered = self._pending_groups_registered
        idle_since = None
        while group_id not in self._running_groups and not registered.is_set():
            now = asyncio.get_running_loop().time()
            idle_since = None if may_join() else (idle_since if idle_since is not None else now)
            if idle_since is not None and now - idle_since >= grace_s:
                break
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(registered.wait(), timeout=0.05)
        return self._running_groups.get(group_id)

    def set_target_group_size(self, size: Optional[int]) -> None:
        """The group size at which this peer, as a leader, begins the all-reduce without waiting out the
        matchmaking window (hivemind has no per-step setting). Averager process only."""
        self._matchmaking.target_group_size = size

    def refresh_potential_leaders(self) -> None:
        """Have matchmaking read the averagers declared in the DHT again (hivemind re-reads them only while its
        earliest known one is past `PotentialLeaders.max_assured_time`). Averager process only."""
        self._matchmaking.potential_leaders.update_triggered.set()

    def skip_leaders(self, skip: Callable[[PeerID], bool]) -> None:
        """Make matchmaking pass over the leaders `skip` returns True for (hivemind asks each potential leader in
        turn through `Matchmaking._request_join_group`; None means "not this one"). Idempotent; averager process."""
        matchmaking = self._matchmaking
        if getattr(matchmaking, "_skips_leaders", False):
            return
        request_join_group = matchmaking._request_join_group

        async def request_unless_skipped(leader: PeerID) -> Optional[GroupInfo]:
            return None if skip(leader) else await request_join_group(leader)

        matchmaking._request_join_group = request_unless_skipped
        matchmaking._skips_leaders = True

    def matchmaking_holds_a_group(self) -> bool:
        """Whether matchmaking has this peer in a group that has not begun: a leader accepted it, it leads
        followers, or it has a group assembled and not yet handed on (hivemind's Matchmaking state; it has no such
        query). Averager process only."""
        matchmaking = self._matchmaking
        assembled = matchmaking.assembled_group
        found = assembled.done() and not assembled.cancelled() and assembled.exception() is None
        return matchmaking.current_leader is not None or bool(matchmaking.current_followers) or found

    def run_in_averager_process(self, method: str, **kwargs) -> None:
        """Have the averager process run `await self.<method>(**kwargs)` as a task (hivemind's control pipe, the
        way `step()` reaches it); pass an MPFuture in `kwargs` for its answer."""
        self._outer_pipe.send((method, [], kwargs))


def cancel_step(control: StepControl) -> bool:
    """`control.cancel()`, in an order the averager process cannot misread; True if the step was cancelled.

    hivemind 1.1.12's StepControl.cancel wakes the averager process (through the step's cancel future) before it
    marks the step itself cancelled. An averager that wakes in between finds the step live, goes back to looking
    for a group, and holds the round until its timeout, while this process waits for it to let go of the
    buffers. Under CPU load, a lone peer that gives up its rounds (as in tests/test_swarm.py) stalled that way in
    9 of 17 runs under three CPU hogs; with this order, in none of 23. Marking the step cancelled first closes
    the window.
    """
    if control._trigger is not None:
        control._trigger.cancel()
    cancelled = MPFuture.cancel(control)  # the step's own state, which the averager reads once woken
    if control._cancel is not None and not control._cancel.done():
        control._cancel.set_result(None)
    return cancelled


# ---- the all-reduce ----


class AllReduceRunnerBase(AllReduceRunner):
    """`AllReduceRunner` with its private hooks under names of our own (the defaults are hivemind's):

    - `accumulate_parts_streaming(stream, sender_index)`: reducer side, an async iterator of the answers to one
      sender's stream of parts;
    - `communicate_with_peer(peer_id)`: sender side, sends our parts of `peer_id`'s span and registers its answers
      (ours too, when `peer_id` is this peer) in `tensor_part_container`.
    """

    def _accumulate_parts_streaming(self, stream: AsyncIterator[averaging_pb2.AveragingData], sender_index: int):
        self._note_senders_started()
        return self.accumulate_parts_streaming(stream, sender_index)

    def accumulate_parts_streaming(
        self, stream: AsyncIterator[averaging_pb2.AveragingData], sender_index: int
    ) -> AsyncIterator[averaging_pb2.AveragingData]:
        return AllReduceRunner._accumulate_parts_streaming(self, stream, sender_index)

    async def _communicate_with_peer(self, peer_id: PeerID):
        return await self.communicate_with_peer(peer_id)

    async def communicate_with_peer(self, peer_id: PeerID):
        return await AllReduceRunner._communicate_with_peer(self, peer_id)

    async def ban_sender(self, peer_id: PeerID) -> None:
        """Drop `peer_id` as a sender for the rest of the round (its later parts are not aggregated)."""
        await self._ban_sender(peer_id)
        self._note_senders_started()

    def _note_senders_started(self) -> None:
        """End hivemind's watch for senders that never start once every sender not dropped has started: it ends
        only when all have, and the all-reduce waits for it to end, so a sender dropped before it started (its
        join never completed) held the round until the sender timeout."""
        if set(self.sender_peer_ids) <= self.active_senders | self.banned_senders:
            self.all_senders_started.set()

    def peer_stub(self, peer_id: PeerID) -> StubBase:
        """The RPC stub to `peer_id`'s averager."""
        return self._get_peer_stub(peer_id)

    def input_messages_for(self, peer_index: int) -> AsyncIterator[averaging_pb2.AveragingData]:
        """Our parts of reducer `peer_index`'s span, compressed, as the messages hivemind streams to it."""
        return self._generate_input_for_peer(peer_index)


def parts_sent_to(container: TensorPartContainer, peer_index: int) -> list[torch.Tensor]:
    """The parts of our tensors that reducer `peer_index` averages, in order, uncompressed (views of the tensors)."""
    return [part for part, _ in container._input_parts_by_peer[peer_index]]


def outputs_registered(container: TensorPartContainer, peer_index: int) -> int:
    """How many of reducer `peer_index`'s answers are registered (the parts after them are unanswered)."""
    return container._outputs_registered_by_peer[peer_index]


# ---- compression ----

_EXTRA_COMPRESSION_NAMES: dict[int, str] = {}


def register_compression_type(number: int, name: str, codec: CompressionBase) -> None:
    """Make hivemind's (de)serializer decode compression type `number` (unknown to its protobuf enum) with `codec`,
    under `name`. Idempotent: the first codec registered under a name stays.

    hivemind's `CompressionType` enum cannot be extended without rebuilding hivemind (and its p2pd binary comes
    only in the PyPI wheel). An unknown enum value does survive the protobuf round trip, and the serializer looks
    codecs up by `CompressionType.Name(value)` in `_BASE_COMPRESSION_TYPES`, so both learn the extra values.
    """
    enum = runtime_pb2.CompressionType
    if number in enum.values():
        raise ValueError(f"compression type {number} is hivemind's own {enum.Name(number)}")
    serialization._BASE_COMPRESSION_TYPES.setdefault(name, codec)
    _EXTRA_COMPRESSION_NAMES[number] = name
    if getattr(enum, "_extra_names_registered", False):
        return
    stock_name = enum.Name

    def name_of(value: int) -> str:
        return _EXTRA_COMPRESSION_NAMES[value] if value in _EXTRA_COMPRESSION_NAMES else stock_name(value)

    # The enum wrapper is a plain Python object: an instance attribute shadows its method.
    enum.Name = name_of
    enum._extra_names_registered = True
