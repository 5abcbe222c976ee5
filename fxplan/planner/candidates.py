"""The candidate plans of one budget search (:class:`Candidates`), replayed and measured on demand.

A search's candidates (:mod:`fxplan.planner.search`, module docstring) are the solver's plans along its frontier
(:class:`fxplan.planner.frontier.Frontier`), generated as they are asked for, and the other planners' plans at their
smallest peaks (:func:`_others_smallest_plans`). Each is a :class:`Candidate`: its replayed peak is computed when first
asked for, and only as far as a comparison needs (:meth:`Candidate.replayed_up_to`); its measured peak, a fake step of
its rewritten module (:class:`fxplan.planner.plan_meter.PlanMeter`), once measured. :func:`in_replay_order` hands them
out by replayed peak, replaying each only as far as it could still come next. :class:`fxplan.planner.search.Search`
chooses among them.
"""

from __future__ import annotations

import heapq
import logging
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from fxplan.common.console import format_count
from fxplan.errors import FxplanError
from fxplan.planner.frontier import SWEEP, Frontier, chen_plans, exact_family_size
from fxplan.planner.plan_meter import MeasuredWork, PlanMeter
from fxplan.planner.planning import (
    check_choices,
    non_activation_bytes,
    plan_graph,
    predicted_min_budget_bytes_graph,
)
from fxplan.planner.replay import AboveCap, Replay, replay
from fxplan.planner.step_model import StepModel, step_model
from fxplan.planner.trust import MARGIN
from fxplan.rewriter.codegen import SegmentedModule
from fxplan.solvers import dp
from fxplan.solvers.costgraph import CostGraph
from fxplan.solvers.plans import Plan

logger = logging.getLogger("fxplan")

#: The search for the smallest peak looks at the frontier's plans from its bottom up to the first that predicts
#: a peak above this many times the least replayed peak (:meth:`Candidates.bottom`; times the most the sweep model
#: over-predicted one of them, where it did). The sweep model predicted the replayed peak of every candidate of
#: ResNet-50, GPT-2, BERT, U-Net, a timm MobileNet and the synthetic 1,000-node network within 0.27x to 1.18x,
#: and of a 7B Llama (hf:llama, meta device) within 1.285x. A no-budget rewrite of GPT-2 with 23 layers (956 nodes)
#: solved 62 plans instead of 123 (docs/planner.md, "The smallest peak from the frontier's bottom").
REACH = 1.5

#: A replay for :meth:`Candidate.replayed_up_to` runs this far beyond its limit (its answers do not change): a search
#: asks one plan for limits a few percent apart (:func:`in_replay_order`'s window, then :meth:`Candidates.may_fit`'s bar
#: over the least measured / replayed ratio), and a replay stopped just above the first limit was made again for
#: the next: 195 of the 566 replays of a no-budget rewrite of the synthetic 1,000-node network, 5 with this slack.
CAP_SLACK = 0.10


@dataclass
class Candidate:
    """One plan of the search: its replayed peaks (replayed when first asked for: most candidates of a
    budget search are never compared by peak), and once measured its peak and generated module."""

    plan: Plan
    replay_step: Callable[[Plan], Replay] | None = field(default=None, repr=False)
    measured: int | None = None
    module: SegmentedModule | None = None
    rejected: bool = False
    peaks: tuple[int, list[int]] | None = None  # (whole step, per segment), from ``replay_step``
    code: str | None = None  # the generated code measured (the module over the model must run it)
    replayed_at_least: int = 0  # a lower bound of the replayed peak, from a replay stopped at a cap (replayed_up_to)
    solvers: set[str] = field(default_factory=set)  # the solvers with this plan among theirs (Search._seeds)

    def _peaks(self) -> tuple[int, list[int]]:
        if self.peaks is None:
            r = self.replay_step(self.plan)
            self.peaks = (r.peak_bytes, r.segment_peak_bytes)
        return self.peaks

    def replayed_up_to(self, limit: float) -> int:
        """The replayed peak where it is at most ``limit``; else a lower bound of it, above ``limit`` by float
        rounding at least, so that a test ``replayed <= f(limit)`` gives the same answer on either. A search
        comparing a plan with a bar replays it only until its peak passes the bar
        (:func:`fxplan.planner.replay.replay`'s ``cap``): most candidates of a search lose early."""
        if limit == math.inf:
            return self.replayed
        cap = int(limit * (1 + 1e-9)) + 1
        if self.peaks is None and self.replayed_at_least <= cap:
            r = self.replay_step(self.plan, int(cap * (1 + CAP_SLACK)))
            if isinstance(r, AboveCap):
                self.replayed_at_least = r.peak_bytes
            else:
                self.peaks = (r.peak_bytes, r.segment_peak_bytes)
        return self.peaks[0] if self.peaks is not None else self.replayed_at_least

    @property
    def replayed(self) -> int:
        return self._peaks()[0]

    @property
    def segment_replayed(self) -> list[int]:
        return self._peaks()[1]

    @property
    def recompute(self) -> float:
        return self.plan.recompute_fraction

    @property
    def peak(self) -> int:
        """The measured peak; the replayed one until measured (a nested plan found by replay)."""
        return self.replayed if self.measured is None else self.measured


