"""Peak memory and time of one training step, measured rather than modelled.

The meter is a live-storage tracker: a ``TorchDispatchMode`` that sees every op output, records the
untyped storage behind it (keyed by ``storage._cdata``, since fake storages have no data pointer) and
forgets it when the storage dies (``weakref.finalize``) or follows it when Python code resizes it in place
(``UntypedStorage.resize_``: FSDP2 gathers a layer's parameters into storages it grows before the layer runs
and shrinks to nothing after). A sharded tensor (``DTensor``) counts as its local shard. Summing the bytes of
live storages gives the same peak as the CPU allocator, and under ``FakeTensorMode`` it gives that peak without
allocating anything, so a step far larger than the machine can be measured in seconds. What a kernel allocates and
frees inside itself (its scratch, :mod:`fxplan.measure.scratch`) is added while the op runs.

On CUDA, :func:`measure_step` reads the caching allocator's statistics instead.
"""

from __future__ import annotations

import contextlib
import itertools
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

try:
    from torch.distributed.tensor import DTensor
except ImportError:  # a torch built without distributed
    DTensor = ()

from fxplan.capture.capturers import as_call
from fxplan.capture.fakes import (
    DATA_DEPENDENT,
    caches_kept_real,
    data_dependent_error,
    fake_copy,
    fake_mode_of,
    has_fake,
    model_copy,
    tensor_attributes,
    to_fake,
)
from fxplan.capture.guards import is_compiled, is_sharded
from fxplan.errors import FxplanError
from fxplan.measure.scratch import METADATA_QUERIES, call_figures, charged_bytes, output_storages, storage_bytes

GiB = 1024**3
MiB = 1024**2

#: Categories of the breakdown, in display order.
CATEGORIES = ("parameters", "gathered parameters", "buffers", "inputs", "activations", "gradients",
              "backward temporaries", "kernel scratch")
BACKWARD, SCRATCH, GATHERED = "backward temporaries", "kernel scratch", "gathered parameters"


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The tensor whose storage a process holds for ``t``: a ``DTensor``'s local shard, else ``t``."""
    return t._local_tensor if isinstance(t, DTensor) else t


class _StorageResizes:
    """Reports in-place storage resizes (``UntypedStorage.resize_``, called from Python) to the trackers active
    now. The method is wrapped while at least one tracker is active and restored after the last one exits."""

    def __init__(self):
        self.trackers: list[StorageTracker] = []
        self._own = self._original = None

    def enter(self, tracker: StorageTracker) -> None:
        if not self.trackers:
            self._own = torch.UntypedStorage.__dict__.get("resize_")  # None where it is StorageBase's
            self._original = original = torch.UntypedStorage.resize_

            def resize_(storage, size):
                out = original(storage, size)
                for t in self.trackers:
                    t.resized(storage)
                return out

            torch.UntypedStorage.resize_ = resize_
        self.trackers.append(tracker)

    def exit(self, tracker: StorageTracker) -> None:
        self.trackers.remove(tracker)
        if not self.trackers:
            if self._own is None:
                del torch.UntypedStorage.resize_
            else:
                torch.UntypedStorage.resize_ = self._own


_RESIZES = _StorageResizes()


