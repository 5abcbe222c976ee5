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
  autograd node saves, and no copy is made (:meth:`_Rewrite.inplace_openers`);
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
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
import logging
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.fx as fx

from fxplan.capture import effects
from fxplan.capture.graph_module import owning_graph_module, resolve_attr
from fxplan.capture.portable import portable_target, restored
from fxplan.common.console import format_count
from fxplan.errors import FxplanError
from fxplan.rewriter.emit import Emitter
from fxplan.rewriter.recompute import Segment
from fxplan.solvers import subplans

logger = logging.getLogger("fxplan")
_WARNED_INPUTS: set[tuple[str, str]] = set()

_LAST = 1 << 30  # segment index of the output node


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
            return self._fxplan_graph_forward(*args, **kwargs)
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
        graph_args, graph_kwargs = interface.graph_inputs(args, kwargs)
        return interface.output(self._fxplan_graph_forward(*graph_args, **graph_kwargs))

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
                             self.fxplan_children)
        memo[id(self)] = new
        for key, value in {**self._call_state(), **self._user_attrs()}.items():
            new.__dict__[key] = copy.deepcopy(value, memo)
        new._show_signature()
        return new

    def _user_attrs(self) -> dict[str, Any]:
        # Attributes others attach (e.g. fxplan.rewrite's ``fxplan_plan``) survive copies.
        return {
            k: v for k, v in self.__dict__.items()
            if k.startswith("fxplan_") and k not in ("fxplan_segments", "fxplan_children")
        }

    def __reduce__(self) -> tuple[Any, ...]:
        # The graph itself is saved, not its code: GraphModule's own pickling re-traces the code on loading,
        # which renames ATen nodes (``mul_2`` → ``mul_tensor_2``, so the segments name nothing) and runs the
        # ops whose arguments are all constants (an attention mask becomes a ``_tensor_constant``).
        state = {**self._call_state(), **self._user_attrs()}
        graph = _PortableGraph(self._fxplan_graph)
        return (_rebuild, (self._state_holder(), graph, self.fxplan_segments, self._get_name(), self.fxplan_children),
                state)


def _rebuild(
    holder: torch.nn.Module, graph: _PortableGraph, segments: Any, class_name: str, children: Any = None
) -> SegmentedModule:
    return segment_module(_graph_module(holder, graph.restore(), class_name), segments, children)


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


# ----------------------------------------------------------------------------------------------
# validation


def _validate(gm: fx.GraphModule, segments: Sequence[Sequence[str]]) -> list[list[str]]:
    if not isinstance(gm, fx.GraphModule):
        raise FxplanError(
            f"segment_module needs a torch.fx.GraphModule, got {type(gm).__name__}; "
            "trace the model first (torch.fx.symbolic_trace(model))"
        )
    if isinstance(segments, (str, bytes)) or not isinstance(segments, Sequence):
        raise FxplanError("segments must be a list of lists of node names")
    plan = []
    for i, seg in enumerate(segments):
        if isinstance(seg, (str, bytes)) or not isinstance(seg, Sequence):
            raise FxplanError(f"segment {i} must be a list of node names, got {seg!r}")
        if len(seg) == 0:
            raise FxplanError(f"segment {i} is empty; drop it from the plan")
        plan.append([str(v) for v in seg])
    if not plan:
        raise FxplanError("the plan has no segments; pass at least one (all compute nodes)")
    compute = [n.name for n in gm.graph.nodes if effects.is_compute(n)]
    names = {n.name: n for n in gm.graph.nodes}
    seen: dict[str, int] = {}
    for i, seg in enumerate(plan):
        for v in seg:
            if v not in names:
                raise FxplanError(f"segment {i} names {v!r}, which is not a node of the graph")
            if not effects.is_compute(names[v]):
                raise FxplanError(
                    f"segment {i} names {v!r}, a {names[v].op} node; segments list only compute "
                    "nodes (call_module, call_function, call_method)"
                )
            if v in seen:
                raise FxplanError(f"node {v!r} appears in segments {seen[v]} and {i}; list it once")
            seen[v] = i
    missing = [v for v in compute if v not in seen]
    if missing:
        raise FxplanError(
            f"the plan leaves out {format_count(len(missing), 'compute node')}, e.g. {missing[:5]}; "
            "every compute node must be in exactly one segment"
        )
    for n in gm.graph.nodes:
        if n.name in seen:
            for u in n.all_input_nodes:
                if u.name in seen and seen[u.name] > seen[n.name]:
                    raise FxplanError(
                        f"node {n.name!r} in segment {seen[n.name]} uses {u.name!r} from later "
                        f"segment {seen[u.name]}; segments must be in execution order "
                        "(each union of the first i segments a lower set)"
                    )
    return plan


