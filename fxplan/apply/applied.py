"""What ``fxplan.auto_checkpoint`` applied to a model: :class:`AppliedPlan`, readable and saved as JSON, and
:class:`PartialPlan` for a model planned in parts (:mod:`fxplan.apply.partial`), which names its planned submodules
and the modules left to run eagerly, and why."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import torch

from fxplan.apply.regions import RegionPlan
from fxplan.capture.capturers import ExampleCall
from fxplan.common.console import format_bytes, format_count
from fxplan.solvers.plans import Plan


@dataclass
class AppliedPlan:
    """A plan as applied to a model's modules: the checkpointed regions, what a step measured, and for what."""

    model_class: str
    input_shapes: str
    regions: list[RegionPlan]
    measured_peak_bytes: int
    vanilla_peak_bytes: int
    budget_bytes: int | None
    graph_plan: Plan | None = field(default=None, repr=False)  # the planner's plan it carries (not saved)
    recompute_fraction: float = 0.0  # of one forward pass's cost, as the cost graph prices the recomputed nodes
    compile_backend: str | None = None  # the torch.compile backend its peaks were measured under, if any
    per_rank: bool = False  # its peaks are of one rank of a sharded run (auto_checkpoint's shard=)
    host_peak_bytes: int = 0  # the most the host copies of its offloaded values held at once, measured
    exposed_copy_fraction: float = 0.0  # predicted copy time compute does not hide, as a share of a forward pass

    @property
    def time_fraction(self) -> float:
        """What the plan adds to a step, as a share of one forward pass: recomputation and exposed copies."""
        return self.recompute_fraction + self.exposed_copy_fraction

    @property
    def offloaded_calls(self) -> int:
        return sum(sum(r.offload) for r in self.regions)

    def summary(self) -> str:
        saved = sum(r.saved_calls for r in self.regions)
        calls = sum(len(r.ops) for r in self.regions)
        budget = "the smallest peak" if self.budget_bytes is None else f"a budget of {format_bytes(self.budget_bytes)}"
        meter = ("fake tensors, exact" if self.compile_backend is None else
                 f"a real step compiled with torch.compile(backend={self.compile_backend!r})")
        if self.per_rank:
            meter += ", one rank of the model sharded by shard="
        priced = ("cost model" if self.compile_backend != "inductor" else
                  "priced as inductor runs it: fused pointwise ops cost nothing")
        lines = [
            f"fxplan plan applied to {self.model_class} for {budget} (input shapes {self.input_shapes})",
            f"  measured peak of one training step {format_bytes(self.measured_peak_bytes)} "
            f"(unplanned: {format_bytes(self.vanilla_peak_bytes)}; {meter})",
            f"  {format_count(len(self.regions), 'checkpointed module')}; of their {format_count(calls, 'op call')}, "
            f"{saved} saved and {calls - saved} recomputed in backward",
            f"  recomputed in backward: {100 * self.recompute_fraction:.1f}% of one forward pass ({priced})",
        ]
        if self.offloaded_calls:
            lines.append(f"  offloaded to host memory: {format_count(self.offloaded_calls, 'saved op output')}, "
                         f"{format_bytes(self.host_peak_bytes)} on the host at most (measured; the peak above is the "
                         f"device's); copies predicted to add {100 * self.exposed_copy_fraction:.1f}% of a forward "
                         "pass that compute does not hide")
        for r in self.regions[:12]:
            offloaded = f", {sum(r.offload)} of them offloaded" if any(r.offload) else ""
            lines.append(f"    {r.path}: {r.saved_calls} of {format_count(len(r.ops), 'op call')} saved{offloaded}")
        if len(self.regions) > 12:
            lines.append(f"    ... and {len(self.regions) - 12} more")
        return "\n".join(lines)

    def to_json(self) -> str:
        return json.dumps({
            "model_class": self.model_class, "input_shapes": self.input_shapes,
            "regions": [r.to_dict() for r in self.regions], "measured_peak_bytes": self.measured_peak_bytes,
            "vanilla_peak_bytes": self.vanilla_peak_bytes, "budget_bytes": self.budget_bytes,
            "recompute_fraction": self.recompute_fraction, "compile_backend": self.compile_backend,
            "per_rank": self.per_rank, "host_peak_bytes": self.host_peak_bytes,
            "exposed_copy_fraction": self.exposed_copy_fraction,
        })

    @staticmethod
    def from_json(text: str) -> AppliedPlan:
        d = json.loads(text)
        if "parts" in d:
            return PartialPlan.from_dict(d)
        return AppliedPlan(d["model_class"], d["input_shapes"], [RegionPlan.from_dict(r) for r in d["regions"]],
                           d["measured_peak_bytes"], d["vanilla_peak_bytes"], d["budget_bytes"],
                           recompute_fraction=d.get("recompute_fraction", 0.0),
                           compile_backend=d.get("compile_backend"), per_rank=d.get("per_rank", False),
                           host_peak_bytes=d.get("host_peak_bytes", 0),
                           exposed_copy_fraction=d.get("exposed_copy_fraction", 0.0))


