"""The result of planning: an increasing sequence of lower sets and what it is predicted to cost.

A :class:`Plan` is what every solver returns (:func:`fxplan.solvers.dp.solve`, :func:`fxplan.solvers.chen.solve`) and
what the rewriter consumes. Segment ``i`` is ``L_i \\ L_{i-1}`` (Kusumoto et al., section 3); every segment but
the last is run under recomputation, and only the boundary values ``∂(L_i)`` cross segments.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

from fxplan.common.console import format_bytes, format_count
from fxplan.solvers.units import PREFIX as UNIT_PREFIX
from fxplan.solvers.units import Unit


def regions_recomputed(regions: list[str]) -> str:
    """What a plan's ``regions`` (by name) recompute in backward, counted as the plan's summary and the search's log
    both say it: the distinct cheap values that units of recomputed inputs drop (``13 cheap values``: several units
    may share none, one unit drops several), or the convolutions whose BatchNorm and ReLU are recomputed."""
    units = [r for r in regions if r.startswith(UNIT_PREFIX)]
    if len(units) < len(regions):
        return f"the BatchNorm and ReLU in front of {format_count(len(regions) - len(units), 'convolution')}"
    return format_count(len({v for u in units for v in Unit.parse(u).dropped}), "cheap value")


def recompute_note(fraction: float, plan: Plan | None = None) -> str:
    """Why a recompute share above one forward pass is possible, to show beside it (``''`` at or below 100%): a value
    is recomputed more than once where a nested plan re-runs a sub-segment at each level holding it, or where a unit
    of recomputed inputs recomputes a cheap value in the backward of each node that keeps it. With ``plan``, the
    reasons that plan has; without, both."""
    if fraction <= 1.0 + 1e-9:
        return ""
    reasons = []
    if plan is None or plan.children:
        reasons.append("nested plan, a sub-segment is recomputed again at each level")
    if plan is None or any(r.startswith(UNIT_PREFIX) for r in plan.regions):
        reasons.append("a cheap value is recomputed for each node that keeps it")
    if plan is not None and any(not r.startswith(UNIT_PREFIX) for r in plan.regions):
        reasons.append("the BatchNorm and ReLU in front of a convolution are recomputed inside recomputed segments too")
    if not reasons:
        reasons.append("a value is recomputed in more than one segment's backward")
    return f" (values recomputed more than once: {'; '.join(reasons)})"


def _fmt_seconds(s: float) -> str:
    return f"{s:.3g} s" if s >= 1 else f"{1000 * s:.3g} ms"


@dataclass
class Plan:
    """A recomputation plan (canonical strategy of Kusumoto et al. 2019, section 3).

    Fields:

    ``segments``            node names per segment, segments in execution order, each in topological order;
                            segment i = L_i \\ L_{i-1}; together a partition of V
    ``lower_sets``          L_1, …, L_k = V as node-name lists (cumulative unions of ``segments``)
    ``boundaries``          per segment, its members still needed by later segments: ∂(L_i) ∩ V_i, the
                            values the forward pass caches
    ``predicted_peak_bytes`` the memory model's peak: from the graph solvers, activations and their
                            gradients only; from ``fxplan.planner.planning.plan_graph``, the whole step
                            (parameters, their gradients, buffers and inputs added); from ``fxplan.plan``
                            / ``fxplan.rewrite``, the whole step replayed node by node (``memory_model``
                            is then ``"replay"``, :mod:`fxplan.planner.replay`), within a few percent of
                            ``measured_peak_bytes``
    ``segment_peak_bytes``  the model's peak while each segment's backward runs
    ``overhead``            the objective the solver minimised: Σ H over segments under ``memory_model``
                            (``"paper"``: equation (1), T(V \\ U_k); ``"autograd"``: T of every segment but
                            the last, which is not recomputed)
    ``recompute_fraction``  forward cost of the checkpointed segments, ÷ one forward pass: T(V_1 ∪ … ∪ V_{k-1})
                            / T(V), each node counted once per checkpointed segment holding it at any level of
                            a nested plan; what the planners rank plans by. Checkpointing never re-runs the
                            last segment, so this differs from equation (1)'s T(V \\ U_k)/T(V), which is kept
                            in ``paper_overhead_fraction`` for comparison with the paper
    ``early_stop_fraction`` the part of ``recompute_fraction`` that checkpoint's early stop never re-runs (set by
                            ``fxplan.rewrite``): a recomputation ends at the last tensor its segment saves, so
                            a segment's trailing nodes after its last saver, and that saver itself if it keeps
                            only its inputs (a convolution), are skipped
                            (:func:`fxplan.solvers.subplans.recomputation`). The step recomputes
                            :attr:`recomputed_fraction`
    ``budget_bytes``        the budget the solver was given (None: none); for a plan returned by
                            ``fxplan.rewrite``, the whole-step budget the user asked for
    ``strategy``            "time", "memory", or Chen's "sqrt", "greedy", "recursive"
    ``solver``              "exact-dp", "approx-dp", "chen"
    ``memory_model``        name of the memory model used for the prediction
    ``solve_seconds``       wall time of the solver
    ``children``            for Chen's recursive plan: segment index (as str) → Plan of that segment's
                            subgraph, which is itself checkpointed inside; empty otherwise
    ``measured_peak_bytes`` the peak of one step of the rewritten model, measured on fake tensors (set by
                            ``fxplan.plan`` and ``fxplan.rewrite``)
    ``T_seconds``           seconds per unit of T when the cost graph's T is time (``cost_model`` "roofline" or
                            "measured" of :func:`fxplan.costs.trace.trace`: 1e-6); None when T is FLOPs or the
                            paper's units. Then :attr:`predicted_extra_seconds` says what the plan costs
    ``regions``             the convolutions that keep their output while the BatchNorm, ReLU (and concatenation)
                            in front of them are recomputed in backward (:mod:`fxplan.capture.regions`), by node
                            name, or the units of cheap values recomputed in the backward of the nodes that keep them
                            (:mod:`fxplan.capture.recomputed_inputs`, named ``inputs:...``); empty when the plan runs on
                            the graph as captured
    ``region_recompute_fraction`` the part of ``recompute_fraction`` those regions recompute
    ``offloaded``           nodes whose values the forward keeps in host memory for backward instead of on the
                            device (:mod:`fxplan.solvers.offload`, run by :mod:`fxplan.rewriter.offload`); empty when
                            nothing is offloaded
    ``host_peak_bytes``     the most the host copies of the offloaded values hold at once, measured with
                            ``measured_peak_bytes`` (which counts device bytes only)
    ``copy_seconds``        predicted seconds of all the offloaded values' copies, out and back, per step
    ``exposed_copy_seconds`` the part of ``copy_seconds`` that compute does not hide: what offloading adds to a step
    ``host_link``           where the copies' bandwidth comes from (measured on a CUDA device, or the CPU's copy)
    """

    segments: list[list[str]]
    lower_sets: list[list[str]]
    boundaries: list[list[str]]
    predicted_peak_bytes: int
    segment_peak_bytes: list[int]
    overhead: float
    recompute_fraction: float
    paper_overhead_fraction: float
    budget_bytes: int | None
    strategy: str
    solver: str
    memory_model: str
    solve_seconds: float = 0.0
    total_T: float = 0.0
    segment_T: list[float] = field(default_factory=list)
    children: dict[str, Plan] = field(default_factory=dict)
    measured_peak_bytes: int | None = None
    T_seconds: float | None = None
    regions: list[str] = field(default_factory=list)
    region_recompute_fraction: float = 0.0
    early_stop_fraction: float = 0.0
    offloaded: list[str] = field(default_factory=list)
    host_peak_bytes: int | None = None
    copy_seconds: float | None = None
    exposed_copy_seconds: float | None = None
    host_link: str = ""

    @property
    def num_segments(self) -> int:
        return len(self.segments)

    @property
    def recomputed_fraction(self) -> float:
        """Forward cost one step really recomputes, ÷ one forward pass: ``recompute_fraction`` less
        ``early_stop_fraction``."""
        return self.recompute_fraction - self.early_stop_fraction

    @property
    def predicted_extra_seconds(self) -> float | None:
        """Predicted seconds one training step spends recomputing (the forward time of everything
        recomputed, nested segments included); None when the cost model is not time."""
        if self.T_seconds is None:
            return None
        return self.recomputed_fraction * self.total_T * self.T_seconds

    @property
    def predicted_forward_seconds(self) -> float | None:
        """Predicted seconds of one forward pass of the original model; None when T is not time."""
        return None if self.T_seconds is None else self.total_T * self.T_seconds

    def summary(self) -> str:
        """A description in plain words: how the plan was found, its peak (measured and predicted, and what
        each means), what it recomputes, then one line per segment. The paper's notation stays in the fields."""
        k = self.num_segments
        aim = {"time": "least recomputation within the budget", "memory": "lowest peak"}.get(self.strategy,
                                                                                           self.strategy)
        budget = format_bytes(self.budget_bytes) if self.budget_bytes is not None else "none given"
        predicted = format_bytes(self.predicted_peak_bytes)
        lines = [f"Plan: {format_count(k, 'segment')}, found by {self.solver} ({aim}) in {self.solve_seconds:.2f} s"]
        if self.measured_peak_bytes is not None:
            lines += [
                f"  budget {budget}; peak of one training step: {format_bytes(self.measured_peak_bytes)} measured, "
                f"{predicted} predicted",
                "  (measured: one step of the rewritten model, counted exactly on fake tensors; the budget holds this.",
                "   predicted: " + ("the step replayed node by node from the traced graph, a check on the measurement"
                                    if self.memory_model == "replay" else
                                    "the planner's memory model, which chose the segments; it may exceed the "
                                    "measured peak and the budget") + ".)",
            ]
        else:
            lines.append(f"  budget {budget}; predicted peak of one training step {predicted} (the planner's "
                         "memory model; fxplan.rewrite measures the real peak)")
        recomputed = (f"  recomputed in backward: {100 * self.recomputed_fraction:.1f}% of one forward pass"
                      + recompute_note(self.recomputed_fraction, self))
        if self.early_stop_fraction:
            recomputed += (f" ({100 * self.recompute_fraction:.1f}% is checkpointed; checkpoint's early stop skips "
                           f"the rest)")
        extra = self.predicted_extra_seconds
        if extra is not None:
            recomputed += (f", predicted to add {_fmt_seconds(extra)} to each training step (forward pass "
                           f"{_fmt_seconds(self.total_T * self.T_seconds)})")
        lines.append(recomputed)
        if self.regions:
            share = f"{100 * self.region_recompute_fraction:.1f}% of a forward pass, included above"
            units = [r for r in self.regions if r.startswith(UNIT_PREFIX)]
            if len(units) < len(self.regions):
                one = len(self.regions) - len(units) == 1
                lines.append(f"  {regions_recomputed(self.regions)} recomputed in backward, where "
                             + ("the convolution keeps its" if one else "the convolutions keep their")
                             + f" output ({share})")
            else:
                values = sorted({v for u in units for v in Unit.parse(u).dropped})
                lines.append(f"  {regions_recomputed(self.regions)} ({', '.join(values[:4])}"
                             f"{', …' if len(values) > 4 else ''}) dropped after the forward pass and recomputed "
                             f"in the backward of the nodes that keep them ({share})")
        if self.offloaded:
            lines.append(self._offload_line())
        lines += self._segment_lines("  ", top=True)
        return "\n".join(lines)

    def _offload_line(self) -> str:
        """What the plan offloads, the host bytes, and the copies' time against the compute that hides them."""
        shown = ", ".join(self.offloaded[:4]) + (", …" if len(self.offloaded) > 4 else "")
        line = f"  offloaded to host memory: {format_count(len(self.offloaded), 'value')} ({shown})"
        if self.host_peak_bytes is not None:
            line += f", {format_bytes(self.host_peak_bytes)} on the host at most (measured)"
        if self.copy_seconds is not None and self.exposed_copy_seconds is not None:
            hidden = self.copy_seconds - self.exposed_copy_seconds
            line += (f"; copies predicted to take {_fmt_seconds(self.copy_seconds)}, {_fmt_seconds(hidden)} of it "
                     f"hidden behind compute, adding {_fmt_seconds(self.exposed_copy_seconds)} to each step")
        if self.host_link:
            line += f" (link: {self.host_link})"
        return line

    def _segment_lines(self, indent: str, top: bool) -> list[str]:
        """One line per segment; a nested segment's sub-segments (``children``) indented below it."""
        k = self.num_segments
        lines = []
        for i, seg in enumerate(self.segments):
            kept = self.boundaries[i] if i < len(self.boundaries) else []
            shown = ", ".join(kept[:4]) + (f", … (+{len(kept) - 4})" if len(kept) > 4 else "")
            if i == k - 1:
                what = "not recomputed" if top else "not checkpointed by itself (runs as part of its segment)"
            elif self.total_T and i < len(self.segment_T):
                what = f"recomputed in backward ({100 * self.segment_T[i] / self.total_T:.1f}% of a forward pass)"
            else:
                what = "recomputed in backward"
            lines.append(
                f"{indent}[{i}] {format_count(len(seg), 'op')} {seg[0]} … {seg[-1]}; "
                f"keeps {format_count(len(kept), 'value')}"
                + (f" [{shown}]" if kept else "")
                + f"; {what}"
                + (f"; predicted peak during its backward {format_bytes(self.segment_peak_bytes[i])}"
                   if i < len(self.segment_peak_bytes) else "")
            )
            if str(i) in self.children:
                lines.append(f"{indent}    sub-plan of [{i}], its sub-segments checkpointed again inside it:")
                lines += self.children[str(i)]._segment_lines(indent + "    ", top=False)
        return lines

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["children"] = {k: v.to_dict() for k, v in self.children.items()}
        return d

    def to_json(self, **kwargs: Any) -> str:
        """JSON text that :meth:`from_json` turns back into an equal Plan."""
        return json.dumps(self.to_dict(), **kwargs)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Plan:
        d = dict(d)
        d["children"] = {k: cls.from_dict(v) for k, v in d.get("children", {}).items()}
        return cls(**d)

    @classmethod
    def from_json(cls, text: str) -> Plan:
        return cls.from_dict(json.loads(text))
