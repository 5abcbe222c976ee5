"""The propagation behind the cost graph: the captured graph run node by node on fake tensors.

:class:`CostPropagator` runs a fake copy of the captured graph (:func:`fxplan.costs.trace.trace` makes it) one node at
a time and keeps a :class:`NodeRecord` per node: the bytes and storages of its outputs, the storages autograd saves
for its backward (seen through ``saved_tensors_hooks``), and what :class:`~fxplan.costs.op_census.NodeCensus`
counts of its forward (FLOPs, bytes moved, ops, buffers written, the most bytes it holds at once). Then, from the
same values, what the replay of a plan's backward needs of autograd: which inputs of each node its backward gives a
gradient (:meth:`CostPropagator.gradients`) and how many bytes each node's backward holds at once
(:meth:`CostPropagator.backward_rises`). Calls alike (a repeated layer's nodes, by :meth:`CostPropagator.call_key`)
are counted once. :mod:`fxplan.costs.node_costs` turns the records into the cost graph's nodes.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
import torch.fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._pytree import tree_leaves, tree_map

from fxplan.capture.effects import COMPUTE_OPS, mutated_position
from fxplan.capture.recomputed_inputs import Recipe
from fxplan.costs.op_census import NewStorages, NodeCensus, buffer_names, tensors
from fxplan.errors import TraceError
from fxplan.measure.scratch import charged_bytes, storage_bytes

logger = logging.getLogger("fxplan")


class NodeRecord:
    """What the propagation records of one node (:class:`CostPropagator`)."""

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


class CostPropagator(torch.fx.Interpreter):
    """Runs the graph node by node on fake tensors, recording costs and saved tensors per node."""

    def __init__(self, gm: torch.fx.GraphModule, fake_mode: FakeTensorMode):
        # Every value stays alive until propagation ends: storages are identified by address, and an
        # address freed early would be reused by a later node and confuse who saved what.
        super().__init__(gm, garbage_collect_values=False)
        self.fake_mode = fake_mode
        self.records: dict[str, NodeRecord] = {}
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
        record = NodeRecord()
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
