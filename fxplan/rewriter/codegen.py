"""Plan segments → a drop-in ``torch.fx.GraphModule`` that recomputes what the plan drops.

:func:`segment_module` implements the canonical strategy of Kusumoto et al. (section 3) for a given
increasing sequence of lower sets ``L_1 ≺ … ≺ L_k = V``, passed as the blocks ``V_i = L_i \\ L_{i-1}``:

* the graph is reordered so that each block is contiguous, and each block becomes one function,
  ``self.segment_i(...)``, whose inputs are the values it reads from earlier blocks (or the model's
  inputs) and whose outputs are the values later blocks or the model's output read (``∂(L_i)``);
* every block but the last runs under recomputation (:class:`fxplan.rewriter.recompute.Segment`), so only the
  boundary values are kept through the forward, and backward recomputes the rest block by block;
* FX's code generation drops each value after its last use, in the top-level function and in every
  segment.

Where the data graph is not the whole story (see :mod:`fxplan.capture.effects`):

* an in-place op that opens a recomputed segment on a value from an earlier one, and that nothing
  else in between needs (ResNet's ``relu(out += identity)`` at a block boundary), runs inline between
  the segments, not recomputed: the later segment keeps the op's result, which is also what the op's
  autograd node saves, and no copy is made (:meth:`fxplan.rewriter.planned_graph.Rewrite.inplace_openers`);
* any other in-place op whose overwritten value is read by a recomputation (it is an input of a
  recomputed segment that runs no later than the op), or that the plan moves across a reader of the
  old value, gets a private copy of its operand first (``x_copy = x.clone()`` before ``self.relu(x_copy)``):
  the same values, dtypes and gradients as the in-place op, with the memory of the out-of-place one.
  Readers after the op are redirected to its result, so they still see the new value;
* random ops must stay in program order (otherwise they would draw different numbers than the
  original model): a plan that reorders two of them is rejected.

Exactness: with the same inputs, outputs and parameter gradients are bitwise equal to the original's
on the CPU when the plan keeps the program order (contiguous blocks of a topological order), because
the autograd graph is the same up to identity-gradient copy nodes. A plan that reorders nodes can
change the order in which the autograd engine sums three or more gradient contributions to one value
(a tensor or tied weight used three or more times), which changes results in the last bits.

The plan's checks and the in-place fixes of its graph are :mod:`fxplan.rewriter.planned_graph`'s, the code of the
segments :mod:`fxplan.rewriter.emit`'s; this module puts the module together (:func:`segment_module`) and holds what
it is (:class:`SegmentedModule`).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import inspect
import logging
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.fx as fx

from fxplan.capture.graph_module import owning_graph_module, resolve_attr
from fxplan.capture.portable import portable_target, restored
from fxplan.errors import FxplanError
from fxplan.rewriter import offload
from fxplan.rewriter.emit import Emitter
from fxplan.rewriter.planned_graph import Rewrite, split_off, validate
from fxplan.rewriter.recompute import Segment, checkpointed, views_replayed
from fxplan.solvers import subplans

logger = logging.getLogger("fxplan")


def copy_for_inplace(x: Any) -> Any:
    """A private copy of ``x`` for an in-place op to overwrite (non-tensors are returned as is)."""
    return x.clone() if isinstance(x, torch.Tensor) else x


class SegmentedModule(fx.GraphModule):
    """The rewritten model: calls one :class:`~fxplan.rewriter.recompute.Segment` per block of the plan.

    It owns the original module tree under the original names (same ``state_dict`` keys and
    ``named_buffers()`` as the model: tensor constants of the captured graph are plain attributes, which
    :meth:`_apply` converts); its segments only reference it. Its ``forward`` has the signature of the
    original model's (:meth:`_show_signature`), and attributes it lacks are the original's (:meth:`__getattr__`).
    ``print(m.code)`` shows the calls,
    ``print(m.segment_0.code)`` a block, and :meth:`readable` everything.

    Built from a captured model (:mod:`fxplan.capture.capturers`), it runs the plan only for the call it was
    planned for: training with gradients, every module in the train/eval mode it was captured in,
    and (for graphs from torch.export) the same argument structure and input shapes. Any other call
    runs the original model's ``forward`` on the same modules, which is what the original would do;
    a training call that differs from the planned one is logged, since it recomputes nothing.
    """

    fxplan_segments: tuple[tuple[str, ...], ...]
    fxplan_offloaded: tuple[str, ...] = ()
    #: Run a planned training call checkpointed as a whole: the module is one segment, not the last, of a larger
    #: step (a part of a model rewritten in parts, :mod:`fxplan.apply.rewritten_parts`), so its forward keeps only
    #: its inputs and its backward recomputes it, with its own plan inside.
    fxplan_checkpointed_whole: bool = False

    def recompile(self):
        result = super().recompile()
        impl = type(self)  # GraphModule gives every instance a class of its own
        if impl.__dict__.get("forward") is not impl.__dict__.get("_fxplan_planned_forward"):
            impl._fxplan_graph_forward = impl.forward

            def forward(self, *args: Any, **kwargs: Any) -> Any:
                return SegmentedModule._call_as_planned(self, *args, **kwargs)

            impl.forward = impl._fxplan_planned_forward = forward
            self._show_signature()
        return result

    def _show_signature(self) -> None:
        """Give ``forward`` the signature of the call it stands for: the original model's ``forward`` where the
        module was built from a capture, else the graph's. Training stacks read it (Hugging Face ``Trainer``
        keeps only the dataset columns ``inspect.signature(model.forward)`` names, and would drop every column
        of a ``forward(*args, **kwargs)``)."""
        impl = type(self)
        interface = self.__dict__.get("_fxplan_interface")
        signature = getattr(interface, "signature", None)
        if signature is None:
            try:
                signature = inspect.signature(impl._fxplan_graph_forward)
            except (TypeError, ValueError):
                return
        else:  # the bound method's signature: a ``self`` first, which inspect drops again for the bound method
            this = inspect.Parameter("self", inspect.Parameter.POSITIONAL_ONLY)
            signature = signature.replace(parameters=[this, *signature.parameters.values()])
        impl._fxplan_planned_forward.__signature__ = signature

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self._show_signature()  # a loaded module gets its interface back here

    def _call_as_planned(self, *args: Any, **kwargs: Any) -> Any:
        original = self.__dict__.get("_fxplan_original")
        interface = self.__dict__.get("_fxplan_interface")
        if original is None or interface is None:
            return self._run_planned(args, kwargs)
        original.training = self.training
        if not torch.is_grad_enabled():
            return self._run_original(original, args, kwargs)
        why = interface.mismatch(original, args, kwargs)
        if why is not None:
            if self.training and why not in self._fxplan_warned:
                self._fxplan_warned.add(why)
                logger.warning("fxplan: %s runs its original forward, without recomputation, for this call: "
                               "%s. Rewrite it for this call to plan it.", self._get_name(), why)
            return self._run_original(original, args, kwargs)
        return interface.output(self._run_planned(*interface.graph_inputs(args, kwargs)))

    def _run_planned(self, args: tuple, kwargs: dict[str, Any]) -> Any:
        """The generated forward on the graph's inputs; checkpointed as a whole where
        :attr:`fxplan_checkpointed_whole` and a training forward records gradients."""
        if not (self.fxplan_checkpointed_whole and self.training and torch.is_grad_enabled()):
            return self._graph_forward(*args, **kwargs)
        # as a segment is checkpointed: its buffers guarded, from the random states of its forward
        segments = self.segment_modules()
        slots = [(f"{path}.{name}" if path else name, module, name) for path, module in self.named_modules()
                 for name, buf in module._buffers.items() if buf is not None]
        learned = self.__dict__.setdefault("_fxplan_whole_learned", set())
        known = set(learned).union(*(segment.known_mutating(slots) for segment in segments))
        generators = list({id(g): g for segment in segments for g in segment.own_generators()}.values())
        out, new = checkpointed(self._graph_forward, args, kwargs, slots=slots, known=known, random=True,
                                generators=generators)
        learned.update(new)
        return out

    def _graph_forward(self, *args: Any, **kwargs: Any) -> Any:
        with views_replayed(), self._offloading(args, kwargs):
            return self._fxplan_graph_forward(*args, **kwargs)

    def _offloading(self, args: tuple, kwargs: dict[str, Any]) -> contextlib.AbstractContextManager:
        """The session that keeps the plan's offloaded values in host memory (:mod:`fxplan.rewriter.offload`) for
        one planned training forward; nothing where the plan offloads nothing."""
        if not self.fxplan_offloaded:
            return contextlib.nullcontext()
        resident = [*self.parameters(), *self.buffers(),
                    *(t for t in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor))]
        device = next((t.device for t in resident), torch.device("cpu"))
        return offload.session_for(resident, device)

    def __getattr__(self, name: str) -> Any:
        """An attribute the module lacks is the original model's (``config``, ``generate``, ``save_pretrained``,
        a nanoGPT's ``configure_optimizers``): it acts on the original object, whose submodules and parameters are
        this module's. Private names are not looked up there."""
        try:
            return super().__getattr__(name)
        except AttributeError:
            original = self.__dict__.get("_fxplan_original")
            if original is None or name.startswith("_"):
                raise
            return getattr(original, name)

    def _run_original(self, original: torch.nn.Module, args: tuple, kwargs: dict[str, Any]) -> Any:
        """``original(*args, **kwargs)`` on this module's state. Submodules are the same objects; the root's own
        parameters and buffers are entries of two dicts, so a forward that rebinds one (``self.count =
        self.count + 1``, in eval mode too) would change the original's alone: the original is given this
        module's entries before the call and this module takes back the original's after it."""
        shared = ((self._parameters, original._parameters), (self._buffers, original._buffers))
        for mine, theirs in shared:
            theirs.update({name: mine[name] for name in theirs if name in mine})
        try:
            return original(*args, **kwargs)
        finally:
            for mine, theirs in shared:
                mine.update({name: theirs[name] for name in theirs if name in mine})

    def unplanned_reason(self, *args: Any, **kwargs: Any) -> str | None:
        """Why a training call with these arguments would run the original forward instead of the plan
        (a graph captured by torch.export is specialised to the planned call's input shapes), or None."""
        original = self.__dict__.get("_fxplan_original")
        interface = self.__dict__.get("_fxplan_interface")
        if original is None or interface is None:
            return None
        return interface.mismatch(original, args, kwargs)

    def segment_modules(self) -> list[Segment]:
        """The segments, in execution order."""
        return [getattr(self, name) for name in self._fxplan_segment_names]

    def readable(self) -> str:
        """The top-level code followed by each segment's code (sub-segments after their segment)."""
        parts = [f"# {self._get_name()}.forward{self.code}"]

        def show(name: str, seg: Segment, indent: str) -> None:
            if not indent:
                tag = "recomputed in backward" if seg.fxplan_recompute else "kept for backward"
            else:
                tag = "checkpointed again" if seg.fxplan_recompute else "runs as part of its segment"
            if seg.fxplan_children:
                tag += f"; its sub-segments {', '.join(seg.fxplan_children)} checkpointed again inside"
            code = "".join(indent + line + "\n" if line else "\n" for line in seg.code.split("\n"))
            parts.append(f"{indent}# self.{name} ({tag}){code.rstrip()}\n")
            for sub, child in seg.fxplan_children.items():
                show(f"{name}.{sub}", child, indent + "    ")

        for name in self._fxplan_segment_names:
            show(name, getattr(self, name), "")
        return "\n".join(parts)

    def _state_holder(self) -> torch.nn.Module:
        holder = torch.nn.Module()
        segs = set(self._fxplan_segment_names)
        holder.__dict__["_modules"] = {k: v for k, v in self._modules.items() if k not in segs}
        holder.__dict__["_parameters"] = dict(self._parameters)
        holder.__dict__["_buffers"] = dict(self._buffers)
        holder.__dict__["_non_persistent_buffers_set"] = set(self._non_persistent_buffers_set)
        holder.__dict__["_fxplan_extras"] = dict(self._fxplan_extra_attrs)
        holder.training = self.training
        return holder

    def _apply(self, fn: Any, recurse: bool = True) -> SegmentedModule:
        """``nn.Module._apply`` (what ``.to()``, ``.cuda()``, ``.half()`` run), and the same for the tensor constants,
        which are attributes, not buffers."""
        result = super()._apply(fn, recurse)
        for name, value in self._fxplan_extra_attrs.items():
            if isinstance(value, torch.Tensor):
                self._fxplan_extra_attrs[name] = self.__dict__[name] = fn(value)
        return result

    def _call_state(self) -> dict[str, Any]:
        return {k: self.__dict__[k] for k in ("_fxplan_original", "_fxplan_interface") if k in self.__dict__}

    def __deepcopy__(self, memo: dict[int, Any]) -> SegmentedModule:
        holder = copy.deepcopy(self._state_holder(), memo)
        graph = copy.deepcopy(self._fxplan_graph)
        new = segment_module(_graph_module(holder, graph, self._get_name()), self.fxplan_segments,
                             self.fxplan_children, self.fxplan_offloaded)
        memo[id(self)] = new
        for key, value in {**self._call_state(), **self._user_attrs()}.items():
            new.__dict__[key] = copy.deepcopy(value, memo)
        new._show_signature()
        return new

    def _user_attrs(self) -> dict[str, Any]:
        # Attributes others attach (e.g. fxplan.rewrite's ``fxplan_plan``) survive copies.
        return {
            k: v for k, v in self.__dict__.items()
            if k.startswith("fxplan_") and k not in ("fxplan_segments", "fxplan_children", "fxplan_offloaded")
        }

    def __reduce__(self) -> tuple[Any, ...]:
        # The graph itself is saved, not its code: GraphModule's own pickling re-traces the code on loading,
        # which renames ATen nodes (``mul_2`` → ``mul_tensor_2``, so the segments name nothing) and runs the
        # ops whose arguments are all constants (an attention mask becomes a ``_tensor_constant``).
        state = {**self._call_state(), **self._user_attrs()}
        graph = _PortableGraph(self._fxplan_graph)
        return (_rebuild, (self._state_holder(), graph, self.fxplan_segments, self._get_name(), self.fxplan_children,
                           self.fxplan_offloaded), state)


