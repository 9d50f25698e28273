"""peers/hivemind_seam.py: the version check, the private-name checks, and one test per private touch that the
hivemind behaviour it relies on is there. Also: no private hivemind name is used anywhere else."""

import asyncio
import inspect
import re
import time
from pathlib import Path

import hivemind
import numpy as np
import pytest
import torch
from hivemind.averaging import DecentralizedAverager
from hivemind.averaging.allreduce import AllReduceRunner
from hivemind.averaging.control import AveragingStage, StepControl
from hivemind.averaging.partition import TensorPartContainer
from hivemind.compression import deserialize_torch_tensor, serialize_torch_tensor
from hivemind.compression.base import CompressionBase, NoCompression
from hivemind.proto import runtime_pb2
from hivemind.utils import get_dht_time
from hivemind.utils.mpfuture import MPFuture

from tscale_p2p.errors import UserError
from tscale_p2p.peers.hivemind_seam import (
    DECLARED_ATTRIBUTES,
    PRIVATE_ATTRIBUTES,
    PRIVATE_HOOKS,
    AllReduceRunnerBase,
    AveragerBase,
    UnsupportedHivemind,
    cancel_step,
    check_hivemind_version,
    check_private_api,
    outputs_registered,
    parts_sent_to,
    register_compression_type,
)

ROOT = Path(__file__).resolve().parent.parent


def test_an_untested_hivemind_version_is_refused_in_one_line_naming_both_versions():
    check_hivemind_version(hivemind.__version__)  # the installed one is tested
    with pytest.raises(UnsupportedHivemind) as error:
        check_hivemind_version("1.2.0")
    message = str(error.value)
    assert "1.2.0" in message and "1.1.12" in message and "\n" not in message
    assert isinstance(error.value, ImportError) and isinstance(error.value, UserError)  # the CLI prints one line


def test_every_private_name_used_is_in_the_installed_hivemind():
    check_private_api()


def test_a_missing_or_changed_private_hook_is_named_at_import(monkeypatch):
    monkeypatch.delattr(AllReduceRunner, "_ban_sender")
    monkeypatch.setattr(AllReduceRunner, "_communicate_with_peer", lambda self, peer_id, retries: None)
    with pytest.raises(UnsupportedHivemind, match=r"_communicate_with_peer takes .*retries.*_ban_sender is gone"):
        check_private_api()


def test_the_bases_route_each_private_hook_with_hiveminds_parameters():
    for base, hivemind_class in ((AveragerBase, DecentralizedAverager), (AllReduceRunnerBase, AllReduceRunner)):
        hooks = [(name, params) for cls, name, params in PRIVATE_HOOKS if cls is hivemind_class]
        overridden = [(name, params) for name, params in hooks if name in vars(base)]
        assert overridden, base
        for name, params in overridden:  # our wrapper replaces hivemind's, with the same parameters
            assert tuple(inspect.signature(vars(base)[name]).parameters) == params, name


def test_the_private_attributes_are_where_the_tables_say():
    averager = DecentralizedAverager([torch.zeros(3)], dht=None, start=False, prefix="seam", client_mode=True)
    for cls, names in PRIVATE_ATTRIBUTES:
        if cls is DecentralizedAverager:
            assert all(hasattr(averager, name) for name in names)
    for cls, names in DECLARED_ATTRIBUTES:
        assert set(names) <= set(cls.__annotations__)
    assert AveragerBase.averaged_tensors.fget(averager) == averager._averaged_tensors


