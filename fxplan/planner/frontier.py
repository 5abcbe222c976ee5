"""The candidate plans of one graph and solver, generated from either end (:class:`Frontier`).

For the DP solvers the candidates are the time-centric frontier (Kusumoto et al., sections 4.2-4.4): the plan
without recomputation, the plans for a fixed grid of budgets below its predicted peak, the plan at the
solver's smallest predicted peak and the memory-centric plan. The grid's budgets are

    t_k = floor(top × (1 − step)^k),  k = 1, 2, ...  while t_k ≥ lo,

``top`` the predicted peak of the plan without recomputation and ``lo`` the solver's smallest predicted peak.
They depend on the graph only, never on the plans found between them, so the frontier can be generated from
the top (a budget search, which wants the plans of least recomputation first) or from the bottom (the search
for the smallest peak, which wants the plans of least peak and, at the bottom of a frontier of large graphs,
needs a few of its dozens of solves).

A grid point whose budget the plan of the point above it fits is passed over: the DP's plan there recomputes
as little as that plan (it fits a larger budget, and fits this one), and is that very plan wherever the DP
breaks ties alike at both budgets (on ResNet-50, GPT-2, BERT, U-Net and a timm MobileNet, solved at every grid
point: the same plan at every point passed over but three, whose recomputation differed in the 16th digit).
From the top, the plan above stands in for it and nothing is solved; from the bottom, the plan above is solved
first. So both ends generate the same candidates, ties of equal recomputation aside.

Solver ``"chen"``: the plans of Chen et al.'s Algorithm 3 over its grid of B and the √n plan, by recomputation.
"""

from __future__ import annotations

import math

import torch

from fxplan.errors import BudgetError, FxplanError
from fxplan.planner.planning import non_activation_bytes, plan_graph, predicted_min_budget_bytes_graph
from fxplan.solvers import chen, dp
from fxplan.solvers.costgraph import CostGraph
from fxplan.solvers.lowersets import enumerate_lower_sets
from fxplan.solvers.plans import Plan
from fxplan.solvers.sweep_model import SweepModel

#: Most grid points of the frontier.
FRONTIER = 200

#: Relative step of the grid: plans whose predicted peaks are closer than this are not all visited (with the
#: approximate DP on ResNet-50 and DenseNet-161 this cost 0.2-0.4% of recomputation on average over budgets,
#: and saved 2-3x the time of visiting every plan).
STEP = 0.01

#: On large graphs the grid is coarser: at most max(FRONTIER_MIN, FRONTIER_WORK / nodes) points from the plan
#: without recomputation down to the smallest predicted peak (a geometric step between the two, if larger than
#: STEP). A solve's cost grows with the graph (at 3,000 nodes 1-3 s in the middle of the frontier, against
#: 0.01-0.1 s at 1,000); graphs of up to FRONTIER_WORK / FRONTIER = 500 nodes (the zoo but DenseNet-161, 571
#: nodes: 175 points) take the fine step. docs/planner.md, "fxplan.rewrite end to end".
FRONTIER_WORK, FRONTIER_MIN = 100_000, 24

#: The grid's solves plan over at most this many lower sets (those whose boundary holds the fewest bytes,
#: :func:`fxplan.solvers.family_dp.family_run`): at a middle budget a solve's moves grow as the square of the sets
#: (10,000 sets: 50 million, over the DP's cap). The smallest-peak and memory-centric plans use all.
FRONTIER_SETS = 1000

#: The same for the exact DP on lattices too large for its family engine, where a solve takes seconds.
LARGE_STEP, LARGE_FRONTIER = 0.05, 12

#: The memory model the DP solvers plan candidates with (all instances are equal: one planning context).
SWEEP = SweepModel()


