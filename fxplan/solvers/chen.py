"""Chen et al.'s plans (2016, "Training deep nets with sublinear memory cost"), as baselines.

All three return the same :class:`~fxplan.solvers.plans.Plan` as the DP, evaluated under the same memory model, so
they can be compared one to one.

Candidate split points (Chen's ``C`` in Algorithm 3). Kusumoto et al. (appendix B) take the articulation
points of the graph. On a DAG the notion that makes a split useful is: ``v`` is a split point when its
ancestor closure ``L_v`` is a lower set whose boundary is ``{v}`` alone, i.e. every path from a source to a
sink passes through ``v`` and no edge jumps over it. Cutting there caches exactly one tensor, ``v``.

Variants:

``"sqrt"``      section 4.3: ~√n segments of equal length (in topological positions), each ending at the
                split point nearest to its ideal end;
``"greedy"``    Algorithm 3 (memory planning with budget B) with the grid search over B of section 4.3
                and appendix A: run with B = 0 to get (x, y), then try 6 values of B on a geometric grid
                over [√(xy)/√2, √2·√(xy)]. Chen et al. search that grid for the plan of least memory;
                to honour a budget that leaves room for less recomputation, the grid is continued with
                the same ratio up to B = M(V), where Algorithm 3 makes no split at all
                (:func:`budget_grid_chains`). With a budget, the plan of least recomputation whose
                predicted peak fits is kept; without one, the plan of least predicted peak;
``"recursive"`` section 4.4 with k = 1: split at the middle split point, then apply the same plan inside
                each half (its subgraph is checkpointed again inside), recursively, down to single
                segments; the result is a two-segment plan whose ``children`` hold the nested plans.
"""

from __future__ import annotations

import math
import time

from fxplan.common.console import format_bytes
from fxplan.errors import BudgetError, FxplanError
from fxplan.solvers.costgraph import CostGraph
from fxplan.solvers.dp import plan_from_chain
from fxplan.solvers.lowersets import GraphIndex, iter_bits
from fxplan.solvers.memory_model import BoundModel, evaluate_chain, get_model
from fxplan.solvers.plans import Plan

GRID_SIZE = 6


def split_points(ix: GraphIndex) -> list[int]:
    """Topological indices of the split points (module docstring), increasing; V's last node excluded.

    ∂(L_v) = {v} when v has readers (all outside L_v) and every other member of L_v has all its readers
    in L_v; the members other than v are the union of the L_p of v's predecessors, so what they read is
    the union of what those L_p read, carried along the topological order (O(edges) bitset unions)."""
    read_by = [0] * ix.n  # the readers of the members of L_v
    out = []
    for v in range(ix.n):
        below = 0
        for p in iter_bits(ix.pred[v]):
            below |= read_by[p]
        read_by[v] = below | ix.dsucc[v]
        L = ix.anc[v]
        if L != ix.full and ix.dsucc[v] and not below & ~L:
            out.append(v)
    return out


def _chain(ix: GraphIndex, splits: list[int]) -> list[int]:
    chain = []
    for v in sorted(set(splits)):
        L = ix.anc[v]
        if not chain or (L & chain[-1] == chain[-1] and L != chain[-1]):
            chain.append(L)
    chain.append(ix.full)
    return chain


def sqrt_splits(ix: GraphIndex, cands: list[int]) -> list[int]:
    """Split points for ~√n equal segments (Chen section 4.3)."""
    if not cands:
        return []
    k = max(1, round(math.sqrt(ix.n)))
    out = []
    for i in range(1, k):
        target = i * ix.n / k
        out.append(min(cands, key=lambda c: abs(c + 1 - target)))
    return sorted(set(out))


def greedy_splits(ix: GraphIndex, cands: list[int], B: float) -> tuple[list[int], int, int]:
    """Algorithm 3 (memory planning with budget B): returns (split points, x, y).

    x is the approximate cost of the stored inter-stage values, y the approximate largest stage.
    """
    cset = set(cands)
    temp = x = y = 0
    out = []
    for v in range(ix.n):
        temp += ix.M[v]
        if v in cset and temp > B:
            x += ix.M[v]
            y = max(y, temp)
            out.append(v)
            temp = 0
    return out, x, y


def _pick(ix: GraphIndex, bm: BoundModel, chains: list[list[int]], budget: int | None) -> list[int]:
    scored = []
    for ch in chains:
        peak, over, _, _ = evaluate_chain(bm, ch)
        scored.append((peak, over, ch))
    if budget is None:
        return min(scored, key=lambda s: (s[0], s[1]))[2]
    fits = [s for s in scored if s[0] <= budget]
    if not fits:
        best = min(s[0] for s in scored)
        raise BudgetError(
            f"none of Chen's plans fits the budget of {format_bytes(budget)} ({budget} bytes) under the "
            f"{bm.name!r} memory model; the smallest this baseline reaches is {format_bytes(best)} "
            f"({best} bytes).",
            min_feasible_bytes=int(best), advice="Raise the budget or use fxplan.solvers.dp.solve.",
        )
    return min(fits, key=lambda s: (s[1], s[0]))[2]


def grid_chains(ix: GraphIndex, cands: list[int]) -> list[list[int]]:
    """The plans of Chen's grid search over B (appendix A), B = 0 first."""
    return [_chain(ix, greedy_splits(ix, cands, B)[0]) for B in _grid(ix, cands)]


