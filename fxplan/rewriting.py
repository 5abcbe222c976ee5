"""``fxplan.rewrite``: plan, generate code, and hold the plan to measured memory.

The solvers predict memory with a model; :func:`fit_budget` measures each candidate rewrite on fake
tensors (:func:`fxplan.measure_step`, exact) and searches the solver's budget until the measured peak
of one step fits the user's budget. :class:`LazyRewrite` does the same on the first call when no
example inputs were given.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import torch

from fxplan.capture import ExampleCall, capture
from fxplan.codegen import SegmentedModule, segment_module
from fxplan.costgraph import CostGraph
from fxplan.errors import BudgetError, FxplanError
from fxplan.measure import GiB, measure_step
from fxplan.planning import (
    budget_to_bytes,
    check_choices,
    min_budget_bytes_graph,
    plan_graph,
    resident_bytes,
    solve_graph,
)
from fxplan.plans import Plan
from fxplan.trace import trace, trace_module

logger = logging.getLogger("fxplan")


#: Rounds of bisection over the solver's budget when its first plan overshoots the measured budget.
BISECTION_ROUNDS = 6


def rewrite(
    model: torch.nn.Module,
    budget_gb: float | None = None,
    *,
    example_inputs: Sequence[Any] | None = None,
    strategy: str = "time",
    solver: str = "approx",
    plan: Plan | None = None,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
) -> torch.nn.Module:
    """A drop-in replacement of ``model`` that recomputes activations so one training step fits ``budget_gb``.

    With ``example_inputs`` (real or fake tensors) the model is planned now and a
    :class:`~fxplan.codegen.SegmentedModule` (a ``torch.fx.GraphModule``) is returned; without them a
    module is returned that plans on its first call and re-plans when input shapes change.
    ``budget_gb=None`` asks for the smallest feasible budget. ``plan`` skips planning and uses the given
    plan as is. ``loss_fn(output)`` is the loss used when measuring (default: sum of the outputs).

    The budget is held to *measured* memory: each candidate plan is measured with
    :func:`fxplan.measure_step` on fake tensors, and the solver's budget is bisected until the measured
    peak fits with the least recomputation (:func:`fit_budget`). The result carries ``fxplan_plan``
    (predicted and measured peak, recompute fraction, segments) and ``fxplan_measured_peak_bytes``.
    Raises :class:`BudgetError` whose ``min_feasible_bytes`` is the smallest measured peak reached.
    """
    if not isinstance(model, torch.nn.Module):
        raise FxplanError(f"fxplan.rewrite needs an nn.Module, got {type(model).__name__}")
    if plan is not None:
        gm = trace_module(model) if example_inputs is None else capture(model, example_inputs).gm
        return _attach(segment_module(gm, plan.segments), plan, None)
    budget_bytes = budget_to_bytes(budget_gb)
    check_choices(strategy, solver)
    if example_inputs is None:
        return LazyRewrite(model, budget_bytes, strategy=strategy, solver=solver, loss_fn=loss_fn)
    return fit_budget(model, example_inputs, budget_bytes, strategy=strategy, solver=solver, loss_fn=loss_fn)


def _attach(module: SegmentedModule, chosen: Plan, measured: int | None) -> SegmentedModule:
    module.fxplan_plan = replace(chosen, measured_peak_bytes=measured)
    module.fxplan_measured_peak_bytes = measured
    return module


def fit_budget(
    model: torch.nn.Module,
    example_inputs: tuple[Any, ...],
    budget_bytes: int | None,
    *,
    strategy: str,
    solver: str,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
) -> SegmentedModule:
    """Plan, rewrite and measure until the measured peak of one step is within ``budget_bytes``.

    The solver's memory model is a prediction. The budget given to the solver is bisected, measuring
    each candidate plan, and the plan with the largest solver budget (least recomputation) whose
    measured peak fits is returned: above the user's budget when the model over-predicts, between the
    solver's smallest feasible budget and the user's when it under-predicts.
    """
    module = _fit(trace(model, example_inputs), model, example_inputs, budget_bytes, strategy=strategy,
                  solver=solver, loss_fn=loss_fn)
    module.fxplan_plan = replace(module.fxplan_plan, budget_bytes=budget_bytes)
    return module


def _fit(cg: CostGraph, model, example_inputs, budget_bytes: int | None, *, strategy: str, solver: str,
         loss_fn) -> SegmentedModule:
    measured: dict[tuple[int | None, str], tuple[SegmentedModule, int] | None] = {}

    def attempt(target: int | None, how: str = strategy) -> tuple[SegmentedModule, int] | None:
        if (target, how) not in measured:
            try:
                chosen = plan_graph(cg, model, target, strategy=how, solver=solver)
            except BudgetError:
                measured[target, how] = None
            else:
                module = segment_module(cg.graph["gm"], chosen.segments)
                peak = measure_step(module, example_inputs, fake=True, loss_fn=loss_fn).peak_bytes
                logger.debug("solver budget %s: %d segments, predicted %d, measured %d bytes", target,
                             len(chosen.segments), chosen.predicted_peak_bytes, peak)
                measured[target, how] = (_attach(module, chosen, peak), peak)
        return measured[target, how]

    if budget_bytes is None:
        return attempt(None)[0]

    def fits(result) -> bool:
        return result is not None and result[1] <= budget_bytes

    if strategy == "memory":
        result = attempt(budget_bytes)
        if not fits(result):
            raise _infeasible(budget_bytes, attempt, measured)
        return result[0]
    # Bracket the largest solver budget whose plan fits when measured: [good_target, bad_target).
    good_target, good = budget_bytes, attempt(budget_bytes)
    if fits(good):
        # The model is usually pessimistic: a larger solver budget may still fit, with less recomputation.
        bad_target = _no_recompute_prediction(cg, model)
        if bad_target <= good_target:
            return good[0]
        top = attempt(bad_target)
        if fits(top):
            return top[0]
    else:
        bad_target = budget_bytes
        good_target = (min_budget_bytes_graph(cg, model, solver=solver) if solver != "chen"
                       else resident_bytes(cg, model) + 1)
        good = attempt(good_target)
        if not fits(good):
            raise _infeasible(budget_bytes, attempt, measured)
    for _ in range(BISECTION_ROUNDS):
        mid = (good_target + bad_target) // 2
        candidate = attempt(mid)
        if fits(candidate):
            good, good_target = candidate, mid
        else:
            bad_target = mid
    return good[0]


def _no_recompute_prediction(cg: CostGraph, model: torch.nn.Module) -> int:
    """The predicted peak (whole step) of the plan without recomputation, one segment (same for every DP)."""
    single = solve_graph(cg, None, strategy="time", solver="approx")
    return single.predicted_peak_bytes + resident_bytes(cg, model)


def _infeasible(budget_bytes: int, attempt, measured) -> BudgetError:
    """A BudgetError naming the smallest measured peak among the plans tried and the memory-centric one."""
    attempt(None, "memory")
    smallest = min(result[1] for result in measured.values() if result is not None)
    return BudgetError(
        f"no plan fits a measured peak of {budget_bytes / GiB:.3f} GiB ({budget_bytes} bytes); the smallest "
        f"measured peak fxplan reaches is {smallest / GiB:.3f} GiB ({smallest} bytes). Raise budget_gb to at "
        "least that, or reduce the batch size.",
        min_feasible_bytes=smallest,
    )


class LazyRewrite(torch.nn.Module):
    """``fxplan.rewrite`` without example inputs: plans on the first training call, re-plans on new shapes.

    It owns the original module tree under the original names (same ``state_dict`` keys). In
    ``eval()`` mode or under ``torch.no_grad()`` it runs the original forward and plans nothing.
    """

    def __init__(self, model: torch.nn.Module, budget_bytes: int | None, *, strategy: str, solver: str,
                 loss_fn: Callable[[Any], torch.Tensor] | None):
        super().__init__()
        self.__dict__["_modules"] = model._modules
        self.__dict__["_parameters"] = model._parameters
        self.__dict__["_buffers"] = model._buffers
        self.__dict__["_non_persistent_buffers_set"] = model._non_persistent_buffers_set
        self.__dict__["_fxplan_original"] = model
        self.__dict__["fxplan_module"] = None
        self._settings = dict(budget_bytes=budget_bytes, strategy=strategy, solver=solver, loss_fn=loss_fn)
        self._shapes: tuple | None = None

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
            if self._shapes is None:
                logger.info("fxplan: planning for input shapes %s", shapes)
            else:
                logger.warning("fxplan: input shapes changed from %s to %s; re-planning", self._shapes, shapes)
            module = fit_budget(original, ExampleCall(args, kwargs), **self._settings)
            self.__dict__["fxplan_module"] = module
            self._shapes = shapes
        self.fxplan_module.training = self.training
        return self.fxplan_module(*args, **kwargs)


def _shape_key(args: Sequence[Any], kwargs: dict[str, Any]) -> tuple:
    leaves = torch.utils._pytree.tree_leaves((tuple(args), kwargs))
    return tuple((tuple(t.shape), str(t.dtype), str(t.device)) if isinstance(t, torch.Tensor) else repr(t)
                 for t in leaves)
