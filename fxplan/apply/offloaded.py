"""Offloading on the model's own modules: what the checkpointed modules save, kept in host memory.

A plan applied to the model's modules (:mod:`fxplan.apply.auto`) saves some op outputs of each checkpointed module
for backward; each of them may instead be copied to host memory as it is saved and brought back when backward first
reaches the module (selective checkpointing hands its saved outputs to the saved-tensor hooks of
:mod:`fxplan.rewriter.offload`). Whole modules are offloaded, in the order the forward runs them (the earliest
first, as :func:`fxplan.solvers.offload.offload_order` orders values), as few as the budget needs: the count is found
by bisection on measured fake steps, device and host bytes apart. The copies are priced as the rewrite's are
(:func:`fxplan.solvers.offload.copy_schedule`): a value is made by its op's node and read in backward when backward
reaches the module's last node, where the module's recomputation starts.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from fxplan.apply.regions import RegionPlan
from fxplan.apply.runtime import call_label
from fxplan.costs.host_link import HostLink
from fxplan.planner.trust import negligibly_above
from fxplan.solvers.offload import Offloadable, copy_schedule, fewest_fitting


@dataclass(frozen=True)
class OffloadedStep:
    """What one step of regions with offloads measured: device peak, host peak, and the offloaded calls (label and
    bytes, in the order the forward saved them: :func:`fxplan.rewriter.offload.recording`)."""

    peak_bytes: int
    host_peak_bytes: int
    records: list[tuple[str, int]]


@dataclass(frozen=True)
class OffloadFit:
    """Regions with the first ``count`` offloaded, their step, and the seconds their copies add to it."""

    regions: list[RegionPlan]
    count: int
    step: OffloadedStep
    exposed_seconds: float


class RegionOffloads:
    """The offloading choice for plans applied to one model (module docstring). ``measure(regions)`` runs one fake
    step of the model with ``regions`` on; ``call_nodes[path]`` names the captured graph's node of each op call of
    the module at ``path``; ``node_seconds`` are the forward seconds of the graph's nodes, in order."""

    def __init__(self, measure: Callable[[list[RegionPlan]], OffloadedStep], call_nodes: dict[str, list[str]],
                 node_seconds: dict[str, float], link: HostLink, host_limit: int | None):
        self.measure, self.call_nodes, self.link, self.host_limit = measure, call_nodes, link, host_limit
        self.node_seconds = node_seconds
        self.position = {v: i for i, v in enumerate(node_seconds)}

    def fit(self, regions: list[RegionPlan], budget: int | None) -> OffloadFit | None:
        """The fewest regions to offload (in forward order) for ``budget`` (None: for a device peak within
        ``NEGLIGIBLE`` of offloading all of them), within the host limit; None where there is nothing to offload or the
        host limit leaves nothing."""
        order = [i for i, r in enumerate(regions) if any(r.offloadable)]
        if not order:
            return None
        most = self._with(regions, order, len(order))
        while most is not None and self.host_limit is not None and most.step.host_peak_bytes > self.host_limit \
                and most.count > 0:
            most = self._with(regions, order, most.count // 2)  # halve until the host copies fit
        if most is None or most.count == 0:
            return None
        if budget is not None and most.step.peak_bytes > budget:
            return most
        bar = budget if budget is not None else negligibly_above(most.step.peak_bytes)
        return fewest_fitting(most, most.count, lambda k: self._with(regions, order, k),
                                lambda fit: fit.step.peak_bytes <= bar)

    def _with(self, regions: list[RegionPlan], order: list[int], count: int) -> OffloadFit:
        on = set(order[:count])
        chosen = [r.offloading(i in on) for i, r in enumerate(regions)]
        step = self.measure(chosen)
        return OffloadFit(chosen, count, step, self._exposed(chosen, step.records))

    def _exposed(self, regions: list[RegionPlan], records: list[tuple[str, int]]) -> float:
        """The seconds the recorded copies add to a step (:func:`fxplan.solvers.offload.copy_schedule`)."""
        last_node = {r.path: max((self.position[v] for v in self.call_nodes.get(r.path, ()) if v in self.position),
                                 default=0) for r in regions}
        labels = {call_label(r.path, j): (r.path, j) for r in regions for j, on in enumerate(r.offload) if on}
        values = []
        for label, nbytes in records:
            path, j = labels.get(label, (None, None))
            if path is None:
                continue
            node = self.call_nodes[path][j]
            made = self.position.get(node, last_node[path])
            values.append(Offloadable(label, nbytes, made, last_node[path]))
        schedule = copy_schedule(values, list(self.node_seconds.values()), self.link.bytes_per_s,
                                 overlapped=self.link.overlapped)
        return schedule.exposed_seconds


def call_nodes(ops: dict, regions_paths: set[str] | None = None) -> dict[str, list[str]]:
    """Per module path, the captured graph's node of each op call its forward makes, in order: the calls a region
    of that module decides on (:func:`fxplan.apply.regions.regions_for` takes them in the same order)."""
    out: dict[str, list[str]] = {}
    for name, node in ops.items():
        for path in node.scope:
            if regions_paths is None or path in regions_paths:
                out.setdefault(path, []).extend([name] * len(node.calls))
    return out


def without_offloads(regions: list[RegionPlan]) -> list[RegionPlan]:
    return [replace(r, offload=()) for r in regions]
