"""``fxplan.rewrite`` and ``fxplan.plan``: plans held to measured memory, one answer for one budget.

Both run the same measured search (:mod:`fxplan.planner.search`): a fixed set of candidate plans, each
predicted by replaying its step and measured on fake tensors (:func:`fxplan.measure_step`, exact)
when it may fit, and the candidate of least recomputation whose measured peak fits the budget.
``plan`` returns that plan; ``rewrite`` the generated module that runs it. :class:`LazyRewrite` does
the same on the first call when no example inputs were given.
"""

from __future__ import annotations

import collections
import functools
import inspect
import logging
import time
import types
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import torch

from fxplan.apply import rewritten_parts
from fxplan.apply.applied import PartialPlan
from fxplan.apply.partial import data_dependent_cause
from fxplan.capture import effects
from fxplan.capture.capturers import CallInterface, Captured, ExampleCall, as_call, capture, symbolic_trace_module
from fxplan.capture.fakes import DATA_DEPENDENT, caches_kept_real, has_fake, refusing_data_dependent
from fxplan.capture.guards import host_generators_kept
from fxplan.capture.regions import with_regions
from fxplan.common import collector, heartbeat
from fxplan.common.console import format_bytes, format_count
from fxplan.costs.host_link import host_link
from fxplan.costs.trace import trace
from fxplan.errors import FxplanError
from fxplan.measure.meter import device_of, measure_step
from fxplan.planner.offloading import OffloadSearch
from fxplan.planner.planning import check_choices, host_limit, whole_step_budget
from fxplan.planner.variants import Searches
from fxplan.rewriter.codegen import SegmentedModule, segment_module
from fxplan.solvers.costgraph import CostGraph
from fxplan.solvers.plans import Plan, recompute_note, regions_recomputed

logger = logging.getLogger("fxplan")


@refusing_data_dependent
@caches_kept_real()
def rewrite(
    model: torch.nn.Module,
    budget_gb: float | None = None,
    *,
    example_inputs: Sequence[Any] | None = None,
    strategy: str = "time",
    solver: str = "approx",
    plan: Plan | PartialPlan | None = None,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    budget_bytes: int | None = None,
    offload: bool = False,
    host_bytes: int | None = None,
) -> torch.nn.Module:
    """A drop-in replacement of ``model`` that recomputes activations so one training step fits the budget.

    The budget is the peak of one whole training step as :func:`fxplan.measure_step` measures it (the
    step a training loop runs: the output is held while backward runs, existing ``.grad`` count), in
    GiB (``budget_gb``) or bytes (``budget_bytes``); with neither, the smallest peak fxplan reaches.
    With ``example_inputs`` (real or fake tensors) the model is planned now and a
    :class:`~fxplan.rewriter.codegen.SegmentedModule` (a ``torch.fx.GraphModule``) is returned; without them a
    module is returned that plans on the first call of each input shape (:class:`LazyRewrite`).
    ``plan`` skips planning and uses the given plan as is (measured when example inputs are given).
    ``loss_fn(output)`` is the loss used when measuring (default: sum of the outputs).
    ``offload=True`` adds the third choice: a value the forward keeps for backward may be kept in host memory
    instead, and brought back before backward reads it (:mod:`fxplan.planner.offloading`); the budget is then of
    the device's bytes, and ``host_bytes`` bounds the host copies (None: no bound).

    The result is the plan of least recomputation whose measured peak fits (:mod:`fxplan.planner.search`); it
    carries ``fxplan_plan`` (replayed and measured peak, recompute fraction, segments) and
    ``fxplan_measured_peak_bytes``. Raises :class:`BudgetError` whose ``min_feasible_bytes`` is the
    smallest measured peak fxplan reaches with ``solver``; that many bytes, as a budget, succeed.

    A model whose step does not capture as a whole, for data-dependent Python in its forward, is rewritten in parts
    (:mod:`fxplan.apply.rewritten_parts`): the result is then of the model's own class, with its submodules that
    capture rewritten and the rest running as the model's code runs it, and ``fxplan_plan`` is a
    :class:`~fxplan.apply.applied.PartialPlan` naming both, with the whole step's peak measured on real steps.
    """
    if not isinstance(model, torch.nn.Module):
        raise FxplanError(f"fxplan.rewrite needs an nn.Module, got {type(model).__name__}")
    model = original_model(model)
    if isinstance(plan, PartialPlan):
        if example_inputs is None:
            raise FxplanError("a plan in parts is applied to the parts a step calls: give example_inputs")
        return rewritten_parts.apply_in_parts(model, plan, as_call(example_inputs),
                                              functools.partial(_rewritten_with, measure=False), loss_fn)
    if plan is not None:
        return _rewritten_with(model, plan, example_inputs, loss_fn=loss_fn)
    budget = whole_step_budget(budget_gb, budget_bytes)
    check_choices(strategy, solver)
    host = host_limit(offload, host_bytes)
    if example_inputs is None:
        return LazyRewrite(model, budget, strategy=strategy, solver=solver, loss_fn=loss_fn, offload=offload,
                           host_limit=host)
    return fit_budget(model, example_inputs, budget, strategy=strategy, solver=solver, loss_fn=loss_fn,
                      offload=offload, host_limit=host)


