"""Peak memory and time of one training step, measured rather than modelled.

The meter is the live-storage tracker of :mod:`fxplan.measure.tracker`, run over one step of a private copy of the
model; under ``FakeTensorMode`` it gives the step's peak without allocating anything, so a step far larger than the
machine can be measured in seconds. On CUDA, :func:`measure_step` reads the caching allocator's statistics instead,
and a compiled module is measured by torch.profiler's allocation events.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._pytree import tree_leaves

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
from fxplan.measure.scratch import storage_bytes
from fxplan.measure.tracker import BACKWARD, CATEGORIES, StorageTracker, local_tensor

GiB = 1024**3
MiB = 1024**2

@dataclass
class StepStats:
    """What one forward + backward step cost.

    ``peak_bytes`` counts every tensor the step holds: parameters, buffers, inputs, activations,
    gradients and backward temporaries. ``breakdown`` splits the live bytes at the peak moment by those
    categories. ``meter`` says which meter produced the numbers. ``host_peak_bytes`` is the most that the host
    copies of offloaded values held at once (:mod:`fxplan.rewriter.offload`), apart from ``peak_bytes``.
    ``ops`` is how many ATen calls the metered step dispatched (0 where the meter does not see them).
    """

    peak_bytes: int
    breakdown: dict[str, int]
    seconds: float
    meter: str
    timeline: list[tuple[str, int]] | None = field(default=None, repr=False)
    host_peak_bytes: int = 0
    ops: int = 0

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
                     tracker.timeline, tracker.host_peak_bytes, tracker.ops)


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
