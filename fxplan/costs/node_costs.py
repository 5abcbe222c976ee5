"""The cost graph's nodes and edges, from the propagation's records (:mod:`fxplan.costs.propagation`).

:func:`build_cost_graph` makes a node per compute node of the captured graph with what the solvers and the replay
read of it (``M``, ``T``, what its backward saves, ``kind``, ...: :mod:`fxplan.costs.trace` lists them), a data edge
per use of one node's value by another and an ``order_only`` edge per program order the data edges do not carry.
What a node's backward keeps is told apart into its own output, its predecessors' outputs and other bytes by
:func:`classify_saved`, which the savers of recomputed inputs share (:mod:`fxplan.costs.unit_savers`). ``T`` is FLOPs or
the paper's units here, and microseconds on the model's device for the time models (:func:`time_costs`).
"""

from __future__ import annotations

import logging
import operator

import torch
import torch.fx

from fxplan.capture.effects import COMPUTE_OPS, ordering_edges
from fxplan.costs.propagation import CostPropagator, NodeRecord
from fxplan.costs.timecost import T_SECONDS, device_speed, measure_seconds
from fxplan.solvers.costgraph import CostGraph

logger = logging.getLogger("fxplan")

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


def build_cost_graph(gm, propagator: CostPropagator, cost_model: str, name: str) -> CostGraph:
    """The cost graph of ``gm`` from ``propagator``'s records (module docstring); ``T`` from :func:`_time_cost`."""
    cg = CostGraph()
    records, resident = propagator.records, propagator.resident_keys
    cg.graph.update(gm=gm, param_bytes=int(propagator.param_bytes), input_bytes=int(propagator.input_bytes),
                    name=name, cost_model=cost_model, T_seconds=None)
    owner = storage_owners(gm, records)
    for node in gm.graph.nodes:
        if node.op not in COMPUTE_OPS:
            continue
        rec = records[node.name]
        kind = node_kind(gm, node)
        saves_output, saved_inputs, extra, saves_resident = classify_saved(node, rec, owner, resident)
        cg.add_node(
            node.name,
            T=_time_cost(rec, kind, cost_model),
            M=int(rec.out_bytes),
            saved=int(extra),
            saves_output=saves_output,
            saved_inputs=saved_inputs,
            saves_resident=saves_resident,
            alias_of=owner.get(rec.alias_storage) if rec.alias_storage is not None else None,
            mutates=rec.mutates,
            forward_rise=int(rec.forward_rise),
            flops=int(rec.flops),
            kind=kind,
            target=target_name(node),
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


def storage_owners(gm: torch.fx.GraphModule, records: dict[str, NodeRecord]) -> dict[int, str]:
    """Storage -> the first node whose output it is (views and in-place ops own none)."""
    owner: dict[int, str] = {}
    for node in gm.graph.nodes:
        if node.op in COMPUTE_OPS:
            rec = records[node.name]
            for key in rec.out_storages:
                if key != rec.alias_storage:
                    owner.setdefault(key, node.name)
    return owner


def classify_saved(node, rec: NodeRecord, owner: dict[int, str],
                    resident: set[int]) -> tuple[bool, tuple[str, ...], int, bool]:
    """Split what the node's backward keeps into its own output, predecessors' outputs, the bytes of the
    rest, and whether it keeps any parameter, buffer or graph input (``resident``: held for the whole step
    anyway, so no bytes). A saved storage owned by a non-adjacent ancestor (a view chain) is attributed to
    that ancestor.
    """
    saves_output = False
    saved_inputs: list[str] = []
    extra = 0
    saves_resident = any(key in resident for key in rec.saved_storages)
    for key, nbytes in rec.saved_storages.items():
        producer = owner.get(key)
        if key in rec.out_storages and (producer is None or producer == node.name or key == rec.alias_storage):
            saves_output = True
        elif producer is not None and producer != node.name:
            if producer not in saved_inputs:
                saved_inputs.append(producer)
        elif producer is None and key not in rec.out_storages and key not in resident:
            extra += nbytes
    return saves_output, tuple(saved_inputs), extra, saves_resident


def node_kind(gm: torch.fx.GraphModule, node: torch.fx.Node) -> str:
    """The node's ``kind`` in the cost graph: ``conv``, ``bn``, ``relu``, ..., else its module's class, its
    function's or its method's name."""
    if node.op == "call_module":
        mod = gm.get_submodule(node.target)
        for cls, kind in _MODULE_KINDS.items():
            if isinstance(mod, cls):
                return kind
        return type(mod).__name__.lower()
    if node.op == "call_function":
        if isinstance(node.target, torch._ops.OpOverload):
            name = node.target._opname
            return "conv" if name.startswith(("conv", "convolution")) else _ATEN_KINDS.get(name, name)
        name = getattr(node.target, "__name__", str(node.target))
        return {operator.add: "add", operator.iadd: "add", operator.mul: "mul"}.get(node.target, name)
    return str(node.target)


#: ATen op names (graphs from torch.export) that mean the same as a module kind above.
_ATEN_KINDS = {"batch_norm": "bn", "relu": "relu", "relu_": "relu", "max_pool2d": "maxpool",
               "avg_pool2d": "avgpool", "adaptive_avg_pool2d": "avgpool", "dropout": "dropout",
               "embedding": "embedding", "add": "add", "add_": "add", "mul": "mul"}


def target_name(node: torch.fx.Node) -> str:
    """The node's ``target`` in the cost graph: its function's name, or its module path or method name."""
    if node.op == "call_function":
        return getattr(node.target, "__name__", str(node.target))
    return str(node.target)


def _time_cost(rec: NodeRecord, kind: str, cost_model: str) -> float:
    """FLOPs or the paper's units; the time models' T is set afterwards by :func:`time_costs`."""
    if cost_model == "paper":
        return 10.0 if kind == "conv" else 1.0
    return float(max(rec.flops, rec.numel, 1))


def time_costs(cg: CostGraph, gm: torch.fx.GraphModule, propagator: CostPropagator, cost_model: str) -> None:
    """T in microseconds of forward time on the model's device (:mod:`fxplan.costs.timecost`).

    ``measured`` runs each distinct node on real tensors; a node that cannot run that way (data it
    cannot invent, meta parameters) gets its roofline time instead.
    """
    records = propagator.records
    devices = {r.device for r in records.values() if r.device is not None}
    device = next(iter(devices), torch.device("cpu"))
    if device.type == "meta" or (device.type == "cuda" and not torch.cuda.is_available()) or len(devices) > 1:
        logger.warning("fxplan: cannot time nodes on %s here; node costs are FLOPs (cost_model='flops')",
                       ", ".join(sorted(map(str, devices))))
        cg.graph["T_seconds"], cg.graph["cost_model"] = None, "flops"
        return
    speed = device_speed(device)
    nodes = {n.name: n for n in gm.graph.nodes}
    for name in cg.nodes:
        rec = records[name]
        if cost_model == "fused":  # pointwise ops and norms run inside the kernels of their readers
            seconds = speed.seconds(rec.flops, 0, 0)
        else:
            seconds = speed.seconds(rec.flops, rec.bytes_moved, rec.ops, rec.op_bytes)
        if cost_model == "measured" and rec.ops:
            try:
                seconds = measure_seconds(_real_op(gm, nodes[name]), *rec.call, device)
            except Exception as exc:  # an op that cannot run on invented data keeps its roofline time
                logger.debug("fxplan: node %s not measured (%s); roofline time used", name, exc)
        cg.nodes[name]["T"] = max(seconds, speed.op_seconds) / T_SECONDS
    cg.graph["T_seconds"], cg.graph["cost_model"] = T_SECONDS, cost_model


def _real_op(gm: torch.fx.GraphModule, node: torch.fx.Node):
    """What ``node`` runs, on the user's own (real) modules: the module, the function, or the Tensor method."""
    if node.op == "call_module":
        return gm.get_submodule(node.target)
    if node.op == "call_method":
        return getattr(torch.Tensor, node.target)
    return node.target
