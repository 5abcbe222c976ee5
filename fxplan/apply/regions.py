"""A graph plan as checkpointed module regions, with a save-or-recompute decision for each op call inside them.

A plan (:class:`~fxplan.solvers.plans.Plan`) keeps, of the captured graph's values, those that cross from one
segment to a later one (its ``boundaries``) and what the last segment's ops save, and drops the values of its
recomputed regions and units. :func:`regions_for` turns that into the model's own vocabulary:

* **Regions.** Submodules, from the top of the module tree down, in one of three :data:`MAPPINGS`:
  ``largest``, the largest modules called once per step; ``aligned``, the largest whose nodes lie in one
  segment, a module whose recomputed nodes span several segments being split into its children; ``blocks``,
  the items of the model's module lists and sequences (a decoder's layers, a ResNet stage's blocks), the
  repeated unit that per-layer checkpointing wraps. A module with nothing to recompute is left alone, and the
  root never is a region (its ``forward`` and signature stay the user's). Nodes outside every region run as in
  the model: what they save is kept. Each mapping loses something against the plan (below); the search
  measures all three.
* **Decisions.** Inside a region, each op call (operator, and how many calls of that operator came before it in
  the region's forward: :mod:`fxplan.apply.op_map`) is saved where it makes a value the plan keeps, and
  recomputed otherwise; views are always recomputed (they cost nothing). Three rules keep the step exact: a call
  that writes a tensor from outside the region (a BatchNorm's running statistics, an in-place op on the region's
  input) is saved, so that recomputation never writes it twice; a kept value that a later call of the region
  overwrites in place is saved after the last such write (selective checkpointing refuses cached tensors that
  change; a module where that would move a save of the first rule is not a region); random ops are always
  recomputed, so that recomputation, from the random state checkpointing restores, draws what the forward pass
  drew; so are casts (:data:`CASTS`: autocast's cache makes the recomputation's casts differ from the forward's).

What cannot map: segment boundaries inside one module call with no submodule between them (the module is one
region, recomputed whole), segments across two sibling modules (each is its own region, and the value between
them stays: a checkpoint keeps its inputs), nested plans (their sub-segments are their segment's) and values of
the root's own ops. The measured search of :mod:`fxplan.apply.auto` measures what that costs.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import torch

from fxplan.apply.op_map import NodeOps
from fxplan.capture.regions import find_regions
from fxplan.solvers.plans import Plan
from fxplan.solvers.units import PREFIX as UNIT_PREFIX
from fxplan.solvers.units import Unit

#: Casts are never saved: autocast caches the casts of parameters for the rest of its context, so the
#: recomputation in backward (after that context) makes casts the forward pass did not, and selective
#: checkpointing, which pairs the calls of an operator by their order, would hand a saved cast to another call.
CASTS = frozenset({"aten._to_copy.default"})


@dataclass(frozen=True)
class RegionPlan:
    """One checkpointed module: its path, and per op call of its forward, in order, the operator and whether
    its output is saved (else recomputed in backward)."""

    path: str
    ops: tuple[str, ...]
    save: tuple[bool, ...]
    shapes: tuple[str, ...] = ()  # of each call's first output: what a check of the model's own calls compares
    #: operators whose calls in the model's own forward are not the captured graph's (another mask
    #: construction, say): their calls get the policy's default (:class:`fxplan.apply.runtime.RegionPolicy`)
    unmatched: tuple[str, ...] = ()
    #: per op call, whether its saved output is kept in host memory (:mod:`fxplan.rewriter.offload`); empty: none is
    offload: tuple[bool, ...] = ()
    #: per op call, whether its saved output could be: saved, and not for writing state from outside the region
    offloadable: tuple[bool, ...] = field(default=(), compare=False)

    def decisions(self) -> dict[str, tuple[bool, ...]]:
        """Per operator, the save flag of each of its calls in order: how a policy looks a call up."""
        return self._by_op(self.save)

    def offloads(self) -> dict[str, tuple[bool, ...]]:
        """Per operator, whether each of its calls' saved output is offloaded, in order (empty where none is)."""
        return self._by_op(self.offload) if any(self.offload) else {}

    def offloading(self, on: bool) -> RegionPlan:
        """This region with every call it could offload offloaded (``on``), or none."""
        return replace(self, offload=self.offloadable if on and any(self.offloadable) else ())

    def _by_op(self, flags: tuple[bool, ...]) -> dict[str, tuple[bool, ...]]:
        by_op: dict[str, list[bool]] = {}
        for op, flag in zip(self.ops, flags):
            if op not in self.unmatched:
                by_op.setdefault(op, []).append(flag)
        return {op: tuple(f) for op, f in by_op.items()}

    @property
    def saved_calls(self) -> int:
        return sum(save for op, save in zip(self.ops, self.save) if op not in self.unmatched)

    def calls_by_op(self) -> dict[str, list[str]]:
        """Per operator, the output shapes of its calls in order: the calls as a policy tells them apart."""
        by_op: dict[str, list[str]] = {}
        for op, shape in zip(self.ops, self.shapes):
            by_op.setdefault(op, []).append(shape)
        return by_op

    def to_dict(self) -> dict:
        return {"path": self.path, "ops": list(self.ops), "save": [int(s) for s in self.save],
                "shapes": list(self.shapes), "unmatched": list(self.unmatched),
                "offload": [int(o) for o in self.offload]}

    @staticmethod
    def from_dict(d: dict) -> RegionPlan:
        return RegionPlan(d["path"], tuple(d["ops"]), tuple(bool(s) for s in d["save"]), tuple(d.get("shapes", ())),
                          tuple(d.get("unmatched", ())), tuple(bool(o) for o in d.get("offload", ())))