@refusing_data_dependent
def plan(
    model: torch.nn.Module,
    example_inputs: Sequence[Any],
    *,
    budget_gb: float | None = None,
    strategy: str = "time",
    solver: str = "approx",
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    budget_bytes: int | None = None,
    offload: bool = False,
    host_bytes: int | None = None,
) -> Plan | PartialPlan:
    """The plan ``fxplan.rewrite`` would run for this budget: the same search, the same answer.

    ``strategy``: ``"time"`` (least recomputation within the budget) or ``"memory"`` (lowest peak,
    Kusumoto et al. section 4.4). ``solver``: ``"approx"`` (pruned lower sets, fast), ``"exact"`` (all
    lower sets) or ``"chen"`` (Chen et al.'s Algorithm 3). The plan's ``predicted_peak_bytes`` is the
    replayed whole-step peak and ``measured_peak_bytes`` the measured one (fake tensors: nothing is
    allocated). Raises :class:`BudgetError` with ``min_feasible_bytes`` (measured bytes) if nothing fits.
    ``offload`` and ``host_bytes`` as for :func:`rewrite`. For a model that ``rewrite`` rewrites in parts, the
    :class:`~fxplan.apply.applied.PartialPlan` it applies.
    """
    budget = whole_step_budget(budget_gb, budget_bytes)
    check_choices(strategy, solver)
    module = fit_budget(original_model(model), example_inputs, budget, strategy=strategy, solver=solver,
                        loss_fn=loss_fn, offload=offload, host_limit=host_limit(offload, host_bytes))
    return module.fxplan_plan


def original_model(model: torch.nn.Module) -> torch.nn.Module:
    """The model a module that fxplan made stands for (a rewritten module, a :class:`LazyRewrite`), else
    ``model``: planning or rewriting a rewritten module plans the model it was made from (its graph holds
    segments, not the model's nodes, which no plan names). Same modules, parameters and train/eval mode."""
    original = model.__dict__.get("_fxplan_original")
    if original is None and not isinstance(model, (SegmentedModule, LazyRewrite)):
        return model
    if original is None:
        raise FxplanError(f"{type(model).__name__} is a module fxplan rewrote from a torch.fx graph, not from a "
                          "model: plan or rewrite the graph module it was made from")
    original.training = model.training
    return original


def _rewritten_with(model: torch.nn.Module, plan: Plan, example_inputs: Sequence[Any] | None, *,
                    loss_fn: Callable[[Any], torch.Tensor] | None = None, measure: bool = True) -> SegmentedModule:
    """``model`` rewritten with ``plan``, made before; its peak measured on fake tensors where ``example_inputs``
    are given and ``measure``."""
    captured = _captured_for(model, example_inputs)
    gm = with_regions(captured, plan.regions).gm if plan.regions else captured.gm
    _check_fits(gm, plan, type(model).__name__)
    module = segment_module(gm, plan.segments, plan.children, plan.offloaded)
    measured, host = None, plan.host_peak_bytes
    if example_inputs is not None and measure:
        stats = measure_step(module, example_inputs, fake=True, loss_fn=loss_fn)
        measured, host = stats.peak_bytes, stats.host_peak_bytes if plan.offloaded else None
    module.fxplan_plan = replace(plan, measured_peak_bytes=measured, host_peak_bytes=host)
    module.fxplan_measured_peak_bytes = measured
    return module


