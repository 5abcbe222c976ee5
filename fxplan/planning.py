"""The torch-facing planning API: model + example inputs + budget in bytes -> Plan.

The solvers (:mod:`fxplan.dp`, :mod:`fxplan.chen`) work on a CostGraph and predict the bytes of
activations and their gradients. Users give budgets for the whole step as measured by
:func:`fxplan.measure_step`, so this layer adds what is resident for the whole step (parameters, their
gradients, buffers, inputs) before comparing with a budget.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import torch

from fxplan import chen, dp
from fxplan.costgraph import CostGraph
from fxplan.errors import BudgetError, FxplanError
from fxplan.measure import GiB
from fxplan.plans import Plan
from fxplan.trace import trace

SOLVERS = ("approx", "exact", "chen")
STRATEGIES = ("time", "memory")


def resident_bytes(cg: CostGraph, model: torch.nn.Module) -> int:
    """Bytes held for the whole step besides activations: parameters, their gradients, buffers, inputs."""
    grads = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    return int(cg.graph["param_bytes"] + grads + buffers + cg.graph["input_bytes"])


def budget_to_bytes(budget_gb: float | None) -> int | None:
    """GiB (as users write them) to bytes, validating the value."""
    if budget_gb is None:
        return None
    if not isinstance(budget_gb, (int, float)) or not math.isfinite(budget_gb) or budget_gb <= 0:
        raise FxplanError(f"budget_gb must be a positive number of GiB, got {budget_gb!r}")
    return int(budget_gb * GiB)


def check_choices(strategy: str, solver: str) -> None:
    """Raise a clear FxplanError for an unknown strategy or solver name."""
    if solver not in SOLVERS:
        raise FxplanError(f"solver must be one of {', '.join(SOLVERS)}, got {solver!r}")
    if strategy not in STRATEGIES:
        raise FxplanError(f"strategy must be one of {', '.join(STRATEGIES)}, got {strategy!r}")


def solve_graph(cg: CostGraph, activation_budget: int | None, *, strategy: str, solver: str) -> Plan:
    """Run the chosen solver on a cost graph with a budget for activations (bytes, or None)."""
    check_choices(strategy, solver)
    if activation_budget is not None and activation_budget <= 0:
        raise BudgetError("the budget does not even cover the parameters, gradients and inputs",
                          min_feasible_bytes=None)
    if solver == "chen":
        variant = "sqrt" if activation_budget is None else "greedy"
        return chen.solve(cg, activation_budget, variant=variant)
    return dp.solve(cg, activation_budget, strategy=strategy, exact=solver == "exact")


def plan(
    model: torch.nn.Module,
    example_inputs: Sequence[Any],
    *,
    budget_gb: float | None,
    strategy: str = "time",
    solver: str = "approx",
) -> Plan:
    """Plan recomputation for one training step of ``model`` within ``budget_gb`` GiB of peak memory.

    ``strategy``: ``"time"`` (least recomputation within the budget) or ``"memory"`` (lowest peak,
    Kusumoto et al. section 4.4). ``solver``: ``"approx"`` (pruned lower sets, fast), ``"exact"`` (all
    lower sets) or ``"chen"`` (Chen et al.'s greedy plan). ``budget_gb=None`` plans for the smallest
    feasible budget. Inputs may be fake tensors; nothing is allocated. The plan's
    ``predicted_peak_bytes`` is converted to whole-step bytes (resident bytes added).

    Raises :class:`BudgetError` with ``min_feasible_bytes`` (whole-step bytes) if nothing fits.
    """
    cg = trace(model, example_inputs)
    return plan_graph(cg, model, budget_to_bytes(budget_gb), strategy=strategy, solver=solver)


def plan_graph(cg: CostGraph, model: torch.nn.Module, budget_bytes: int | None, *, strategy: str,
               solver: str) -> Plan:
    """:func:`plan` on an already traced cost graph; budgets and predictions in whole-step bytes."""
    resident = resident_bytes(cg, model)
    if budget_bytes is None and strategy == "time" and solver != "chen":
        budget_bytes = min_budget_bytes_graph(cg, model, solver=solver)
    activation_budget = None if budget_bytes is None else budget_bytes - resident
    try:
        result = solve_graph(cg, activation_budget, strategy=strategy, solver=solver)
    except BudgetError as exc:
        smallest = None if exc.min_feasible_bytes is None else exc.min_feasible_bytes + resident
        if smallest is None and solver != "chen":
            smallest = min_budget_bytes_graph(cg, model, solver=solver)
        raise BudgetError(
            f"no {solver} plan fits a peak of {budget_bytes / GiB:.3f} GiB; the smallest feasible budget is "
            + (f"{smallest / GiB:.3f} GiB ({smallest} bytes)" if smallest else "unknown")
            + f", of which {resident / GiB:.3f} GiB are parameters, gradients, buffers and inputs.",
            min_feasible_bytes=smallest,
        ) from exc
    return replace(result, predicted_peak_bytes=result.predicted_peak_bytes + resident,
                   budget_bytes=budget_bytes,
                   segment_peak_bytes=[b + resident for b in result.segment_peak_bytes])


def min_budget_bytes_graph(cg: CostGraph, model: torch.nn.Module, *, solver: str = "approx") -> int:
    """The smallest whole-step budget (bytes) for which the solver finds a plan."""
    if solver not in ("approx", "exact"):
        raise FxplanError(f"min_budget_bytes needs solver 'approx' or 'exact', got {solver!r}")
    return dp.min_budget_bytes(cg, exact=solver == "exact") + resident_bytes(cg, model)


def min_budget_bytes(model: torch.nn.Module, example_inputs: Sequence[Any], *, solver: str = "approx") -> int:
    """The smallest peak (bytes, whole step) any plan of ``solver`` is predicted to reach."""
    return min_budget_bytes_graph(trace(model, example_inputs), model, solver=solver)
