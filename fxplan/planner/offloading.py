"""The measured search with the third choice: keep, recompute or offload each saved value, for a device budget.

The recomputation search (:class:`fxplan.planner.variants.Searches`) gives the base plans: the one of least
recomputation, the one it chooses for the budget, and its smallest. On a base plan, a census step learns which
values the forward really saves for backward (every value not returned as an output is marked, and the step
records those autograd saves or a checkpointed segment keeps: :func:`fxplan.rewriter.offload.recording`). They are
offloaded in the order of :func:`fxplan.solvers.offload.offload_order`, as few as the budget needs: the count is
found by bisection on measured steps (device bytes; the host copies counted apart), within the host-memory limit.
Each way to fit is priced as the extra seconds of one step: recomputation (the cost graph's forward times) plus the
copy time compute cannot hide (:func:`fxplan.solvers.offload.copy_schedule`); the cheapest is chosen. Without a
budget, the lowest device peak is, offloading the fewest values that come within ``NEGLIGIBLE`` of offloading all.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace

from fxplan.common import heartbeat
from fxplan.common.console import format_bytes, format_count
from fxplan.costs.host_link import HostLink
from fxplan.errors import BudgetError, FxplanError
from fxplan.measure.meter import StepStats
from fxplan.planner.trust import negligibly_above
from fxplan.planner.variants import Choice, Searches
from fxplan.rewriter.codegen import SegmentedModule
from fxplan.solvers.offload import CopySchedule, Offloadable, copy_schedule, fewest_fitting, offload_order
from fxplan.solvers.plans import Plan

logger = logging.getLogger("fxplan")


@dataclass
class _Fit:
    """One way to fit: a base plan, the values it offloads, its measured step and the price of its copies."""

    choice: Choice
    plan: Plan
    values: list[Offloadable]
    stats: StepStats
    code: str
    schedule: CopySchedule
    extra_seconds: float


class OffloadSearch:
    """The keep / recompute / offload choice of one model and inputs (module docstring). ``host_limit`` bounds the
    bytes of the host copies (None: no bound)."""

    def __init__(self, searches: Searches, link: HostLink, host_limit: int | None = None):
        self.searches, self.link, self.host_limit = searches, link, host_limit
        self._censuses: dict[int, list[Offloadable]] = {}

    def choose(self, budget_bytes: int | None, strategy: str) -> SegmentedModule:
        """The module of the cheapest way to fit ``budget_bytes`` (None: the lowest device peak)."""
        fits = [fit for fit in (self._fit(base, budget_bytes) for base in self._bases(budget_bytes, strategy))
                if fit is not None]
        if budget_bytes is not None and not any(f.stats.peak_bytes <= budget_bytes for f in fits):
            smallest = self.searches.choose(None, strategy)  # the recomputation search's smallest, offloaded on
            fits += [fit for fit in [self._fit(smallest, budget_bytes)] if fit is not None]
        for f in fits:
            logger.debug("fxplan: offloading %d values on a %d-segment plan: %d device bytes, %.3g s extra",
                         len(f.values), f.plan.num_segments, f.stats.peak_bytes, f.extra_seconds)
        if budget_bytes is None:
            found = min(fits, key=lambda f: (f.stats.peak_bytes, f.extra_seconds))
        else:
            fitting = [f for f in fits if f.stats.peak_bytes <= budget_bytes]
            if not fitting:
                raise self._infeasible(budget_bytes, min(f.stats.peak_bytes for f in fits))
            found = min(fitting, key=lambda f: (f.extra_seconds, f.stats.peak_bytes))
        return self._module(found, budget_bytes)

    def _bases(self, budget_bytes: int | None, strategy: str) -> list[Choice]:
        """The recomputation plans to offload on first: the least recomputing, and the one chosen for the budget, or
        without a budget the smallest (each once). :meth:`choose` adds the smallest where none of them fits."""
        plain = self.searches.plain
        bases = [Choice(plain, next(plain.search.by_recompute(others=False)))]
        try:
            bases.append(self.searches.choose(budget_bytes, strategy))
        except BudgetError:
            pass
        unique: dict[tuple, Choice] = {}
        for b in bases:
            unique.setdefault((id(b.variant), repr(b.candidate.plan.segments), repr(b.candidate.plan.children)), b)
        return list(unique.values())

    def _fit(self, base: Choice, budget_bytes: int | None) -> _Fit | None:
        """The fewest values of ``base``'s census to offload for ``budget_bytes`` (None: for a device peak within
        ``NEGLIGIBLE`` of offloading all of them), measured; the most it can offload where even that does not fit."""
        heartbeat.stage("measuring which saved values to offload")
        values = self._within_host_limit(self._census(base))
        everything = self._measured(base, values)
        if everything is None or (budget_bytes is not None and everything.stats.peak_bytes > budget_bytes):
            return everything
        bar = budget_bytes if budget_bytes is not None else negligibly_above(everything.stats.peak_bytes)
        return fewest_fitting(everything, len(values), lambda k: self._measured(base, values[:k]),
                                lambda fit: fit.stats.peak_bytes <= bar)

    def _census(self, base: Choice) -> list[Offloadable]:
        """The values ``base``'s step saves for backward that may be offloaded, in the order to offload them."""
        key = id(base.candidate)
        if key not in self._censuses:
            cg = base.variant.search.cg
            order = [v for segment in base.candidate.plan.segments for v in segment]
            position = {v: i for i, v in enumerate(order)}
            outputs = _output_storages(cg)
            marked = [v for v in order if _storage_of(cg, v) not in outputs]
            plan = base.candidate.plan
            measured = base.variant.search.meter.measure_offloaded(plan.segments, plan.children, marked)
            if measured is None:
                raise FxplanError("internal error: the rewriter rejects a plan it generated before, with offloads")
            seen, values = set(), []
            for name, nbytes in measured[1]:
                if name not in seen:
                    seen.add(name)
                    readers = [position[w] for w in cg.successors(name)
                               if not cg.edges[name, w].get("order_only") and w in position]
                    values.append(Offloadable(name, nbytes, position[name], max(readers, default=position[name])))
            self._censuses[key] = offload_order(values)
            logger.info("fxplan: %s of a %s plan could be offloaded (%s)", format_count(len(values), "saved value"),
                        format_count(base.candidate.plan.num_segments, "segment"),
                        format_bytes(sum(v.nbytes for v in values)))
        return self._censuses[key]

    def _within_host_limit(self, values: list[Offloadable]) -> list[Offloadable]:
        if self.host_limit is None:
            return values
        kept, total = [], 0
        for v in values:
            if total + v.nbytes > self.host_limit:
                break
            kept.append(v)
            total += v.nbytes
        return kept

    def _measured(self, base: Choice, values: list[Offloadable]) -> _Fit | None:
        plan = base.candidate.plan
        measured = base.variant.search.meter.measure_offloaded(plan.segments, plan.children, [v.name for v in values])
        if measured is None:
            return None
        stats, _, code = measured
        schedule = self._schedule(base, values)
        recompute = base.variant.recomputed_T(base.candidate) * self._seconds_per_T(base)
        return _Fit(base, plan, values, stats, code, schedule, recompute + schedule.exposed_seconds)

    def _schedule(self, base: Choice, values: list[Offloadable]) -> CopySchedule:
        cg = base.variant.search.cg
        segments = base.candidate.plan.segments
        order = [v for segment in segments for v in segment]
        recomputed = [i < len(segments) - 1 for i, segment in enumerate(segments) for _ in segment]
        seconds = [cg.nodes[v]["T"] * self._seconds_per_T(base) for v in order]
        return copy_schedule(values, seconds, self.link.bytes_per_s, overlapped=self.link.overlapped,
                             recomputed=recomputed)

    def _seconds_per_T(self, base: Choice) -> float:
        return seconds_per_T(base.variant.search.cg)

    def _module(self, fit: _Fit, budget_bytes: int | None) -> SegmentedModule:
        """The chosen fit's module over the model, its plan saying what is kept, recomputed and offloaded."""
        base = fit.choice
        planned = base.variant.finished_plan(base.candidate, budget_bytes)
        names = [v.name for v in fit.values]
        module = base.variant.search.meter.module(planned.segments, planned.children, fit.code, names)
        module.fxplan_plan = replace(
            planned, offloaded=names, measured_peak_bytes=fit.stats.peak_bytes,
            host_peak_bytes=fit.stats.host_peak_bytes, copy_seconds=fit.schedule.copy_seconds,
            exposed_copy_seconds=fit.schedule.exposed_seconds, host_link=self.link.source)
        module.fxplan_measured_peak_bytes = fit.stats.peak_bytes
        return module

    def _infeasible(self, budget_bytes: int, smallest: int) -> BudgetError:
        return BudgetError(
            f"no plan fits a measured device peak of {format_bytes(budget_bytes)} ({budget_bytes} bytes), offloading "
            f"included; the smallest fxplan reaches is {format_bytes(smallest)} ({smallest} bytes).",
            min_feasible_bytes=smallest,
            advice="Raise the budget to at least that or reduce the batch size"
                   + (", or allow more host memory" if self.host_limit is not None else "") + ".")


def seconds_per_T(cg) -> float:
    """Seconds per unit of the cost graph's ``T``: what weighs copies against recomputation. An FxplanError where
    ``T`` is not time (FLOPs: the model sits on a device fxplan cannot time here)."""
    T_seconds = cg.graph.get("T_seconds")
    if T_seconds is None:
        raise FxplanError("offloading needs node times to weigh copies against recomputation, and this cost graph "
                          "has none (its costs are FLOPs: the model sits on a device fxplan cannot time here)")
    return T_seconds


def _storage_of(cg, name: str) -> str:
    """The node whose storage ``name``'s value is on (itself, or the node it is a view of)."""
    seen = set()
    while name not in seen:
        seen.add(name)
        owner = cg.nodes[name].get("alias_of")
        if owner is None or owner not in cg.nodes:
            return name
        name = owner
    return name


def _output_storages(cg) -> set[str]:
    """The storages of the values the captured graph returns: the caller holds them through backward, so a host
    copy would free nothing and its copy back would be a second device copy."""
    gm = cg.graph["gm"]
    output = next(n for n in gm.graph.nodes if n.op == "output")
    return {_storage_of(cg, u.name) for u in output.all_input_nodes if u.name in cg.nodes}

