"""The measured budget search behind ``fxplan.rewrite`` and ``fxplan.plan``.

A user's budget is a measured peak (:func:`fxplan.measure_step`); the solvers plan with a memory model.
The search reconciles the two in a way that cannot depend on the budget asked for:

1. **Candidates.** A fixed set of plans per model, inputs and solver, whatever the budget, generated
   lazily (:class:`fxplan.planner.frontier.Frontier`) in order of non-decreasing recomputation: for the DP solvers,
   the time-centric frontier (Kusumoto et al., sections 4.2-4.4): the plan without recomputation, the plans
   for a fixed grid of budgets below its predicted peak, then the plan at the solver's smallest predicted peak
   and the memory-centric plan, planned with the sweep memory model (:mod:`fxplan.solvers.sweep_model`), which ranks
   plans as measured far better than the autograd model (except the exact DP on lattices too large for its
   family engine). A budget search takes them from the top; the search for the smallest peak from the bottom,
   as far as they may come near the smallest (:meth:`Search.bottom`, ``REACH``). For Chen's solver, the
   plans of Algorithm 3 over its grid of B (:func:`fxplan.solvers.chen.greedy_plans`) and the √n plan. A DP solver's
   candidates also include the other planners' plans at their smallest peaks (``_others_smallest_plans``: Chen's
   plans, the other DP's), so its smallest peak is at most any of theirs; ``solver="chen"`` is the paper's
   baseline and keeps to Chen's plans. The candidates are :mod:`fxplan.planner.candidates`' (generated, replayed
   and measured as they are asked for); this module chooses among them.
2. **Prediction.** Each candidate's peak is predicted by replaying its step
   (:func:`fxplan.planner.replay.replay`, exact or nearly on the plans measured: docs/rewrite.md) and its
   recomputation is known exactly (``recompute_fraction``).
3. **Choice.** For a budget B: the candidate of least recomputation whose *measured* peak is at
   most B (ties: the lower measured peak). Without a budget: the least recomputation among the
   candidates whose measured peak is within ``NEGLIGIBLE`` of the smallest measured peak, so a plan
   that saves nothing measurable recomputes nothing. Memory-centric: the smallest measured peak.
   Candidates are measured lazily (on fake tensors, exact): one whose replayed peak, scaled by the
   smallest ratio of measured to replayed peak seen so far, is above B / (1 - ``MARGIN``) is taken not
   to fit without measuring it, which is exact as long as the replay does not over-predict one plan by
   more than ``MARGIN`` beyond the plans measured. Once every candidate measured replayed within
   ``TRUST`` of its measurement, a budget's candidates are ruled out where their replay is above
   B / (1 - ``TRUST``).

4. **Below the canonical plans.** When no candidate fits B, and for the smallest peak (no budget, or
   ``strategy="memory"``), the nested search of :mod:`fxplan.planner.nested` starts from the candidate of least
   measured peak, from each other solver's smallest candidate and from their solvers' next plans by measured
   peak (:meth:`Search._seeds`, within a budget of measurements per solver), and looks for a nested plan
   (sub-segments checkpointed inside segments) that measures lower; the lowest found is taken
   (:meth:`Search.lowest`); at that peak, and at a budget below every canonical plan, the plan returned is the
   least recomputation among the nested plans measured that fit (:meth:`fxplan.planner.nested.NestedSearch.cheapest`).
   At a budget some canonical plan fits, a nested plan that fits and recomputes less is returned instead,
   looked for where the canonical plan recomputes at least as much as one of the other solvers' smallest plans
   (:meth:`Search.cheaper_nested`). The nested search measures at most
   :func:`fxplan.planner.nested.measurement_budget` candidates per starting plan (48, fewer above 500 nodes, none
   above 24,000) and as many for all of a solver's starting plans together, and only moves whose replayed peak
   could win. Where the replay predicted every candidate measured before the nested search to within
   ``TRUST``, the nested search ranks its moves by replay and measures none: the nested plan it takes is
   measured (and so is any nested plan chosen for a budget), and one that measures above its replay by more
   than ``TRUST`` (``NESTED_SLACK`` for the lowest where it still measures below every canonical plan; a cheaper
   one is set aside ``NESTED_MISSES`` times first), or above the budget, sends the search back to measuring
   every move: the fake-tensor step stays the final check. Where nesting gains nothing, results are the
   canonical search's; where it does, a budget below the canonical plans is met instead of refused.

Because the candidate set does not depend on B and the choice is "least recomputation among those
that fit", a larger budget never gets more recomputation, and its plan is never one that a smaller
budget's plan beats on both peak and recomputation; for the nested plans, as far as they are looked for
(:meth:`Search.cheaper_nested` says where not). The smallest measured peak over all candidates
and the nested plans found from them is what ``BudgetError.min_feasible_bytes`` reports, and exactly
that budget is accepted.
"""

