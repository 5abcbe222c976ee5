"""Cost graphs of a model with some of its recomputed regions, spliced from two traces instead of traced.

A model with recomputed regions (:mod:`fxplan.capture.regions`) is planned over several graphs: as captured, with
every region, and with subsets of them (:mod:`fxplan.planner.variants`). Each is a graph
:func:`fxplan.costs.trace.trace` could trace, at the price of a fake-tensor run of the whole model and a backward
probe per node. But what the trace records of a node is the node's own: its output, what its backward saves, its
forward cost, the storages it aliases and writes, its backward's rise. Replacing some regions does not change those
facts for the nodes outside them, and a region node's facts are those it has in the graph with every region. So the
cost graph of a subset is assembled from the captured graph's trace (nodes outside the subset's regions)
and the trace of the graph with every region (the subset's region nodes, and the readers of its recomputed
inputs), with names translated: the graph
of each subset names its nodes as a re-trace of its code does (:func:`fxplan.capture.regions.with_regions`), and
removed nodes shift the numbering of the nodes that share their name (``cat_4`` becomes ``cat_2``).

The splice checks that the graphs line up node for node (same ops in the same order); where they do not,
it raises :class:`SpliceError`, and the caller traces the graph instead. ``tests/test_splice.py`` compares
spliced and traced cost graphs attribute for attribute.
"""

from __future__ import annotations

import copy

import torch.fx as fx

from fxplan.capture.effects import ordering_edges
from fxplan.capture.graph_module import owning_graph_module
from fxplan.capture.recomputed_inputs import call_recomputing
from fxplan.capture.regions import conv_of_recomputed_region, with_regions
from fxplan.errors import FxplanError
from fxplan.solvers.costgraph import CostGraph

#: Graph attributes a trace sets that do not depend on which regions the graph has.
_SHARED = ("param_bytes", "input_bytes", "name", "cost_model", "T_seconds", "example_output")

#: Node attributes that name other nodes (translated), and node metadata the rewriter reads.
_NAME_LISTS, _NAMES, _META = ("saved_inputs",), ("alias_of",), ("fxplan_mutates", "fxplan_fresh_output")

_COMPUTE = ("call_module", "call_function", "call_method")


class SpliceError(FxplanError):
    """The graphs do not line up node for node: trace the graph instead."""


def spliced(plain: CostGraph, every: CostGraph, regions: list, subset: list) -> CostGraph:
    """The cost graph of the model with the regions ``subset`` (some of ``regions``), as
    :func:`fxplan.costs.trace.trace` would give it: ``plain`` is the trace of the captured graph, ``every`` the
    trace of the graph with all of ``regions`` (module docstring). Raises :class:`SpliceError` where the
    graphs do not line up."""
    source, every_gm = plain.graph["captured"], every.graph["captured"].gm
    captured = with_regions(source, subset)
    gm = captured.gm
    like, fake_mode = plain.graph["fake"]
    fake = _fake_twin(gm, like)  # before the marks below: the trace marks the copy it propagated with less
    # names across the graphs: every's -> the source's, this graph's -> the source's, and back
    from_every = _aligned(source.gm, every_gm, {name for r in regions for name in r.removed})
    to_source = _aligned(source.gm, gm, {name for r in subset for name in r.removed})
    into = {src: name for name, src in to_source.items()}
    every_into = {name: into[src] for name, src in from_every.items() if src in into}
    every_name = {src: name for name, src in from_every.items()}
    every_nodes = _by_name(every_gm)
    origins = {name: (every, every_name[name], every_into, every_nodes) for r in subset for name in r.replaced}
    plain_origin = (plain, None, into, _by_name(source.gm))

    cg = CostGraph()
    cg.graph.update({key: plain.graph[key] for key in _SHARED if key in plain.graph})
    grad_inputs, passes = {}, set()
    for node in gm.graph.nodes:
        if node.op not in _COMPUTE:
            continue
        src = to_source[node.name]
        traced, name, names, traced_nodes = origins.get(src, plain_origin)
        name = name or src
        attrs = dict(traced.nodes[name])
        for key in _NAME_LISTS:
            attrs[key] = tuple(_translate(names, v) for v in attrs[key])
        for key in _NAMES:
            attrs[key] = None if attrs[key] is None else _translate(names, attrs[key])
        cg.add_node(node.name, **attrs)
        for key in _META:
            node.meta[key] = traced_nodes[name].meta[key]
        given, passing = traced.graph["gradients"]
        grad_inputs[node.name] = frozenset(_translate(names, v) for v in given[name])
        if name in passing:
            passes.add(node.name)
        cg.add_edges_from((pred.name, node.name) for pred in node.all_input_nodes if pred.op in _COMPUTE)
    return _finished(cg, captured, (fake, fake_mode), (grad_inputs, frozenset(passes)))