# ----------------------------------------------------------------------------------------------
# in-place ops and random ops


class _Rewrite:
    """The plan applied to a private copy of the graph: segment of each node, copies, redirects."""

    def __init__(self, gm: fx.GraphModule, plan: list[list[str]], plain: frozenset[int] = frozenset()):
        self.gm = gm
        self.plain = plain  # leaves that are not checkpointed (in-place ops split off by _split_off)
        self.graph = copy.deepcopy(gm.graph)
        by_name = {n.name: n for n in self.graph.nodes}
        self.seg: dict[fx.Node, int] = {}
        for i, names in enumerate(plan):
            for v in names:
                self.seg[by_name[v]] = i
        self.k = len(plan)
        # Classify once: rewriting only swaps argument nodes, never what a node is.
        self.mpos = {n: effects.mutated_position(n, gm) for n in self.graph.nodes if effects.is_compute(n)}
        self.is_view = {
            n: self.mpos[n] is None and effects.view_source(n, gm) is not None for n in self.mpos
        }

    def _source(self, n: fx.Node) -> fx.Node | None:
        where = self.mpos.get(n)
        if where is not None:
            kind, key = where
            value = n.args[key] if kind == "arg" else n.kwargs.get(key)  # type: ignore[index]
            return value if isinstance(value, fx.Node) else None
        if self.is_view.get(n):
            first = n.args[0]
            return first if isinstance(first, fx.Node) else None
        return None

    def roots(self) -> dict[fx.Node, fx.Node]:
        root: dict[fx.Node, fx.Node] = {}
        for n in self.graph.nodes:
            src = self._source(n)
            root[n] = root.get(src, src) if src is not None else n
        return root

    def seg_of(self, node: fx.Node) -> int:
        if node.op == "output":
            return _LAST
        return self.seg.get(node, -1)  # placeholders and attributes: available everywhere

    def inplace_openers(self) -> list[tuple[str, int, int]]:
        """In-place ops that would open a recomputed leaf on a value from an earlier leaf, and can run alone.

        A ``relu_(a)`` that is the first node of leaf ``s`` while ``a`` comes from leaf ``j < s`` would
        need a private copy of ``a`` (:meth:`fix_inplace`): the recomputed leaf keeps ``a`` as its input
        and must not overwrite it. When nothing but the op reads ``a`` outside leaf ``j`` and the op's
        other inputs come from leaves ``<= j`` (ResNet's ``out += identity; out = relu(out)`` at a block
        boundary), :func:`segment_module` runs the op by itself, not recomputed, between the two: the
        same program, the op overwrites ``a`` as the model does, its autograd node saves what it saves in
        the model (for ReLU: its result, the very tensor leaf ``s`` keeps as input), and nothing is
        copied. Returns ``(op name, j, s)``; random ops are never split off (their order is fixed).
        """
        out = []
        pos = {v: i for i, v in enumerate(self.graph.nodes)}
        first: dict[int, fx.Node] = {}
        for v in self.graph.nodes:
            if v in self.seg:
                first.setdefault(self.seg[v], v)
        for n in self.graph.nodes:
            a = self._source(n) if effects.is_compute(n) and self.mpos.get(n) is not None else None
            if a is None or a not in self.seg or effects.is_random(n, self.gm):
                continue
            j, s = self.seg[a], self.seg_of(n)
            if not (j < s < self.k - 1 and first[s] is n):
                continue
            if any(m is not n and self._source(m) is a for m in self.graph.nodes) or self._source(a) is not None:
                continue  # a is an alias, or has a view or another in-place op: leave it to fix_inplace
            if any(self.seg_of(u) > j for u in n.all_input_nodes if u is not a):
                continue
            if any(self.seg_of(r) > j for r in a.users if r is not n and pos[r] < pos[n]):
                continue  # a reader of the old value would run after the op
            out.append((n.name, j, s))
        return out

    def fix_inplace(self) -> None:
        """Copy the operand of each in-place op that recomputation or the plan's order would break."""
        for n in list(self.graph.nodes):
            if not effects.is_compute(n):
                continue
            where = self.mpos.get(n)
            a = self._source(n) if where is not None else None
            if where is None or a is None:
                continue
            pos = {v: i for i, v in enumerate(self.graph.nodes)}
            roots = self.roots()
            members = [m for m in self.graph.nodes if roots[m] is roots[a]]
            s = self.seg_of(n)
            if roots[a].op == "get_attr":
                # A module attribute (a buffer) updated in place: the buffer guard's business, unless a
                # recomputed segment takes a value of it from another segment. Checkpoint holds that value
                # for the recomputation, and state cannot be given a private copy.
                computed = [m for m in members if m.op != "get_attr"]
                if self._read_by_recompute(computed, s):
                    raise FxplanError(
                        f"in-place op {n.name!r} (segment {s}) updates {roots[a].target!r}, a module attribute "
                        "that a recomputed segment takes from another segment; keep the attribute's in-place "
                        "updates in one segment with the ops that read them"
                    )
                continue
            if not (self._read_by_recompute(members, s) or self._reordered(members, n, pos)):
                continue
            if roots[a].op == "placeholder" and (n.name, roots[a].target) not in _WARNED_INPUTS:
                _WARNED_INPUTS.add((n.name, roots[a].target))  # once: the search generates many candidates
                logger.warning("fxplan: in-place op %r overwrites model input %r, whose old value a recomputed "
                               "segment needs: the rewritten module runs it on a private copy in training, so the "
                               "caller's tensor keeps its value where the model's forward changes it",
                               n.name, roots[a].target)
            self._copy_operand(n, a, where, members, pos)

    def _read_by_recompute(self, members: list[fx.Node], s: int) -> bool:
        for m in members:
            for r in m.users:
                k = self.seg_of(r)
                if k <= s and k < self.k - 1 and k not in self.plain and k != self.seg_of(m):
                    return True
        return False

    def _reordered(self, members: list[fx.Node], n: fx.Node, pos: dict[fx.Node, int]) -> bool:
        s = self.seg_of(n)
        for m in members:
            for r in m.users:
                if r is n:
                    continue
                if pos[r] < pos[n] and self.seg_of(r) > s:
                    return True
                if pos[r] > pos[n] and self.seg_of(r) < s:
                    return True
        return False

    def _copy_operand(self, n, a, where, members, pos) -> None:
        later = [r for m in members for r in m.users if r is not n and pos[r] > pos[n]]
        for r in later:
            for u in r.all_input_nodes:
                if u in members and u is not a and pos[u] < pos[n]:
                    raise FxplanError(
                        f"{r.name!r} reads {u.name!r}, an alias of {a.name!r}, after in-place op "
                        f"{n.name!r} overwrote it, and the plan needs {n.name!r} made "
                        "out-of-place; keep these nodes in one segment or write the model "
                        "without the in-place op"
                    )
        s = self.seg_of(n)
        for r in later:
            if a in r.all_input_nodes:
                if self.seg_of(r) < s:
                    raise FxplanError(
                        f"{r.name!r} (segment {self.seg_of(r)}) reads {a.name!r} after in-place op "
                        f"{n.name!r} (segment {s}) overwrote it; the plan must not put "
                        f"{r.name!r} in an earlier segment (see fxplan.capture.effects.ordering_edges)"
                    )
                r.replace_input_with(a, n)
        with self.graph.inserting_before(n):
            if n.op == "call_function" and n.target in effects.INPLACE_OPERATORS:
                op, target = "call_function", copy_for_inplace
            else:
                op, target = "call_method", "clone"
            c = self.graph.create_node(op, target, (a,), {}, name=f"{a.name}_copy")
        self.seg[c] = s
        kind, key = where
        if kind == "arg":
            n.update_arg(key, c)
        else:
            n.update_kwarg(key, c)

    def check_random_order(self) -> None:
        last: fx.Node | None = None
        for n in self.graph.nodes:
            if effects.is_compute(n) and effects.is_random(n, self.gm):
                if last is not None and self.seg_of(n) < self.seg_of(last):
                    raise FxplanError(
                        f"the plan runs random op {n.name!r} (segment {self.seg_of(n)}) before "
                        f"{last.name!r} (segment {self.seg_of(last)}), which precedes it in the "
                        "model; they would draw different random numbers. Keep random ops in "
                        "program order (see fxplan.capture.effects.ordering_edges)"
                    )
                last = n


