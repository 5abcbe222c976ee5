"""The methods ``fxplan compare`` measures: how each turns a model into the module whose step is measured.

A :class:`Method` has a name (the report's row), a family (``baseline``, ``peer`` or ``fxplan``) and a
``prepare(ctx) -> Prepared`` function. The driver (:mod:`fxplan.compare.driver`) measures what ``prepare``
returns; nothing here measures anything.

Method names: ``vanilla``; ``checkpoint_sequential``; ``torch.compile@F`` (``activation_memory_budget``
F); ``sac-ilp@F`` (PyTorch's automatic selective checkpointing, ``torch.distributed._tools.sac_ilp``, at the budget
F of the way from the smallest its ILP meets to the unplanned peak, both in its own memory model);
``hf-checkpointing`` (Hugging Face's own checkpointing, transformers only); ``auto-checkpoint``
(:func:`fxplan.auto_checkpoint` on a copy of the model, at its smallest peak); fxplan's ``chen``,
``approx-time``, ``approx-memory``, ``exact-time``, ``exact-memory`` at the smallest budget each reaches
(Kusumoto et al. 2019, Table 1); and trade-off curve points ``approx-time@P`` and ``chen@P``: fxplan
at the budget P of the way from the smallest feasible peak to vanilla's (0 = smallest, 1 = vanilla's).
"""

from __future__ import annotations

import contextlib
import signal
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._pytree import tree_map

from fxplan.capture.fakes import model_copy
from fxplan.common.console import format_bytes, format_count
from fxplan.compare import peers, torch_sac
from fxplan.errors import FxplanError
from fxplan.measure.meter import GiB, measure_step

#: fxplan's methods: row name -> (strategy, solver). ``chen`` is Chen et al.'s plan (strategy ignored).
FXPLAN_METHODS = {
    "chen": ("time", "chen"),
    "approx-time": ("time", "approx"),
    "approx-memory": ("memory", "approx"),
    "exact-time": ("time", "exact"),
    "exact-memory": ("memory", "exact"),
}
DEFAULT_COMPILE_BUDGETS = (0.75, 0.5, 0.25)
#: One point between the smallest peak and vanilla's by default: each point is two more methods planned, measured
#: and timed (``--curve-points 0.25,0.5,0.75`` draws more of the curve).
DEFAULT_CURVE_POINTS = (0.5,)
DEFAULT_SAC_BUDGETS = (0.5,)
#: A training step as a multiple of its forward pass, for predicted step-time ratios: the backward pass
#: takes about twice the forward (1.7-1.9x measured on ResNet-50, batch 16, 112², 2-core CPU).
STEP_FORWARDS = 3.0


class MethodTimeout(FxplanError):
    """A method's preparation (e.g. the exact DP) ran past its time limit."""

    progress_status = "timed out"


@dataclass
class Prepared:
    """What a method's ``prepare`` returns: the module to run, and what it knows about itself."""

    module: torch.nn.Module
    info: dict[str, Any] = field(default_factory=dict)   # Row fields to set (budget, plan numbers, note)
    fake_meter: bool = True                               # may be measured on fake tensors
    real_module: torch.nn.Module | None = None            # module for real steps, if not a copy of module


@dataclass
class Context:
    """One network being compared: the model, its inputs at both batches, and shared intermediate results.

    ``small_inputs`` is None for a model measured on fake tensors only (no real step can run).
    """

    network: str
    model: torch.nn.Module
    loss_fn: Callable[[Any], torch.Tensor]
    paper_inputs: tuple                  # fake tensors at the main batch
    small_inputs: tuple | None           # real tensors at the small batch, on ``device``
    device: torch.device
    time_limit: float | None
    vanilla_peak: int | None = None
    cache: dict[str, Any] = field(default_factory=dict)


@dataclass
class Method:
    name: str
    family: str
    prepare: Callable[[Context], Prepared]
    main: bool = True

    @property
    def series(self) -> str:
        """The name without its ``@`` suffix: ``approx-time@0.5`` belongs to ``approx-time``."""
        return self.name.split("@")[0]


@contextlib.contextmanager
def time_limit(seconds: float | None) -> Iterator[None]:
    """Raise :class:`MethodTimeout` in the block after ``seconds`` (SIGALRM; main thread on Unix only)."""
    usable = seconds and hasattr(signal, "setitimer") and threading.current_thread() is threading.main_thread()
    if not usable:
        yield
        return

    def handler(signum, frame):
        raise MethodTimeout(f"timed out after {seconds:g} s")

    old = signal.signal(signal.SIGALRM, handler)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


# ------------------------------------------------------------------------------------------------ peers


def _vanilla(ctx: Context) -> Prepared:
    return Prepared(peers.vanilla(ctx.model), {"budget": "-"})


def _checkpoint_sequential(ctx: Context) -> Prepared:
    module = peers.checkpoint_sequential_peer(ctx.model)
    n = len(module.chain)
    return Prepared(module, {"budget": f"{format_count(module.segments, 'segment')} of {format_count(n, 'step')}",
                             "segments": module.segments})