def derived(plain: CostGraph, units: list) -> CostGraph:
    """The cost graph of the model with the units of recomputed inputs ``units``
    (:mod:`fxplan.capture.recomputed_inputs`), as :func:`fxplan.costs.trace.trace` would give it, from ``plain`` (the
    trace of the captured graph) alone: a unit changes no node but its savers, which run through
    ``call_recomputing``, keep other values for their backward and recompute in it; what that changes of each saver,
    the trace of the captured graph found by running its call once more (``plain.graph["unit_savers"]``). Raises
    :class:`SpliceError` where a saver was not probed (a trace without ``probe_units``)."""
    facts = plain.graph.get("unit_savers") or {}
    missing = [s for u in units for s in u.savers if s not in facts]
    if missing:
        raise SpliceError(f"saver {missing[0]} of a unit was not probed by the trace")
    source = plain.graph["captured"]
    captured = with_regions(source, units)
    gm = captured.gm
    like, fake_mode = plain.graph["fake"]
    fake = _fake_twin(gm, like)
    source_nodes = _by_name(source.gm)
    cg = CostGraph()
    cg.graph.update({key: plain.graph[key] for key in _SHARED if key in plain.graph})
    for node in gm.graph.nodes:
        if node.op not in _COMPUTE:
            continue
        attrs = dict(plain.nodes[node.name])
        if node.name in facts and node.target is call_recomputing:
            attrs.update(facts[node.name])
            if not attrs["backward_rise"]:
                del attrs["backward_rise"]  # as the trace leaves it: set where not 0
        cg.add_node(node.name, **attrs)
        for key in _META:
            node.meta[key] = source_nodes[node.name].meta[key]
        cg.add_edges_from((pred.name, node.name) for pred in node.all_input_nodes if pred.op in _COMPUTE)
    return _finished(cg, captured, (fake, fake_mode), plain.graph["gradients"])


def _finished(cg: CostGraph, captured, fake: tuple, gradients: tuple) -> CostGraph:
    """``cg`` (its nodes and data edges made, and its graph's nodes marked) completed as a trace leaves a cost
    graph: the ordering edges, the fake twin's marks, and the graph attributes."""
    gm = captured.gm
    for before, after in ordering_edges(gm):
        if not cg.has_edge(before, after):
            cg.add_edge(before, after, order_only=True)
    marked = _by_name(gm)
    for node in fake[0].graph.nodes:
        if node.name in cg:
            node.meta["fxplan_fresh_output"] = marked[node.name].meta["fxplan_fresh_output"]
    cg.graph.update(gm=gm, captured=captured, gradients=gradients, fake=fake)
    return cg


def _fake_twin(gm: fx.GraphModule, like: fx.GraphModule) -> fx.GraphModule:
    """A module running ``gm``'s graph over the modules and fake state of ``like`` (the fake copy of the captured
    graph the plain trace made: the same module paths), as the trace's own fake copy would run it; sharing
    them costs nothing, where a copy makes every parameter again. The search measures its plans on it."""
    graph = fx.Graph()
    output = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    graph.output(graph.graph_copy(gm.graph, {}), type_expr=output.type)
    graph._codegen = copy.deepcopy(gm.graph._codegen)
    constants = {n.target: vars(source)[n.target] for n in graph.nodes if n.op == "get_attr"
                 for source in (gm, like) if n.target in vars(source)}  # like's fakes; gm's recipes
    twin = owning_graph_module(like, graph, constants, class_name=type(gm).__name__)
    twin.meta.update(like.meta)
    return twin


def _aligned(source: fx.GraphModule, replaced: fx.GraphModule, inside: set[str]) -> dict[str, str]:
    """``replaced``'s node names -> ``source``'s, for a graph made from ``source`` by replacing regions (whose
    nodes in ``inside`` are gone): the two agree node for node, in order, but for the region nodes and the
    ``get_attr`` nodes that fetch their modules."""
    kept = [n for n in source.graph.nodes if n.op != "get_attr" and n.name not in inside]
    made = [n for n in replaced.graph.nodes if n.op != "get_attr"]
    if len(kept) != len(made):
        raise SpliceError(f"the graph with regions has {len(made)} nodes where {len(kept)} were expected")
    names = {}
    for old, new in zip(kept, made):
        region = new.op == "call_function" and new.target in (conv_of_recomputed_region, call_recomputing)
        if (old.op, old.target) != (new.op, new.target) and not (region and old.op in _COMPUTE):
            raise SpliceError(f"node {new.name} ({new.op} {new.target}) does not line up with {old.name} "
                              f"({old.op} {old.target})")
        names[new.name] = old.name
    return names


def _by_name(gm: fx.GraphModule) -> dict[str, fx.Node]:
    return {n.name: n for n in gm.graph.nodes}


def _translate(names: dict[str, str], name: str) -> str:
    if name not in names:
        raise SpliceError(f"node {name} has no counterpart in the graph with regions")
    return names[name]