def _split_off(
    blocks: list[subplans.Block], openers: list[tuple[str, int, int]]
) -> tuple[list[subplans.Block], set[int]]:
    """A copy of ``blocks`` in which each in-place op of :meth:`_Rewrite.inplace_openers` is a block of its
    own that is not checkpointed, and the ids of those blocks.

    The op ``n`` opens leaf ``s``; its operand comes from leaf ``j``. The new block goes right before the
    ancestor of leaf ``s`` that is a sibling of an ancestor of leaf ``j`` (in their closest common
    parent), so the operand is made inside that parent or outside it and never a recomputed segment's
    input. Only done when leaf ``s`` is the first leaf of that ancestor (nothing else moves); a leaf that is
    ``n`` alone is not split but marked. Elsewhere :meth:`_Rewrite.fix_inplace` copies the operand.
    """
    blocks = copy.deepcopy(blocks)
    paths: list[list[int]] = []

    def walk(bs: list[subplans.Block], prefix: list[int]) -> None:
        for i, b in enumerate(bs):
            if b.sub is None:
                paths.append([*prefix, i])
            else:
                walk(b.sub, [*prefix, i])

    walk(blocks, [])
    leaves = subplans.leaf_blocks(blocks)
    plain: set[int] = set()
    moves = []
    for name, j, s in openers:
        pj, ps = paths[j], paths[s]
        d = next(i for i in range(min(len(pj), len(ps))) if pj[i] != ps[i])
        if len(leaves[s].names) == 1 and len(ps) == d + 1:
            plain.add(id(leaves[s]))  # the op is a whole segment of its own: just do not checkpoint it
        elif len(leaves[s].names) > 1 and not any(x != 0 for x in ps[d + 1:]):
            moves.append((ps, name, s, d))
    for ps, name, s, d in sorted(moves, reverse=True):  # later positions first: earlier ones stay valid
        parent_path, at = ps[:d], ps[d]
        leaves[s].names.remove(name)
        siblings = blocks
        for i in parent_path:
            siblings = siblings[i].sub  # type: ignore[assignment]
        new = subplans.Block([name])
        siblings.insert(at, new)
        plain.add(id(new))
    return blocks, plain