class StorageTracker(TorchDispatchMode):
    """Counts the bytes of every live tensor storage and the running peak.

    Storages that exist before tracking starts (parameters, inputs, ...) are added with
    :meth:`register`. Every storage that an op creates while the mode is active is charged to the current
    ``phase`` (a category name) and released when it is freed. ``peak_breakdown`` is the per-category
    split of live bytes at the moment of the peak.
    """

    def __init__(self, phase: str = "activations", device: torch.device | None = None):
        super().__init__()
        self.phase = phase
        self.device = device  # where a storage that was not tracked but grows in place is charged
        self.current_bytes = 0
        self.peak_bytes = 0
        # storage key -> (bytes, category, serial); keys are addresses and get reused, serials never.
        self._live: dict[int, tuple[int, str, int]] = {}
        self._serials = itertools.count()
        self._by_category: dict[str, int] = {}
        self.peak_breakdown: dict[str, int] = {}
        self.timeline: list[tuple[str, int]] | None = None
        # Serials of backward-created storages live at the peak, to tell gradients from temporaries later.
        self._backward_live: set[int] = set()
        self.peak_backward_serials: frozenset[int] = frozenset()

    def __enter__(self):
        _RESIZES.enter(self)
        return super().__enter__()

    def __exit__(self, *exc):
        _RESIZES.exit(self)
        return super().__exit__(*exc)

    def resized(self, storage: torch.UntypedStorage) -> None:
        """Follow an in-place resize of ``storage``: a tracked one counts its new size; one that was not tracked
        and grew (FSDP2's unsharded parameters, made when the model was sharded) counts from now on as
        gathered parameters."""
        key = storage._cdata
        entry = self._live.get(key)
        if entry is None:
            if storage.nbytes():
                self._add(storage, GATHERED, charged_bytes(storage.nbytes(), self.device))
            return
        nbytes, category, serial = entry
        new = charged_bytes(storage.nbytes(), self.device) if storage.nbytes() else 0
        self._live[key] = (new, category, serial)
        self._by_category[category] += new - nbytes
        self.current_bytes += new - nbytes
        self._note_peak()

    def register(self, tensor: torch.Tensor, category: str) -> None:
        """Count an existing tensor's storage under ``category`` (once per storage; of a DTensor, its shard)."""
        tensor = local_tensor(tensor)
        self._add(tensor.untyped_storage(), category, storage_bytes(tensor))

    def record_timeline(self) -> None:
        """Keep (op name, live bytes) after every op, for memory-timeline plots."""
        self.timeline = []

    def _add(self, storage: torch.UntypedStorage, category: str, nbytes: int) -> None:
        """Count ``storage`` as ``nbytes`` (what the device's allocator takes for it, the real kernel's size where a
        fake one differs: :mod:`fxplan.measure.scratch`)."""
        key = storage._cdata
        if key in self._live:
            return
        serial = next(self._serials)
        self._live[key] = (nbytes, category, serial)
        self._by_category[category] = self._by_category.get(category, 0) + nbytes
        self.current_bytes += nbytes
        if category == BACKWARD:
            self._backward_live.add(serial)
        weakref.finalize(storage, self._release, key)
        self._note_peak()

    def _note_peak(self, scratch: int = 0) -> None:
        """A new peak if the live bytes, with ``scratch`` a kernel holds beside them, exceed it."""
        if self.current_bytes + scratch > self.peak_bytes:
            self.peak_bytes = self.current_bytes + scratch
            self.peak_breakdown = {**self._by_category, SCRATCH: scratch} if scratch else dict(self._by_category)
            self.peak_backward_serials = frozenset(self._backward_live)

    def _release(self, key: int) -> None:
        entry = self._live.pop(key, None)
        if entry is not None:
            nbytes, category, serial = entry
            self.current_bytes -= nbytes
            self._by_category[category] -= nbytes
            self._backward_live.discard(serial)

    def live_entry(self, tensor: torch.Tensor) -> tuple[int, str, int] | None:
        """(bytes, category, serial) of a live tracked tensor's storage, or None."""
        return self._live.get(local_tensor(tensor).untyped_storage()._cdata)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func in METADATA_QUERIES:
            return out
        figures = call_figures(func, args, kwargs)
        outputs = [local_tensor(t) for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        for storage, nbytes in output_storages(figures, outputs):
            self._add(storage, self.phase, nbytes)
        self._note_peak(figures.scratch)  # the kernel held it beside its outputs
        if self.timeline is not None:
            self.timeline.append((str(func.overloadpacket.__name__), self.current_bytes))
        return out


@contextlib.contextmanager
def track_memory(*existing: torch.Tensor, phase: str = "activations") -> Iterator[StorageTracker]:
    """Track live tensor storages inside the ``with`` block.

    ``existing`` tensors (e.g. parameters and inputs) are counted from the start. Read
    ``tracker.peak_bytes`` and ``tracker.current_bytes`` inside or after the block.
    """
    tracker = StorageTracker(phase)
    for t in existing:
        tracker.register(t, "inputs")
    with tracker:
        yield tracker


@dataclass
class StepStats:
    """What one forward + backward step cost.

    ``peak_bytes`` counts every tensor the step holds: parameters, buffers, inputs, activations,
    gradients and backward temporaries. ``breakdown`` splits the live bytes at the peak moment by those
    categories. ``meter`` says which meter produced the numbers.
    """

    peak_bytes: int
    breakdown: dict[str, int]
    seconds: float
    meter: str
    timeline: list[tuple[str, int]] | None = field(default=None, repr=False)

    @property
    def peak_gib(self) -> float:
        return self.peak_bytes / GiB

    def table(self) -> str:
        """A readable two-column breakdown."""
        rows = [f"{'category':<22}{'MiB':>12}"]
        for name in CATEGORIES:
            if self.breakdown.get(name):
                rows.append(f"{name:<22}{self.breakdown[name] / MiB:>12.1f}")
        rows.append(f"{'peak':<22}{self.peak_bytes / MiB:>12.1f}")
        return "\n".join(rows)


def default_loss(output: Any) -> torch.Tensor:
    """Sum of every floating-point tensor in the output: a loss whose gradient touches every output."""
    leaves = [t for t in tree_leaves(output) if isinstance(t, torch.Tensor) and t.is_floating_point()]
    if not leaves:
        raise FxplanError("the model returned no floating-point tensor; pass loss_fn= to measure_step")
    loss = leaves[0].sum()
    for t in leaves[1:]:
        loss = loss + t.sum()
    return loss


def measure_step(
    model: torch.nn.Module,
    example_inputs: Sequence[Any],
    *,
    fake: bool = False,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    timeline: bool = False,
    shard: Callable[[torch.nn.Module], Any] | None = None,
) -> StepStats:
    """Measure the peak bytes and wall time of one forward + backward of ``model`` on ``example_inputs``.

    The step is the one a training loop runs, in the state the model is in::

        out = model(*example_inputs); loss = loss_fn(out); loss.backward()

    with ``out`` still referenced while backward runs, and with the gradients the model already
    holds (``.grad`` of its parameters, e.g. when gradients are accumulated over steps without
    ``zero_grad``) counted from the start and added into, as autograd does. A model whose ``.grad``
    are None (after ``zero_grad()``) gets new ones during backward.

    The step runs on a private copy of the model, so the caller's parameters, gradients and buffers
    (e.g. BatchNorm running statistics) are left untouched. With ``fake=True`` the copy and the inputs
    are fake tensors and nothing is allocated; the peak is exact all the same. On CUDA models (not fake)
    the allocator's ``max_memory_allocated`` is the meter.

    A ``torch.compile``d module is measured as it runs compiled: a real step after one that compiles it, on
    the CPU by torch.profiler's allocation events, which see compiled kernels' buffers. With ``fake=True`` it
    is refused (fake tensors would run its eager code).

    ``shard`` measures the step as one rank of a sharded run holds it. It is the training script's own function
    that shards a module in place (FSDP2's ``fully_shard`` on each layer, then on the root); it is called on the
    private fake copy, and the step runs on that copy: the parameters and gradients a rank holds are its shards, and
    each layer's parameters count while FSDP2 holds them gathered. ``example_inputs`` is one rank's batch. The
    process group must be initialised (the run's own, or a ``fake`` one to plan on one process); the collectives
    of a fake step exchange nothing, so a rank measures without the others.
    """
    loss_fn = loss_fn or default_loss
    call = as_call(example_inputs)
    inputs = (call.args, call.kwargs)
    if not isinstance(model, torch.nn.Module):
        raise FxplanError(f"measure_step needs an nn.Module, got {type(model).__name__}")
    if shard is not None:
        return _measure_sharded(model, inputs, loss_fn, shard, timeline)
    fake_mode = fake_mode_of(model, inputs) if fake or has_fake(model, inputs) else None
    if is_compiled(model):
        return _measure_compiled(model, call, loss_fn, fake_mode is not None)
    if fake_mode is not None:
        with caches_kept_real():
            return measure_fake(fake_copy(model, fake_mode), to_fake(inputs, fake_mode), fake_mode, loss_fn, timeline)
    device = device_of(model, inputs)
    if device.type == "cuda":
        return cuda_step_stats(real_copy(model), inputs, loss_fn, device)
    return _measure_tracked(real_copy(model), inputs, loss_fn, timeline, f"live storages ({device.type})")


def _measure_sharded(model: torch.nn.Module, inputs: tuple[tuple, dict[str, Any]],
                     loss_fn: Callable[[Any], torch.Tensor], shard: Callable[[torch.nn.Module], Any],
                     timeline: bool) -> StepStats:
    """:func:`measure_step` with ``shard`` (its docstring): a fake step of a fake copy sharded by ``shard``."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        raise FxplanError("shard= measures the step as one rank of a sharded run holds it: initialise the process "
                          "group first (torch.distributed.init_process_group), as the training script does")
    if is_compiled(model) or is_sharded(model):
        raise FxplanError(f"shard= shards a copy of {type(model).__name__} itself: give the module before it is "
                          "sharded or compiled")
    fake_mode = fake_mode_of(model, inputs)
    with caches_kept_real():
        copy = fake_copy(model, fake_mode)
        shard(copy)
        return measure_fake(copy, to_fake(inputs, fake_mode), fake_mode, loss_fn, timeline)


def _measure_compiled(model: torch.nn.Module, call: Any, loss_fn: Callable[[Any], torch.Tensor],
                      fake: bool) -> StepStats:
    """:func:`measure_step` of a compiled module (its docstring): the step after a warm-up step that compiles."""
    if fake:
        raise FxplanError(f"{type(model._orig_mod).__name__} is compiled (torch.compile): a step on fake tensors "
                          "would measure its eager code; measure it with fake=False, or the module before compiling")
    compiled = real_copy(model)
    grads = [None if p.grad is None else p.grad.clone() for p in compiled.parameters()]
    loss_fn(compiled(*call.args, **call.kwargs)).backward()  # compiles forward and backward, not measured
    for p, g in zip(compiled.parameters(), grads):
        p.grad = g
    device = device_of(compiled, (call.args, call.kwargs))
    if device.type == "cuda":
        return cuda_step_stats(compiled, (call.args, call.kwargs), loss_fn, device)
    start = time.perf_counter()
    peak = profiled_step_peak(compiled, call, loss_fn)
    return StepStats(peak, {}, time.perf_counter() - start, "torch.profiler allocation events (compiled)")


def measure_fake(model: torch.nn.Module, inputs: tuple[tuple, dict[str, Any]], fake_mode: FakeTensorMode,
                 loss_fn: Callable[[Any], torch.Tensor] | None = None, timeline: bool = False) -> StepStats:
    """:func:`measure_step` with ``fake=True`` of a model whose state is fake tensors of ``fake_mode`` already
    (a :func:`fxplan.capture.fakes.fake_copy`), on fake ``(args, kwargs)``: the step runs on the model itself.

    Where many modules generated over one fake copy are measured (:mod:`fxplan.planner.search`) this saves a copy
    per step: for a rewritten module, a second code generation and every parameter made again. The
    parameters' ``.grad`` are put back afterwards, so every step starts as the first did (buffers written
    in place, such as BatchNorm statistics, hold no values and keep their shapes).
    """
    grads = [(p, p.grad) for p in model.parameters()]
    try:
        with fake_mode:
            return _measure_tracked(model, inputs, loss_fn or default_loss, timeline, "fake tensors")
    except DATA_DEPENDENT as exc:
        raise data_dependent_error(exc, f"one training step of {type(model).__name__}") from exc
    finally:
        for p, g in grads:
            p.grad = g


def real_copy(model: torch.nn.Module) -> torch.nn.Module:
    """``copy.deepcopy(model)`` with the parameters' ``.grad`` copied too (deepcopy drops them)."""
    out = model_copy(model)
    for p, q in zip(model.parameters(), out.parameters()):
        if p.grad is not None and q.grad is None:
            q.grad = p.grad.detach().clone()
    return out