from __future__ import annotations

import heapq
import logging
import sys
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import Any

import torch

from fxplan.common import heartbeat
from fxplan.common.console import format_bytes
from fxplan.errors import BudgetError, FxplanError
from fxplan.planner.candidates import Candidate, Candidates, in_replay_order
from fxplan.planner.near_replay import NearReplays
from fxplan.planner.nested import NestedResult, NestedSearch
from fxplan.planner.plan_meter import MeasuredWork
from fxplan.planner.planning import check_choices
from fxplan.planner.trust import (
    MARGIN,
    NESTED_MISSES,
    NESTED_SLACK,
    TRUST,
    StepFloor,
    negligibly_above,
    replayed_within_trust,
)
from fxplan.rewriter.codegen import SegmentedModule
from fxplan.solvers import subplans
from fxplan.solvers.costgraph import CostGraph
from fxplan.solvers.plans import Plan
from fxplan.solvers.subplans import Block

logger = logging.getLogger("fxplan")

#: The nested search starts from at most this many plans per solver (:meth:`Search._seeds`), all of a solver's
#: within ``fxplan.planner.nested.SEEDS_MEASUREMENTS`` times one search's measurements; a start that lowers nothing
#: costs one round of moves at most (``fxplan.planner.nested.MOVES_PER_ROUND`` measurements, fewer once replayed).
SEEDS_PER_SOLVER = 8