def dropped_values(plan: Plan, gm: torch.fx.GraphModule) -> set[str]:
    """The values the plan's recomputed regions and units drop: recomputed in backward, never kept."""
    names = set(plan.regions or ())
    dropped = {v for name in names if name.startswith(UNIT_PREFIX) for v in Unit.parse(name).dropped}
    convs = {name for name in names if not name.startswith(UNIT_PREFIX)}
    if convs:
        dropped |= {v for region in find_regions(gm) if region.conv in convs for v in region.dropped}
    return dropped


def kept_values(plan: Plan, nodes: dict[str, NodeOps], dropped: set[str]) -> tuple[set[str], dict[str, int]]:
    """The nodes whose values the plan keeps, and each planned node's segment (nested plans: their segment's)."""
    segment_of = {v: i for i, segment in enumerate(plan.segments) for v in segment}
    kept = {v for boundary in plan.boundaries[:-1] for v in boundary}  # what crosses to a later segment
    kept |= set(plan.segments[-1]) if plan.segments else set()  # the last segment is not recomputed
    kept |= {v for v in nodes if v not in segment_of and v not in dropped}  # not planned: runs as in the model
    return kept - dropped, segment_of


#: How a plan's segments become checkpointed modules (module docstring).
MAPPINGS = ("largest", "aligned", "blocks")

#: FLOPs per byte of output above which an op is compute-bound: a value the plan keeps but autograd does not is
#: saved where its op is (a matrix product), recomputed where it is not (a pointwise op).
COMPUTE_BOUND_FLOPS_PER_BYTE = 16


def worth_saving(cg: Any) -> set[str]:
    """The kept values a region saves (module docstring, decisions): those autograd keeps for backward (a node's own
    output or an input its backward reads), and those of compute-bound ops. Selective checkpointing replays a
    region's whole forward in backward, running every call it does not return from its cache; a saved value that
    autograd does not keep would be memory the plan does not have, and recomputing a cheap one costs little."""
    worth = set()
    for v, data in cg.nodes(data=True):
        if data.get("saves_output") or data.get("flops", 0) > COMPUTE_BOUND_FLOPS_PER_BYTE * max(data["M"], 1):
            worth.add(v)
        worth.update(data.get("saved_inputs", ()))
    return worth


