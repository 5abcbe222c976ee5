"""Recomputed regions: keep what a convolution returns, recompute what autograd saves for it.

Autograd keeps, for ``conv(relu(batch_norm(cat(xs))))``, the concatenation (for the BatchNorm), the ReLU's
output (for itself and the convolution) and the batch statistics: on a DenseNet the bulk of a step's
memory. A *recomputed region* is such a chain of cheap nodes feeding one convolution, run as one node
that keeps only the region's inputs (values other nodes hold anyway) and the weight; its backward
recomputes the concatenation, BatchNorm and ReLU and then runs the convolution's backward exactly as
autograd's convolution node does. The convolution itself is never run again, which no canonical or
nested segment can express (a segment recomputes every node in it). This is the move Rockmate makes
(Zhao et al. 2023: a node's output and what its backward saves are separate values) and the plan
``torch.compile``'s min-cut partitioner chooses under an ``activation_memory_budget`` on these networks
(``scripts/compile_recompute.py``).

Exact by construction: the first forward runs the BatchNorm module itself (its running statistics are
updated once); the recomputation runs the same ``batch_norm`` kernel on copies of the running statistics,
so the output is the same bits and the module's statistics are not updated again; the gradient of the
convolution is ``aten.convolution_backward`` with the arguments autograd gives it. Where that cannot be
guaranteed the region runs as the plain chain (no grad, autocast on, functorch transforms, unbatched
input). Only ``torch.fx.symbolic_trace`` graphs are matched (nodes that call torch.nn's own
``Conv1d/2d/3d``, ``BatchNorm1d/2d/3d`` and ``ReLU`` classes, not subclasses, with no hooks).

:func:`find_regions` matches the regions of a captured graph; :func:`with_regions` returns a capture with
them replaced, which :func:`fxplan.costs.trace.trace` and the planner take as any other graph; the choice
between the graph with and without regions is the budget search's (:mod:`fxplan.api`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

from fxplan.capture.capturers import Captured
from fxplan.capture.effects import alias_roots, mutated_arg
from fxplan.capture.graph_module import owning_graph_module
from fxplan.capture.recomputed_inputs import find_units, parse_checked, plain_ops_only, saver_node
from fxplan.errors import FxplanError
from fxplan.solvers.costgraph import CostGraph
from fxplan.solvers.units import PREFIX, Unit

_CONVS = (nn.Conv1d, nn.Conv2d, nn.Conv3d)
_NORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)


@dataclass(frozen=True)
class Region:
    """``conv(relu(norm(cat(inputs) or inputs[0])))`` in a captured graph, by node names."""

    conv: str
    relu: str
    norm: str
    cat: str | None

    @property
    def recomputed(self) -> tuple[str, ...]:
        """The nodes its backward runs again."""
        return (self.norm, self.relu) + ((self.cat,) if self.cat else ())

    @property
    def removed(self) -> tuple[str, ...]:
        """The nodes of the captured graph that the graph with this region no longer has."""
        return self.recomputed

    @property
    def dropped(self) -> tuple[str, ...]:
        """The nodes whose values autograd no longer keeps."""
        return self.recomputed

    @property
    def replaced(self) -> tuple[str, ...]:
        """The nodes of the captured graph that run otherwise in the graph with this region."""
        return (self.conv,)


def find_regions(gm: fx.GraphModule) -> list[Region]:
    """The recomputed regions of ``gm`` (module docstring), in graph order. A region whose inputs are
    overwritten in place after it runs is left out: it keeps them for its backward, where the model's
    BatchNorm kept a concatenation of them (autograd would refuse the step where the model runs)."""
    found = []
    written_after = _written_after(gm)
    for conv in gm.graph.nodes:
        if not (_is_module(gm, conv, _CONVS) and _plain_conv(gm.get_submodule(conv.target))
                and len(conv.args) == 1 and not conv.kwargs):
            continue
        relu = conv.args[0]
        if not (isinstance(relu, fx.Node) and _is_relu(gm, relu) and _only_reader(relu, conv)):
            continue
        norm = relu.args[0]
        if not (isinstance(norm, fx.Node) and _is_module(gm, norm, _NORMS) and _only_reader(norm, relu)
                and len(norm.args) == 1 and not norm.kwargs):
            continue
        x = norm.args[0]
        cat = x if isinstance(x, fx.Node) and _is_cat(x) and _only_reader(x, norm) else None
        inputs = cat.args[0] if cat is not None else (x,)
        if any(written_after(i, conv) for i in inputs if isinstance(i, fx.Node)):
            continue
        found.append(Region(conv.name, relu.name, norm.name, cat.name if cat else None))
    return found


def _written_after(gm: fx.GraphModule):
    """``(value, node) -> bool``: whether the storage of ``value`` is overwritten in place after ``node``."""
    roots = alias_roots(gm.graph, gm)
    position = {n: i for i, n in enumerate(gm.graph.nodes)}
    last_write: dict[fx.Node, int] = {}
    for n in gm.graph.nodes:
        target = mutated_arg(n, gm) if n.op in ("call_module", "call_function", "call_method") else None
        if target is not None:
            last_write[roots.get(target, target)] = position[n]
    return lambda value, node: last_write.get(roots.get(value, value), -1) > position[node]


def with_regions(captured: Captured, regions: list) -> Captured:
    """A copy of the capture (same modules, same ``state_dict``) with the regions replaced: each of this module's
    by one node named as its convolution was, each unit of recomputed inputs (:mod:`fxplan.capture.recomputed_inputs`)
    by calls of its savers through :func:`~fxplan.capture.recomputed_inputs.call_recomputing`. ``regions``: as
    :func:`find_regions` and :func:`~fxplan.capture.recomputed_inputs.find_units` give them for this graph,
    or their names (a plan's ``regions``); a name that is no region of this graph raises FxplanError."""
    source = captured.gm
    regions = _named_regions(source, regions)
    ends = {r.conv: r for r in regions if isinstance(r, Region)}
    units = {name: r for r in regions if isinstance(r, Unit) for name in r.savers}
    if ends and units:
        raise FxplanError("fxplan: a graph has convolution regions or recomputed inputs, not both")
    inside = {name for r in ends.values() for name in r.recomputed}
    nodes = {n.name: n for n in source.graph.nodes}
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    recipes: dict[str, Any] = {}
    for node in source.graph.nodes:
        if node.name in ends:
            env[node] = _region_node(graph, node, ends[node.name], env)
        elif node.name in units:
            env[node] = saver_node(graph, nodes, units[node.name], node, env, recipes)
        elif node.name not in inside:
            env[node] = graph.node_copy(node, env.__getitem__)
    attributes = {n.target: vars(source)[n.target] for n in graph.nodes
                  if n.op == "get_attr" and n.target in vars(source)}  # what the capture made up
    attributes.update(recipes)
    gm = owning_graph_module(source, graph, attributes, class_name=type(source).__name__)
    if ends:
        # the node names a re-trace of the code gives (the region nodes replace several, so the names of
        # the nodes that follow them would otherwise depend on which regions a graph has)
        gm = owning_graph_module(source, _AllLeaves().trace(gm), attributes, class_name=type(source).__name__)
    gm.meta.update(source.meta)
    gm.graph.lint()
    return Captured(gm, captured.method, captured.interface)


def regions_of(cg: CostGraph) -> list:
    """The recomputed regions a budget is searched with: the convolution regions of a ``symbolic_trace`` graph,
    else its units of recomputed inputs (:mod:`fxplan.capture.recomputed_inputs`); found once per cost graph (the trace
    probes the units' savers, the budget search plans with them)."""
    if "regions" not in cg.graph:
        captured = cg.graph["captured"]
        regions = find_regions(captured.gm) if captured.method == "symbolic_trace" else []
        cg.graph["regions"] = regions or find_units(cg)
    return list(cg.graph["regions"])


def _named_regions(gm: fx.GraphModule, regions: list) -> list:
    """``regions`` with names (a plan's) resolved against ``gm``; FxplanError for a name that is no region."""
    names = [r for r in regions if isinstance(r, str)]
    if not names:
        return regions
    by_conv = {r.conv: r for r in find_regions(gm)}
    missing = [n for n in names if not n.startswith(PREFIX) and n not in by_conv]
    if missing:
        raise FxplanError(f"no recomputed region ends at {'node' if len(missing) == 1 else 'nodes'} {missing[:3]} "
                          "of this model's graph: the plan "
                          "was made for another model or version")
    return [parse_checked(gm, r) if isinstance(r, str) and r.startswith(PREFIX) else by_conv.get(r, r)
            for r in regions]


class _AllLeaves(fx.Tracer):
    """Traces a GraphModule's code again as ``torch.load`` does: every submodule is a leaf."""

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        return True


def recompute_cost(cg: CostGraph, regions: list[Region]) -> float:
    """T (the cost graph's units) the regions' backward recomputes: their norms, ReLUs, concatenations."""
    return float(sum(cg.nodes[name]["T"] for r in regions for name in r.recomputed))


def dropped_bytes(cg: CostGraph, region: Region | Unit) -> int:
    """Bytes of the values the region no longer keeps for backward (in the captured graph's cost graph): of a
    convolution region, the outputs of its norm, ReLU and concatenation that have storage of their own (an
    in-place ReLU's is the norm's); of a unit, its dropped values."""
    return sum(cg.nodes[name]["M"] for name in region.dropped if cg.nodes[name].get("alias_of") is None)


def _region_node(graph: fx.Graph, conv: fx.Node, region: Region, env: dict[fx.Node, fx.Node]) -> fx.Node:
    """The node running ``region`` (ending at ``conv`` of the source graph) in ``graph`` (named by the re-trace
    of :func:`with_regions`)."""
    norm = conv.args[0].args[0]
    if region.cat is not None:
        cat = norm.args[0]
        inputs, cat_dim = tuple(cat.args[0]), _cat_dim(cat)
    else:
        inputs, cat_dim = (norm.args[0],), None
    modules = (graph.get_attr(conv.target), graph.get_attr(norm.target))
    return graph.call_function(conv_of_recomputed_region, (*modules, cat_dim, *(env[i] for i in inputs)))


def _is_module(gm: fx.GraphModule, node: fx.Node, classes: tuple[type, ...]) -> bool:
    if node.op != "call_module":
        return False
    module = gm.get_submodule(node.target)
    return type(module) in classes and not _hooked(module)


def _hooked(module: nn.Module) -> bool:
    return any(getattr(module, name, None) for name in (
        "_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks",
        "_state_dict_hooks", "_load_state_dict_pre_hooks"))


def _plain_conv(conv: nn.Module) -> bool:
    """A convolution whose forward is one ``aten.convolution`` with explicit padding (no padding mode, no
    ``padding='same'``, which pads asymmetrically in a separate op)."""
    return conv.padding_mode == "zeros" and not isinstance(conv.padding, str)


def _is_relu(gm: fx.GraphModule, node: fx.Node) -> bool:
    if _is_module(gm, node, (nn.ReLU,)):
        return len(node.args) == 1 and not node.kwargs
    return node.op == "call_function" and node.target in (F.relu, torch.relu) and len(node.args) == 1 \
        and set(node.kwargs) <= {"inplace"}


def _is_cat(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target is torch.cat and isinstance(node.args[0], (list, tuple)) \
        and all(isinstance(a, fx.Node) for a in node.args[0]) and set(node.kwargs) <= {"dim"}


def _cat_dim(cat: fx.Node) -> int:
    return cat.args[1] if len(cat.args) > 1 else cat.kwargs.get("dim", 0)


def _only_reader(node: fx.Node, reader: fx.Node) -> bool:
    return list(node.users) == [reader]


# ----------------------------------------------------------------------------------------------
# the runtime


def conv_of_recomputed_region(conv: nn.Module, norm: nn.Module, cat_dim: int | None, *inputs: torch.Tensor):
    """``conv(relu(norm(cat(inputs, cat_dim) or inputs[0])))``, keeping only the inputs and the weight for
    backward where that is exact (module docstring), else the plain chain."""
    x0 = inputs[0]
    if isinstance(x0, fx.Proxy):  # traced again (torch.load re-traces a GraphModule's code): one node again
        return _traced_again(x0.tracer, conv, norm, cat_dim, inputs)
    if plain_ops_only(x0) or x0.dim() != conv.weight.dim():
        return conv(F.relu(norm(_joined(inputs, cat_dim)), inplace=True))
    return _RecomputedRegion.apply(conv, norm, cat_dim, conv.weight, conv.bias, norm.weight, norm.bias, *inputs)


def _traced_again(tracer: fx.Tracer, conv: nn.Module, norm: nn.Module, cat_dim: int | None,
                  inputs: tuple[fx.Proxy, ...]) -> fx.Proxy:
    """The region's nodes as :func:`with_regions` makes them, with the same names (a rewritten module
    names its segments' nodes, and finds them again by name after ``torch.load``)."""
    graph = tracer.graph
    conv_path, norm_path = tracer.path_of_module(conv), tracer.path_of_module(norm)
    name = graph._target_to_str(conv_path)  # the name fx gave the convolution's own node
    conv_module = graph.create_node("get_attr", conv_path, name=f"{name}_module")
    norm_module = graph.create_node("get_attr", norm_path, name=f"{graph._target_to_str(norm_path)}_module")
    node = graph.create_node("call_function", conv_of_recomputed_region,
                             (conv_module, norm_module, cat_dim, *(p.node for p in inputs)), name=name)
    return fx.Proxy(node, tracer)


def _joined(inputs: tuple[torch.Tensor, ...], cat_dim: int | None) -> torch.Tensor:
    return inputs[0] if cat_dim is None else torch.cat(inputs, cat_dim)


class _RecomputedRegion(torch.autograd.Function):
    """The region as one autograd node: saves the inputs and the weights; backward recomputes the norm and
    ReLU, then runs ``aten.convolution_backward`` with the arguments of autograd's convolution node.
    Under ``create_graph=True`` it differentiates the recomputed chain, convolution included, instead, so
    that gradients of gradients are those of the model."""

    @staticmethod
    def forward(ctx, conv, norm, cat_dim, conv_weight, conv_bias, norm_weight, norm_bias, *inputs):
        use_batch_stats = norm.training or norm.running_mean is None
        y = conv._conv_forward(F.relu(norm(_joined(inputs, cat_dim)), inplace=True), conv_weight, conv_bias)
        # In eval mode the output depends on the running statistics: saved, so that a change before
        # backward is an autograd error rather than a different gradient.
        stats = () if use_batch_stats or norm.running_mean is None else (norm.running_mean, norm.running_var)
        ctx.save_for_backward(conv_weight, conv_bias, norm_weight, norm_bias, *inputs, *stats)
        ctx.conv, ctx.norm, ctx.cat_dim, ctx.count = conv, norm, cat_dim, len(inputs)
        ctx.use_batch_stats = use_batch_stats
        return y

    @staticmethod
    def backward(ctx, grad):
        conv_weight, conv_bias, norm_weight, norm_bias, *rest = ctx.saved_tensors
        inputs, stats = rest[:ctx.count], rest[ctx.count:]
        if torch.is_grad_enabled():  # create_graph=True
            return (None, None, None, *_chain_gradients(ctx, grad, (conv_weight, conv_bias, norm_weight, norm_bias,
                                                                    *inputs), stats))
        needs = ctx.needs_input_grad
        with torch.enable_grad():
            w, b = _leaf(norm_weight, needs[5]), _leaf(norm_bias, needs[6])
            leaves = [_leaf(t, needs[7 + i]) for i, t in enumerate(inputs)]
            y = _norm_again(ctx.norm, _joined(tuple(leaves), ctx.cat_dim), w, b, ctx.use_batch_stats, stats)
            h = F.relu(y, inplace=True)  # as the model's ReLU may: the norm's backward needs not its output
        conv = ctx.conv
        grad_h, grad_weight, grad_bias = torch.ops.aten.convolution_backward(
            grad, h.detach(), conv_weight, None if conv_bias is None else [conv_bias.shape[0]], list(conv.stride),
            list(conv.padding), list(conv.dilation), False, [0] * (conv_weight.dim() - 2), conv.groups,
            [h.requires_grad, needs[3], needs[4]])
        wanted = [t for t in (w, b, *leaves) if t is not None and t.requires_grad]
        grads = iter(torch.autograd.grad(h, wanted, grad_h) if wanted else ())
        regional = [next(grads) if t is not None and t.requires_grad else None for t in (w, b, *leaves)]
        return (None, None, None, grad_weight, grad_bias, *regional)


def _chain_gradients(ctx, grad: torch.Tensor, tensors: tuple, stats: tuple) -> list[torch.Tensor | None]:
    """The gradients of the whole recomputed chain with a graph of their own (``create_graph=True``)."""
    # aliases, so that each gradient is that of this use only (one input may be computed from another)
    tensors = tuple(None if t is None else t.view_as(t) for t in tensors)
    conv_weight, conv_bias, norm_weight, norm_bias, *inputs = tensors
    h = F.relu(_norm_again(ctx.norm, _joined(tuple(inputs), ctx.cat_dim), norm_weight, norm_bias,
                           ctx.use_batch_stats, stats), inplace=True)
    y = ctx.conv._conv_forward(h, conv_weight, conv_bias)
    needed = [t for t, need in zip(tensors, ctx.needs_input_grad[3:]) if need]
    grads = iter(torch.autograd.grad(y, needed, grad, create_graph=True, allow_unused=True))
    return [next(grads) if need else None for need in ctx.needs_input_grad[3:]]


def _leaf(t: torch.Tensor | None, needs_grad: bool) -> torch.Tensor | None:
    return None if t is None else t.detach().requires_grad_(needs_grad)


def _norm_again(norm: nn.Module, x: torch.Tensor, weight, bias, use_batch_stats: bool, stats) -> torch.Tensor:
    """The norm's output again, the same bits, without touching its running statistics: the same kernel
    (running statistics given or not, as the module gave them) on copies of them."""
    if use_batch_stats:
        running = (None, None) if norm.running_mean is None else (norm.running_mean.clone(),
                                                                   norm.running_var.clone())
        return F.batch_norm(x, *running, weight, bias, True, norm.momentum or 0.0, norm.eps)
    return F.batch_norm(x, *stats, weight, bias, False, 0.0, norm.eps)
