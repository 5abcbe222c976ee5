"""The cost-graph facts of the savers of units of recomputed inputs, probed without tracing their graphs.

A graph with units of recomputed inputs (:mod:`fxplan.capture.recomputed_inputs`) runs each unit's saver through
``call_recomputing``, whose backward keeps other values than the plain graph's nodes do. :func:`unit_savers` runs each
saver's call once on the values the plain graph's propagation computed
(:class:`~fxplan.costs.propagation.CostPropagator`) and records what differs: what its backward keeps, its backward's
rise and its kind. From them
:func:`fxplan.planner.splice.derived` makes the graphs with units without a trace of their own
(``trace(..., probe_units=True)`` asks for them).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._pytree import tree_leaves

from fxplan.capture.graph_module import resolve_attr
from fxplan.capture.recomputed_inputs import call_recomputing
from fxplan.capture.regions import regions_of, with_regions
from fxplan.costs.node_costs import classify_saved, node_kind, storage_owners, target_name
from fxplan.costs.op_census import tensors
from fxplan.costs.propagation import CostPropagator, NodeRecord
from fxplan.measure.scratch import storage_bytes
from fxplan.solvers.costgraph import CostGraph
from fxplan.solvers.units import Unit


def unit_savers(cg: CostGraph, propagator: CostPropagator) -> dict[str, dict[str, Any]]:
    """Per saver of the graph's units of recomputed inputs (where the budget search uses them:
    :func:`fxplan.capture.regions.regions_of`), the cost-graph facts that differ in a graph where it runs through
    :func:`~fxplan.capture.recomputed_inputs.call_recomputing`: what its backward keeps, its backward's rise, its kind.
    Found by running each saver's call once more on the values of this propagation, as a trace of that graph
    runs it (:func:`fxplan.planner.splice.derived` makes the graphs with units from them, with no trace of their
    own)."""
    units = [u for u in regions_of(cg) if isinstance(u, Unit)]
    if not units:
        return {}
    gm = with_regions(cg.graph["captured"], units).gm
    values = {n.name: v for n, v in propagator.env.items()}

    def value(n: torch.fx.Node) -> Any:
        if n.name in values:
            return values[n.name]
        return getattr(gm, n.target) if n.target in vars(gm) else resolve_attr(propagator.module, n.target)

    owner, resident = storage_owners(propagator.module, propagator.records), propagator.resident_keys
    facts: dict[str, dict[str, Any]] = {}
    rises: dict[tuple, int] = {}
    patterns: dict[tuple, tuple] = {}  # a repeated layer's savers run once (call_key)
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target is not call_recomputing:
            continue
        call = (torch.fx.node.map_arg(node.args, value), torch.fx.node.map_arg(node.kwargs, value))
        flat = _call_tensors(call)
        key = propagator.call_key(node, call)
        pattern = patterns.get(key) if key is not None else None
        if pattern is None:
            pattern = _saved_pattern(propagator.fake_mode, call, flat)
            if key is not None:
                patterns[key] = pattern
        saves_output, saved_inputs, extra, saves_resident = classify_saved(node, _record_of(pattern, flat), owner,
                                                                            resident)
        rise = propagator.call_rise(node, call, key, rises) if propagator.grad_fns.get(node.name) else 0
        facts[node.name] = dict(kind=node_kind(gm, node), target=target_name(node), saves_output=saves_output,
                                saved_inputs=saved_inputs, saved=int(extra), saves_resident=saves_resident,
                                backward_rise=rise)
    return facts


def _call_tensors(call: tuple) -> list[torch.Tensor]:
    """The tensors of a call's arguments, then the parameters and buffers of the modules among them."""
    modules = [m for m in tree_leaves(call) if isinstance(m, torch.nn.Module)]
    return tensors(call) + [t for m in modules for t in (*m.parameters(), *m.buffers())]


def _saved_pattern(fake_mode: FakeTensorMode, call: tuple, flat: list[torch.Tensor]) -> tuple[list, list]:
    """What ``call_recomputing(*args, **kwargs)`` on ``call`` keeps for its backward (storage, bytes) and returns
    (storages), each storage named by the position of a tensor of ``flat`` (:func:`_call_tensors`) that has it,
    or, for one the call makes, ``("new", k)``: a pattern that holds for any call alike
    (:meth:`fxplan.costs.propagation.CostPropagator._key_of`)."""
    position: dict[int, Any] = {}
    for i, t in enumerate(flat):
        position.setdefault(t.untyped_storage()._cdata, i)

    def ref(t: torch.Tensor) -> Any:
        return position.setdefault(t.untyped_storage()._cdata, ("new", len(position)))

    saved: list[tuple[Any, int]] = []

    def pack(t: torch.Tensor):
        saved.append((ref(t), storage_bytes(t)))
        return t

    with fake_mode, torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = call_recomputing(*call[0], **call[1])
    return saved, [ref(t) for t in tensors(out)]


def _record_of(pattern: tuple[list, list], flat: list[torch.Tensor]) -> NodeRecord:
    """The record of a saver's call (what it keeps and returns) from :func:`_saved_pattern` and the call's tensors."""
    def key(r: Any) -> Any:
        return flat[r].untyped_storage()._cdata if isinstance(r, int) else r

    rec = NodeRecord()
    saved, outputs = pattern
    for r, nbytes in saved:
        rec.saved_storages.setdefault(key(r), nbytes)
    for r in outputs:
        rec.out_storages.add(key(r))
        if isinstance(r, int):
            rec.alias_storage = key(r)
    return rec