class Candidates:
    """The candidates of one model, inputs and solver, generated, replayed and measured on demand (module
    docstring); :class:`fxplan.planner.search.Search` chooses among them."""

    def __init__(self, cg: CostGraph, model: torch.nn.Module, example_inputs: tuple[Any, ...], *, solver: str,
                 loss_fn: Callable[[Any], torch.Tensor] | None = None, work: MeasuredWork | None = None):
        check_choices("time", solver)
        self.cg, self.inputs, self.loss_fn, self.solver = cg, example_inputs, loss_fn, solver
        self.step: StepModel = step_model(cg, model, example_inputs, loss_fn)
        self.ratio = 1.0  # the least measured / replayed peak seen so far, at most 1
        self.model = model
        self.frontier = Frontier(cg, model, solver)
        self._at: dict[int, Candidate | None] = {}  # the solver's own, by frontier position (None: no new plan)
        self._bottom_candidates: list[Candidate] | None = None  # :meth:`bottom`, once made
        self._others_smallest: list[Candidate] | None = None  # other solvers' smallest plans: :meth:`others_smallest`
        self.meter = PlanMeter(cg, example_inputs, loss_fn, work)

    def _candidate(self, p: Plan, walk: bool) -> Candidate | None:
        """A new candidate for ``p`` (replayed when its peak is first asked for); None if a candidate has the same
        plan. A plan of the frontier (``walk``) that one of :meth:`others_smallest` has is the frontier's, whichever
        was made first (the search for the smallest peak makes the others' first): their candidate, with what it
        replayed and measured, moves to the frontier with the frontier's plan."""
        same = [c for c in self.candidates + (self._others_smallest or [])
                if c.plan.segments == p.segments and c.plan.children == p.children]
        if not same:
            return Candidate(p, self._replay, solvers={p.solver})
        c = same[0]
        c.solvers.add(p.solver)
        if not walk or not any(f is c for f in self._others_smallest or []):
            return None
        self._others_smallest = [f for f in self._others_smallest if f is not c]  # new: iterations of the old go on
        c.plan = p
        return c

    def _replay(self, p: Plan, cap: int | None = None) -> Replay | AboveCap:
        return replay(self.cg, self.step, p.segments, cap=cap)

    @property
    def candidates(self) -> list[Candidate]:
        """The solver's own candidates made so far, in the frontier's order
        (:class:`fxplan.planner.frontier.Frontier`)."""
        return [c for _, c in sorted(self._at.items()) if c is not None]

    def _candidate_at(self, k: int) -> Candidate | None:
        """The candidate at the frontier's position ``k``, made once; None where it adds no plan."""
        if k not in self._at:
            p = self.frontier.at(k)
            self._at[k] = None if p is None else self._candidate(p, walk=True)
        return self._at[k]

    def walk(self) -> Iterator[Candidate]:
        """Every candidate in the frontier's order (non-decreasing recomputation), generating plans as they are
        asked for: the first before the frontier's size is known (which solves for the smallest budget)."""
        k = 0
        while k == 0 or k < self.frontier.size:
            c = self._candidate_at(k)
            if c is not None:
                yield c
            k += 1

    def bottom(self) -> list[Candidate]:
        """The candidates that may have the smallest peak, in the frontier's order: generated from the frontier's
        bottom up (the memory-centric plan, the plan at the smallest predicted peak, then the grid's) until a plan
        predicts a peak above ``REACH`` times the least replayed peak of these and :meth:`others_smallest`'s (``REACH``
        times the most any of them replayed below its prediction, where more than 1): the plans above it predict
        higher peaks still (the time-centric DP's plan for a larger budget recomputes less, and one that fitted
        the smaller budget would have been chosen for it). Chen's plans: all (they are made together)."""
        if self._bottom_candidates is None:
            if self.solver == "chen":
                self._bottom_candidates = list(self.walk())
                return self._bottom_candidates
            least, over, found = math.inf, 1.0, []
            for c in self.others_smallest():
                least = min(least, c.replayed_up_to(least))
            for k in reversed(range(self.frontier.size)):
                c = self._candidate_at(k)
                if c is None:
                    continue
                if self.frontier.grid_budget(k) is not None or k == 0:
                    if c.plan.predicted_peak_bytes > REACH * over * least:
                        break
                found.append(c)
                least = min(least, c.replayed_up_to(least))
                if c.peaks is not None:
                    over = max(over, c.plan.predicted_peak_bytes / c.replayed)
            self._bottom_candidates = found[::-1]
        return self._bottom_candidates

    def others_smallest(self) -> list[Candidate]:
        """The other solvers' candidates at their smallest peaks (:func:`_others_smallest_plans`), by recomputation."""
        if self._others_smallest is None:
            self._others_smallest = []
            for p in _others_smallest_plans(self.cg, self.model, self.solver):
                c = self._candidate(p, walk=False)
                if c is not None:
                    self._others_smallest.append(c)
            self._others_smallest.sort(key=lambda c: c.recompute)
        return self._others_smallest

    # ------------------------------------------------------------------------------------ measuring
    def measure(self, c: Candidate) -> int | None:
        """The measured peak of ``c`` (measured once, :class:`fxplan.planner.plan_meter.PlanMeter`); None if the
        rewriter rejects the plan. :meth:`result` generates the chosen plan's module over the model."""
        if c.measured is None and not c.rejected:
            got = self.meter.measure(c.plan.segments, c.plan.children)
            if got is None:
                c.rejected = True
                return None
            c.measured, c.code = got
            logger.debug("candidate: %s, recompute %.3f, replayed %d, measured %d bytes",
                         format_count(c.plan.num_segments, "segment"), c.recompute, c.replayed, c.measured)
            self.ratio = min(self.ratio, c.measured / c.replayed)
        return c.measured

    def may_fit(self, c: Candidate, budget: float) -> bool:
        """False only if ``c`` cannot fit ``budget`` unless the replay errs by more than the margin."""
        return c.replayed_up_to(budget / (self.ratio * (1 - MARGIN))) * self.ratio * (1 - MARGIN) <= budget

    def measured_candidates(self) -> list[Candidate]:
        """The candidates measured so far, the solver's and :meth:`others_smallest`'s."""
        return [c for c in [*self.candidates, *(self._others_smallest or [])] if c.measured is not None]


