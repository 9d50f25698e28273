"""CPU offload of the optimizer: fp32 master weights and AdamW state in host RAM, working weights on the GPU.

Where the bytes of one parameter live (bf16 working weights, `delay` d):

    GPU    working weight (2); its gradient (2) until copied out: as produced in the backward, or with
           gradient accumulation summed on the device until the step's last micro-batch (`device_passes`)
    host   fp32 master (4), AdamW moments (8), fp32 gradient accumulators (4 each, d + 1 of them),
           pinned transfer buffers: gradient staging (2), weight upload slots (2 each, d + 1 of them)

Only the transfer buffers are pinned: they are all the DMA engine touches, and pinning the masters and moments
too would lock 16 bytes per parameter of RAM for nothing.

One step, seen from the GPU: the forward runs unit by unit (the model's `execution_units()`: embedding, each
block, head). A forward pre-hook makes sure a unit's weights are the version this step needs before it runs,
copying them in from their upload slot on the upload stream, and prefetches every later unit already ready.
In backward each parameter's gradient, as soon as it is accumulated, is copied to the staging buffer on the
gradient stream (a post-accumulate-grad hook) and its GPU memory is released.

With gradient accumulation the gradients either stay on the device until the step's last micro-batch
(`device_passes`, one transfer per step) or leave after every micro-batch and are summed on the host in fp32.

Seen from the host: the gradient thread adds the staged gradients into an fp32 accumulator; `step()` hands it
to the update thread, which clips (by the norm the device measured as the gradients left it, when they left in
one pass), runs torch's fused CPU AdamW unit by unit in forward order and casts each unit's new masters into an
upload slot, where the forward picks them up.

`delay` 0: step s trains on the weights after s updates, exactly like an ordinary optimizer; the update of step
s - 1 overlaps the forward of step s unit by unit (unit u waits only for unit u's update).
`delay` 1 (TScale's): step s trains on the weights after s - 1 updates, so a whole step hides the CPU update.

With a CPU "device" (tests) the same hooks, threads and buffers run; the copies are synchronous CPU copies and
there are no streams or events.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

import psutil
import torch
from torch import nn

from tscale_p2p.clipping import clip_in_optimizers
from tscale_p2p.errors import UserError

log = logging.getLogger(__name__)

MAX_DELAY = 1
_MASTER_AND_MOMENTS_BYTES = 4 + 8  # fp32 master, AdamW exp_avg and exp_avg_sq
_GRAD_BYTES = 4


def host_bytes_per_parameter(working_dtype: torch.dtype, delay: int) -> int:
    """Host RAM one parameter costs under offload (see the module docstring)."""
    copies = delay + 1
    working = torch.empty((), dtype=working_dtype).element_size()
    return _MASTER_AND_MOMENTS_BYTES + _GRAD_BYTES * copies + working * (1 + copies)


def check_host_memory(param_dtypes: Iterable[tuple[int, torch.dtype]], delay: int, mode: str) -> int:
    """Refuse (one line) to offload when the host lacks the RAM; returns the bytes needed.

    `param_dtypes` gives (number of elements, working dtype) for every parameter."""
    counts = list(param_dtypes)
    needed = sum(numel * host_bytes_per_parameter(dtype, delay) for numel, dtype in counts)
    available = psutil.virtual_memory().available
    if needed > available:
        params = sum(numel for numel, _ in counts)
        raise UserError(
            f"--offload {mode} needs {needed / 2**30:.1f} GiB of host RAM for {params / 1e9:.2f}B parameters "
            f"(fp32 masters, AdamW state, gradient and transfer buffers) but only {available / 2**30:.1f} GiB "
            f"is available; use a smaller --model or more RAM"
        )
    return needed


class _SideStream:
    """Copies ordered after the current stream's work on a side CUDA stream; plain copies on the CPU."""

    def __init__(self, device: torch.device) -> None:
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    @contextmanager
    def after_current(self):
        if self.stream is None:
            yield
            return
        self.stream.wait_stream(torch.cuda.current_stream(self.stream.device))
        with torch.cuda.stream(self.stream):
            yield

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src, non_blocking=self.stream is not None)

    def record(self) -> torch.cuda.Event | None:
        if self.stream is None:
            return None
        event = torch.cuda.Event(blocking=True)  # waiting host threads sleep instead of spinning a core
        event.record(self.stream)
        return event