# ----------------------------------------------------------------------------------------------
# code generation


def segment_module(
    gm: fx.GraphModule, segments: Sequence[Sequence[str]], children: Mapping[str, Any] | None = None
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

    Raises :class:`~fxplan.errors.FxplanError` for plans that are not such a sequence, or that
    would change what the model computes (random ops reordered, a read moved before the in-place
    op it must follow).
    """
    if isinstance(segments, (str, bytes)) or not isinstance(segments, Sequence):
        raise FxplanError("segments must be a list of lists of node names")
    given = subplans.tree(segments, children)
    plan = _validate(gm, subplans.leaves(given))
    rw = _Rewrite(gm, plan)
    blocks, plain = _split_off(given, rw.inplace_openers())
    if plain:  # in-place ops split off: the leaves changed, and so does the rewrite
        leaves = subplans.leaf_blocks(blocks)
        rw = _Rewrite(gm, subplans.leaves(blocks), frozenset(i for i, b in enumerate(leaves) if id(b) in plain))
    rw.fix_inplace()
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
    emitter = Emitter(gm, {v: i for i, v in enumerate(nodes)}, blocks, iter(leaf_nodes), plain)
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
    out._fxplan_extra_attrs = extra
    out._fxplan_segment_names = list(seg_modules)
    out._fxplan_graph = copy.deepcopy(gm.graph)
    out.fxplan_segments = tuple(tuple(b.names) for b in given)
    out.fxplan_children = subplans.as_children(given)
    out.training = gm.training  # not .train(): leave the submodules' own modes alone
    out._fxplan_warned = set()
    if "fxplan_call" in gm.meta:
        out.__dict__["_fxplan_original"], out.__dict__["_fxplan_interface"] = gm.meta["fxplan_call"]
        out._show_signature()
    for seg in emitter.made:
        seg.training = gm.training
        seg._set_owner(out)
    return out