def in_replay_order(candidates: list[Candidate], done: Callable[[Candidate], bool]) -> Iterator[Candidate]:
    """``candidates`` by replayed peak (ties: least recomputation, then their order), until ``done(c)`` says the
    caller needs no candidate from ``c`` on; ``done`` must be monotone in the replayed peak, as it is asked
    with a lower bound of it (:meth:`Candidate.replayed_up_to`). Each is replayed only as far as it could
    still come next: a search for the smallest peak replays the top of a time-centric frontier (little
    recomputation, a peak several times the smallest) until its peak passes the least seen so far."""
    least: float = math.inf
    heap: list[tuple[int, float, int, bool, Candidate]] = []
    for n, c in sorted(enumerate(candidates), key=lambda nc: nc[1].plan.predicted_peak_bytes or 0):
        value = c.replayed_up_to(least * (1 + _REPLAY_WINDOW))
        exact = c.peaks is not None
        if exact:
            least = min(least, value)
        heapq.heappush(heap, (value, c.recompute, n, exact, c))
    while heap:
        value, recompute, n, exact, c = heap[0]
        if done(c):
            return
        heapq.heappop(heap)
        if exact:
            yield c
        else:
            heapq.heappush(heap, (c.replayed, recompute, n, True, c))


#: How far above the least replayed peak seen so far :func:`in_replay_order` replays candidates in full at
#: first; those above it are replayed to the end only if the caller asks for them.
_REPLAY_WINDOW = 2 * MARGIN


def _others_smallest_plans(cg: CostGraph, model: torch.nn.Module, solver: str) -> list[Plan]:
    """For a DP solver, the other planners' plans at their smallest peaks: Chen's plans, and the other
    DP's time-centric plan at its smallest budget and memory-centric plan (where its family of lower
    sets differs from this solver's; otherwise its plans are this solver's). They join the candidates so
    that the smallest measured peak a DP solver reports is at most every planner's smallest plan's, whichever
    solver was asked for; where the other DP refuses (the exact DP over more moves
    than its cap), without its plans. ``solver="chen"`` stays the paper's baseline: none.
    """
    if solver == "chen":
        return []
    lower_sets, pruned = exact_family_size(cg), dp.context(cg, SWEEP).family(False).S
    plans = chen_plans(cg, model)
    other = "exact" if solver == "approx" else "approx"
    if lower_sets != pruned and (other == "approx" or lower_sets is not None):
        try:
            resident = non_activation_bytes(cg, model)
            lo = predicted_min_budget_bytes_graph(cg, model, solver=other, memory_model=SWEEP, resident=resident)
            plans += [plan_graph(cg, model, lo, strategy="time", solver=other, memory_model=SWEEP, resident=resident),
                      plan_graph(cg, model, None, strategy="memory", solver=other, memory_model=SWEEP,
                                 resident=resident)]
        except FxplanError as exc:  # the exact DP's caps (moves, time): its plans are extras, not the answer
            # The error's advice ("use the approximate DP") is for a user who asked for that DP, not for this
            # search; a user of the approximate DP loses nothing they asked for, so that is said at DEBUG only.
            reason = str(exc).split("; use ")[0]
            logger.log(logging.DEBUG if solver == "approx" else logging.INFO,
                       "fxplan: the candidates leave out the %s DP's smallest plans, which it cannot solve here (%s)",
                       other, reason)
    return plans