def regions_for(plan: Plan, nodes: dict[str, NodeOps], gm: torch.fx.GraphModule,
                children: dict[str, list[str]], regionable: set[str], *, mapping: str,
                blocks: frozenset[str] = frozenset(), worth: set[str] | None = None) -> list[RegionPlan]:
    """The checkpointed regions that carry ``plan`` in one of the :data:`MAPPINGS` (module docstring).
    ``children`` maps each module path to its children's; ``regionable`` names the modules that may be regions
    (called once per step, with plain arguments); ``blocks`` the items of module lists and sequences, the
    regions of the ``blocks`` mapping. Where a region's nodes span segments, a segment's boundary inside it is
    a value it saves. The plan's ``offloaded`` values that a region saves are offloaded by it; those outside every
    region stay on the device. With ``worth`` (:func:`worth_saving`), a kept value outside it that no recomputed
    value is made from is recomputed instead."""
    dropped = dropped_values(plan, gm)
    kept, segment_of = kept_values(plan, nodes, dropped)
    recomputed = {v for v, ops in nodes.items() if v not in kept and any(c.makes_value for c in ops.calls)}
    offloaded = set(plan.offloaded) & kept
    saved = kept
    if worth is not None:
        read_by_recomputed = {u.name for n in gm.graph.nodes if n.name in recomputed for u in n.all_input_nodes}
        saved = {v for v in kept if v in worth or v in read_by_recomputed or v in offloaded}
    inside: dict[str, list[str]] = {}
    for name, ops in nodes.items():
        for path in ops.scope:
            inside.setdefault(path, []).append(name)

    def choose(path: str) -> list[RegionPlan]:
        members = inside.get(path, [])
        if members and not any(v in recomputed or v in offloaded for v in members):
            return []
        segments = {segment_of[v] for v in members if v in segment_of and v not in dropped}
        fits = {"largest": True, "aligned": len(segments) <= 1, "blocks": path in blocks}[mapping]
        if members and path and path in regionable and fits:
            region = _decide(path, [nodes[v] for v in members], saved, offloaded)
            if region is not None:
                return [region]
        return [region for child in children.get(path, []) for region in choose(child)]

    return choose("")


def _decide(path: str, members: list[NodeOps], kept: set[str], offloaded: set[str] = frozenset()) -> RegionPlan | None:
    """The region's decisions (module docstring); None where none is exact: a call that must be saved (it writes
    state from outside the region) makes a value that a later call of the region overwrites in place. A saved call
    that makes an ``offloaded`` node's value, and nothing the region did not make, is offloaded."""
    calls = [call for node in members for call in node.calls]
    keep_storages = {s for node in members if node.name in kept for s in node.value}
    made_here: set[int] = set()
    forced = [False] * len(calls)
    last_write: dict[int, int] = {}  # storage -> the last call that writes it in place
    made_by: dict[int, int] = {}  # storage -> the first non-view call that returned it
    for i, call in enumerate(calls):
        forced[i] = any(s not in made_here for s in call.writes)
        made_here |= set(call.outputs)
        for s in call.writes:
            last_write[s] = i
        if not call.view:
            for s in call.outputs:
                made_by.setdefault(s, i)
    save = list(forced)
    for s in keep_storages:
        if s in made_by:
            save[max(made_by[s], last_write.get(s, -1))] = True
    for i, call in enumerate(calls):
        if not save[i]:
            continue
        later = max((last_write.get(s, -1) for s in call.outputs), default=-1)
        if later > i:  # selective checkpointing refuses a cached tensor that changes: keep it after the change
            if forced[i]:
                return None
            save[i], save[later] = False, True
    for i, call in enumerate(calls):
        if (call.random or call.op in CASTS) and not forced[i]:
            save[i] = False  # recomputed, so every random op draws again from the restored state, in order
    offloadable = tuple(save[i] and not forced[i] and bool(call.outputs) for i, call in enumerate(calls))
    offload_storages = {s for node in members if node.name in offloaded for s in node.value}
    offload = tuple(can and set(call.outputs) <= offload_storages for can, call in zip(offloadable, calls))
    return RegionPlan(path, tuple(c.op for c in calls), tuple(save), tuple(c.shape for c in calls),
                      offload=offload if any(offload) else (), offloadable=offloadable)
