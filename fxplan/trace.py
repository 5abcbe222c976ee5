"""Tracing a model into a :class:`~fxplan.costgraph.CostGraph`.

``torch.fx.symbolic_trace`` at module granularity gives the graph (leaf modules are torch.nn's, which
matches the node counts of Kusumoto et al.'s Chainer graphs). The example inputs are then propagated
through a private fake-tensor copy of the model, one node at a time, to record per node:

* ``M``: bytes of the node's output tensors (as if written out of place);
* ``T``: FLOPs from ``torch.utils.flop_counter`` with a floor of one per output element (so cheap
  elementwise ops are not free), or the paper's rule (10 for a convolution, 1 otherwise) with
  ``cost_model="paper"``;
* what autograd saves for the node's backward, seen through ``saved_tensors_hooks``: whether it keeps
  the node's own output (``saves_output``), which predecessors' outputs it keeps (``saved_inputs``),
  and the bytes of anything else it keeps (``saved``: BatchNorm statistics, pooling indices, masks);
* ``alias_of``: the predecessor whose storage the output shares (views and in-place ops), else None.

Besides data edges, the graph holds ``order_only`` edges (see :func:`fxplan.effects.ordering_edges`):
random ops keep their program order, and readers after an in-place write stay after it, so every
plan over the graph is one the rewriter can run exactly. Solvers treat them like data edges, which
can only overestimate memory.

Propagation runs on fake tensors, so it allocates nothing, works at any batch size and leaves the
user's model (parameters, BatchNorm statistics) untouched.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Any

import torch
import torch.fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._pytree import tree_leaves
from torch.utils.flop_counter import FlopCounterMode

from fxplan.costgraph import CostGraph
from fxplan.effects import ordering_edges
from fxplan.errors import TraceError
from fxplan.measure import fake_copy, fake_mode_of, to_fake

COMPUTE_OPS = ("call_module", "call_function", "call_method")

_MODULE_KINDS = {
    torch.nn.modules.conv._ConvNd: "conv",
    torch.nn.Linear: "linear",
    torch.nn.modules.batchnorm._BatchNorm: "bn",
    torch.nn.ReLU: "relu",
    torch.nn.modules.pooling._MaxPoolNd: "maxpool",
    torch.nn.modules.pooling._AvgPoolNd: "avgpool",
    torch.nn.modules.pooling._AdaptiveAvgPoolNd: "avgpool",
    torch.nn.modules.dropout._DropoutNd: "dropout",
    torch.nn.Embedding: "embedding",
    torch.nn.LSTM: "lstm",
}


def trace_module(model: torch.nn.Module) -> torch.fx.GraphModule:
    """``torch.fx.symbolic_trace`` with an error that says which module failed and what to do."""
    if not isinstance(model, torch.nn.Module):
        raise TraceError(f"fxplan traces nn.Module objects, got {type(model).__name__}")
    if isinstance(model, torch.fx.GraphModule):
        return model
    tracer = _LocatingTracer()
    try:
        graph = tracer.trace(model)
    except Exception as exc:  # torch.fx raises many types; all mean "not traceable"
        where = tracer.fxplan_path[-1] if tracer.fxplan_path else type(model).__name__
        raise TraceError(
            f"torch.fx could not trace {type(model).__name__}: the failure is inside module '{where}' "
            f"({type(exc).__name__}: {exc}). Typical causes are Python control flow that depends on tensor "
            "values or shapes. Make that module a leaf (torch.fx.wrap it, or move the dynamic part into a "
            "submodule fxplan treats as one node), or rewrite the branch without data-dependent control flow."
        ) from exc
    return torch.fx.GraphModule(tracer.root, graph, type(model).__name__)


class _LocatingTracer(torch.fx.Tracer):
    """A tracer that remembers the module path it is inside, to name it when tracing fails."""

    def __init__(self):
        super().__init__()
        self.fxplan_path: list[str] = []

    def call_module(self, m, forward, args, kwargs):
        self.fxplan_path.append(self.path_of_module(m) or type(m).__name__)
        out = super().call_module(m, forward, args, kwargs)
        self.fxplan_path.pop()
        return out


def trace(model: torch.nn.Module, example_inputs: Sequence[Any], *, cost_model: str = "flops") -> CostGraph:
    """Trace ``model`` and propagate ``example_inputs`` (real or fake) into a cost graph.

    ``cost_model`` is ``"flops"`` (default) or ``"paper"`` (Kusumoto et al. section 3: 10 for a
    convolution, 1 otherwise). The traced GraphModule (sharing the user's submodules) is kept in
    ``cg.graph["gm"]``.
    """
    if cost_model not in ("flops", "paper"):
        raise ValueError(f"cost_model must be 'flops' or 'paper', got {cost_model!r}")
    gm = trace_module(model)
    inputs = tuple(example_inputs)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    required = [n for n in placeholders if not n.args]  # a placeholder's args hold its default value
    if not len(required) <= len(inputs) <= len(placeholders):
        names = ", ".join(n.target for n in placeholders)
        count = len(placeholders) if len(required) == len(placeholders) else f"{len(required)} to {len(placeholders)}"
        raise TraceError(f"{type(model).__name__}.forward takes {count} inputs ({names}), "
                         f"got {len(inputs)} example inputs")
    fake_mode = fake_mode_of(model, inputs)
    propagator = _CostPropagator(fake_copy(gm, fake_mode), fake_mode)
    with fake_mode, torch.enable_grad():
        propagator.run(*to_fake(inputs, fake_mode))
    return _build_cost_graph(gm, propagator, cost_model, type(model).__name__)


class _NodeRecord:
    __slots__ = ("out_bytes", "flops", "saved_storages", "out_storages", "numel", "alias_storage")

    def __init__(self):
        self.out_bytes = 0
        self.flops = 0
        self.numel = 0
        self.saved_storages: dict[int, int] = {}
        self.out_storages: set[int] = set()
        self.alias_storage: int | None = None


class _CostPropagator(torch.fx.Interpreter):
    """Runs the graph node by node on fake tensors, recording costs and saved tensors per node."""

    def __init__(self, gm: torch.fx.GraphModule, fake_mode: FakeTensorMode):
        # Every value stays alive until propagation ends: storages are identified by address, and an
        # address freed early would be reused by a later node and confuse who saved what.
        super().__init__(gm, garbage_collect_values=False)
        self.records: dict[str, _NodeRecord] = {}
        self.param_bytes = sum(p.numel() * p.element_size() for p in gm.parameters())
        self.input_bytes = 0
        self.resident_keys = {t.untyped_storage()._cdata for t in [*gm.parameters(), *gm.buffers()]}

    def placeholder(self, target, args, kwargs):
        value = super().placeholder(target, args, kwargs)
        for t in _tensors(value):
            self.input_bytes += t.numel() * t.element_size()
            self.resident_keys.add(t.untyped_storage()._cdata)
        return value

    def run_node(self, n: torch.fx.Node):
        if n.op not in COMPUTE_OPS:
            return super().run_node(n)
        record = _NodeRecord()
        input_storages = {t.untyped_storage()._cdata for a in n.all_input_nodes
                          for t in _tensors(self.env.get(a))}

        def pack(t: torch.Tensor):
            s = t.untyped_storage()
            record.saved_storages.setdefault(s._cdata, s.nbytes())
            return t

        flop_counter = FlopCounterMode(display=False)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), flop_counter:
            out = super().run_node(n)
        record.flops = flop_counter.get_total_flops()
        for t in _tensors(out):
            key = t.untyped_storage()._cdata
            record.out_bytes += t.numel() * t.element_size()
            record.numel += t.numel()
            record.out_storages.add(key)
            if key in input_storages:
                record.alias_storage = key
        self.records[n.name] = record
        return out


def _tensors(value) -> list[torch.Tensor]:
    return [t for t in tree_leaves(value) if isinstance(t, torch.Tensor)]


def _build_cost_graph(gm, propagator: _CostPropagator, cost_model: str, name: str) -> CostGraph:
    cg = CostGraph()
    records, resident = propagator.records, propagator.resident_keys
    cg.graph.update(gm=gm, param_bytes=int(propagator.param_bytes), input_bytes=int(propagator.input_bytes),
                    name=name)
    owner: dict[int, str] = {}
    for node in gm.graph.nodes:
        if node.op not in COMPUTE_OPS:
            continue
        rec = records[node.name]
        for key in rec.out_storages:
            if key != rec.alias_storage:
                owner.setdefault(key, node.name)
        kind = _kind(gm, node)
        saves_output, saved_inputs, extra = _classify_saved(node, rec, owner, resident)
        cg.add_node(
            node.name,
            T=_time_cost(rec, kind, cost_model),
            M=int(rec.out_bytes),
            saved=int(extra),
            saves_output=saves_output,
            saved_inputs=saved_inputs,
            alias_of=owner.get(rec.alias_storage) if rec.alias_storage is not None else None,
            kind=kind,
            target=_target_name(node),
        )
        for pred in node.all_input_nodes:
            if pred.op in COMPUTE_OPS:
                cg.add_edge(pred.name, node.name)
    # Program order that data edges do not carry (random draws, readers after an in-place write):
    # plans must keep it, so it joins the graph as edges that carry no data.
    for before, after in ordering_edges(gm):
        if not cg.has_edge(before, after):
            cg.add_edge(before, after, order_only=True)
    return cg


def _classify_saved(node, rec: _NodeRecord, owner: dict[int, str],
                    resident: set[int]) -> tuple[bool, tuple[str, ...], int]:
    """Split what the node's backward keeps into its own output, predecessors' outputs, and the rest.

    Parameters, buffers and graph inputs (``resident``) are held for the whole step anyway and ignored.
    A saved storage owned by a non-adjacent ancestor (a view chain) is attributed to that ancestor.
    """
    saves_output = False
    saved_inputs: list[str] = []
    extra = 0
    for key, nbytes in rec.saved_storages.items():
        producer = owner.get(key)
        if key in rec.out_storages and (producer is None or producer == node.name or key == rec.alias_storage):
            saves_output = True
        elif producer is not None and producer != node.name:
            if producer not in saved_inputs:
                saved_inputs.append(producer)
        elif producer is None and key not in rec.out_storages and key not in resident:
            extra += nbytes
    return saves_output, tuple(saved_inputs), extra


def _kind(gm: torch.fx.GraphModule, node: torch.fx.Node) -> str:
    if node.op == "call_module":
        mod = gm.get_submodule(node.target)
        for cls, kind in _MODULE_KINDS.items():
            if isinstance(mod, cls):
                return kind
        return type(mod).__name__.lower()
    if node.op == "call_function":
        name = getattr(node.target, "__name__", str(node.target))
        return {operator.add: "add", operator.iadd: "add", operator.mul: "mul"}.get(node.target, name)
    return str(node.target)


def _target_name(node: torch.fx.Node) -> str:
    if node.op == "call_function":
        return getattr(node.target, "__name__", str(node.target))
    return str(node.target)


def _time_cost(rec: _NodeRecord, kind: str, cost_model: str) -> float:
    if cost_model == "paper":
        return 10.0 if kind == "conv" else 1.0
    return float(max(rec.flops, rec.numel, 1))