def existing_grads(model: torch.nn.Module) -> list[torch.Tensor]:
    """The gradients the model's parameters hold now (each storage once)."""
    return [p.grad for p in model.parameters() if p.grad is not None]


@contextlib.contextmanager
def fresh_autocast_cache() -> Iterator[None]:
    """Run one training step as a training loop runs it under ``torch.autocast``: with the weight casts
    autocast caches made anew, not found cached by an earlier step in the same autocast region (a loop
    enters the region once per step; fxplan runs many steps inside the user's one), and not left cached
    after it. Outside autocast the cache is empty and this does nothing."""
    torch.clear_autocast_cache()
    try:
        yield
    finally:
        torch.clear_autocast_cache()


def _measure_tracked(model, inputs, loss_fn, timeline: bool, meter: str) -> StepStats:
    tracker = StorageTracker(device=device_of(model, inputs))
    if timeline:
        tracker.record_timeline()
    for p in model.parameters():
        tracker.register(p, "parameters")
    for b in [*model.buffers(), *tensor_attributes(model)]:
        tracker.register(b, "buffers")
    for g in existing_grads(model):
        tracker.register(g, "gradients")
    for t in tree_leaves(inputs):
        if isinstance(t, torch.Tensor):
            tracker.register(t, "inputs")
    start = time.perf_counter()
    with fresh_autocast_cache(), tracker:
        tracker.phase = "activations"
        out = model(*inputs[0], **inputs[1])
        loss = loss_fn(out)
        tracker.phase = BACKWARD
        loss.backward()  # ``out`` is still referenced, as in a training loop
        del loss, out
    seconds = time.perf_counter() - start
    return StepStats(tracker.peak_bytes, _breakdown_at_peak(tracker, existing_grads(model)), seconds, meter,
                     tracker.timeline)