class Frontier:
    """The candidate plans of ``solver`` on ``cg``, at positions 0, 1, ... in order of non-decreasing
    recomputation (module docstring): the plan without recomputation, the grid's plans, the plan at the
    smallest predicted peak, the memory-centric plan. :meth:`at` solves a position when first asked for;
    :attr:`size` is known once the smallest predicted peak is (the second position asked for)."""

    def __init__(self, cg: CostGraph, model: torch.nn.Module, solver: str):
        self.cg, self.model, self.solver = cg, model, solver
        self._large: bool | None = None  # the exact DP on a lattice too large for its family engine
        self._resident: int | None = None
        self._targets: list[int] | None = None  # the grid's budgets, k = 1, 2, ...
        self._lo: int | None = None
        self._solved: dict[int, Plan | None] = {}  # by position; None: no plan (below the grid's sets' least peak)
        self._stand_in: dict[int, Plan | None] = {}  # grid points passed over: the plan above them
        self._chen: list[Plan] | None = None

    @property
    def large(self) -> bool:
        """True for the exact DP on a lattice too large for its family engine (:func:`too_large_for_family`):
        its search engine evaluates moves incrementally, which only the autograd model supports (the sweep model
        ranks plans as measured far better: docs/rewrite.md), and each of its solves is slow, so its grid is
        coarser (``LARGE_STEP``, ``LARGE_FRONTIER``)."""
        if self._large is None:
            self._large = self.solver == "exact" and too_large_for_family(self.cg)
        return self._large

    @property
    def resident(self) -> int:
        if self._resident is None:
            self._resident = non_activation_bytes(self.cg, self.model)  # once: it walks every parameter
        return self._resident

    @property
    def size(self) -> int:
        """The number of positions."""
        if self.solver == "chen":
            return len(self._chen_plans())
        return len(self._grid()) + 3

    def at(self, k: int) -> Plan | None:
        """The plan at position ``k``; None where the position adds none (a grid point passed over, or one below
        the least peak over the grid's ``FRONTIER_SETS`` sets)."""
        if self.solver == "chen":
            return self._chen_plans()[k]
        if k == 0 or k > len(self._grid()):
            return self._plan(k)
        above = self._stand_in[k - 1] if k - 1 in self._stand_in else self._plan(k - 1)
        if above is not None and above.predicted_peak_bytes <= self._grid()[k - 1]:
            self._stand_in[k] = above
            return None
        return self._plan(k)

    def grid_budget(self, k: int) -> int | None:
        """The budget position ``k`` is solved for (None: the plan without recomputation, or one after the grid)."""
        grid = self._grid() if k > 0 and self.solver != "chen" else []
        return grid[k - 1] if 0 < k <= len(grid) else None

    def _plan(self, k: int) -> Plan | None:
        """The solver's plan for position ``k``, solved once."""
        if k not in self._solved:
            self._solved[k] = self._solve(k)
        return self._solved[k]

    def _solve(self, k: int) -> Plan | None:
        # None: the autograd model (the default); planning contexts (fxplan.solvers.dp.context) cache the sweep
        # model's moves
        common = dict(solver=self.solver, memory_model=None if self.large else SWEEP, resident=self.resident)
        if k == 0:
            return plan_graph(self.cg, self.model, 2**62, strategy="time", max_sets=FRONTIER_SETS, **common)
        grid = self._grid()
        if k <= len(grid):
            try:
                return plan_graph(self.cg, self.model, grid[k - 1], strategy="time", max_sets=FRONTIER_SETS, **common)
            except BudgetError:  # below the least peak over the FRONTIER_SETS sets
                return None
        if k == len(grid) + 1:
            return plan_graph(self.cg, self.model, self._lo, strategy="time", **common)
        return plan_graph(self.cg, self.model, None, strategy="memory", **common)

    def _grid(self) -> list[int]:
        """The grid's budgets (module docstring), made with the plan without recomputation and the smallest
        predicted peak: on graphs of more than ``FRONTIER_WORK / FRONTIER`` nodes, at most
        ``max(FRONTIER_MIN, FRONTIER_WORK / nodes)`` points, evenly spaced in log between the two."""
        if self._targets is None:
            top = self._plan(0).predicted_peak_bytes
            self._lo = lo = predicted_min_budget_bytes_graph(self.cg, self.model, solver=self.solver,
                                                   memory_model=None if self.large else SWEEP, resident=self.resident)
            step, most = (LARGE_STEP, LARGE_FRONTIER) if self.large else (STEP, FRONTIER)
            points = max(FRONTIER_MIN, min(most, FRONTIER_WORK // max(1, self.cg.number_of_nodes())))
            if points < most and top > lo:
                step = max(step, 1 - (lo / top) ** (1 / points))
            targets = []
            for k in range(1, most):
                target = math.floor(top * (1 - step) ** k)
                if target < lo:
                    break
                targets.append(target)
            self._targets = targets
        return self._targets

    def _chen_plans(self) -> list[Plan]:
        if self._chen is None:
            self._chen = sorted(chen_plans(self.cg, self.model), key=lambda p: p.recompute_fraction)
        return self._chen


def chen_plans(cg: CostGraph, model: torch.nn.Module) -> list[Plan]:
    """Chen et al.'s plans: Algorithm 3 over its grid of B, and the √n plan."""
    return chen.greedy_plans(cg) + [plan_graph(cg, model, None, strategy="time", solver="chen")]


def exact_family_size(cg: CostGraph) -> int | None:
    """The number of lower sets of ``cg``; None if more than the exact DP's family engine takes."""
    try:
        return len(enumerate_lower_sets(dp.context(cg, SWEEP).ix, limit=dp.FAMILY_LIMIT))
    except FxplanError:
        return None


def too_large_for_family(cg: CostGraph) -> bool:
    """True if the exact DP would use its search engine (more lower sets than its family engine takes)."""
    return exact_family_size(cg) is None