class Search(Candidates):
    """The choice among the candidates of one model, inputs and solver, and the nested plans below them (module
    docstring); the candidates themselves are :class:`fxplan.planner.candidates.Candidates`'."""

    def __init__(self, cg: CostGraph, model: torch.nn.Module, example_inputs: tuple[Any, ...], *, solver: str,
                 loss_fn: Callable[[Any], torch.Tensor] | None = None, trust_replay: bool = True,
                 step_floor: StepFloor | None = None, work: MeasuredWork | None = None):
        super().__init__(cg, model, example_inputs, solver=solver, loss_fn=loss_fn, work=work)
        self.step_floor = step_floor or StepFloor(model, example_inputs, loss_fn)
        self.trust_replay = trust_replay  # may the nested search rank by replay (TRUST)? False: it measures
        self._near = NearReplays(cg, self.step)  # the nested search's moves, replayed from the tree they move
        self._lowest: Candidate | None = None
        self._nested: NestedSearch | None = None  # the nested search of :meth:`lowest`, once run
        self._by_replay: tuple[Candidate, Candidate] | None = None  # (start, lowest found): :meth:`_replayed_lowest`
        self._nested_candidates: dict[tuple, Candidate] = {}  # by plan: :meth:`_nested_candidate`
        self._misses = 0  # nested plans chosen by replay that measured above what they had to fit: _confirmed
        self._vouching: list[Candidate] = []  # a nested plan measured in place of the canonical ones: _nested_first

    def _replay_tree(self, blocks: list[Block], cap: int | None = None, base: list[Block] | None = None) -> int:
        return self._near.replay(blocks, cap, base).peak_bytes

    # ------------------------------------------------------------------------------------ choosing
    def smallest(self) -> Candidate:
        """The candidate of least measured peak (ties: least recomputation)."""
        best = self._smallest_of([*self.bottom(), *self.others_smallest()])
        if best is None:
            raise FxplanError("the rewriter rejected every candidate plan; see the debug log of 'fxplan'")
        return best

    def _smallest_of(self, candidates: list[Candidate]) -> Candidate | None:
        """The least measured peak of ``candidates`` (ties: least recomputation), measuring those whose replay
        may beat the best measured so far (the margin of :meth:`may_fit`). Once the replay is trusted
        (:meth:`_trusted`), the least replayed peak (ties: least recomputation), measured: another
        candidate could measure lower by at most twice ``TRUST``."""
        best: Candidate | None = None
        heartbeat.stage("measuring the canonical plans of least peak")

        def done(c: Candidate) -> bool:
            return best is not None and (self._trusted() or not self.may_fit(c, best.measured)
                                         or self.step_floor.reached(best.measured) or self.meter.work.spent)

        for c in in_replay_order(candidates, done):
            m = self.measure(c)
            if m is not None and (best is None or (m, c.recompute) < (best.measured, best.recompute)):
                best = c
        return best

    def lowest(self) -> Candidate:
        """The candidate of least measured peak, nested plans included: the canonical plan of
        :meth:`smallest`, or the lowest nested plan :mod:`fxplan.planner.nested` finds from :meth:`_seeds`.

        The nested search trusts the replay (ranks its moves by replayed peaks, measuring none) where every
        candidate measured so far replayed within ``TRUST`` (where none is, the plan it finds may be measured first
        and vouch for the replay itself: :meth:`_nested_first`); the plan it finds is then measured, and if
        the replay under-predicted it by more than ``TRUST``, the search is made again, measuring, unless by at
        most ``NESTED_SLACK`` with the plan still measuring below :meth:`smallest`'s: then it is kept at its
        measured peak (and after the search made again, where that search finds nothing lower). No nested search
        is made where :meth:`smallest` measures within ``FLOOR_SLACK`` of the
        physical floor."""
        if self._lowest is None:
            heartbeat.stage("solving and replaying the canonical plans of least peak")
            self._lowest = self._nested_first()
        if self._lowest is None:
            smallest = self.smallest()  # measures the candidates the replay is judged by
            if self.step_floor.reached(smallest.measured):  # what a nested plan could still gain is negligible
                self._lowest = smallest
                return smallest
            trusted = self._trusted()
            self._lowest = self._replayed_lowest(smallest) if trusted else self._nested_search(smallest, False)
            if trusted and self._lowest is not smallest:  # a nested plan found by replay (measured by now or not)
                found, m = self._lowest, self.measure(self._lowest)
                if m is not None and m <= found.replayed * (1 + TRUST):
                    if m >= smallest.measured:  # replayed lower, measured not: within TRUST
                        self._lowest = smallest
                elif m is not None and m <= found.replayed * (1 + NESTED_SLACK) and m < smallest.measured:
                    logger.debug("the lowest nested plan measured %d bytes, replayed %d: kept", m, found.replayed)
                    self._correct_nested(found, m)
                else:
                    self._distrust(f"its nested plan measured {m} bytes, replayed {found.replayed}")
                    again = self._nested_search(smallest, False)
                    # what the replay found and was measured stays a plan to choose
                    self._lowest = found if m is not None and (m, found.recompute) < (again.peak, again.recompute) \
                        else again
        return self._lowest

    def _nested_first(self) -> Candidate | None:
        """Where nothing is measured yet and the replay may be trusted, the lowest nested plan found by replay from
        the least replayed canonical plan (:meth:`_replayed_lowest`), measured first. If it measures within ``TRUST``
        of its replay and below what the canonical plans could measure were the replay as close on them (``TRUST``
        below the least replayed), it is the lowest plan and vouches for the replay as a measured canonical plan
        would (:meth:`measured_candidates`): a no-budget rewrite whose smallest plan is nested spends one fake step
        less. Else None: :meth:`lowest` measures the canonical plans and judges this plan as before."""
        if not self.trust_replay or self.measured_candidates():
            return None
        start = next(in_replay_order([*self.bottom(), *self.others_smallest()], lambda c: False), None)
        found = self._replayed_lowest(start) if start is not None else None
        if found is None or found is start:
            return None
        m = self.measure(found)
        if m is None or not replayed_within_trust([found]) or m >= start.replayed * (1 - TRUST):
            return None
        self._vouching.append(found)
        return found

    def may_measure_at_most(self, bar: int) -> bool:
        """False if no plan of this search measures at most ``bar`` bytes, judged by the replay where nothing is
        measured yet: its lowest plan by replay (:meth:`_replayed_lowest` from the least replayed candidate)
        replays above ``bar`` by more than ``TRUST``. For a search whose replay another search of the same
        trace vouches for (:meth:`fxplan.planner.variants.Searches.smallest_choices`); :meth:`lowest` reuses what it
        finds."""
        if self._lowest is not None:
            return self._lowest.measured <= bar
        start = next(in_replay_order([*self.bottom(), *self.others_smallest()], lambda c: False))
        return self._replayed_lowest(start).peak * (1 - TRUST) <= bar

    def _replayed_lowest(self, start: Candidate) -> Candidate:
        """The lowest of ``start`` and the nested plans found from it by replay alone (:meth:`_nested_search`,
        trusted), kept per start: the same search whether or not anything was measured before it."""
        if self._by_replay is None or self._by_replay[0] is not start:
            self._by_replay = start, self._nested_search(start, True)
        return self._by_replay[1]

    def _nested_search(self, lowest: Candidate, trusted: bool) -> Candidate:
        """The lowest of ``lowest`` (:meth:`smallest`) and the nested plans found from :meth:`_seeds` (ranked by
        replay if ``trusted``, then not measured), keeping the nested search for :meth:`_nested_fit`."""
        heartbeat.stage("searching nested plans below the canonical ones" + (" by replay" if trusted else ""))
        self._nested = nested = NestedSearch(self.cg, self.meter, replayed=self._replay_tree, trusted=trusted)
        found_at, started = None, set()
        for group in self._seeds(trusted, lowest) if nested.max_measurements > 0 else []:
            nested.start_group()  # a budget per solver: see _seeds
            for seed in group:
                if nested.total_left <= 0 or nested.spent:
                    break
                if id(seed) in started:  # a plan of two solvers: searched from once
                    continue
                started.add(id(seed))
                found = nested.improve(seed.plan, seed.replayed if trusted else seed.peak, seed.segment_replayed)
                # found.measured is replayed where the search trusts the replay: compared with a replay
                if found is not None and found.measured < (lowest.replayed if trusted else lowest.measured):
                    lowest, found_at = self._nested_candidate(found, seed.plan), (found, seed.plan)
        if found_at is not None:  # plans of that peak that recompute less join nested.measured
            heartbeat.stage("searching nested plans of that peak that recompute less")
            nested.cheapen(*found_at)
        return lowest

    def _trusted(self) -> bool:
        """True if the replay may rank candidates: every candidate measured so far (one at least) replayed
        within ``TRUST`` of its measured peak, and no nested plan found by replay measured otherwise."""
        return self.trust_replay and replayed_within_trust(self.measured_candidates())

    def measured_candidates(self) -> list[Candidate]:
        """The candidates measured so far that the replay is judged by: the canonical ones, and a nested plan that
        vouched for the replay in their place (:meth:`_nested_first`)."""
        return super().measured_candidates() + self._vouching

    def _distrust(self, why: str) -> None:
        """Forget the nested plans ranked by replay: from now on the nested search measures its moves."""
        logger.info("fxplan: the replay missed a nested plan (%s); searching again, measuring", why)
        self.trust_replay, self._lowest, self._nested, self._by_replay = False, None, None, None

    def _confirmed(self, c: Candidate, limit: int, budget_bytes: int | None, strategy: str) -> Candidate:
        """``c``, measured, if it measures at most ``limit``; else (a nested plan the replay under-predicted)
        the choice made again: without that plan where it is not the lowest plan (whose peak :meth:`lowest`
        measured) and fewer than ``NESTED_MISSES`` have missed so far, else with a nested search that
        measures its moves."""
        return c if self._measured_within(c, limit) else self.choose(budget_bytes, strategy)

    def _measured_within(self, c: Candidate, limit: int) -> bool:
        """True if ``c`` is measured already or measures at most ``limit``; else (a nested plan the replay
        under-predicted) False, that plan judged by its measured peak from now on where it is not the lowest
        plan and fewer than ``NESTED_MISSES`` have missed so far, else the replay distrusted."""
        if c.measured is not None:
            return True
        m = self.measure(c)
        if m is not None and m <= limit:
            return True
        self._misses += 1
        if c is not self._lowest and self._misses < NESTED_MISSES and self._correct_nested(c, m):
            logger.debug("a nested plan measured %s bytes, replayed %d: the next cheapest", m, c.replayed)
        else:
            self._distrust(f"measured {m} bytes, replayed {c.replayed}, needed at most {limit}")
        return False

    def _correct_nested(self, c: Candidate, measured: int | None) -> bool:
        """Have the nested search judge its plan ``c`` by ``measured`` (None: rejected) instead of its replay
        (:meth:`fxplan.planner.nested.NestedSearch.correct`); False if ``c`` is not one of its plans."""
        key = next((k for k, v in self._nested_candidates.items() if v is c), None)
        if key is not None:
            self._nested.correct(key[0], sys.maxsize if measured is None else measured)
        return key is not None

    def cheaper_nested(self, budget: int, recompute: float) -> Candidate | None:
        """The nested plan of least recomputation that measures at most ``budget``, where it recomputes less than
        ``recompute`` (a canonical plan's that fits); else None. The nested plans are the ones :meth:`lowest`
        finds, the same at every budget, so a budget above the canonical plans' smallest peak is not given more
        recomputation than a nested plan that fits it (which a smaller budget is given). They are looked for
        only where ``recompute`` is at least that of the least recomputing of the plans at the other solvers'
        smallest peaks (:meth:`others_smallest`; Chen's: all its plans), near which the nested search starts: the search
        costs fake steps (at a middle budget of the synthetic 3,000-node network, 33 s became 100 s), and
        budgets well above the smallest peak have canonical plans that recompute less. Not a bound: a nested plan
        may recompute less than every one of those plans (a tiny Llama's smallest nested plan over every
        unit, 0.78 against 1.28) and so beat a canonical plan that recomputes less than they do."""
        if recompute <= 0:
            return None
        reference = self.others_smallest() or list(self.walk())
        if not reference or recompute < min(c.recompute for c in reference):
            return None
        while True:
            self.lowest()
            c = self._nested_fit(budget)
            if c is None or c.recompute >= recompute:
                return None
            if self._measured_within(c, budget):
                return c

    def _nested_fit(self, budget: int) -> Candidate | None:
        """The nested plan of least recomputation measured by :meth:`lowest` whose peak is at most ``budget``."""
        got = self._nested.cheapest(budget) if self._nested is not None else None
        if got is None:
            return None
        return self._nested_candidate(*got)

    def _nested_candidate(self, found: NestedResult, seed: Plan) -> Candidate:
        """A nested plan the nested search found (from the plan ``seed``), as a candidate of its measured peak
        and code (:meth:`result` generates its module); not measured yet where the search ranked by replay
        (``found.code`` None: ``found.measured`` is its replayed peak). One candidate per plan, so that each
        is measured at most once."""
        key = (repr(found.blocks), found.recompute_fraction)
        if key not in self._nested_candidates:
            self._nested_candidates[key] = Candidate(found.plan(self.cg, seed), peaks=(found.measured, []))
        c = self._nested_candidates[key]
        if c.measured is None and found.code is not None:
            c.measured, c.code = found.measured, found.code
        return c

    def _seeds(self, trusted: bool, best: Candidate) -> list[list[Candidate]]:
        """Where the nested search starts, one list per solver: ``best`` (the smallest candidate), then the
        smallest of each other solver's candidates (so a DP solver's search starts where ``solver="chen"``'s
        does, and ends at most as high); after each, its solver's other plans whose replay is within the margin
        of :meth:`may_fit` of the first's peak, by peak (at most ``SEEDS_PER_SOLVER`` in all; ``trusted``: by
        replayed peaks alone, measuring none and reading no measurement, so that the search is the same before
        and after the candidates are measured), each searched while the solver's budget of measurements lasts
        (:meth:`lowest` keeps the lowest; the budget is per solver, so that the search from Chen's plans
        is the one ``solver="chen"`` makes). The search is local, and where it ends depends on where it
        starts: on ResNet-50 at batch 96 it lowers nothing from the approximate DP's smallest plan (2.39
        GiB) but goes from Chen's (2.76 GiB) to 2.25 GiB (docs/rewrite.md); at batch 8 four of Chen's plans
        measure the same peak and lead to different ends."""
        by_solver: dict[str, list[Candidate]] = {}  # a plan several solvers have is in each one's list
        for c in [*self.bottom(), *self.others_smallest()]:
            for solver in sorted(c.solvers):
                by_solver.setdefault(solver, []).append(c)
        groups = []
        for solver, group in sorted(by_solver.items(), key=lambda item: item[0] != best.plan.solver):
            if solver == best.plan.solver:
                low = best
            elif trusted:
                low = next(in_replay_order(group, lambda c: False))
            else:
                low = self._smallest_of(group)
            if low is None:
                continue
            if trusted:
                near = [c for c in group if c is not low and not c.rejected
                        and c.replayed_up_to(low.replayed / (1 - MARGIN)) * (1 - MARGIN) <= low.replayed]
                others = sorted(near, key=lambda c: (c.replayed, c.recompute))
            else:
                near = [c for c in group if c is not low and not c.rejected and self.may_fit(c, low.peak)]
                others = sorted((c for c in near if self.measure(c) is not None), key=lambda c: (c.peak, c.recompute))
            groups.append([low, *others][:SEEDS_PER_SOLVER])
        return groups

    def least_recompute(self, budget: int, near_smallest: bool = False) -> Candidate | None:
        """The candidate of least recomputation whose measured peak is at most ``budget`` (ties: lower peak);
        ``near_smallest``: a budget within ``NEGLIGIBLE`` of the smallest peak, which only the frontier's bottom
        (:meth:`bottom`) may fit.

        Where nothing is measured yet, the first measurement is of the candidate of least recomputation that
        the replay says fits: where the replay is right, it is trusted from then on (:meth:`could_fit`) and
        that candidate is the answer, in one fake step."""
        walk = self.bottom if near_smallest else self.walk
        if self.trust_replay and not self.measured_candidates():
            first = next((c for plans in (walk, self.others_smallest) for c in plans()
                          if c.replayed_up_to(budget) <= budget), None)
            if first is not None:
                self.measure(first)
        found: Candidate | None = None
        for c in walk():  # recomputation never decreases along the walk
            if found is not None and c.recompute > found.recompute:
                break
            found = self._better(c, found, budget)
        if found is None or found.recompute > 0:
            for c in self.others_smallest():
                if found is not None and c.recompute > found.recompute:
                    break
                found = self._better(c, found, budget)
        return found

    def by_recompute(self, others: bool = True) -> Iterator[Candidate]:
        """The candidates in order of non-decreasing recomputation, generated as they are asked for: the walk's,
        and (``others``) the other solvers' smallest plans (:meth:`others_smallest`, made once a plan that recomputes
        anything is asked for)."""
        walk = self.walk()
        first = next(walk, None)
        if first is not None:
            yield first
        if others:
            yield from heapq.merge(walk, self.others_smallest(), key=lambda c: c.recompute)
        else:
            yield from walk

    def could_fit(self, c: Candidate, budget: int, trusted: bool) -> bool:
        """False if ``c``'s replayed peak rules out a measured peak within ``budget``: by more than ``TRUST``
        where the replay is ``trusted`` (every candidate measured so far replayed within it), else by the
        margin of :meth:`may_fit`."""
        if trusted:
            return c.replayed_up_to(budget / (1 - TRUST)) * (1 - TRUST) <= budget
        return self.may_fit(c, budget)

    def _better(self, c: Candidate, found: Candidate | None, budget: int) -> Candidate | None:
        """``c`` if it fits ``budget`` and beats ``found`` (less recomputation, ties: lower peak), else ``found``;
        ``c`` is measured unless :meth:`could_fit` rules it out."""
        if not self.could_fit(c, budget, self._trusted()):
            return found
        m = self.measure(c)
        if m is None or m > budget:
            return found
        if found is None or (c.recompute, m) < (found.recompute, found.measured):
            return c
        return found

    def choose(self, budget_bytes: int | None, strategy: str) -> Candidate:
        """The candidate for a whole-step budget (bytes; None: the smallest) and strategy (module docstring)."""
        check_choices(strategy, "approx")
        if strategy == "memory" or budget_bytes is None:
            best = self.lowest()
            if budget_bytes is not None and best.measured > budget_bytes:  # a nested plan may still fit
                nested = self._nested_fit(budget_bytes)
                if nested is None:
                    raise self.infeasible(budget_bytes, best.measured)
                return self._confirmed(nested, budget_bytes, budget_bytes, strategy)
            limit = best.measured if strategy == "memory" else negligibly_above(best.measured)
            fits = [best, self._nested_fit(limit)] + ([] if strategy == "memory" else
                                                      [self.least_recompute(limit, near_smallest=True)])
            found = min((c for c in fits if c is not None), key=lambda c: (c.recompute, c.peak))
            return self._confirmed(found, limit, budget_bytes, strategy)
        found = self.least_recompute(budget_bytes)
        if found is not None:
            return self.cheaper_nested(budget_bytes, found.recompute) or found
        lowest = self.lowest()  # below every canonical plan: the cheapest nested one that fits
        found = self._nested_fit(budget_bytes) or lowest
        if found.peak > budget_bytes:
            raise self.infeasible(budget_bytes, lowest.measured)
        return self._confirmed(found, budget_bytes, budget_bytes, strategy)

    def infeasible(self, budget_bytes: int, smallest: int) -> BudgetError:
        """The :class:`BudgetError` for ``budget_bytes``, ``smallest`` the least measured peak found."""
        if self.solver == "chen":
            whose = "Chen's plans reach (the chen solver, the paper's baseline; the DP solvers may reach lower)"
        else:
            whose = (f"fxplan reaches with the {self.solver} solver (its search including Chen's and the other DP's "
                     "plans)")
        return BudgetError(
            f"no plan fits a measured peak of {format_bytes(budget_bytes)} ({budget_bytes} bytes); the smallest "
            f"measured peak {whose} is {format_bytes(smallest)} ({smallest} bytes).",
            min_feasible_bytes=smallest,
            advice=f"Raise the budget to at least that (budget_bytes={smallest} is accepted) or reduce the batch size.",
        )

    def _early_stop(self, p: Plan) -> float:
        """``Plan.early_stop_fraction`` of ``p``."""
        T = {v: self.cg.nodes[v]["T"] for v in self.cg.nodes}
        blocks = subplans.tree(p.segments, p.children)
        return subplans.early_stop_cost(blocks, subplans.SaveFacts.of(self.cg.nodes), T) / (sum(T.values()) or 1.0)

    def result(self, c: Candidate, budget_bytes: int | None) -> SegmentedModule:
        """The chosen candidate's module, carrying its plan with replayed and measured peaks."""
        if c.module is None:
            c.module = self.meter.module(c.plan.segments, c.plan.children, c.code)
        c.module.fxplan_plan = self.finished_plan(c, budget_bytes)
        c.module.fxplan_measured_peak_bytes = c.measured
        return c.module

    def finished_plan(self, c: Candidate, budget_bytes: int | None) -> Plan:
        """The candidate's plan with its replayed and measured peaks, the budget and what the step recomputes."""
        return replace(c.plan, predicted_peak_bytes=c.replayed, segment_peak_bytes=list(c.segment_replayed),
                       memory_model=c.plan.memory_model if c.plan.children else "replay",
                       measured_peak_bytes=c.measured, budget_bytes=budget_bytes,
                       T_seconds=self.cg.graph.get("T_seconds"), early_stop_fraction=self._early_stop(c.plan))