def _check_fits(gm: torch.fx.GraphModule, plan: Plan, model_name: str) -> None:
    """An FxplanError saying why, where ``plan``'s segments do not name exactly the compute nodes of ``gm`` (the
    graph of this model and call): a plan applies to the model it was made for (same class and configuration, any
    parameter values) called with inputs of the same structure."""
    nodes = [n.name for n in gm.graph.nodes if effects.is_compute(n)]
    named = [name for segment in plan.segments for name in segment]
    unknown = sorted(set(named) - set(nodes))
    missing = sorted(set(nodes) - set(named))
    if unknown or missing:
        parts = [f"names {format_count(len(unknown), 'node')} this graph does not have (e.g. {unknown[:3]})"
                 if unknown else "",
                 f"leaves out {len(missing)} of its {'node' if len(missing) == 1 else 'nodes'} (e.g. {missing[:3]})"
                 if missing else ""]
        raise FxplanError(f"the plan does not fit {model_name} called with these inputs: it "
                          f"{' and '.join(p for p in parts if p)}. A plan applies to the model it was made for (same "
                          "class and configuration) called with inputs of the same structure (the same arguments "
                          "given, the same train/eval mode); plan this model (fxplan.plan) instead")


@refusing_data_dependent
@caches_kept_real()
@collector.spared()
def min_budget_bytes(model: torch.nn.Module, example_inputs: Sequence[Any], *, solver: str = "approx",
                     loss_fn: Callable[[Any], torch.Tensor] | None = None) -> int:
    """The smallest measured peak (bytes, whole step) fxplan reaches with ``solver``: the smallest budget
    ``fxplan.rewrite`` accepts, and what its :class:`BudgetError` reports."""
    model = original_model(model)
    return Searches(_traced(model, example_inputs, solver), model, example_inputs, solver=solver,
                    loss_fn=loss_fn).lowest()


def _traced(model: torch.nn.Module, example_inputs: Sequence[Any], solver: str) -> CostGraph:
    """The cost graph the search plans on: the savers of units of recomputed inputs probed, as every search but
    Chen's also plans the graphs with units (:mod:`fxplan.planner.variants`)."""
    return trace(model, example_inputs, probe_units=solver != "chen")


def _captured_for(model: torch.nn.Module, example_inputs: Sequence[Any] | None) -> Captured:
    """The capture a given plan runs on: the inputs' capture, or ``symbolic_trace`` without inputs."""
    if example_inputs is not None:
        return capture(model, example_inputs)
    gm = symbolic_trace_module(model)
    if gm is model:  # a GraphModule given: planned as it is
        return Captured(gm, "symbolic_trace", None)
    # the rewritten module then has the model's signature and output types, as with example inputs
    interface = CallInterface(model, ExampleCall((), {}), flat=False, output_types=gm.meta.get("fxplan_output_types"))
    gm.meta["fxplan_call"] = (model, interface)
    return Captured(gm, "symbolic_trace", interface)


@refusing_data_dependent
@caches_kept_real()
@collector.spared()
def fit_budget(
    model: torch.nn.Module,
    example_inputs: tuple[Any, ...],
    budget_bytes: int | None,
    *,
    strategy: str,
    solver: str,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    offload: bool = False,
    host_limit: int | None = None,
    in_parts: bool = True,
) -> torch.nn.Module:
    """Trace, search (:mod:`fxplan.planner.search`; with ``offload``, :mod:`fxplan.planner.offloading`) and return
    the chosen plan's module for ``budget_bytes``; where the model does not capture as a whole for data-dependent
    Python and ``in_parts``, the model rewritten in parts (:mod:`fxplan.apply.rewritten_parts`).

    Says what it is doing on the ``fxplan`` logger at INFO level (a large model takes minutes): the trace,
    then the plan chosen, with seconds and fake-tensor steps, and every ``HEARTBEAT_S`` seconds in between the
    stage it is in (:mod:`fxplan.common.heartbeat`)."""
    # fake steps run the model's own forward, which may draw from Python's or numpy's generators (SpecAugment)
    with heartbeat.beating(f"planning {type(model).__name__}"), host_generators_kept():
        try:
            return _fit(model, example_inputs, budget_bytes, strategy=strategy, solver=solver, loss_fn=loss_fn,
                        offload=offload, host_limit=host_limit)
        except (FxplanError, *DATA_DEPENDENT) as exc:  # data-dependent Python: rewritten in the parts that capture
            if not in_parts or data_dependent_cause(exc, model) is None or offload or has_fake(model, example_inputs):
                raise
            fit = functools.partial(_fit_part, strategy=strategy, solver=solver)
            apply = functools.partial(_rewritten_with, measure=False)
            return rewritten_parts.rewrite_in_parts(model, as_call(example_inputs), budget_bytes, exc, fit, apply,
                                                    loss_fn)