@dataclass(eq=False)
class _Param:
    working: nn.Parameter  # the model's own Parameter, on the device in its working dtype
    master: torch.Tensor  # fp32, host
    grads: list[torch.Tensor]  # fp32 accumulators, one per step in flight
    staging: torch.Tensor  # pinned, working dtype: the gradient on its way out
    slots: list[torch.Tensor]  # pinned, working dtype: updated weights on their way in
    position: int = 0  # in model order: where its gradient's norm goes


@dataclass(eq=False)
class _Unit:
    modules: Sequence[nn.Module]
    params: list[_Param]
    optimizer: torch.optim.AdamW | None = None  # over this unit's masters
    groups: list[int] = field(default_factory=list)  # caller's group index of each inner group
    slot_versions: list[int] = field(default_factory=list)
    slot_events: list = field(default_factory=list)
    device_version: int = 0
    device_event: torch.cuda.Event | None = None  # upload the compute stream has yet to wait for


def _stop_threads(queues: Sequence[queue.Queue], threads: Sequence[threading.Thread]) -> None:
    """Let the host threads finish their jobs and end, in pipeline order (the gradient thread still feeds
    the update thread). Also run at interpreter exit, where a thread still working inside an OpenMP team
    makes the process abort ("terminate called without an active exception")."""
    for jobs, thread in zip(queues, threads):
        jobs.put(None)
        thread.join(timeout=60)


def _pinned_views(shapes: Sequence[torch.Size], dtype: torch.dtype, pin: bool) -> list[torch.Tensor]:
    """Views into one flat host buffer: one pinned allocation per unit, since pinned allocations are rounded
    up to a power of two each."""
    sizes = [s.numel() for s in shapes]
    flat = torch.empty(sum(sizes), dtype=dtype, pin_memory=pin)
    return [chunk.view(shape) for chunk, shape in zip(flat.split(sizes), shapes)]