def _rebuild(
    holder: torch.nn.Module, graph: _PortableGraph, segments: Any, class_name: str, children: Any = None,
    offloaded: Sequence[str] = (),
) -> SegmentedModule:
    return segment_module(_graph_module(holder, graph.restore(), class_name), segments, children, offloaded)


class _PortableGraph:
    """An ``fx.Graph`` as data pickle can save (fx nodes cannot be pickled): each node's op, name, target (an
    operator by its name), arguments (other nodes by name) and type; node metadata is left out (it holds fake
    tensors, and nothing that runs the module reads it)."""

    def __init__(self, graph: fx.Graph):
        self.codegen = graph._codegen
        self.nodes = [
            (node.op, node.name, portable_target(node.target),
             fx.node.map_aggregate((node.args, node.kwargs), _portable_argument), node.type)
            for node in graph.nodes
        ]

    def restore(self) -> fx.Graph:
        graph = fx.Graph()
        graph._codegen = self.codegen
        made: dict[str, fx.Node] = {}
        for op, name, target, arguments, type_ in self.nodes:
            args, kwargs = fx.node.map_aggregate(arguments, lambda a: made[a.name] if isinstance(a, _NodeName) else
                                                 restored(a))
            target = restored(target)
            made[name] = graph.create_node(op, target, args, kwargs, name, type_)
            if made[name].name != name:
                raise FxplanError(f"fxplan: loading a rewritten module: node {name!r} came back as {made[name].name!r}")
        return graph