def test_the_container_accessors_return_the_parts_hivemind_made():
    tensors = [torch.arange(1000.0), torch.arange(500.0).view(50, 10)]
    container = TensorPartContainer(tensors, [1.0, 1.0, 2.0], part_size_bytes=400)
    flat = torch.cat([t.reshape(-1) for t in tensors])
    parts = [parts_sent_to(container, peer) for peer in range(3)]
    assert [len(p) for p in parts] == list(container.num_parts_by_peer)
    assert torch.equal(torch.cat([part for peer in parts for part in peer]), flat)  # in order, nothing missing
    for peer in range(3):
        assert all(a is b for a, b in zip(parts[peer], container.get_raw_input_parts(peer)))  # hivemind's own
    assert [outputs_registered(container, peer) for peer in range(3)] == [0, 0, 0]
    container.register_processed_part(2, 0, parts[2][0])
    assert outputs_registered(container, 2) == 1
    container.register_failed_reducer(2)
    assert outputs_registered(container, 2) == container.num_parts_by_peer[2]


def test_a_cancelled_step_is_marked_cancelled_before_the_averager_is_woken():
    """hivemind's StepControl.cancel wakes the averager process before it marks the step cancelled. An averager
    that wakes in between finds the step live and keeps looking for a group until the round's timeout, while its
    peer waits for it: under CPU load a lone peer stalled that way. The swarm cancels in the other order."""
    trigger, cancel = MPFuture(), MPFuture()  # (the first MPFuture of a process sets up their shared machinery)
    now = get_dht_time()
    control = StepControl(scheduled_time=now, deadline=now + 60, allow_retries=True, weight=1.0, data_for_gather=b"")
    control.attach(trigger, cancel)
    seen_by_the_woken_averager = []
    cancel.add_done_callback(lambda _: seen_by_the_woken_averager.append(control.cancelled()))
    assert cancel_step(control)
    assert seen_by_the_woken_averager == [True]
    assert control.cancelled() and trigger.cancelled()


class _Halves(CompressionBase):
    """A codec hivemind does not know: float16 bytes under a compression type its enum lacks."""

    compression_type = 97

    def compress(self, tensor, info, allow_inplace=False):
        return runtime_pb2.Tensor(compression=self.compression_type, buffer=tensor.half().numpy().tobytes(),
                                  size=tensor.shape, dtype="float32", requires_grad=False)

    def extract(self, serialized):
        values = np.frombuffer(serialized.buffer, dtype=np.float16).astype(np.float32)
        return torch.from_numpy(values).view(tuple(serialized.size))

    def estimate_compression_ratio(self, info):
        return 0.5


def test_a_registered_compression_type_round_trips_through_hiveminds_serializer():
    # (registers type 97 for the rest of the session: nothing else uses it)
    register_compression_type(97, "SEAM_TEST_HALVES", _Halves())
    register_compression_type(97, "SEAM_TEST_HALVES", NoCompression())  # idempotent: the first codec stays
    x = torch.randn(7, 3)
    wire = serialize_torch_tensor(x, 97).SerializeToString()
    message = runtime_pb2.Tensor()
    message.ParseFromString(wire)  # an enum value protobuf does not know survives the trip
    assert message.compression == 97
    assert torch.equal(deserialize_torch_tensor(message), x.half().float())
    assert runtime_pb2.CompressionType.Name(97) == "SEAM_TEST_HALVES"
    assert runtime_pb2.CompressionType.Name(runtime_pb2.FLOAT16) == "FLOAT16"  # hivemind's own names stay
    with pytest.raises(ValueError):
        runtime_pb2.CompressionType.Name(63)
    with pytest.raises(ValueError, match="FLOAT16"):
        register_compression_type(runtime_pb2.FLOAT16, "MINE", _Halves())


class _Recording(AveragerBase):
    """Counts its hook calls (in shared memory: they run in the averager process) and uses the seam's accessors."""

    def __init__(self, *args, **kwargs):
        self.calls = torch.zeros(2, dtype=torch.int64).share_memory_()  # run_step, download_state
        super().__init__(*args, **kwargs)

    async def run_step(self, **kwargs):
        self.calls[0] += 1
        self.set_target_group_size(5)
        self.skip_leaders(lambda leader: True)
        return await super().run_step(**kwargs)

    async def download_state(self, future, timeout=None):
        self.calls[1] += 1
        return await super().download_state(future, timeout=timeout)

    async def _report(self, future: MPFuture) -> None:
        skipped = await self._matchmaking._request_join_group(self.peer_id)  # skipped: no request is made
        self.refresh_potential_leaders()
        refresh = self._matchmaking.potential_leaders.update_triggered.is_set()
        future.set_result((type(self.p2p).__name__, self._matchmaking.target_group_size, skipped, refresh))