def _fit_part(module: torch.nn.Module, call: ExampleCall, budget_bytes: int | None, *, strategy: str,
              solver: str) -> SegmentedModule:
    """One part of a model rewritten in parts (:mod:`fxplan.apply.rewritten_parts`), as a whole model is."""
    return fit_budget(module, call, budget_bytes, strategy=strategy, solver=solver, in_parts=False)


def _fit(model: torch.nn.Module, example_inputs: tuple[Any, ...], budget_bytes: int | None, *, strategy: str,
         solver: str, loss_fn: Callable[[Any], torch.Tensor] | None, offload: bool,
         host_limit: int | None) -> SegmentedModule:
    t0 = time.perf_counter()
    heartbeat.stage("capturing and tracing the model")
    cg = _traced(model, example_inputs, solver)
    logger.info("fxplan: traced %s with %s: %d nodes, %.1f s; planning for %s", type(model).__name__,
                cg.graph["captured"].method, cg.number_of_nodes(), time.perf_counter() - t0,
                "the smallest peak" if budget_bytes is None else f"a budget of {format_bytes(budget_bytes)}")
    t1 = time.perf_counter()
    heartbeat.stage("searching the candidate plans")
    searches = Searches(cg, model, example_inputs, solver=solver, loss_fn=loss_fn)
    if offload:
        return _fit_with_offload(searches, budget_bytes, strategy, host_limit, t1)
    chosen = searches.choose(budget_bytes, strategy)
    module = chosen.variant.result(chosen.candidate, budget_bytes)
    plan = module.fxplan_plan
    logger.info("fxplan: %s%s, recompute %.1f%%%s, measured peak %s; planned in %.1f s (%s, %d measured on fake "
                "tensors)", format_count(plan.num_segments, "segment"),
                f", {regions_recomputed(plan.regions)} recomputed in backward" if plan.regions else "",
                100 * plan.recompute_fraction, recompute_note(plan.recompute_fraction, plan),
                format_bytes(chosen.measured), time.perf_counter() - t1,
                format_count(searches.candidates, "candidate plan"), searches.steps)
    logger.debug("fxplan: the measured steps dispatched %d ATen calls", searches.work.ops)
    note = budget_note(plan)
    if note:
        logger.info("fxplan: %s", note)
    return module


def _fit_with_offload(searches: Searches, budget_bytes: int | None, strategy: str, host_limit: int | None,
                      start: float) -> SegmentedModule:
    search = OffloadSearch(searches, host_link(device_of(searches.model, searches.inputs)), host_limit)
    module = search.choose(budget_bytes, strategy)
    plan = module.fxplan_plan
    logger.info("fxplan: %s, recompute %.1f%%, %s offloaded (%s on the host), measured device peak %s; planned in "
                "%.1f s (%d measured on fake tensors)", format_count(plan.num_segments, "segment"),
                100 * plan.recompute_fraction, format_count(len(plan.offloaded), "value"),
                format_bytes(plan.host_peak_bytes or 0), format_bytes(plan.measured_peak_bytes),
                time.perf_counter() - start, searches.steps)
    return module


def budget_note(plan: Plan) -> str | None:
    """The sentence to tell a user whose budget is at or above the unplanned peak, else None. A plan that recomputes
    nothing is chosen exactly when the step as the model runs it fits the budget (the search takes the plan of least
    recomputation that fits), and its measured peak is then the unplanned peak."""
    if plan.budget_bytes is None or plan.measured_peak_bytes is None or plan.recompute_fraction or plan.regions:
        return None
    return (f"the budget of {format_bytes(plan.budget_bytes)} is at or above the unplanned peak of one training step "
            f"({format_bytes(plan.measured_peak_bytes)} measured): nothing needs recomputing, and the plan runs the "
            "step as the model does; a lower budget saves memory")