class OffloadedAdamW:
    """AdamW whose fp32 masters and state live in host RAM and whose step runs on CPU threads.

    Drop-in for the trainer's `torch.optim.AdamW`: `param_groups` (set `lr` there), `step()`, `zero_grad()`,
    and a `state_dict()` in torch's AdamW format over the masters, so checkpoints move freely between
    offloaded and ordinary runs. `master_weights()` / `load_weights()` read and replace the fp32 weights.

    `units` lists the model's modules in execution order (each parameter in exactly one unit); `groups` are
    the caller's parameter groups (lists of the model's Parameters plus options, as for torch.optim.AdamW);
    `working_dtype(name, param)` picks each parameter's dtype on the device. The Parameters are moved to
    `device` in place (same objects, so modules sharing them keep working). `device_passes` backward passes
    are summed on the device (in the working dtype, by autograd) before each copy to the host: with gradient
    accumulation, the trainer's micro-batches per step trade 2 bytes/parameter of device memory for one
    transfer and one host pass per step instead of one per micro-batch.
    """

    def __init__(
        self,
        model: nn.Module,
        units: Sequence[Sequence[nn.Module]],
        groups: Sequence[Mapping],
        device: torch.device,
        working_dtype: Callable[[str, nn.Parameter], torch.dtype],
        *,
        lr: float,
        betas: tuple[float, float],
        grad_clip: float = 0.0,
        delay: int = 0,
        device_passes: int = 1,
    ) -> None:
        if not 0 <= delay <= MAX_DELAY:
            raise UserError(f"offload delay must be 0 or {MAX_DELAY}, got {delay}")
        self.device, self.delay, self.grad_clip = torch.device(device), delay, grad_clip
        self.device_passes = device_passes
        self._copies = delay + 1  # gradient accumulators and upload slots in flight
        names = {id(p): name for name, p in model.named_parameters()}
        group_of = {id(p): number for number, group in enumerate(groups) for p in group["params"]}
        pin = self.device.type == "cuda"

        self._units: list[_Unit] = []
        self._master_of: dict[str, torch.Tensor] = {}
        seen: set[int] = set()
        for modules in units:
            params = [p for m in modules for p in m.parameters() if id(p) not in seen]
            seen.update(id(p) for p in params)
            dtypes = {id(p): working_dtype(names[id(p)], p) for p in params}
            adopted = {}
            for dtype in sorted(set(dtypes.values()), key=str):  # one flat host buffer per dtype and purpose
                chosen = [p for p in params if dtypes[id(p)] == dtype]
                shapes = [p.shape for p in chosen]
                staging = _pinned_views(shapes, dtype, pin)
                slots = list(zip(*(_pinned_views(shapes, dtype, pin) for _ in range(self._copies))))
                for p, stage, slot in zip(chosen, staging, slots):
                    adopted[id(p)] = self._adopt(p, dtype, stage, list(slot))
            # model order, so gradient clipping sums the norms exactly as an ordinary run does
            unit = _Unit(modules=modules, params=[adopted[id(p)] for p in params])
            unit.slot_versions = [0] + [-1] * delay  # version 0, the initial weights, is on the device
            unit.slot_events = [None] * self._copies
            self._units.append(unit)
            for record in unit.params:
                self._master_of[names[id(record.working)]] = record.master
        missing = [name for name, p in model.named_parameters() if id(p) not in seen]
        if missing:
            raise ValueError(f"parameters outside every unit: {missing[:3]}")
        self._params = [record for unit in self._units for record in unit.params]
        for position, record in enumerate(self._params):
            record.position = position
        # For clipping, the norm of each gradient as it leaves the device, where reading it costs next to nothing
        # (on a 3B model the host's pass over the fp32 gradients took ~2 s a step, competing with AdamW for memory
        # bandwidth). Valid when a step's gradients leave in one pass; summed on the host from several passes
        # they need the host's norm.
        self._grad_norms = torch.zeros(len(self._params), device=self.device)
        self._grad_norm = torch.zeros((), device=self.device)
        self._grad_norm_host = torch.zeros((), pin_memory=pin)
        self._step_grad_norms: list[torch.Tensor | None] = [None] * self._copies  # per accumulator, from the device

        master = {id(r.working): r.master for r in self._params}
        outer = [{**group, "params": [master[id(p)] for p in group["params"]]} for group in groups]
        # The caller's view: torch's own AdamW over the masters. It never steps; it owns param_groups and
        # builds and loads state dicts in torch's format from the units' states.
        self._reference = torch.optim.AdamW(outer, lr=lr, betas=betas, fused=True)
        for unit in self._units:
            inner: dict[int, list[torch.Tensor]] = {}
            for record in unit.params:
                inner.setdefault(group_of[id(record.working)], []).append(record.master)
            unit.groups = sorted(inner)
            unit.optimizer = torch.optim.AdamW(
                [{**self._reference.param_groups[g], "params": inner[g]} for g in unit.groups], fused=True
            )

        self._upload = _SideStream(self.device)
        self._download = _SideStream(self.device)
        self._cond = threading.Condition()
        self._error: BaseException | None = None
        self._submitted = 0  # optimizer steps handed to the update thread
        self._copied_passes = 0  # gradient copy-outs since the last step()
        self._passes_on_device = 0  # backward passes whose gradients still sit, summed, on the device
        self._grads_pending = len(self._params)  # gradients of the current backward not yet produced
        self._backward_open = False
        self._staging_free = threading.Event()
        self._staging_free.set()
        self._accumulator_free = [threading.Event() for _ in range(self._copies)]
        for event in self._accumulator_free:
            event.set()
        # cumulative seconds: host work of each thread, and the device side waiting for the host; the update's
        # three parts (the norm for clipping, AdamW, the cast into the upload slots) are also kept apart
        self.timings = dict.fromkeys(["accumulate", "update", "update_norm", "update_adamw", "update_cast", "stall"], 0.0)
        self._grad_jobs: queue.Queue = queue.Queue()
        self._update_jobs: queue.Queue = queue.Queue()
        # Both threads keep torch's thread count, the caller's: each gets an OpenMP team of that size. Splitting
        # the cores between them measured slower on a 16-core host (benchmarks/history/offload.md).
        self._threads = [
            threading.Thread(target=self._run, args=(self._grad_jobs, self._accumulate), daemon=True,
                             name="offload-gradients"),
            threading.Thread(target=self._run, args=(self._update_jobs, self._update), daemon=True,
                             name="offload-update"),
        ]
        for thread in self._threads:
            thread.start()
        self._stop_threads = weakref.finalize(self, _stop_threads, (self._grad_jobs, self._update_jobs), self._threads)

        self._hooks = []
        for index, unit in enumerate(self._units):
            self._hooks.append(unit.modules[0].register_forward_pre_hook(self._pre_forward_hook(index)))
        for record in self._params:
            self._hooks.append(record.working.register_post_accumulate_grad_hook(self._grad_hook(record)))

    def _adopt(self, param: nn.Parameter, dtype: torch.dtype, staging, slots) -> _Param:
        if param.device.type != "cpu" or param.dtype != torch.float32:
            raise ValueError(f"offload expects fp32 CPU parameters to adopt as masters, got {param.dtype} on "
                             f"{param.device}")
        master = param.data
        param.data = master.to(self.device, dtype, copy=True)
        slots[0].copy_(master)
        grads = [torch.zeros_like(master) for _ in range(self._copies)]
        return _Param(working=param, master=master, grads=grads, staging=staging, slots=slots)

    # --- the caller's optimizer interface ------------------------------------------------------------

    @property
    def param_groups(self) -> list[dict]:
        return self._reference.param_groups

    def step(self) -> None:
        """Hand this step's gradients to the update thread; returns at once."""
        self._raise_if_failed()
        if self._grads_pending != len(self._params):
            raise RuntimeError(f"{self._grads_pending} parameters received no gradient in the last backward")
        if self._passes_on_device:
            raise RuntimeError(f"step() after {self._passes_on_device} backward passes whose gradients are still "
                               f"on the device (they are copied out every {self.device_passes})")
        if self._copied_passes == 0:
            raise RuntimeError("step() without a backward pass since the last step")
        options = [{k: v for k, v in group.items() if k != "params"} for group in self.param_groups]
        accumulator = self._submitted % self._copies
        self._submitted += 1
        self._copied_passes = 0
        self._grad_jobs.put(("seal", options, self._submitted, accumulator))

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Nothing to do: each gradient left the device as it was produced."""

    def wait(self) -> None:
        """Block until every submitted update is applied to the masters."""
        self._grad_jobs.join()
        self._update_jobs.join()
        self._raise_if_failed()

    def state_dict(self) -> dict:
        self.wait()
        self._reference.state.clear()
        for unit in self._units:
            self._reference.state.update((p, s) for p, s in unit.optimizer.state.items() if s)
        return self._reference.state_dict()

    def load_state_dict(self, state_dict: Mapping) -> None:
        self.wait()
        self._reference.load_state_dict(state_dict)
        for unit in self._units:
            for group, number in zip(unit.optimizer.param_groups, unit.groups):
                group.update({k: v for k, v in self.param_groups[number].items() if k != "params"})
            for record in unit.params:
                unit.optimizer.state[record.master] = self._reference.state[record.master]

    def master_weights(self) -> dict[str, torch.Tensor]:
        """The fp32 masters by parameter name (live tensors: copy them to keep them)."""
        self.wait()
        return dict(self._master_of)

    @torch.no_grad()
    def load_weights(self, weights: Mapping[str, torch.Tensor]) -> None:
        """Replace the masters and the device weights; every later step starts from these."""
        self.wait()
        missing = set(self._master_of) - set(weights)
        if missing:
            raise ValueError(f"weights lack {sorted(missing)[:3]}")
        for name, master in self._master_of.items():
            master.copy_(weights[name])
        current = self._submitted
        for unit in self._units:
            if unit.device_event is not None:  # a prefetched upload nobody waited for yet
                torch.cuda.current_stream(self.device).wait_event(unit.device_event)
            for record in unit.params:
                for slot in record.slots:
                    slot.copy_(record.master)
                record.working.copy_(record.master)
            # every version a later step may still ask for is now these weights
            unit.slot_versions = [current - (current - i) % self._copies for i in range(self._copies)]
            unit.slot_events = [None] * self._copies
            unit.device_version, unit.device_event = max(0, current - self.delay), None

    def close(self) -> None:
        """Stop the threads and remove the hooks (the model keeps its current device weights)."""
        self.wait()
        for hook in self._hooks:
            hook.remove()
        self._stop_threads()

    # --- the device side: hooks ---------------------------------------------------------------------

    def _pre_forward_hook(self, index: int):
        @torch.compiler.disable
        def hook(module, args):
            self._before_unit(index)

        return hook

    def _grad_hook(self, record: _Param):
        def hook(param: torch.Tensor) -> None:
            self._gradient_ready(record, param)

        return hook

    def _before_unit(self, index: int) -> None:
        """Make unit `index` hold the weights this step needs; prefetch the later units that are ready."""
        needed = max(0, self._submitted - self.delay)
        unit = self._units[index]
        if unit.device_version != needed:
            self._upload_unit(unit, needed, block=True)
            for later in self._units[index + 1 :]:
                if later.device_version != needed:
                    self._upload_unit(later, needed, block=False)
        if unit.device_event is not None:
            torch.cuda.current_stream(self.device).wait_event(unit.device_event)
            unit.device_event = None

    def _upload_unit(self, unit: _Unit, version: int, block: bool) -> None:
        slot = version % self._copies
        with self._cond:
            if block and unit.slot_versions[slot] < version:
                start = time.perf_counter()
                self._cond.wait_for(lambda: unit.slot_versions[slot] >= version or self._error is not None)
                self.timings["stall"] += time.perf_counter() - start
            self._raise_if_failed()
            if unit.slot_versions[slot] != version:
                if unit.slot_versions[slot] > version:
                    raise RuntimeError(f"upload slot overwritten before use: {unit.slot_versions[slot]} > {version}")
                return
        # through the Parameter, not .data: its version counter must move (the fp8/int8 weight caches key on it)
        with torch.no_grad(), self._upload.after_current():
            for record in unit.params:
                self._upload.copy(record.working, record.slots[slot])
            event = self._upload.record()
        with self._cond:
            unit.slot_events[slot] = event
        unit.device_version, unit.device_event = version, event

    def _gradient_ready(self, record: _Param, param: torch.Tensor) -> None:
        """Post-accumulate-grad hook: on the last of `device_passes` backward passes, copy the gradient to the
        host and free it on the device; on earlier ones leave it there for autograd to sum into."""
        copying = self._passes_on_device == self.device_passes - 1
        if copying:
            if not self._backward_open:
                start = time.perf_counter()
                self._staging_free.wait()  # the gradient thread has consumed the previous copy
                self.timings["stall"] += time.perf_counter() - start
                self._raise_if_failed()
                self._staging_free.clear()
                self._backward_open = True
            grad = param.grad
            if self.grad_clip > 0:
                torch.linalg.vector_norm(grad, dtype=torch.float32, out=self._grad_norms[record.position])
            with self._download.after_current():
                self._download.copy(record.staging, grad)
            if self._download.stream is not None:
                grad.record_stream(self._download.stream)  # keep its memory until the copy has read it
            param.grad = None
        self._grads_pending -= 1
        if self._grads_pending == 0:  # this backward pass is complete
            self._grads_pending = len(self._params)
            if not copying:
                self._passes_on_device += 1
                return
            first = self._copied_passes == 0
            if self.grad_clip > 0:
                torch.linalg.vector_norm(self._grad_norms, out=self._grad_norm)  # as torch's get_total_norm
                with self._download.after_current():
                    self._download.copy(self._grad_norm_host, self._grad_norm)
            self._grad_jobs.put(("accumulate", self._download.record(), first, self._submitted % self._copies))
            self._copied_passes += 1
            self._passes_on_device = 0
            self._backward_open = False

    # --- the host side: two threads -----------------------------------------------------------------

    def _run(self, jobs: queue.Queue, handle: Callable) -> None:
        while True:
            job = jobs.get()
            try:
                if job is None:
                    return
                if self._error is None:
                    handle(*job)
            except BaseException as error:  # surfaced on the caller's thread at its next call
                log.exception("offload thread failed")
                with self._cond:
                    self._error = error
                    self._cond.notify_all()
                self._staging_free.set()
                for event in self._accumulator_free:
                    event.set()
            finally:
                jobs.task_done()

    @torch.no_grad()
    def _accumulate(self, kind: str, *args) -> None:
        if kind == "seal":  # this step's gradients are complete: on to the update thread
            options, version, accumulator = args
            self._accumulator_free[accumulator].clear()
            self._update_jobs.put((options, version, accumulator))
            return
        event, first, accumulator = args
        if first:
            self._accumulator_free[accumulator].wait()  # the update `delay` steps back is done reading it
        if event is not None:
            event.synchronize()
        if self.grad_clip > 0:  # the device's norm is the step's only if this pass is the step's only one
            self._step_grad_norms[accumulator] = self._grad_norm_host.clone() if first else None
        start = time.perf_counter()
        for record in self._params:
            if first:
                record.grads[accumulator].copy_(record.staging)
            else:
                record.grads[accumulator].add_(record.staging)
        self.timings["accumulate"] += time.perf_counter() - start
        self._staging_free.set()

    @torch.no_grad()
    def _update(self, options: list[dict], version: int, accumulator: int) -> None:
        start = time.perf_counter()
        for record in self._params:
            record.master.grad = record.grads[accumulator]
        if self.grad_clip > 0:
            norm = self._step_grad_norms[accumulator]
            if norm is None:
                norm = torch.nn.utils.get_total_norm([r.master.grad for r in self._params])
            clip_in_optimizers([unit.optimizer for unit in self._units], norm, self.grad_clip)
        clipped = time.perf_counter()
        self.timings["update_norm"] += clipped - start
        slot = version % self._copies
        for unit in self._units:  # in execution order, so the next forward can start on the first units
            for group, number in zip(unit.optimizer.param_groups, unit.groups):
                group.update(options[number])
            adamw = time.perf_counter()
            unit.optimizer.step()
            cast = time.perf_counter()
            self.timings["update_adamw"] += cast - adamw
            with self._cond:
                event = unit.slot_events[slot]
            if event is not None:
                event.synchronize()  # the upload that last read this slot has finished
            for record in unit.params:
                record.slots[slot].copy_(record.master)
            self.timings["update_cast"] += time.perf_counter() - cast
            with self._cond:
                unit.slot_versions[slot] = version
                self._cond.notify_all()
        for record in self._params:
            record.master.grad = None
        self.timings["update"] += time.perf_counter() - start
        self._accumulator_free[accumulator].set()

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise RuntimeError("the offload optimizer thread failed") from self._error