def _breakdown_at_peak(tracker: StorageTracker, grads: list[torch.Tensor]) -> dict[str, int]:
    """Live bytes per category at the peak; parameter gradients are only known as such after backward."""
    breakdown = dict(tracker.peak_breakdown)
    grad_entries = {tracker.live_entry(g) for g in grads} - {None}
    moved = sum(nbytes for nbytes, _, serial in grad_entries if serial in tracker.peak_backward_serials)
    if moved:
        breakdown[BACKWARD] -= moved
        breakdown["gradients"] = moved
    return {k: v for k, v in breakdown.items() if v}


def cuda_step_stats(model, inputs, loss_fn, device: torch.device) -> StepStats:
    """One real step of ``model`` (run in place) on ``inputs`` = ``(args, kwargs)``, the output held through
    backward as in a training loop, measured by the caching allocator's ``max_memory_allocated`` (plus what
    existed before the step)."""
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    resident = resident_bytes(model, inputs)
    start = time.perf_counter()
    with fresh_autocast_cache():
        out = model(*inputs[0], **inputs[1])
        loss = loss_fn(out)
        loss.backward()
    torch.cuda.synchronize(device)
    seconds = time.perf_counter() - start
    del loss, out
    peak = torch.cuda.max_memory_allocated(device) - base + resident
    breakdown = {"parameters": resident, "activations": peak - resident}
    return StepStats(peak, breakdown, seconds, "cuda allocator")