def _hf_checkpointing(ctx: Context) -> Prepared:
    module = peers.hf_checkpointing_peer(ctx.model)
    return Prepared(module, {"budget": "every layer checkpointed"})


def real_copy(module: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    """A copy of ``module`` on ``device`` for real steps."""
    return model_copy(module).to(device)


def _compiled(fraction: float) -> Callable[[Context], Prepared]:
    def prepare(ctx: Context) -> Prepared:
        if ctx.small_inputs is None:
            raise peers.NotApplicable("not applicable: compiled code is measured on a real step only, and this "
                                      "model is too large for one (fake tensors only)")
        real_model = real_copy(ctx.model, ctx.device)
        module = peers.compile_peer(real_model, fraction)
        start = time.perf_counter()
        module.warm_up(ctx.small_inputs, ctx.loss_fn)
        return Prepared(module, {
            "budget": f"activation_memory_budget={fraction:g}", "plan_seconds": time.perf_counter() - start,
            "note": "compiled code is invisible to the fake-tensor meter: measured at the small batch only",
        }, fake_meter=False, real_module=module)

    return prepare


def _sac_ilp(fraction: float) -> Callable[[Context], Prepared]:
    def prepare(ctx: Context) -> Prepared:
        # a model too large for real steps cannot have its ops timed on real tensors: their roofline instead
        mode = torch_sac.CPU_ROOFLINE if ctx.small_inputs is None else None
        start = time.perf_counter()
        module = peers.sac_ilp_peer(ctx.model, ctx.paper_inputs, ctx.loss_fn, fraction, runtime_mode=mode)
        plan = module.fxplan_sac
        return Prepared(module, {
            "budget": f"sac_milp {format_bytes(plan.budget_bytes)} ({fraction:g} of the way from "
                      f"{format_bytes(plan.smallest_budget_bytes)} to {format_bytes(plan.baseline_peak_bytes)})",
            "plan_seconds": time.perf_counter() - start, "segments": len(plan.discard),
            "note": f"{format_count(len(plan.discard), 'checkpointed module')} chosen by torch's sac_milp "
                    f"({plan.runtime_mode} op times); the real steps run the same decisions at the small batch"})

    return prepare


# ----------------------------------------------------------------------------------------------- fxplan


def _fxplan(strategy: str, solver: str, point: float | None = None) -> Callable[[Context], Prepared]:
    """fxplan at the smallest feasible budget (as in Table 1), or at ``point`` of the way from it to vanilla.

    A model fxplan cannot capture raises :class:`fxplan.TraceError` here; the driver turns it into an
    error row that quotes the message.
    """

    def prepare(ctx: Context) -> Prepared:
        from fxplan.api import rewrite

        budget_gb = None
        label = "smallest feasible"
        if point is not None:
            lo, hi = _min_budget(ctx), ctx.vanilla_peak
            if hi is None:
                raise FxplanError("vanilla's peak is unknown, so no budget between it and the minimum can be set")
            budget_bytes = int(lo + point * (hi - lo))
            budget_gb = budget_bytes / GiB
            label = format_bytes(budget_bytes)
        start = time.perf_counter()
        with time_limit(ctx.time_limit if solver == "exact" else None):
            module = rewrite(ctx.model, budget_gb, example_inputs=ctx.paper_inputs, strategy=strategy,
                             solver=solver, loss_fn=ctx.loss_fn)
        seconds = time.perf_counter() - start
        plan = getattr(module, "fxplan_plan", None)
        info: dict[str, Any] = {"budget": label, "plan_seconds": seconds}
        if plan is not None:
            info.update(predicted_peak_bytes=plan.predicted_peak_bytes, budget_bytes=plan.budget_bytes,
                        planned_recompute_fraction=plan.recomputed_fraction, solve_seconds=plan.solve_seconds,
                        segments=len(plan.segments))
            extra, forward = plan.predicted_extra_seconds, plan.predicted_forward_seconds
            if extra is not None and forward:
                info.update(predicted_extra_seconds=extra,
                            predicted_time_ratio=1 + extra / (STEP_FORWARDS * forward))
        real = _planned_for_small_batch(ctx, module, strategy, solver, point)
        if real is not None:
            info["note"] = ("the captured graph is specialised to the main batch's input shapes (torch.export), "
                            "so the real steps run a plan made the same way for the small batch")
        return Prepared(module, info, real_module=real)

    return prepare


def _auto_checkpoint(ctx: Context) -> Prepared:
    """The plan applied to a copy of the model's own modules, at the smallest peak it reaches there."""
    from fxplan.apply.auto import auto_checkpoint

    start = time.perf_counter()
    module = auto_checkpoint(model_copy(ctx.model), example_inputs=ctx.paper_inputs, loss_fn=ctx.loss_fn)
    applied = module.fxplan_plan
    return Prepared(module, {
        "budget": "smallest feasible", "plan_seconds": time.perf_counter() - start,
        "planned_recompute_fraction": applied.recompute_fraction, "segments": len(applied.regions),
        "note": f"{format_count(len(applied.regions), 'checkpointed module')} of the model's own; the real steps run "
                "the same decisions at the small batch"})


def _planned_for_small_batch(ctx: Context, module: torch.nn.Module, strategy: str, solver: str,
                             point: float | None) -> torch.nn.Module | None:
    """A module planned for the small batch where ``module``'s plan would not run at it, else None.

    Without it the real steps of an export-captured model would run its original forward and be
    reported as fxplan's. The small-batch plan sits at the same place between that batch's smallest
    peak and vanilla's as the main plan does.
    """
    from fxplan.api import min_budget_bytes, rewrite
    from fxplan.rewriter.codegen import SegmentedModule

    if ctx.small_inputs is None or not isinstance(module, SegmentedModule):
        return None
    small = tree_map(lambda x: x.cpu() if isinstance(x, torch.Tensor) else x, ctx.small_inputs)
    if module.unplanned_reason(*small) is None:
        return None
    budget_bytes = None
    if point is not None:
        lo = min_budget_bytes(ctx.model, small, solver=solver, loss_fn=ctx.loss_fn)
        hi = measure_step(ctx.model, small, fake=True, loss_fn=ctx.loss_fn).peak_bytes
        budget_bytes = int(lo + point * (hi - lo))
    with time_limit(ctx.time_limit if solver == "exact" else None):
        real = rewrite(ctx.model, budget_bytes=budget_bytes, example_inputs=small, strategy=strategy,
                       solver=solver, loss_fn=ctx.loss_fn)
    return real if ctx.device.type == "cpu" else real_copy(real, ctx.device)


def _min_budget(ctx: Context) -> int:
    if "min_budget" not in ctx.cache:
        from fxplan.planner.planning import predicted_min_budget_bytes

        ctx.cache["min_budget"] = predicted_min_budget_bytes(ctx.model, ctx.paper_inputs, solver="approx")
    return ctx.cache["min_budget"]


# ------------------------------------------------------------------------------------------- choosing


def default_methods(
    compile_budgets: Sequence[float] = DEFAULT_COMPILE_BUDGETS,
    curve_points: Sequence[float] = DEFAULT_CURVE_POINTS,
    *,
    exact: bool = True,
    sac_budgets: Sequence[float] = DEFAULT_SAC_BUDGETS,
) -> list[Method]:
    """Vanilla, the peers (``sac-ilp`` at each of ``sac_budgets``), fxplan's plan applied to the model's modules and
    its five rewrites, then extra trade-off points (approx-time and chen at budgets ``curve_points`` of the way from
    the smallest feasible budget to vanilla's peak)."""
    methods = [Method("vanilla", "baseline", _vanilla),
               Method("checkpoint_sequential", "peer", _checkpoint_sequential),
               Method("hf-checkpointing", "peer", _hf_checkpointing)]
    methods += [Method(f"torch.compile@{f:g}", "peer", _compiled(f)) for f in compile_budgets]
    methods += [Method(f"sac-ilp@{f:g}", "peer", _sac_ilp(f)) for f in sac_budgets]
    methods.append(Method("auto-checkpoint", "fxplan", _auto_checkpoint))
    for name, (strategy, solver) in FXPLAN_METHODS.items():
        if exact or solver != "exact":
            methods.append(Method(name, "fxplan", _fxplan(strategy, solver)))
    for p in curve_points:
        methods.append(Method(f"approx-time@{p:g}", "fxplan", _fxplan("time", "approx", p), main=False))
        methods.append(Method(f"chen@{p:g}", "fxplan", _fxplan("time", "chen", p), main=False))
    return methods


def select_methods(methods: Sequence[Method], wanted: Sequence[str]) -> list[Method]:
    """The methods named in ``wanted`` (a name, or a series such as ``torch.compile`` for every budget),
    with vanilla first whatever was asked: reductions and time ratios are relative to it.

    Raises :class:`FxplanError` naming every unknown name and the valid ones.
    """
    names = {m.name for m in methods} | {m.series for m in methods}
    unknown = [w for w in wanted if w not in names]
    if unknown:
        valid = ", ".join(dict.fromkeys(m.series for m in methods))
        raise FxplanError(f"unknown method {', '.join(map(repr, unknown))}; valid methods: {valid} "
                          "(a series name selects all its budgets, e.g. torch.compile)")
    chosen = [m for m in methods if m.name in wanted or m.series in wanted]
    return [m for m in methods if m.name == "vanilla" and m not in chosen] + chosen


__all__ = [
    "Context", "DEFAULT_COMPILE_BUDGETS", "DEFAULT_CURVE_POINTS", "DEFAULT_SAC_BUDGETS", "FXPLAN_METHODS", "Method",
    "MethodTimeout", "Prepared", "default_methods", "real_copy", "select_methods", "time_limit",
]
