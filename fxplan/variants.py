"""One budget search over two graphs of a model: as captured, and with its recomputed regions.

A recomputed region (:mod:`fxplan.regions`) keeps a convolution's output and recomputes the BatchNorm and
ReLU in front of it in every backward: memory saved at a fixed price, which a budget may not need. So the
graph with regions is searched as its own model (:class:`fxplan.search.Search`, its own trace), and the
choice spans both searches on one scale, the forward cost recomputed per step (the cost graph's T, the
regions' own recomputation included):

- a budget: of the canonical plans of both searches (:class:`fxplan.search.Search`'s candidates, not
  nested) that fit, the one that recomputes least (ties: the lower measured peak). Each frontier is walked
  only as far as needed: the captured graph's up to the regions' own cost first (no plan with regions
  recomputes less), and the graph with regions is traced on first need; where one of its plans fits, the
  captured graph's walk goes on only up to that plan's cost. Where no canonical plan of either graph fits,
  the two searches' nested plans (:mod:`fxplan.nested`) are compared the same way;
- no budget (the smallest peak): the least recomputation among the two choices within
  :data:`fxplan.search.NEGLIGIBLE` of the lower of the two smallest measured peaks;
- ``strategy="memory"``: the lower measured peak.

Each search is monotone in the budget, so the choice is too: a larger budget never recomputes more.
The smallest measured peak is the lower of the two searches', and that budget is accepted. ``solver="chen"``
searches the captured graph only: Chen's plans stay the paper's baseline.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch

from fxplan.codegen import SegmentedModule
from fxplan.costgraph import CostGraph
from fxplan.errors import BudgetError
from fxplan.regions import Region, find_regions, recompute_cost, with_regions
from fxplan.search import NEGLIGIBLE, Candidate, Search
from fxplan.trace import trace

logger = logging.getLogger("fxplan")


@dataclass
class Variant:
    """One graph's search, with the regions it runs and the T they recompute in every step."""

    search: Search
    regions: list[Region]
    region_T: float = 0.0

    def recomputed_T(self, c: Candidate) -> float:
        """Forward cost ``c`` recomputes per step, regions included (the cost graph's units)."""
        return c.recompute * c.plan.total_T + self.region_T

    def result(self, c: Candidate, budget_bytes: int | None) -> SegmentedModule:
        """The candidate's module; its plan names the regions and counts their recomputation."""
        module = self.search.result(c, budget_bytes)
        if self.regions:
            plan = module.fxplan_plan
            share = self.region_T / plan.total_T if plan.total_T else 0.0
            module.fxplan_plan = replace(plan, regions=[r.conv for r in self.regions], region_recompute_fraction=share,
                                         recompute_fraction=plan.recompute_fraction + share)
        return module


@dataclass
class Choice:
    """A search's candidate for a budget, with the graph it runs on."""

    variant: Variant
    candidate: Candidate

    @property
    def measured(self) -> int:
        return self.candidate.measured

    @property
    def cost(self) -> tuple[float, int]:
        """What the choice across graphs minimises: forward cost recomputed per step, then measured peak."""
        return self.variant.recomputed_T(self.candidate), self.candidate.measured


