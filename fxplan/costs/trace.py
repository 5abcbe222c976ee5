"""Tracing a model into a :class:`~fxplan.solvers.costgraph.CostGraph`.

:func:`fxplan.capture.capturers.capture` gives the graph: ``torch.fx.symbolic_trace`` at module granularity where
it works (leaf modules are torch.nn's, which matches the node counts of Kusumoto et al.'s Chainer
graphs), an ATen graph from ``torch.export`` otherwise. The example inputs are then propagated
through a private fake-tensor copy of the model, one node at a time, to record per node:

* ``M``: bytes of the node's output tensors (as if written out of place);
* ``T``: the node's forward cost. ``cost_model="roofline"`` (default) and ``"measured"``: microseconds on
  the model's device (:mod:`fxplan.costs.timecost`; a roofline of FLOPs, bytes moved and ops against the
  device's measured speed, or the node timed on real tensors of its shapes); ``"flops"``: FLOPs from
  ``torch.utils.flop_counter`` with a floor of one per output element; ``"paper"``: the paper's rule
  (10 for a convolution, 1 otherwise);
* what autograd saves for the node's backward, seen through ``saved_tensors_hooks``: whether it keeps
  the node's own output (``saves_output``), which predecessors' outputs it keeps (``saved_inputs``),
  and the bytes of anything else it keeps (``saved``: BatchNorm statistics, pooling indices, masks);
  ``saves_resident``: whether it also keeps a parameter, buffer or model input (no bytes of its own, but
  where a recomputation that checkpoint stops early ends);
* ``flops``: the FLOPs ``torch.utils.flop_counter`` counts for the node (matrix products, convolutions,
  attention; 0 for pointwise ops and norms, which :mod:`fxplan.capture.recomputed_inputs` takes for cheap);
* ``alias_of``: the predecessor whose storage the output shares (views and in-place ops), else None;
* ``mutates``: the buffers the node writes in place, seen from the schemas of the ops it runs;
* ``forward_rise`` and ``backward_rise``: the most bytes of new storages the node's forward and its
  backward hold at once (its outputs and gradients, and the temporaries between the ops it runs: an
  attention decomposed into matmuls, a softmax and a dropout; and what their kernels hold inside
  themselves, :mod:`fxplan.measure.scratch`), for the replay (``backward_rise`` where not 0).

The same propagation records what the replay of a plan's backward (:mod:`fxplan.planner.replay`) needs from
autograd: which inputs of each node its backward gives a gradient, which nodes have no backward of
their own (``cg.graph["gradients"]``), and the model's output (``cg.graph["example_output"]``, fake
tensors), so that no second pass over the graph is needed for them. The fake copy it ran on is kept
with its fake mode (``cg.graph["fake"]``) for the budget search to measure candidates on.

Besides data edges, the graph holds ``order_only`` edges (see :func:`fxplan.capture.effects.ordering_edges`):
random ops keep their program order, and readers after an in-place write stay after it, so every
plan over the graph is one the rewriter can run exactly. Solvers treat them like data edges, which
can only overestimate memory.

Propagation runs on fake tensors, so it allocates nothing, works at any batch size and leaves the
user's model (parameters, BatchNorm statistics) untouched.
"""

from __future__ import annotations

import logging
import operator
from collections.abc import Callable
from typing import Any

import networkx as nx
import torch
import torch.fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._pytree import tree_leaves, tree_map

from fxplan.capture.capturers import Captured, ExampleCall, as_call, capture, export_after
from fxplan.capture.effects import mutated_position, ordering_edges
from fxplan.capture.fakes import (
    DATA_DEPENDENT,
    caches_kept_real,
    data_dependent_error,
    fake_copy,
    fake_mode_of,
    to_fake,
)
from fxplan.capture.graph_module import resolve_attr
from fxplan.capture.recomputed_inputs import Recipe, call_recomputing
from fxplan.capture.regions import regions_of, with_regions
from fxplan.costs.op_census import NewStorages, NodeCensus, buffer_names, tensors
from fxplan.costs.timecost import T_SECONDS, TIME_MODELS, device_speed, measure_seconds
from fxplan.errors import FxplanError, TraceError
from fxplan.measure.meter import fresh_autocast_cache
from fxplan.measure.scratch import charged_bytes, storage_bytes
from fxplan.solvers.costgraph import CostGraph
from fxplan.solvers.units import Unit