@pytest.mark.timeout(60)
def test_the_averager_hooks_and_accessors_work_in_a_running_averager():
    dht = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    averager = _Recording([torch.zeros(4)], dht, start=False, prefix="seam", allreduce_timeout=7.0)
    try:
        averager.start()  # not run_in_background: hivemind's makes this process ignore Ctrl+C for good
        averager.wait_until_ready()
        assert averager.allreduce_timeout == 7.0 and averager.averaged_tensors[0].shape == (4,)
        assert averager.load_state_from_peers(timeout=10) is None  # nobody to download from
        control = averager.step(wait=False, timeout=30)
        deadline = time.monotonic() + 20
        while control.stage != AveragingStage.LOOKING_FOR_GROUP:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert cancel_step(control)
        with pytest.raises((asyncio.CancelledError, Exception)):
            control.result(timeout=10)
        assert averager.calls.tolist() == [1, 1]
        report = MPFuture()
        averager.run_in_averager_process("_report", future=report)
        assert report.result(timeout=10) == ("P2P", 5, None, True)
    finally:
        averager.shutdown()
        dht.shutdown()


# ---- nothing outside the seam touches hivemind's privates ----

SCANNED = ("peers", "tscale_p2p", "cli", "tui", "kernels", "benchmarks", "tests")
SEAM_FILES = {ROOT / "peers" / "hivemind_seam.py", Path(__file__).resolve()}
PRIVATE_NAMES = sorted(
    {name for _, name, _ in PRIVATE_HOOKS if name.startswith("_")}
    | {name for _, names in PRIVATE_ATTRIBUTES + DECLARED_ATTRIBUTES for name in names}
)
PRIVATE_USE = re.compile(
    r"(?:\.|def )(?:" + "|".join(map(re.escape, PRIVATE_NAMES)) + r")\b"
    r"|\b_BASE_COMPRESSION_TYPES\b|\.Name\s*=(?!=)"  # (the enum patch: `CompressionType.Name = ...`)
)


# A module can reach hivemind's objects only by importing hivemind or our subclasses of its classes; others may
# well have a `_step` of their own.
REACHES_HIVEMIND = re.compile(r"^\s*(?:from|import) (?:hivemind|tscale_p2p\.peers\.(?:averaging|codec))\b", re.M)


def test_no_private_hivemind_name_is_used_outside_the_seam():
    found = []
    for folder in SCANNED:
        for path in sorted((ROOT / folder).rglob("*.py")):
            text = path.read_text()
            if path.resolve() in SEAM_FILES or not REACHES_HIVEMIND.search(text):
                continue
            for number, line in enumerate(text.splitlines(), 1):
                if PRIVATE_USE.search(line):
                    found.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert not found, "private hivemind names outside peers/hivemind_seam.py:\n" + "\n".join(found)


def test_the_scan_catches_private_uses():
    for line in ("sent = container._input_parts_by_peer[peer_index][part_index][0]",
                 "await super()._step(step=step, future_for_init=future_for_init)",
                 "    async def _accumulate_parts_streaming(self, stream, sender_index):",
                 "if control._trigger is not None:", "serialization._BASE_COMPRESSION_TYPES.setdefault(name, codec)",
                 "runtime_pb2.CompressionType.Name = name"):
        assert PRIVATE_USE.search(line), line
    assert not PRIVATE_USE.search("runtime_pb2.CompressionType.Name(part.compression) == name")
    assert not PRIVATE_USE.search("self._step_finished.set()")  # our own names that merely start alike