class Searches:
    """The searches of one model, inputs and solver: the captured graph's, and, when asked for, the graph
    with its recomputed regions (module docstring)."""

    def __init__(self, cg: CostGraph, model: torch.nn.Module, example_inputs: Any, *, solver: str,
                 loss_fn: Callable[[Any], torch.Tensor] | None = None):
        self.model, self.inputs, self.solver, self.loss_fn = model, example_inputs, solver, loss_fn
        self.plain = Variant(Search(cg, model, example_inputs, solver=solver, loss_fn=loss_fn), [])
        captured = cg.graph["captured"]
        # Chen's plans stay the paper's baseline (fxplan.search): no regions for solver="chen"
        self._regions = find_regions(captured.gm) if captured.method == "symbolic_trace" and solver != "chen" else []
        self._region_T = recompute_cost(cg, self._regions)  # what any plan with regions recomputes, at least
        self._with_regions: Variant | None = None

    @property
    def variants(self) -> list[Variant]:
        """The searches made so far."""
        return [self.plain] + ([self._with_regions] if self._with_regions else [])

    def with_regions(self) -> Variant | None:
        """The search over the graph with every recomputed region (traced on first use); None without regions."""
        if not self._regions:
            return None
        if self._with_regions is None:
            t0 = time.perf_counter()
            cg = self.plain.search.cg
            traced = self._guarded(lambda: trace(self.model, self.inputs, cost_model=cg.graph["cost_model"],
                                                 captured=with_regions(cg.graph["captured"], self._regions)))
            if traced is None:
                return None
            search = Search(traced, self.model, self.inputs, solver=self.solver, loss_fn=self.loss_fn)
            self._with_regions = Variant(search, self._regions, self._region_T)
            logger.info("fxplan: traced the graph with %d recomputed regions (convolutions keeping their output) "
                        "in %.1f s", len(self._regions), time.perf_counter() - t0)
        return self._with_regions

    def lowest(self) -> int:
        """The smallest measured peak of either search (bytes)."""
        plain = self.plain.search.lowest().measured
        other = self.with_regions()
        regions = self._guarded(lambda: other.search.lowest().measured) if other else None
        return plain if regions is None else min(plain, regions)

    def choose(self, budget_bytes: int | None, strategy: str) -> Choice:
        """The choice for a whole-step budget (bytes; None: the smallest) and strategy (module docstring);
        BudgetError with the smaller of the two smallest peaks where neither search fits."""
        if budget_bytes is not None and strategy != "memory" and self._regions:
            found = self._cheapest_canonical(budget_bytes)
            if found is not None:
                return found
        plain = _attempt(self.plain, budget_bytes, strategy)
        needs_more = isinstance(plain, BudgetError) or budget_bytes is None or strategy == "memory" \
            or self._region_T < plain.cost[0]
        other = self.with_regions() if needs_more else None
        outcome = self._guarded(lambda: _attempt(other, budget_bytes, strategy)) if other else None
        outcomes = [plain] + ([outcome] if outcome is not None else [])
        fits = [o for o in outcomes if isinstance(o, Choice)]
        if not fits:
            raise min(outcomes, key=lambda e: e.min_feasible_bytes or math.inf)
        if strategy == "memory":
            return min(fits, key=lambda c: (c.measured, c.cost))
        if budget_bytes is None:
            limit = math.floor(min(c.measured for c in fits) * (1 + NEGLIGIBLE))
            fits = [c for c in fits if c.measured <= limit]
        return min(fits, key=lambda c: c.cost)

    def _cheapest_canonical(self, budget_bytes: int) -> Choice | None:
        """The canonical plan (no nesting) of least cost that fits the budget over both graphs, each searched
        only as far as the other's answer requires; None where no canonical plan of either fits.

        The captured graph's frontier is walked up to the regions' own cost first: a plan there that fits
        costs less than any plan with regions, which is then not traced. Otherwise the graph with regions
        gives its cheapest fit, and the captured graph's walk goes on up to that plan's cost."""
        plain = self.plain.search
        per_fraction = plain.cg.total_T() or 1.0  # a plain candidate's cost is its recompute fraction times this
        cheap = plain.least_recompute(budget_bytes, most=self._region_T / per_fraction)
        if cheap is not None:
            return Choice(self.plain, cheap)
        other = self.with_regions()
        found = self._guarded(lambda: other.search.least_recompute(budget_bytes)) if other else None
        if found is None:
            cheap = plain.least_recompute(budget_bytes)
            return None if cheap is None else Choice(self.plain, cheap)
        best = Choice(other, found)
        cheap = plain.least_recompute(budget_bytes, most=best.cost[0] / per_fraction)
        return best if cheap is None else min(best, Choice(self.plain, cheap), key=lambda c: c.cost)

    def _guarded(self, run: Callable[[], Any]) -> Any:
        """``run()`` on the graph with regions; where it fails (a model the regions do not suit), None and a
        warning: the captured graph's answer stands, and the regions are not tried again."""
        try:
            return run()
        except Exception as error:  # noqa: BLE001 (any failure of the optional graph leaves a complete answer)
            logger.warning("fxplan: planning with recomputed regions failed (%s: %s); planning without them",
                           type(error).__name__, str(error).splitlines()[0][:200] if str(error) else "")
            self._regions, self._with_regions = [], None
            return None

    @property
    def candidates(self) -> int:
        """Candidate plans generated so far, over both graphs (for the log)."""
        return sum(len(v.search.candidates) for v in self.variants)

    @property
    def steps(self) -> int:
        """Plans measured on fake tensors so far, over both graphs (for the log)."""
        return sum(v.search.meter.steps for v in self.variants)


def _attempt(variant: Variant, budget_bytes: int | None, strategy: str) -> Choice | BudgetError:
    try:
        return Choice(variant, variant.search.choose(budget_bytes, strategy))
    except BudgetError as error:
        return error