logger = logging.getLogger("fxplan")

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


#: What ``trace`` accepts as ``cost_model``.
COST_MODELS = ("roofline", "measured", "flops", "paper")


@caches_kept_real()
def trace(model: torch.nn.Module, example_inputs: Any, *, cost_model: str = "roofline",
          captured: Captured | None = None, probe_units: bool = False) -> CostGraph:
    """Capture ``model`` and propagate ``example_inputs`` (real or fake) into a cost graph.

    ``example_inputs`` is a tuple of positional arguments, a dict of keyword arguments or one tensor.
    ``cost_model`` (module docstring) is ``"roofline"`` (default: works on fake tensors, costs little
    more than counting FLOPs, and gives the same plan on every run), ``"measured"`` (each distinct node timed on real
    tensors: closer to the machine, slower, and varies with load), ``"flops"`` or ``"paper"`` (Kusumoto et
    al. section 3: 10 for a convolution, 1 otherwise). ``cg.graph["T_seconds"]`` is the seconds of one
    unit of T (1e-6 for the two time models; None for FLOPs and the paper's units, which are not time).
    A model whose device cannot be timed here (meta tensors, fake CUDA tensors without a GPU) falls back
    from the time models to FLOPs, with a warning. The captured GraphModule (sharing the user's modules) is kept in
    ``cg.graph["gm"]`` and the :class:`~fxplan.capture.capturers.Captured` record in ``cg.graph["captured"]``.
    Nodes that update buffers in place (BatchNorm statistics of any class, counters) list them in
    ``mutates``, also recorded in the graph node's ``meta["fxplan_mutates"]`` for the rewriter.
    ``probe_units``: also run the savers of the graph's units of recomputed inputs as the graphs with them run
    them (``cg.graph["unit_savers"]``), from which the search derives those graphs (:func:`_unit_savers`).
    """
    if cost_model not in COST_MODELS:
        raise FxplanError(f"cost_model must be one of {', '.join(COST_MODELS)}, got {cost_model!r}")
    call = as_call(example_inputs)
    captured = captured or capture(model, call)
    try:
        with fresh_autocast_cache():
            propagator = _propagate(model, captured, call)
    except TraceError as error:
        if captured.method != "symbolic_trace":
            raise
        # symbolic_trace can give a graph that does not run (a shape frozen into an assertion): try export.
        logger.info("fxplan: capturing %s with torch.export (the graph symbolic_trace made does not run)",
                    type(model).__name__)
        logger.debug("fxplan: the symbolic_trace graph of %s failed: %s", type(model).__name__, error)
        captured = export_after(model, call, error)
        with fresh_autocast_cache():
            propagator = _propagate(model, captured, call)
    gm = captured.gm
    _refuse_own_checkpoints_updating_buffers(model, captured, propagator)
    for node in gm.graph.nodes:
        if node.name in propagator.records:
            node.meta["fxplan_mutates"] = propagator.records[node.name].mutates
    for graph in (gm.graph, propagator.module.graph):  # the search generates code over both
        for node in graph.nodes:
            if node.name in propagator.records:
                node.meta["fxplan_fresh_output"] = propagator.records[node.name].alias_storage is None
    cg = _build_cost_graph(gm, propagator, cost_model, type(model).__name__)
    cg.graph["captured"] = captured
    cg.graph["gradients"] = propagator.gradients()
    nx.set_node_attributes(cg, propagator.backward_rises(), "backward_rise")
    if probe_units:
        try:
            cg.graph["unit_savers"] = _unit_savers(cg, propagator)
        except Exception as error:  # noqa: BLE001 (optional facts: the graphs with units are traced instead)
            logger.info("fxplan: the savers of recomputed inputs were not probed (%s: %s)", type(error).__name__,
                        str(error).splitlines()[0][:200] if str(error) else "")
    # the fake copy propagated (its parameters without .grad: no backward ran) and its fake mode, on which
    # the budget search measures its candidates (fxplan.planner.search) without copying the model again
    cg.graph["fake"] = (propagator.module, propagator.fake_mode)
    cg.graph["example_output"] = tree_map(lambda t: t.detach() if isinstance(t, torch.Tensor) else t,
                                          captured.interface.output(propagator.result))
    if cost_model in TIME_MODELS:
        _time_costs(cg, gm, propagator, cost_model)
    propagator.release()
    return cg