#: Why a module without submodules is no part: its summary counts such modules instead of listing them.
SINGLE_LAYER = "one layer, no submodules to plan"


@dataclass(frozen=True)
class Part:
    """One module of a model planned in parts: planned (its own plan, found as for a whole model, with its own
    step's peaks measured on fake tensors) or run eagerly as the model's code runs it, with why (``reason``: the
    data-dependent code it stops at, file and line, or what keeps it from being planned)."""

    path: str
    module_class: str
    planned: bool
    reason: str = ""
    regions: int = 0  # its checkpointed modules (auto_checkpoint)
    peak_bytes: int | None = None  # of its own step with its plan, fake tensors (None where not measured)
    unplanned_peak_bytes: int | None = None  # of its own step without
    segments: int = 0  # of its rewritten module (fxplan.rewrite), 0 where it is not rewritten

    def describe(self) -> str:
        name = f"{self.path or '(the model)'} ({self.module_class})"
        if not self.planned:
            return f"{name}: runs eagerly: {self.reason}"
        own = ""
        if self.peak_bytes is not None and self.unplanned_peak_bytes is not None:
            own = (f"; its own step {format_bytes(self.unplanned_peak_bytes)} -> {format_bytes(self.peak_bytes)} "
                   "(fake tensors)")
        what = (f"checkpointed whole, rewritten in {format_count(self.segments, 'segment')} inside" if self.segments
                else format_count(self.regions, 'checkpointed module'))
        return f"{name}: {what}{own}{self.reason and '; ' + self.reason}"


@dataclass
class PartialPlan(AppliedPlan):
    """A plan of a model that does not capture as a whole, applied in parts (:mod:`fxplan.apply.partial`): the
    regions of every planned part by their paths in the model (``fxplan.auto_checkpoint``), or the plan of every
    rewritten part by its path (``rewritten``: ``fxplan.rewrite``), and the parts (:class:`Part`). Its peaks are of
    the whole step, measured on real steps (``meter`` says how), not on fake tensors."""

    parts: list[Part] = field(default_factory=list)
    meter: str = ""
    rewritten: dict[str, Plan] = field(default_factory=dict)

    def summary(self) -> str:
        budget = "the smallest peak" if self.budget_bytes is None else f"a budget of {format_bytes(self.budget_bytes)}"
        planned = [p for p in self.parts if p.planned]
        root = next((p for p in self.parts if p.path == ""), None)
        lines = [
            f"fxplan plan applied in parts to {self.model_class} for {budget} (input shapes {self.input_shapes})",
            f"  {self.model_class} does not capture as a whole ({root.reason if root else 'data-dependent code'}): "
            f"{format_count(len(planned), 'part')} planned, the rest runs eagerly as the model's code runs it",
            f"  measured peak of one training step {format_bytes(self.measured_peak_bytes)} "
            f"(unplanned: {format_bytes(self.vanilla_peak_bytes)}; {self.meter})",
            f"  {format_count(len(self.rewritten), 'part')} rewritten" if self.rewritten else
            f"  {format_count(len(self.regions), 'checkpointed module')} in the planned parts",
        ]
        lines += [f"  planned: {p.describe()}" for p in planned]
        eager = [p for p in self.parts if not p.planned and p.path]
        lines += [f"  eager:   {p.describe()}" for p in eager if p.reason != SINGLE_LAYER]
        if any(p.reason == SINGLE_LAYER for p in eager):
            lines.append(f"  eager:   {format_count(sum(p.reason == SINGLE_LAYER for p in eager), 'single layer')} "
                         "outside the planned parts (no submodules to plan)")
        return "\n".join(lines)

    def to_json(self) -> str:
        d = json.loads(super().to_json())
        d["parts"] = [vars(p) for p in self.parts]
        d["meter"] = self.meter
        d["rewritten"] = {path: plan.to_dict() for path, plan in self.rewritten.items()}
        return json.dumps(d)

    @staticmethod
    def from_dict(d: dict[str, Any]) -> PartialPlan:
        return PartialPlan(d["model_class"], d["input_shapes"], [RegionPlan.from_dict(r) for r in d["regions"]],
                           d["measured_peak_bytes"], d["vanilla_peak_bytes"], d["budget_bytes"],
                           parts=[Part(**p) for p in d["parts"]], meter=d.get("meter", ""),
                           rewritten={path: Plan.from_dict(p) for path, p in d.get("rewritten", {}).items()})


def input_shapes(call: ExampleCall) -> str:
    """The shapes and dtypes of a call's tensors, as a plan records what it was made for."""
    leaves = torch.utils._pytree.tree_leaves((call.args, call.kwargs))
    return ", ".join("x".join(map(str, t.shape)) + f" {str(t.dtype).removeprefix('torch.')}"
                     for t in leaves if isinstance(t, torch.Tensor))