def resident_bytes(model: torch.nn.Module, inputs) -> int:
    """Bytes of the distinct storages of the model's parameters, their existing gradients, its buffers (and
    tensors held as attributes, :func:`~fxplan.capture.fakes.tensor_attributes`) and the inputs: what a step holds
    from its start (of a sharded tensor, this process's shard)."""
    seen: dict[int, int] = {}
    tensors = [*model.parameters(), *existing_grads(model), *model.buffers(), *tensor_attributes(model),
               *[t for t in tree_leaves(inputs) if isinstance(t, torch.Tensor)]]
    for t in tensors:
        t = local_tensor(t)
        seen[t.untyped_storage()._cdata] = storage_bytes(t)
    return sum(seen.values())


def device_of(model: torch.nn.Module, inputs) -> torch.device:
    """The device of the model's first parameter, else of the first input tensor; the CPU if none."""
    for t in [*model.parameters(), *tree_leaves(inputs)]:
        if isinstance(t, torch.Tensor):
            return t.device
    return torch.device("cpu")


def measure_step_profiler(
    model: torch.nn.Module,
    example_inputs: Sequence[Any],
    *,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
) -> StepStats:
    """Peak of one real step read from ``torch.profiler``'s allocation events: an independent meter.

    Runs on a private copy of ``model``; see :func:`profiled_step_peak`.
    """
    model = real_copy(model)
    start = time.perf_counter()
    peak = profiled_step_peak(model, example_inputs, loss_fn or default_loss)
    return StepStats(peak, {}, time.perf_counter() - start, "torch.profiler allocation events")


def profiled_step_peak(model: torch.nn.Module, inputs: Any, loss_fn: Callable[[Any], torch.Tensor]) -> int:
    """Peak bytes of one real step of ``model`` (run in place) from the allocator events the profiler records.

    It sees allocations the dispatch-level tracker cannot (inside ``torch.compile``d code, kernel
    workspaces), so it is the meter for compiled peers and the cross-check for :func:`measure_step`.
    Tensors that exist before the step (parameters, buffers, inputs) count as resident from the start.
    """
    from torch.profiler import ProfilerActivity, profile
    from torch.profiler._memory_profiler import Action

    call = as_call(inputs)
    with fresh_autocast_cache(), profile(activities=[ProfilerActivity.CPU], profile_memory=True,
                                         record_shapes=True, with_stack=True) as prof:
        out = model(*call.args, **call.kwargs)
        loss = loss_fn(out)
        loss.backward()  # with ``out`` referenced, as in a training loop
        del loss, out
    resident = resident_bytes(model, (call.args, call.kwargs))
    try:
        timeline = prof._memory_profile().timeline
    except AssertionError:  # torch's data-flow analysis of the events gives up (FSDP2's collectives)
        return resident + _peak_of_allocations(prof)
    current = peak = 0
    for _, action, _, size in timeline:
        if action in (Action.PREEXISTING, Action.CREATE):
            current += size
        elif action == Action.DESTROY:
            current -= size
        peak = max(peak, current)
    # Tensors created before profiling started and never touched are invisible to the profiler.
    return max(peak, resident)


def _peak_of_allocations(prof: Any) -> int:
    """The largest sum of bytes allocated and not yet freed during a profile, from its raw allocation events in
    time order, on every thread: what the step added to what it started with."""
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events() if e.name() == "[memory]")
    current = peak = 0
    for _, nbytes in events:
        current += nbytes
        peak = max(peak, current)
    return peak