def _propagate(model: torch.nn.Module, captured: Captured, call: ExampleCall) -> _CostPropagator:
    gm = captured.gm
    args, kwargs = captured.interface.graph_inputs(call.args, call.kwargs)
    values = placeholder_values(gm, args, kwargs, type(model).__name__)
    fake_mode = fake_mode_of(model, (call.args, call.kwargs))
    propagator = _CostPropagator(fake_copy(gm, fake_mode), fake_mode)
    try:
        with fake_mode, torch.enable_grad():
            propagator.result = propagator.run(*to_fake(values, fake_mode))
    except DATA_DEPENDENT as exc:
        raise data_dependent_error(exc, f"the captured graph of {type(model).__name__} (at node "
                                        f"'{propagator.current}')", TraceError) from exc
    except FxplanError:  # fxplan's own refusal: its message says what to do, whole
        raise
    except Exception as exc:  # anything the model's own code raises on these inputs
        node = propagator.current
        raise TraceError(f"running the captured graph on the example inputs failed at node '{node}' "
                         f"({type(exc).__name__}: {str(exc).strip().splitlines()[0][:300]}); check the example "
                         "inputs' shapes and dtypes against what the model expects") from exc
    return propagator


def _refuse_own_checkpoints_updating_buffers(model: torch.nn.Module, captured: Captured,
                                             propagator: _CostPropagator) -> None:
    """A model that checkpoints parts of itself re-runs them in backward, buffer updates included (its
    BatchNorm statistics move twice per step); the captured graph runs them once, as a step without its
    checkpoints does, so a rewrite could not keep its buffers: refused."""
    if not captured.checkpoints_itself:
        return
    updated = sorted({key for record in propagator.records.values() for key in record.mutates})
    if updated:
        raise FxplanError(
            f"{type(model).__name__} checkpoints parts of its own forward (torch.utils.checkpoint) and its step "
            f"updates buffers ({', '.join(map(str, updated[:3]))}{', ...' if len(updated) > 3 else ''}); its "
            "checkpoints re-run those updates when they recompute in backward, which fxplan's rewrite, planning the "
            "recomputation itself, would not do, so its buffers would differ from the model's. Turn the model's own "
            "checkpointing off (timm: model.set_grad_checkpointing(False); torchvision DenseNet: "
            "memory_efficient=False; Hugging Face: model.gradient_checkpointing_disable()) and let fxplan plan it")


