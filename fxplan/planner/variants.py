"""One budget search over several graphs of a model: as captured, with its recomputed regions, and with subsets
of them.

A recomputed region keeps a node's output and recomputes, in every backward, cheap values its backward needs:
the BatchNorm and ReLU in front of a convolution (:mod:`fxplan.capture.regions`, ``symbolic_trace`` graphs), or, in any
other graph, a unit of values without FLOPs (a LayerNorm's output, a GELU's products) that matrix products
and pointwise ops keep (:mod:`fxplan.capture.recomputed_inputs`). Memory saved at a fixed price, which a budget may
not need, or need only in part. So the graph with every region is searched as its own model
(:class:`fxplan.planner.search.Search`), and so are graphs with some of the regions (``REGION_SUBSETS``: the regions
that drop the most bytes per unit of recomputation first). The graph with every convolution region is traced,
its subsets' cost graphs spliced from the two traces; the graphs with units are derived from the captured
graph's trace, which probed each saver (:mod:`fxplan.planner.splice`). The choice spans the searches on one scale, the
forward cost recomputed per step (the cost graph's T, the regions' own recomputation included):

- a budget: of the canonical plans of all searches (:class:`fxplan.planner.search.Search`'s candidates, not
  nested) that fit, the one that recomputes least (ties: the lower measured peak). The candidates of all
  graphs are taken in one order of cost and measured in that order where the replay allows a fit, up to
  the first that fits (:class:`_CheapestFit`); a graph with regions joins the order, traced or spliced,
  only once its regions' own cost is reached. The nested plans (:mod:`fxplan.planner.nested`) of the captured graph
  and of the graph with every region are compared the same way where no canonical plan of any graph fits,
  and where one does and they may cost less (:meth:`Searches._cheaper_nested`: a tiny Llama at 0.77 of its
  plain peak was given five segments over every unit, 1.37 of a forward recomputed, though the nested plan
  that 0.76 was given, recomputing 0.92, fits it too);
- no budget (the smallest peak): the least recomputation among the two choices (captured graph, every
  region or unit) within :data:`fxplan.planner.trust.NEGLIGIBLE` of the lower of the two smallest measured peaks;
  the graph with every region or unit is searched first, and the captured graph's plans are measured only
  where their replay may come within that (:meth:`Searches.smallest_choices`);
- ``strategy="memory"``: the lower measured peak of those two.

The graph with every unit of recomputed inputs is searched for the smallest peak too: on
GPT-2 its smallest plan was the captured graph's (docs/rewrite.md), but on a ViT-B (batch 64, 224², the CPU)
``fxplan.rewrite(model, None)`` measured 1.489 GiB without it where a budget of 1.3 GiB was met at 1.284 GiB
with 37 units, and it recomputed less.

Each search is monotone in the budget, so the choice is too: a larger budget never recomputes more (as far
as nested plans are looked for: :meth:`fxplan.planner.search.Search.cheaper_nested`).
The smallest measured peak is the lower of the two searches', and that budget is accepted. ``solver="chen"``
searches the captured graph only: Chen's plans stay the paper's baseline.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import Any

import torch

from fxplan.capture.fakes import DATA_DEPENDENT
from fxplan.capture.regions import Region, dropped_bytes, recompute_cost, regions_of, with_regions
from fxplan.common import heartbeat
from fxplan.costs.trace import trace
from fxplan.errors import BudgetError, FxplanError
from fxplan.planner.candidates import Candidate
from fxplan.planner.plan_meter import MeasuredWork
from fxplan.planner.search import Search
from fxplan.planner.splice import SpliceError, derived, spliced
from fxplan.planner.trust import StepFloor, negligibly_above, replayed_within_trust
from fxplan.rewriter.codegen import SegmentedModule
from fxplan.solvers.costgraph import CostGraph
from fxplan.solvers.plans import Plan, regions_recomputed

logger = logging.getLogger("fxplan")

#: The subsets of the regions searched for a budget besides all of them: the regions ranked by the bytes
#: they drop per unit of T they recompute, cut where the ranking has dropped these fractions of what all of
#: them drop. On DenseNet-161 (batch 16, 112²) the plans over them recomputed 0.03-0.15 of a forward pass less
#: than the better of the captured graph and every region at budgets of 42-65% of the plain step's peak, and
#: measured 1-4% of a step faster (docs/results.md); four subsets planned faster and recomputed up to 0.06 more
#: (docs/planner.md).
REGION_SUBSETS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)

#: The same for units of recomputed inputs: fewer, as units are many and alike (GPT-2: three kinds repeated per
#: layer). On GPT-2 small (batch 2 x 512) the plans over them recomputed at most 0.6 points of a forward pass more
#: than over nine subsets, planned in 10.7 s against 17.5; on timm's ViT-tiny up to 1.1 points more; on the
#: synthetic 3,000-node network the same plan, in 23 s against 32 (docs/planner.md, docs/rewrite.md).
UNIT_SUBSETS = (0.25, 0.5, 0.75)


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
        module.fxplan_plan = self.with_regions(module.fxplan_plan)
        return module

    def finished_plan(self, c: Candidate, budget_bytes: int | None) -> Plan:
        """The candidate's plan as :meth:`result` gives it, without generating its module."""
        return self.with_regions(self.search.finished_plan(c, budget_bytes))

    def with_regions(self, plan: Plan) -> Plan:
        """``plan`` naming this graph's regions and counting their recomputation."""
        if not self.regions:
            return plan
        share = self.region_T / plan.total_T if plan.total_T else 0.0
        return replace(plan, regions=[r.conv for r in self.regions], region_recompute_fraction=share,
                       recompute_fraction=plan.recompute_fraction + share)


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
        self.step_floor = StepFloor(model, example_inputs, loss_fn)  # one model, one step: its graphs share it
        self.work = MeasuredWork()  # and the allowance of fake steps
        self.plain = Variant(self._search(cg), [])
        # Chen's plans stay the paper's baseline (fxplan.planner.search): no regions for solver="chen"
        self._regions = regions_of(cg) if solver != "chen" else []
        self._region_T = recompute_cost(cg, self._regions)  # what any plan with regions recomputes, at least
        self._conv_regions = any(isinstance(r, Region) for r in self._regions)
        self._with_regions: Variant | None = None
        self._subsets: dict[tuple[str, ...], Variant] = {}  # the graphs with some regions, by their convolutions

    @property
    def variants(self) -> list[Variant]:
        """The searches made so far."""
        return [self.plain] + ([self._with_regions] if self._with_regions else []) + list(self._subsets.values())

    def with_regions(self) -> Variant | None:
        """The search over the graph with every recomputed region (traced on first use); None without regions."""
        if not self._regions:
            return None
        if self._with_regions is None:
            t0 = time.perf_counter()
            heartbeat.stage(f"making the graph with {regions_recomputed([r.conv for r in self._regions])} "
                            "recomputed in backward")
            made = self._guarded(lambda: self._graph_with(self._regions))
            if made is None:
                return None
            self._with_regions = Variant(self._search(made), self._regions, self._region_T)
            logger.info("fxplan: made the graph with %s recomputed in backward in %.1f s",
                        regions_recomputed([r.conv for r in self._regions]), time.perf_counter() - t0)
        return self._with_regions

    def _search(self, cg: CostGraph) -> Search:
        return Search(cg, self.model, self.inputs, solver=self.solver, loss_fn=self.loss_fn,
                      step_floor=self.step_floor, work=self.work)

    def _graph_with(self, regions: list) -> CostGraph:
        """The cost graph with ``regions``: derived from the captured graph's trace for units of recomputed inputs
        (:func:`fxplan.planner.splice.derived`), traced for convolution regions (or where the derivation cannot be
        made)."""
        cg = self.plain.search.cg
        if not self._conv_regions:
            try:
                return derived(cg, regions)
            except SpliceError as error:
                logger.info("fxplan: tracing the graph with %s recomputed in backward instead of deriving it (%s)",
                            regions_recomputed([r.conv for r in regions]), error)
        return trace(self.model, self.inputs, cost_model=cg.graph["cost_model"],
                     captured=with_regions(cg.graph["captured"], regions))

    def with_subset(self, subset: list[Region]) -> Variant | None:
        """The search over the graph with the regions ``subset``: for convolution regions, spliced from the captured
        graph's trace and the graph with every region's (:mod:`fxplan.planner.splice`; traced where they do not line
        up); for units, derived from the captured graph's trace. None without regions."""
        key = tuple(r.conv for r in subset)
        if key not in self._subsets:
            cg = self.plain.search.cg
            if self._conv_regions:
                every = self.with_regions()
                if every is None:
                    return None

                def graph() -> CostGraph:
                    try:
                        return spliced(cg, every.search.cg, self._regions, subset)
                    except SpliceError as error:
                        logger.info("fxplan: tracing the graph with %s recomputed in backward instead of splicing "
                                    "it (%s)", regions_recomputed([r.conv for r in subset]), error)
                        return trace(self.model, self.inputs, cost_model=cg.graph["cost_model"],
                                     captured=with_regions(cg.graph["captured"], subset))
            else:
                def graph() -> CostGraph:
                    return self._graph_with(subset)

            made = self._guarded(graph)
            if made is None:
                return None
            self._subsets[key] = Variant(self._search(made), subset, recompute_cost(cg, subset))
        return self._subsets[key]

    def region_subsets(self) -> list[list[Region]]:
        """The subsets of ``REGION_SUBSETS`` (``UNIT_SUBSETS`` for units; module docstring), fewest first, each in
        graph order; neither empty nor every region."""
        cg = self.plain.search.cg
        ranked = sorted(self._regions, key=lambda r: -dropped_bytes(cg, r) / max(recompute_cost(cg, [r]), 1e-12))
        total = sum(dropped_bytes(cg, r) for r in ranked)
        order = {r: i for i, r in enumerate(self._regions)}
        subsets, dropped, k = [], 0, 0
        for fraction in REGION_SUBSETS if self._conv_regions else UNIT_SUBSETS:
            while k < len(ranked) and dropped < fraction * total:
                dropped += dropped_bytes(cg, ranked[k])
                k += 1
            if 0 < k < len(ranked) and (not subsets or len(subsets[-1]) < k):
                subsets.append(sorted(ranked[:k], key=order.__getitem__))
        return subsets

    def lowest(self) -> int:
        """The smallest measured peak of either search (bytes); the captured graph's is not measured where its
        replay rules out that it is lower (:meth:`smallest_choices`)."""
        other = self.with_regions()
        regions = self._guarded(lambda: other.search.lowest().measured) if other else None
        if regions is None:
            return self.plain.search.lowest().measured
        if self._ruled_out(regions - 1):
            return regions
        return min(self.plain.search.lowest().measured, regions)

    def smallest_choices(self, strategy: str) -> list[Choice | BudgetError]:
        """The choices without a budget (``strategy``) of the graphs that may give the answer (module docstring):
        the graph with every region or unit first, then the captured graph unless its replay rules out a plan
        measuring within ``NEGLIGIBLE`` of the first graph's choice (for ``"memory"``: at most its peak). The
        graph with units is the lower on most models (six of eight held-out ones: docs/rewrite.md), and a
        graph ruled out costs no fake step: the replay is vouched for by the first graph's measurements, as
        :class:`_CheapestFit` takes it across graphs."""
        other = self.with_regions()
        first = self._guarded(lambda: _attempt(other, None, strategy)) if other else None
        if not isinstance(first, Choice):
            return [_attempt(self.plain, None, strategy)]
        bar = first.measured if strategy == "memory" else negligibly_above(first.measured)
        if self._ruled_out(bar):
            return [first]
        return [_attempt(self.plain, None, strategy), first]

    def _ruled_out(self, bar: int) -> bool:
        """True if the captured graph's search cannot measure at most ``bar`` by the replay, trusted as
        :meth:`trusted` says on the candidates measured so far
        (:meth:`fxplan.planner.search.Search.may_measure_at_most`)."""
        return self.trusted(self.measured_candidates()) and not self.plain.search.may_measure_at_most(bar)

    def choose(self, budget_bytes: int | None, strategy: str, *, report_smallest: bool = True) -> Choice:
        """The choice for a whole-step budget (bytes; None: the smallest) and strategy (module docstring);
        BudgetError where no search fits, with the smallest measured peak fxplan reaches
        (:meth:`_smallest_feasible`) when ``report_smallest``, else the smaller of the searches' lowest."""
        if budget_bytes is not None and strategy != "memory" and self._regions:
            found = self._cheapest_canonical(budget_bytes)
            if found is not None:
                return self._cheaper_nested(found, budget_bytes)
        if budget_bytes is None:
            outcomes = self.smallest_choices(strategy)
        else:
            plain = _attempt(self.plain, budget_bytes, strategy)
            needs_more = strategy == "memory" or isinstance(plain, BudgetError) or self._region_T < plain.cost[0]
            other = self.with_regions() if needs_more else None
            outcome = self._guarded(lambda: _attempt(other, budget_bytes, strategy)) if other else None
            outcomes = [plain] + ([outcome] if outcome is not None else [])
        fits = [o for o in outcomes if isinstance(o, Choice)]
        if not fits:
            error = min(outcomes, key=lambda e: e.min_feasible_bytes or math.inf)
            raise self._smallest_feasible(budget_bytes, strategy, error) if report_smallest else error
        if strategy == "memory":
            return min(fits, key=lambda c: (c.measured, c.cost))
        if budget_bytes is None:
            limit = negligibly_above(min(c.measured for c in fits))
            fits = [c for c in fits if c.measured <= limit]
        return min(fits, key=lambda c: c.cost)

    def _smallest_feasible(self, budget_bytes: int | None, strategy: str, error: BudgetError) -> BudgetError:
        """``error``, or, where the plan ``fxplan.rewrite(model, None)`` returns peaks lower than it says (a
        nested plan below the searches' lowest canonical one: a 2-layer BART, 2,140,928 bytes against
        2,150,720), the same refusal with that peak, once a budget of that many bytes is seen to be accepted
        (what the message promises)."""
        if budget_bytes is None:
            return error
        try:
            smallest = self.choose(None, strategy).measured
            if error.min_feasible_bytes is not None and smallest >= error.min_feasible_bytes:
                return error
            self.choose(smallest, strategy, report_smallest=False)
        except BudgetError:
            return error
        return self.plain.search.infeasible(budget_bytes, smallest)

    def _cheaper_nested(self, found: Choice, budget_bytes: int) -> Choice:
        """``found``, or a nested plan of the captured graph or of the graph with every region that fits
        ``budget_bytes`` and costs less (:meth:`fxplan.planner.search.Search.cheaper_nested`)."""
        best, bar = found, found.cost[0]  # each graph's nested plans against the canonical plan's cost
        with_regions = self.with_regions() if self._region_T < bar else None  # made only where it could win
        for variant in (self.plain, with_regions):
            total_T = variant.search.cg.total_T() if variant is not None else 0.0
            if total_T <= 0 or variant.region_T >= bar:
                continue
            search, recompute = variant.search, (bar - variant.region_T) / total_T
            nested = (search.cheaper_nested(budget_bytes, recompute) if variant is self.plain
                      else self._guarded(lambda s=search, r=recompute: s.cheaper_nested(budget_bytes, r)))
            if nested is not None and Choice(variant, nested).cost < best.cost:
                best = Choice(variant, nested)
        return best

    def _cheapest_canonical(self, budget_bytes: int) -> Choice | None:
        """The canonical plan (no nesting) of least cost that fits the budget over the captured graph and the
        graphs with regions (:class:`_CheapestFit`); None where no canonical plan of any fits."""
        try:
            return _CheapestFit(self, budget_bytes).run()
        except _RegionsFailed:  # dropped with a warning (_guarded): the captured graph alone
            return self._cheapest_canonical(budget_bytes)

    def graphs_by_cost(self) -> list[tuple[float, Callable[[], Variant | None], bool]]:
        """The graphs a budget is searched over, by their regions' own cost: (that cost, the graph's search
        (made on first call), whether its candidates include the other solvers' smallest plans)."""
        graphs = [(0.0, lambda: self.plain, True)]
        if self._regions:
            cg = self.plain.search.cg
            graphs += [(recompute_cost(cg, subset), lambda subset=subset: self.with_subset(subset), False)
                       for subset in self.region_subsets()]
            graphs.append((self._region_T, self.with_regions, True))
            graphs.sort(key=lambda g: g[0])
        return graphs

    def measured_candidates(self) -> list[Candidate]:
        """The canonical candidates measured so far, of every graph."""
        return [c for v in self.variants for c in v.search.measured_candidates()]

    def trusted(self, measured: list[Candidate]) -> bool:
        """True if every search may trust the replay and every one of ``measured`` (:meth:`measured_candidates`,
        one at least) replayed within ``TRUST`` of its measured peak."""
        return all(v.search.trust_replay for v in self.variants) and replayed_within_trust(measured)

    def _guarded(self, run: Callable[[], Any]) -> Any:
        """``run()`` on the graph with regions; where the regions do not suit the model (fxplan refuses their graph
        or plan, or a step with them fails in PyTorch), None and a warning: the captured graph's answer stands, and
        the regions are not tried again. Any other error is fxplan's own and is raised."""
        try:
            return run()
        except DATA_DEPENDENT:  # the model's step, not the regions: the entry point refuses it
            raise
        except (FxplanError, RuntimeError) as error:
            logger.warning("fxplan: planning with recomputed regions failed (%s: %s); planning without them",
                           type(error).__name__, str(error).splitlines()[0][:200] if str(error) else "")
            self._regions, self._with_regions, self._subsets = [], None, {}
            return None

    @property
    def candidates(self) -> int:
        """Candidate plans generated so far, over both graphs (for the log)."""
        return sum(len(v.search.candidates) for v in self.variants)

    @property
    def steps(self) -> int:
        """Plans measured on fake tensors so far, over every graph, the offloading search's included (for the log)."""
        return self.work.steps