class LazyRewrite(torch.nn.Module):
    """``fxplan.rewrite`` without example inputs: plans on the first training call of each input shape.

    The plans of the last :data:`SHAPES_KEPT` shapes are kept, so a loader's last, smaller batch or a return to
    an earlier sequence length runs a plan made before instead of planning again.

    It owns the original module tree under the original names (same ``state_dict`` keys), and its ``forward``
    has the original's signature (``inspect.signature``, which Hugging Face ``Trainer`` reads). In ``eval()`` mode
    or under ``torch.no_grad()`` it runs the original forward and plans nothing.
    """

    def __init__(self, model: torch.nn.Module, budget_bytes: int | None, *, strategy: str, solver: str,
                 loss_fn: Callable[[Any], torch.Tensor] | None, offload: bool = False, host_limit: int | None = None):
        super().__init__()
        self.__dict__["_modules"] = model._modules
        self.__dict__["_parameters"] = model._parameters
        self.__dict__["_buffers"] = model._buffers
        self.__dict__["_non_persistent_buffers_set"] = model._non_persistent_buffers_set
        self.__dict__["_fxplan_original"] = model
        self._settings = dict(budget_bytes=budget_bytes, strategy=strategy, solver=solver, loss_fn=loss_fn,
                              offload=offload, host_limit=host_limit)
        self._shapes: tuple | None = None
        self._planned: collections.OrderedDict[tuple, torch.nn.Module] = collections.OrderedDict()
        self._sign_forward()

    def _sign_forward(self) -> None:
        """An instance ``forward`` with the original model's signature that runs :meth:`forward` (a method of
        the class has one signature for all instances)."""
        try:
            signature = inspect.signature(self._fxplan_original.forward)
        except (TypeError, ValueError):
            return

        def forward(this: LazyRewrite, *args: Any, **kwargs: Any) -> Any:
            return LazyRewrite.forward(this, *args, **kwargs)

        this = inspect.Parameter("self", inspect.Parameter.POSITIONAL_ONLY)
        forward.__signature__ = signature.replace(parameters=[this, *signature.parameters.values()])
        self.__dict__["forward"] = types.MethodType(forward, self)

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state.pop("forward", None)  # a function of this instance: made again on loading
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self._sign_forward()

    @property
    def fxplan_module(self) -> torch.nn.Module | None:
        """The rewritten module of the input shapes of the last training call (None before the first)."""
        return self._planned.get(self._shapes)

    @property
    def fxplan_plan(self) -> Plan | None:
        return None if self.fxplan_module is None else self.fxplan_module.fxplan_plan

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        original = self._fxplan_original
        original.training = self.training
        if not (self.training and torch.is_grad_enabled()):
            return original(*args, **kwargs)
        shapes = _shape_key(args, kwargs)
        if shapes != self._shapes:
            module = self._module_for(shapes, args, kwargs)
            self._shapes = shapes
        else:
            module = self.fxplan_module
        module.training = self.training
        return module(*args, **kwargs)


    def _module_for(self, shapes: tuple, args: tuple, kwargs: dict[str, Any]) -> torch.nn.Module:
        """The rewritten module planned for these input shapes: kept from before, or planned now."""
        module = self._planned.get(shapes)
        if module is not None:
            logger.info("fxplan: input shapes %s planned before; running that plan", shapes)
            self._planned.move_to_end(shapes)
            return module
        if self._shapes is None:
            logger.info("fxplan: planning for input shapes %s", shapes)
        else:
            logger.warning("fxplan: input shapes changed from %s to %s; planning for them (plans kept for %d "
                           "shapes)", self._shapes, shapes, min(len(self._planned) + 1, SHAPES_KEPT))
        module = fit_budget(self._fxplan_original, ExampleCall(args, kwargs), **self._settings)
        self._planned[shapes] = module
        if len(self._planned) > SHAPES_KEPT:
            self._planned.popitem(last=False)
        return module


#: How many input shapes a lazily planned module keeps plans for.
SHAPES_KEPT = 8


def _shape_key(args: Sequence[Any], kwargs: dict[str, Any]) -> tuple:
    leaves = torch.utils._pytree.tree_leaves((tuple(args), kwargs))
    return tuple((tuple(t.shape), str(t.dtype), str(t.device)) if isinstance(t, torch.Tensor) else repr(t)
                 for t in leaves)