def budget_grid_chains(ix: GraphIndex, cands: list[int]) -> list[list[int]]:
    """Chen's grid (:func:`grid_chains`) continued with the same ratio until B reaches M(V).

    Larger B means fewer, longer stages: more memory, and a longer last stage, which is not
    recomputed. The last value, B = M(V), gives the single segment (no recomputation). Duplicate
    plans are dropped; the order is by increasing B.
    """
    grid = _grid(ix, cands)
    total = ix.msum(ix.full)
    ratio = 2 ** (1 / (GRID_SIZE - 1))
    B = grid[-1]
    while 0 < B < total:
        B = min(B * ratio, total)
        grid.append(B)
    chains: list[list[int]] = []
    for B in grid:
        chain = _chain(ix, greedy_splits(ix, cands, B)[0])
        if chain not in chains:
            chains.append(chain)
    return chains


def _grid(ix: GraphIndex, cands: list[int]) -> list[float]:
    """B = 0, then 6 values on a geometric grid over [√(xy)/√2, √2·√(xy)] (appendix A)."""
    _, x, y = greedy_splits(ix, cands, 0)
    b0 = math.sqrt(x * y)
    return [0.0] + [b0 * 2 ** (-0.5 + i / (GRID_SIZE - 1)) for i in range(GRID_SIZE)]


def greedy_plans(cg: CostGraph, memory_model=None) -> list[Plan]:
    """Every plan of :func:`budget_grid_chains`, predicted under ``memory_model`` (no budget applied).

    These are the candidates a measured search chooses from (``fxplan.rewrite(..., solver="chen")``).
    """
    t0 = time.perf_counter()
    ix = GraphIndex.build(cg)
    bm = get_model(memory_model).bind(ix)
    chains = budget_grid_chains(ix, split_points(ix))
    return [plan_from_chain(ix, bm, ch, budget=None, strategy="greedy", solver="chen",
                            seconds=time.perf_counter() - t0) for ch in chains]


def _recursive(cg: CostGraph, memory_model, budget: int | None, t0: float) -> Plan:
    ix = GraphIndex.build(cg)
    bm = get_model(memory_model).bind(ix)
    cands = split_points(ix)
    if not cands:
        return plan_from_chain(ix, bm, [ix.full], budget=budget, strategy="recursive", solver="chen",
                               seconds=time.perf_counter() - t0)
    mid = cands[len(cands) // 2]
    chain = _chain(ix, [mid])
    plan = plan_from_chain(ix, bm, chain, budget=budget, strategy="recursive", solver="chen", seconds=0.0)
    prev, m = 0, 0
    peak, rec = 0, plan.segment_T[0]
    for i, Lp in enumerate(chain):
        seg = ix.names_of(Lp & ~prev)
        child = _recursive(cg.subgraph_on(seg), memory_model, None, t0)
        plan.children[str(i)] = child
        _, G, _ = bm.transition(prev, Lp)
        # the child's own prediction covers the segment's saved values and internal gradients; add the
        # gradients crossing the segment's border (arriving from later, produced for earlier segments)
        border = G + ix.msum(ix.delta_minus(Lp & ~prev) & prev)
        plan.segment_peak_bytes[i] = int(m + child.predicted_peak_bytes + border)
        peak = max(peak, plan.segment_peak_bytes[i])
        rec += child.recompute_fraction * child.total_T
        m += G
        prev = Lp
    plan.predicted_peak_bytes = peak
    plan.recompute_fraction = rec / plan.total_T if plan.total_T else 0.0
    plan.overhead = rec
    plan.solve_seconds = time.perf_counter() - t0
    return plan


def solve(cg: CostGraph, budget_bytes: int | None = None, *, variant: str = "greedy",
          memory_model=None) -> Plan:
    """Chen et al.'s plan for ``cg`` (module docstring), predicted under ``memory_model``.

    With ``budget_bytes``: the "greedy" grid (:func:`budget_grid_chains`) keeps the least-overhead plan
    whose predicted peak fits; the other variants are checked against it. Without: the grid keeps the
    plan of least predicted peak.
    Raises :class:`BudgetError` when the plan (every grid plan) exceeds the budget.
    """
    t0 = time.perf_counter()
    if variant not in ("sqrt", "greedy", "recursive"):
        raise FxplanError(f"variant must be 'sqrt', 'greedy' or 'recursive', not {variant!r}")
    if variant == "recursive":
        plan = _recursive(cg, memory_model, budget_bytes, t0)
        if budget_bytes is not None and plan.predicted_peak_bytes > budget_bytes:
            raise BudgetError(
                f"Chen's recursive plan needs {format_bytes(plan.predicted_peak_bytes)}, over the budget of "
                f"{format_bytes(budget_bytes)}", min_feasible_bytes=plan.predicted_peak_bytes)
        return plan
    ix = GraphIndex.build(cg)
    bm = get_model(memory_model).bind(ix)
    cands = split_points(ix)
    chains = [_chain(ix, sqrt_splits(ix, cands))] if variant == "sqrt" else budget_grid_chains(ix, cands)
    chain = _pick(ix, bm, chains, budget_bytes)
    return plan_from_chain(ix, bm, chain, budget=budget_bytes, strategy=variant, solver="chen",
                           seconds=time.perf_counter() - t0)


__all__ = ["budget_grid_chains", "greedy_plans", "grid_chains", "greedy_splits", "solve", "split_points",
           "sqrt_splits"]