def placeholder_values(gm: torch.fx.GraphModule, args: tuple, kwargs: dict[str, Any], name: str) -> list[Any]:
    """One value per placeholder of ``gm``: positional first, then by name, then the placeholder's default."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if len(args) > len(placeholders):
        raise TraceError(f"{name}.forward takes {len(placeholders)} inputs, got {len(args)} example inputs")
    values = list(args)
    for node in placeholders[len(args):]:
        if node.target in kwargs:
            values.append(kwargs[node.target])
        elif node.args:  # a placeholder's args hold its default value
            values.append(node.args[0])
        else:
            names = ", ".join(str(n.target) for n in placeholders)
            raise TraceError(f"{name}.forward({names}) needs a value for '{node.target}' in the example inputs")
    return values


class _NodeRecord:
    __slots__ = ("out_bytes", "flops", "saved_storages", "out_storages", "numel", "alias_storage", "mutates",
                 "bytes_moved", "op_bytes", "ops", "device", "call", "forward_rise")

    def __init__(self):
        self.out_bytes = 0
        self.flops = 0
        self.bytes_moved = 0
        self.op_bytes: dict[str, int] = {}
        self.ops = 0
        self.device: torch.device | None = None
        self.call: tuple[tuple, dict] = ((), {})  # the node's (fake) arguments, for the measured cost model
        self.numel = 0
        self.saved_storages: dict[int, int] = {}
        self.out_storages: set[int] = set()
        self.alias_storage: int | None = None
        self.mutates: tuple[str, ...] = ()
        self.forward_rise = 0


class _CostPropagator(torch.fx.Interpreter):
    """Runs the graph node by node on fake tensors, recording costs and saved tensors per node."""

    def __init__(self, gm: torch.fx.GraphModule, fake_mode: FakeTensorMode):
        # Every value stays alive until propagation ends: storages are identified by address, and an
        # address freed early would be reused by a later node and confuse who saved what.
        super().__init__(gm, garbage_collect_values=False)
        self.fake_mode = fake_mode
        self.records: dict[str, _NodeRecord] = {}
        self.current = ""
        self.param_bytes = sum(charged_bytes(p.numel() * p.element_size(), p.device) for p in gm.parameters())
        self.input_bytes = 0
        self.resident_keys = {t.untyped_storage()._cdata for t in [*gm.parameters(), *gm.buffers()]}
        self.buffer_names = buffer_names(gm)
        self.result: Any = None  # the graph's output
        # per compute node: the autograd nodes of its outputs, and the first sequence number it used
        self.grad_fns: dict[str, set] = {}
        self.grad_start: dict[str, int] = {}
        # what each call's forward counted (NodeCensus), by what it depends on (call_key): a repeated layer's
        # nodes are counted once
        self.censuses: dict[tuple, tuple] = {}

    def placeholder(self, target, args, kwargs):
        value = super().placeholder(target, args, kwargs)
        for t in tensors(value):
            self.input_bytes += charged_bytes(t.numel() * t.element_size(), t.device)
            self.resident_keys.add(t.untyped_storage()._cdata)
        return value

    def run_node(self, n: torch.fx.Node):
        self.current = n.name
        if n.op not in COMPUTE_OPS:
            return super().run_node(n)
        marker = torch.zeros((), requires_grad=True) * 1  # the next autograd sequence number, taken
        self.grad_start[n.name] = marker.grad_fn._sequence_nr()
        record = _NodeRecord()
        input_storages = {t.untyped_storage()._cdata for a in n.all_input_nodes
                          for t in tensors(self.env.get(a))}

        def pack(t: torch.Tensor):
            record.saved_storages.setdefault(t.untyped_storage()._cdata, storage_bytes(t))
            return t

        record.call = self.fetch_args_kwargs_from_env(n)
        key = self.call_key(n, record.call)
        known = self.censuses.get(key) if key is not None else None
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            if known is None:
                census = NodeCensus(self.buffer_names)
                with census:
                    out = super().run_node(n)
                known = self._census_figures(n, census, input_storages, key)
            else:  # a call like one counted before (a repeated layer): its figures, not counted again
                out = super().run_node(n)
        record.forward_rise, record.flops, record.bytes_moved, record.ops, op_bytes, record.mutates = known
        record.op_bytes = dict(op_bytes)
        record.device = next((t.device for t in tensors((out, record.call))), None)
        for t in tensors(out):
            key = t.untyped_storage()._cdata
            record.out_bytes += charged_bytes(t.numel() * t.element_size(), t.device)
            record.numel += t.numel()
            record.out_storages.add(key)
            if key in input_storages:
                record.alias_storage = key
        self.records[n.name] = record
        self.grad_fns[n.name] = {t.grad_fn for t in tensors(out) if t.grad_fn is not None}
        return out

    def _census_figures(self, n: torch.fx.Node, census: NodeCensus, input_storages: set[int],
                        key: tuple | None) -> tuple:
        """What ``census`` counted of node ``n``'s forward, kept for later calls of the same ``key`` where ``n`` writes
        nothing in place (the names of the buffers written are the node's own; a call that writes nothing writes
        nothing when made again on arguments alike)."""
        if n.op == "call_module" and census.written_storages & input_storages \
                and mutated_position(n, self.module) is None:
            raise TraceError(f"module '{n.target}' writes one of its inputs in place, which fxplan cannot see "
                             "from the module (no inplace=True): a plan could recompute from the written value")
        figures = (census.peak_bytes, census.flops, census.bytes_moved, census.ops, census.op_bytes,
                   tuple(census.written))
        if key is not None and not census.written_storages:
            self.censuses[key] = figures
        return figures

    def release(self) -> None:
        """Drop the propagation's values, last node first.

        The propagation ran with grad enabled and keeps every value, so it holds one autograd graph as deep
        as the model. Dropped in program order (as a dict lets go of its values), the last value would
        take the whole chain of autograd nodes with it, one destructor inside the other: at 20,000 nodes
        that overflows the C stack (a segmentation fault). Dropped last first, each value's autograd node
        goes alone, as the one before it is still held.
        """
        self.result = None
        for node in reversed(self.module.graph.nodes):
            self.env.pop(node, None)
            self.grad_fns.pop(node.name, None)
            if node.name in self.records:
                self.records[node.name].call = ((), {})

    def backward_rises(self) -> dict[str, int]:
        """Per node, the most bytes its backward allocates beyond what it starts with (0 omitted).

        Each node runs again on its own, on detached copies of its inputs (so that its backward stops at
        them), and its backward runs from its outputs to those inputs and its parameters; the storages it
        creates and holds at once are counted: the gradients it returns and, for a node that autograd
        runs as several functions (an attention that PyTorch decomposes into matmuls, a softmax and a
        dropout), the gradients passed between them, which a replay that sees only the node's inputs
        and outputs would miss (:mod:`fxplan.planner.replay`).
        """
        rises: dict[str, int] = {}
        known: dict[tuple, int] = {}  # a repeated layer's nodes are run once (_key_of)
        detached: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id(value): (value, its detached leaf)
        for node in self.module.graph.nodes:
            if node.op not in COMPUTE_OPS or not self.grad_fns.get(node.name):
                continue
            call = self.fetch_args_kwargs_from_env(node)
            rise = self.call_rise(node, call, self.call_key(node, call), known, detached)
            if rise:
                rises[node.name] = rise
        return rises

    def call_key(self, node: torch.fx.Node, call: tuple) -> tuple | None:
        """What ``node``'s backward run on ``call`` (its args and kwargs) depends on (:meth:`_key_of`)."""
        op = self.module.get_submodule(str(node.target)) if node.op == "call_module" else node.target
        return self._key_of(node.op, op, call)

    def call_rise(self, node: torch.fx.Node, call: tuple, key: tuple | None, known: dict[tuple, int],
                  detached: dict[int, tuple[torch.Tensor, torch.Tensor]] | None = None) -> int:
        """The rise of ``node``'s backward run on ``call``, from ``known`` where a call of the same ``key``
        (:meth:`call_key`) was probed (the rise is added to it)."""
        if key is not None and key in known:
            return known[key]
        with self.fake_mode:
            try:
                rise = self._backward_rise(lambda args, kwargs: getattr(self, node.op)(node.target, args, kwargs),
                                           call, self._parameters(node, call), {} if detached is None else detached)
            except Exception as exc:  # noqa: BLE001 (an in-place op on an input, an op fake tensors
                # cannot run again: no estimate; the replay only ranks plans, measured in the end)
                logger.debug("no backward estimate for %s: %s", node.name, exc)
                rise = 0
        if key is not None:
            known[key] = rise
        return rise

    def _parameters(self, node: torch.fx.Node, call: tuple) -> list[torch.Tensor]:
        """The parameters that require gradients of a module node, or of the modules a function node is handed in
        ``call`` (a unit's saver, a recomputed region): leaves of its backward besides its inputs, so that it makes
        their gradients at once with the others, as in a step (a convolution's weight gradient beside its
        kernel's scratch)."""
        if node.op == "call_module":
            modules = [self.module.get_submodule(str(node.target))]
        else:
            modules = [m for m in tree_leaves(call) if isinstance(m, torch.nn.Module)]
        found = {id(p): p for m in modules for p in m.parameters() if p.requires_grad}
        return list(found.values())

    @staticmethod
    def _key_of(kind: str, op: Any, call: tuple) -> tuple | None:
        """What a call's backward depends on (its op or module, and its arguments' shapes, dtypes, strides,
        which of them require gradients and which share storage); None if an argument is of no known kind."""
        storages: dict[int, int] = {}

        def describe(x):
            if isinstance(x, torch.Tensor):
                at = storages.setdefault(x.untyped_storage()._cdata, len(storages))
                return ("tensor", tuple(x.shape), x.dtype, x.stride(), x.requires_grad, at)
            if isinstance(x, (list, tuple)):
                return tuple(describe(y) for y in x)
            if isinstance(x, dict):
                return tuple((k, describe(v)) for k, v in x.items())
            if isinstance(x, slice):
                return ("slice", x.start, x.stop, x.step)
            if x is None or isinstance(x, (bool, int, float, str, torch.dtype, torch.device, torch.layout,
                                           torch.memory_format)):
                return x
            if isinstance(x, torch.nn.Module):  # a module handed to a function (a recomputed region's)
                return module_key(x)
            if isinstance(x, Recipe):  # a unit's saver (fxplan.capture.recomputed_inputs)
                return x.call_key(describe)
            if callable(x):  # an operator handed to a function (the unit's saver), by identity
                hash(x)
                return x
            raise TypeError

        def module_key(mod: torch.nn.Module) -> tuple:
            return (type(mod), repr(mod), mod.training, tuple(describe(t) for t in (*mod.parameters(), *mod.buffers())))

        try:
            key = (kind, module_key(op) if isinstance(op, torch.nn.Module) else op, describe(call))
            hash(key)
        except (TypeError, RuntimeError):  # an argument of no known kind, a tensor without strides
            return None
        return key

    @staticmethod
    def _backward_rise(run: Callable[[tuple, dict], Any], call: tuple, parameters: list[torch.Tensor],
                       detached: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> int:
        """The rise of one call's backward (:meth:`backward_rises`): ``run`` on ``call`` (args, kwargs) made
        leaves, its backward to them and to ``parameters``. ``detached`` holds the leaves made so far: a value
        many nodes read (a DenseNet's features, read by every later concatenation) is detached once; within
        one call, a value read twice gets a leaf per read, as each read has its own gradient."""
        leaves: list[torch.Tensor] = []
        used: set[int] = set()

        def leaf(t):
            if not (isinstance(t, torch.Tensor) and t.requires_grad):
                return t
            if id(t) in used:  # read again by this node: a leaf of its own
                made = t.detach().requires_grad_()
            else:
                if id(t) not in detached:  # the value itself is held, so that its id is not reused
                    detached[id(t)] = (t, t.detach().requires_grad_())
                made = detached[id(t)][1]
                used.add(id(t))
            leaves.append(made)
            return made

        args, kwargs = tree_map(leaf, call)
        out = run(args, kwargs)
        leaves += parameters
        outs = [t for t in tensors(out) if t.grad_fn is not None]
        if not outs or not leaves:
            return 0
        seeds = [torch.ones_like(t) for t in outs]
        with NewStorages() as tracker:
            torch.autograd.grad(outs, leaves, seeds, allow_unused=True)
        return tracker.peak_bytes

    def gradients(self) -> tuple[dict[str, frozenset[str]], frozenset[str]]:
        """Which inputs of each node its backward gives a gradient, and which nodes have no backward of
        their own (their inputs get the incoming gradient as it comes).

        Walking back from a node's outputs through the autograd nodes it created finds the inputs whose
        gradient it computes (a shape-only argument, an integer index, a detached value get none). A
        node that creates no autograd node (it builds or takes apart a tuple) hands its inputs their
        gradients as they come.
        """
        grad_inputs, passes = {}, set()
        for node in self.module.graph.nodes:
            if node.name in self.grad_fns:
                fns, first = self.grad_fns[node.name], self.grad_start[node.name]
                reached = _reached(fns, first)
                grad_inputs[node.name] = frozenset(u.name for u in node.all_input_nodes
                                                   if self.grad_fns.get(u.name, set()) & reached)
                if fns and all(fn._sequence_nr() < first for fn in fns):
                    passes.add(node.name)
        return grad_inputs, frozenset(passes)


def _reached(start_fns: set, first: int) -> set:
    """The autograd nodes created before sequence number ``first`` (by earlier graph nodes) that are
    reached from ``start_fns`` through autograd nodes created at or after it (those of the node being
    examined). An input whose autograd node is among them gets a gradient: also an input that is another
    node's output unchanged (a tuple taken apart, a dropout with p=0), which shares that node's."""
    reached, seen, stack = set(), set(), list(start_fns)
    while stack:
        fn = stack.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        if fn._sequence_nr() < first:
            reached.add(fn)
            continue
        stack.extend(nxt for nxt, _ in fn.next_functions)
    return reached


def _build_cost_graph(gm, propagator: _CostPropagator, cost_model: str, name: str) -> CostGraph:
    cg = CostGraph()
    records, resident = propagator.records, propagator.resident_keys
    cg.graph.update(gm=gm, param_bytes=int(propagator.param_bytes), input_bytes=int(propagator.input_bytes),
                    name=name, cost_model=cost_model, T_seconds=None)
    owner = _storage_owners(gm, records)
    for node in gm.graph.nodes:
        if node.op not in COMPUTE_OPS:
            continue
        rec = records[node.name]
        kind = _kind(gm, node)
        saves_output, saved_inputs, extra, saves_resident = _classify_saved(node, rec, owner, resident)
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


def _storage_owners(gm: torch.fx.GraphModule, records: dict[str, _NodeRecord]) -> dict[int, str]:
    """Storage -> the first node whose output it is (views and in-place ops own none)."""
    owner: dict[int, str] = {}
    for node in gm.graph.nodes:
        if node.op in COMPUTE_OPS:
            rec = records[node.name]
            for key in rec.out_storages:
                if key != rec.alias_storage:
                    owner.setdefault(key, node.name)
    return owner


def _unit_savers(cg: CostGraph, propagator: _CostPropagator) -> dict[str, dict[str, Any]]:
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

    owner, resident = _storage_owners(propagator.module, propagator.records), propagator.resident_keys
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
        saves_output, saved_inputs, extra, saves_resident = _classify_saved(node, _record_of(pattern, flat), owner,
                                                                            resident)
        rise = propagator.call_rise(node, call, key, rises) if propagator.grad_fns.get(node.name) else 0
        facts[node.name] = dict(kind=_kind(gm, node), target=_target_name(node), saves_output=saves_output,
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
    (:meth:`_CostPropagator._key_of`)."""
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


def _record_of(pattern: tuple[list, list], flat: list[torch.Tensor]) -> _NodeRecord:
    """The record of a saver's call (what it keeps and returns) from :func:`_saved_pattern` and the call's tensors."""
    def key(r: Any) -> Any:
        return flat[r].untyped_storage()._cdata if isinstance(r, int) else r

    rec = _NodeRecord()
    saved, outputs = pattern
    for r, nbytes in saved:
        rec.saved_storages.setdefault(key(r), nbytes)
    for r in outputs:
        rec.out_storages.add(key(r))
        if isinstance(r, int):
            rec.alias_storage = key(r)
    return rec


def _classify_saved(node, rec: _NodeRecord, owner: dict[int, str],
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


def _kind(gm: torch.fx.GraphModule, node: torch.fx.Node) -> str:
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


def _target_name(node: torch.fx.Node) -> str:
    if node.op == "call_function":
        return getattr(node.target, "__name__", str(node.target))
    return str(node.target)


def _time_cost(rec: _NodeRecord, kind: str, cost_model: str) -> float:
    """FLOPs or the paper's units; the time models' T is set afterwards by :func:`_time_costs`."""
    if cost_model == "paper":
        return 10.0 if kind == "conv" else 1.0
    return float(max(rec.flops, rec.numel, 1))


def _time_costs(cg: CostGraph, gm: torch.fx.GraphModule, propagator: _CostPropagator, cost_model: str) -> None:
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