@dataclasses.dataclass(frozen=True)
class _NodeName:
    name: str


def _portable_argument(arg: Any) -> Any:
    """A node's argument as pickle can save it: another node by name, a function (the op a saver of
    :mod:`fxplan.capture.recomputed_inputs` runs) as a target is saved."""
    return _NodeName(arg.name) if isinstance(arg, fx.Node) else portable_target(arg)


def _graph_module(holder: torch.nn.Module, graph: fx.Graph, class_name: str) -> fx.GraphModule:
    """A GraphModule running ``graph`` that owns *all* of ``holder``'s state, not only what it uses."""
    return owning_graph_module(holder, graph, holder.__dict__.get("_fxplan_extras"), class_name)


def segment_module(
    gm: fx.GraphModule, segments: Sequence[Sequence[str]], children: Mapping[str, Any] | None = None,
    offloaded: Sequence[str] = (),
) -> SegmentedModule:
    """Rewrite ``gm`` so that it runs ``segments`` as the canonical strategy prescribes.

    ``gm`` is a traced model (``torch.fx.symbolic_trace(model)``); ``segments`` lists the names of
    all its compute nodes, each exactly once, block by block in execution order (no node may use a
    node of a later block). Every block but the last is recomputed in backward. The result shares
    the original modules and parameters with ``gm`` (and so with the traced model), has the same
    ``state_dict`` keys, and trains exactly like it (see the module docstring for the fine print).

    ``children`` (a plan's ``children``: segment index as a string -> sub-plan of that segment's nodes)
    nests plans (:mod:`fxplan.solvers.subplans`): such a segment calls its sub-segments, ``self.segment_i_j``,
    every one but the last checkpointed again inside it. In-place copies and the random-op order are
    decided on the innermost segments, so every value a recomputation at any level reads is protected.

    ``offloaded`` (a plan's ``offloaded``) names the nodes whose values a training forward keeps in host memory
    for backward (:mod:`fxplan.rewriter.offload`).

    Raises :class:`~fxplan.errors.FxplanError` for plans that are not such a sequence, or that
    would change what the model computes (random ops reordered, a read moved before the in-place
    op it must follow).
    """
    if isinstance(segments, (str, bytes)) or not isinstance(segments, Sequence):
        raise FxplanError("segments must be a list of lists of node names")
    given = subplans.tree(segments, children)
    plan = validate(gm, subplans.leaves(given))
    rw = Rewrite(gm, plan)
    blocks, plain = split_off(given, rw.inplace_openers())
    if plain:  # in-place ops split off: the leaves changed, and so does the rewrite
        leaves = subplans.leaf_blocks(blocks)
        rw = Rewrite(gm, subplans.leaves(blocks), frozenset(i for i, b in enumerate(leaves) if id(b) in plain))
    rw.fix_inplace(copy_for_inplace)
    rw.check_random_order()
    graph = rw.graph
    nodes = list(graph.nodes)
    output = next(n for n in nodes if n.op == "output")

    leaf_nodes: list[list[fx.Node]] = [[] for _ in range(rw.k)]
    for v in nodes:
        if v in rw.seg:
            leaf_nodes[rw.seg[v]].append(v)

    top = fx.Graph()
    top._codegen = copy.deepcopy(graph._codegen)
    env: dict[fx.Node, fx.Node] = {}
    for v in nodes:
        if v.op == "placeholder":
            env[v] = top.node_copy(v)
    unknown = sorted(set(offloaded) - {v.name for v in rw.seg})
    if unknown:
        raise FxplanError(f"the plan offloads values of nodes the graph does not have: {unknown[:3]}")
    emitter = Emitter(gm, {v: i for i, v in enumerate(nodes)}, blocks, iter(leaf_nodes), plain, frozenset(offloaded))
    seg_modules = emitter.emit(top, env, blocks, "segment")

    for u in output.all_input_nodes:
        if u.op == "get_attr" and u not in env:
            env[u] = top.node_copy(u)
    top.output(fx.node.map_arg(output.args[0], lambda x: env[x]), type_expr=output.type)
    top.lint()

    root: dict[str, Any] = dict(seg_modules)
    for u in top.nodes:
        if u.op == "get_attr":
            root[str(u.target)] = resolve_attr(gm, str(u.target))
        elif u.op == "call_module" and u.target not in seg_modules:  # an in-place op split off inline
            root[str(u.target)] = gm.get_submodule(str(u.target))
    out = SegmentedModule(root, top, gm._get_name())
    # Own the original module tree, parameters and buffers under their original names.
    out.__dict__["_modules"] = {**gm._modules, **seg_modules}
    out.__dict__["_parameters"] = dict(gm._parameters)
    out.__dict__["_buffers"] = dict(gm._buffers)
    out.__dict__["_non_persistent_buffers_set"] = set(gm._non_persistent_buffers_set)
    extra = {}
    for u in gm.graph.nodes:
        if u.op in ("get_attr", "call_module"):
            atom = str(u.target).split(".")[0]
            if atom not in out._modules and atom not in out._parameters and atom not in out._buffers:
                if atom in gm.__dict__:
                    extra[atom] = gm.__dict__[atom]
    # Tensors the capture made up (constants) are attributes, not buffers: named_buffers() are the model's
    for name in gm.__dict__.get("_fxplan_constants", ()):
        if name in out._buffers:
            extra[name] = out._buffers.pop(name)
            out._non_persistent_buffers_set.discard(name)
    out.__dict__.update(extra)
    out.__dict__["_fxplan_constants"] = set(gm.__dict__.get("_fxplan_constants", ()))  # for fake copies
    out._fxplan_extra_attrs = extra
    out._fxplan_segment_names = list(seg_modules)
    out._fxplan_graph = copy.deepcopy(gm.graph)
    out.fxplan_segments = tuple(tuple(b.names) for b in given)
    out.fxplan_children = subplans.as_children(given)
    out.fxplan_offloaded = tuple(offloaded)
    out.training = gm.training  # not .train(): leave the submodules' own modes alone
    out._fxplan_warned = set()
    if "fxplan_call" in gm.meta:
        out.__dict__["_fxplan_original"], out.__dict__["_fxplan_interface"] = gm.meta["fxplan_call"]
        out._show_signature()
    for seg in emitter.made:
        seg.training = gm.training
        seg._set_owner(out)
    return out
