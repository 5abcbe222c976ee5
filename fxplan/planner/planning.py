"""The solver layer under ``fxplan.plan``: cost graph + whole-step budget in bytes -> predicted Plan.

The solvers (:mod:`fxplan.solvers.dp`, :mod:`fxplan.solvers.chen`) work on a CostGraph and predict the bytes of
activations and their gradients. Budgets here are for the whole step, so this layer adds what is
resident for the whole step (parameters, their gradients, buffers, inputs) before comparing with a
budget. Everything here is a *prediction* of the solver's memory model; ``fxplan.plan`` and
``fxplan.rewrite`` (:mod:`fxplan.planner.search`) hold plans to measured peaks.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import torch

from fxplan.common.console import format_bytes
from fxplan.costs.trace import trace
from fxplan.errors import BudgetError, FxplanError
from fxplan.measure.meter import GiB
from fxplan.solvers import chen, dp
from fxplan.solvers.costgraph import CostGraph
from fxplan.solvers.plans import Plan

SOLVERS = ("approx", "exact", "chen")
STRATEGIES = ("time", "memory")


def non_activation_bytes(cg: CostGraph, model: torch.nn.Module) -> int:
    """Bytes the memory model holds for the whole step beside activations: parameters, their gradients, buffers,
    inputs (a measured step holds the gradients only once backward makes them; what it holds from its start is
    :func:`fxplan.measure.meter.resident_bytes`)."""
    grads = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    return int(cg.graph["param_bytes"] + grads + buffers + cg.graph["input_bytes"])


def budget_to_bytes(budget_gb: float | None) -> int | None:
    """GiB (as users write them) to bytes, validating the value.

    Rounded up, so that a budget printed from a byte count (``min_feasible_bytes / 2**30``) comes back
    as at least that many bytes.
    """
    if budget_gb is None:
        return None
    if isinstance(budget_gb, bool) or not isinstance(budget_gb, (int, float)) or not math.isfinite(budget_gb) \
            or budget_gb <= 0:
        raise FxplanError(f"budget_gb must be a positive number of GiB, got {budget_gb!r}")
    return math.ceil(budget_gb * GiB)


def whole_step_budget(budget_gb: float | None, budget_bytes: int | None) -> int | None:
    """The budget in bytes from either spelling (GiB rounded up to a whole byte, or bytes)."""
    if budget_bytes is None:
        return budget_to_bytes(budget_gb)
    if budget_gb is not None:
        raise FxplanError("give the budget once: budget_gb or budget_bytes, not both")
    if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, int) or budget_bytes <= 0:
        raise FxplanError(f"budget_bytes must be a positive whole number of bytes, got {budget_bytes!r}")
    return budget_bytes


def host_limit(offload: bool, host_bytes: int | None) -> int | None:
    """The bound of the offloaded values' host copies, in bytes (None: none), checked: it means something only with
    ``offload=True``."""
    if host_bytes is not None and not offload:
        raise FxplanError("host_bytes limits the host memory of offloaded values: pass offload=True with it")
    if host_bytes is not None and (isinstance(host_bytes, bool) or not isinstance(host_bytes, int) or host_bytes < 0):
        raise FxplanError(f"host_bytes must be a whole number of bytes, at least 0, got {host_bytes!r}")
    return host_bytes


def check_choices(strategy: str, solver: str) -> None:
    """Raise a clear FxplanError for an unknown strategy or solver name."""
    if solver not in SOLVERS:
        raise FxplanError(f"solver must be one of {', '.join(SOLVERS)}, got {solver!r}")
    if strategy not in STRATEGIES:
        raise FxplanError(f"strategy must be one of {', '.join(STRATEGIES)}, got {strategy!r}")


def solve_graph(cg: CostGraph, activation_budget: int | None, *, strategy: str, solver: str,
                memory_model=None, max_sets: int | None = None) -> Plan:
    """Run the chosen solver on a cost graph with a budget for activations (bytes, or None).

    ``memory_model`` and ``max_sets``: as :func:`fxplan.solvers.dp.solve` takes them (default: the autograd
    model, every set).
    """
    check_choices(strategy, solver)
    if activation_budget is not None and activation_budget <= 0:
        raise BudgetError("the budget does not even cover the parameters, gradients and inputs",
                          min_feasible_bytes=None)
    if solver == "chen":
        variant = "sqrt" if activation_budget is None else "greedy"
        return chen.solve(cg, activation_budget, variant=variant, memory_model=memory_model)
    return dp.solve(cg, activation_budget, strategy=strategy, exact=solver == "exact", memory_model=memory_model,
                    max_sets=max_sets)


def plan_graph(cg: CostGraph, model: torch.nn.Module, budget_bytes: int | None, *, strategy: str,
               solver: str, memory_model=None, max_sets: int | None = None, resident: int | None = None) -> Plan:
    """The solver's plan for a whole-step budget in bytes (None: its smallest predicted peak), with
    whole-step predictions. No measurement: see ``fxplan.plan`` for plans held to measured peaks.
    ``resident``: :func:`non_activation_bytes` if the caller has it (it walks every parameter)."""
    resident = non_activation_bytes(cg, model) if resident is None else resident
    if budget_bytes is None and strategy == "time" and solver != "chen":
        budget_bytes = predicted_min_budget_bytes_graph(cg, model, solver=solver, memory_model=memory_model,
                                                        resident=resident)
    activation_budget = None if budget_bytes is None else budget_bytes - resident
    try:
        result = solve_graph(cg, activation_budget, strategy=strategy, solver=solver, memory_model=memory_model,
                             max_sets=max_sets)
    except BudgetError as exc:
        smallest = None if exc.min_feasible_bytes is None else exc.min_feasible_bytes + resident
        if smallest is None and solver != "chen":
            smallest = predicted_min_budget_bytes_graph(cg, model, solver=solver, memory_model=memory_model,
                                                        resident=resident)
        raise BudgetError(
            f"no {solver} plan fits a peak of {format_bytes(budget_bytes)}; the smallest feasible budget is "
            + (f"{format_bytes(smallest)} ({smallest} bytes)" if smallest else "unknown")
            + f", of which {format_bytes(resident)} are parameters, gradients, buffers and inputs.",
            min_feasible_bytes=smallest,
        ) from exc
    return replace(result, predicted_peak_bytes=result.predicted_peak_bytes + resident,
                   budget_bytes=budget_bytes, T_seconds=cg.graph.get("T_seconds"),
                   segment_peak_bytes=[b + resident for b in result.segment_peak_bytes])


def predicted_min_budget_bytes_graph(cg: CostGraph, model: torch.nn.Module, *, solver: str = "approx",
                                     memory_model=None, resident: int | None = None) -> int:
    """The smallest whole-step budget (bytes) for which the solver finds a plan (predicted); ``resident`` as
    :func:`plan_graph` takes it."""
    if solver not in ("approx", "exact"):
        raise FxplanError(f"the smallest budget needs solver 'approx' or 'exact', got {solver!r}")
    resident = non_activation_bytes(cg, model) if resident is None else resident
    return dp.min_activation_bytes(cg, exact=solver == "exact", memory_model=memory_model) + resident


def predicted_min_budget_bytes(model: torch.nn.Module, example_inputs: Sequence[Any], *,
                               solver: str = "approx") -> int:
    """The smallest peak (bytes, whole step) any plan of ``solver`` is *predicted* to reach by its memory
    model. ``fxplan.min_budget_bytes`` is the measured one (the smallest budget ``fxplan.rewrite``
    accepts)."""
    return predicted_min_budget_bytes_graph(trace(model, example_inputs), model, solver=solver)