class _RegionsFailed(Exception):
    """Planning with regions failed (and they were dropped, with a warning): start again without them."""


class _CheapestFit:
    """The cheapest canonical fit for a budget over the graphs of :class:`Searches`.

    The candidates of all graphs are taken in one order of cost (each graph's in order of recomputation,
    :meth:`fxplan.planner.search.Search.by_recompute`, merged), and measured in that order where their replay allows a
    fit (:meth:`fxplan.planner.search.Search.could_fit`, trusting the replay as :meth:`Searches.trusted` says; before
    anything is measured, only where the replay predicts a fit, and the candidates passed over then are
    looked at again after the first measurement), until the next candidate costs more than a plan that fits
    (ties: the lower measured peak). A graph joins the order once its regions' own cost is reached (no plan
    of it costs less), so it is spliced or traced only where it could beat the plans found; a subset's
    candidates leave out the other solvers' smallest plans. A failure on a graph with regions drops them
    (:meth:`Searches._guarded`) and raises :class:`_RegionsFailed`."""

    def __init__(self, searches: Searches, budget: int):
        self.searches, self.budget = searches, budget
        self.graphs = searches.graphs_by_cost()
        self.queue: list[tuple[float, int, Variant, Candidate, Iterator[Candidate]]] = []
        self.order = itertools.count()
        self.best: Choice | None = None
        self.passed_over: list[tuple[Variant, Candidate]] | None = []  # None once anything is measured

    def run(self) -> Choice | None:
        while True:
            self._open_graphs()
            if not self.queue or (self.best is not None and self.queue[0][0] > self.best.cost[0]):
                return self.best
            _, _, variant, c, stream = heapq.heappop(self.queue)
            self._on(variant, lambda v=variant, s=stream: self._push(v, s))
            self._on(variant, lambda v=variant, c=c: self._consider(v, c))

    def _open_graphs(self) -> None:
        """Start the graphs whose regions' cost the order has reached."""
        while self.graphs and (not self.queue or self.graphs[0][0] <= self.queue[0][0]) and \
                (self.best is None or self.graphs[0][0] <= self.best.cost[0]):
            _, get, others = self.graphs.pop(0)
            variant = get()
            if variant is None:  # only a graph with regions fails to be made (Searches._guarded warned)
                raise _RegionsFailed
            self._on(variant, lambda v=variant, o=others: self._push(v, v.search.by_recompute(o)))

    def _push(self, variant: Variant, stream: Iterator[Candidate]) -> None:
        c = next(stream, None)
        if c is not None:
            heapq.heappush(self.queue, (variant.recomputed_T(c), next(self.order), variant, c, stream))

    def _consider(self, variant: Variant, c: Candidate) -> None:
        measured = self.searches.measured_candidates()
        first = self.passed_over is not None and not measured
        if first:
            if c.replayed_up_to(self.budget) > self.budget:
                self.passed_over.append((variant, c))
                return
        elif not variant.search.could_fit(c, self.budget, self.searches.trusted(measured)):
            return
        m = variant.search.measure(c)
        if m is not None and m <= self.budget and (self.best is None or Choice(variant, c).cost < self.best.cost):
            self.best = Choice(variant, c)
        if first:  # the replay is judged now: the candidates passed over may fit by its rule
            earlier, self.passed_over = self.passed_over, None
            for v, e in earlier:
                self._on(v, lambda v=v, e=e: self._consider(v, e))

    def _on(self, variant: Variant, run: Callable[[], None]) -> None:
        """``run()``, guarded where ``variant`` is a graph with regions (:meth:`Searches._guarded`)."""
        if variant is self.searches.plain:
            run()
            return
        self.searches._guarded(run)
        if not self.searches._regions:
            raise _RegionsFailed


def _attempt(variant: Variant, budget_bytes: int | None, strategy: str) -> Choice | BudgetError:
    try:
        return Choice(variant, variant.search.choose(budget_bytes, strategy))
    except BudgetError as error:
        return error
