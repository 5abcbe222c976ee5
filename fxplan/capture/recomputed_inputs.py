"""Recomputed inputs: nodes keep their outputs; the cheap values their backward needs are recomputed there.

A matrix product saves its input for the gradient of its weight. In a transformer that input is the output of
cheap ops (a LayerNorm; the pointwise ops of a GELU; the ``contiguous`` copy of the attention's output), and
those ops' own backward keeps more such values (a GELU written as ``0.5 * x * (1 + tanh(...))`` keeps four
tensors of the MLP's width). Hugging Face's selective checkpointing and ``torch.compile``'s min-cut
partitioner keep the outputs of the expensive ops and recompute the cheap ones; a canonical or nested
segment cannot (it recomputes every node in it, matrix products included).

A *recomputed-input unit* does it in a captured graph: a set of cheap values (no FLOPs in
``torch.utils.flop_counter``'s count, :func:`recomputable`, not saved by their own op) computed from values
something keeps anyway. Every node whose backward saves one of them (a *saver*) runs through
:func:`call_recomputing`, under ``saved_tensors_hooks`` that keep, in place of those values, the unit's
inputs, and recompute the values (a :class:`Recipe` of the unit's nodes) when the saver's backward asks for
them. The savers themselves never run again, and their backward is autograd's own, so gradients are exact:
recomputed ops draw no random numbers and write nothing, and their inputs must not change before backward
(checked as autograd checks saved tensors).

The hooks compose with those already active (fxplan's recomputed segments, which are
``torch.utils.checkpoint``'s, the trace's, a user's): the unit's inputs, and everything else a saver saves, are
packed by them as they would have been. Where exactness cannot be guaranteed, or hooks are not allowed, a saver
runs as in the model (no grad, autocast on, functorch transforms, ``disable_saved_tensors_hooks``).

This is the second kind of recomputed region (:mod:`fxplan.capture.regions` has the first, for convolutions after
BatchNorm and ReLU, with a backward of its own): :func:`find_units` finds them in any captured graph,
:func:`fxplan.capture.regions.with_regions` replaces each saver by a call of :func:`call_recomputing`
(:func:`saver_node`).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx

from fxplan.capture.effects import alias_roots, may_draw_random, mutated_arg
from fxplan.capture.portable import portable_target, restored
from fxplan.errors import FxplanError
from fxplan.solvers.units import Unit

_COMPUTE = ("call_function", "call_module")

#: Most forward passes of the whole graph that one unit's backward may recompute (every saver's recipe runs the
#: nodes it needs, so a value read by many savers is made again for each). Checkpointing the whole graph recomputes
#: every node once, for less. The selective scan of a state-space model slices one value for each of its steps: a
#: 2-layer Hugging Face Mamba's two scan units recomputed 11.7 forward passes each (their nodes 78 times). The units
#: of the transformers checked recompute at most 0.35 of one (a 2-layer Mixtral of width 64; GPT-2 small 0.003).
MAX_FORWARDS = 1.0


@dataclass(frozen=True)
class _Slot:
    """A reference, in a :class:`Recipe`, to its ``index``-th value: its inputs first, then its steps' outputs."""

    index: int


class Recipe:
    """How a saver's dropped values are made again: ``steps`` of ``(function, args, kwargs)`` over slots (the
    saver's call passes the unit's inputs; a step's function is an op, or a slot holding a module), returning
    the slots ``outputs``."""

    def __init__(self, steps: list[tuple[Any, tuple, dict]], outputs: tuple[int, ...]):
        self.steps, self.outputs = steps, outputs

    def __call__(self, inputs: list[Any]) -> tuple[torch.Tensor, ...]:
        slots = list(inputs)

        def value(a):
            return slots[a.index] if isinstance(a, _Slot) else a

        for fn, args, kwargs in self.steps:
            slots.append(value(fn)(*fx.node.map_aggregate(args, value), **fx.node.map_aggregate(kwargs, value)))
        return tuple(slots[i] for i in self.outputs)

    def call_key(self, describe: Callable[[Any], Any]) -> tuple:
        """What running this recipe depends on, its arguments described by ``describe`` (the trace's key of a
        node's call, so that a repeated layer's savers are probed once)."""
        def plain(a):
            return ("slot", a.index) if isinstance(a, _Slot) else a

        return ("recipe", tuple(describe(fx.node.map_aggregate(step, plain)) for step in self.steps), self.outputs)

    def __reduce__(self):
        steps = [(portable_target(fn), args, kwargs) for fn, args, kwargs in self.steps]
        return _rebuilt_recipe, (steps, self.outputs)


def _rebuilt_recipe(steps, outputs) -> Recipe:
    return Recipe([(restored(fn), args, kwargs) for fn, args, kwargs in steps], outputs)


class Operator:
    """A saver's operator handed to :func:`call_recomputing` through a module attribute: FX prints an argument that
    is a function by its ``repr`` (``<built-in function mul>``), which is no code; ATen operators print as code and
    are passed as they are. Equal where the operators are (a repeated layer's savers are probed once)."""

    def __init__(self, fn: Callable[..., Any]):
        self.fn = fn

    def __call__(self, *args, **kwargs):
        return self.fn(*args, **kwargs)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Operator) and other.fn is self.fn

    def __hash__(self) -> int:
        return hash(self.fn)

    def __reduce__(self):
        return _rebuilt_operator, (portable_target(self.fn),)


def _rebuilt_operator(fn) -> Operator:
    return Operator(restored(fn))


class _Recomputed:
    """The values one call of a saver dropped: its recipe's inputs (tensors packed by the hooks around, with
    their versions), made again on the first unpack and let go once every saved tensor has been handed out."""

    def __init__(self, recipe: Recipe, inputs: tuple, layouts: list[tuple], pack, unpack):
        self.is_tensor = [isinstance(t, torch.Tensor) for t in inputs]
        self.versions = [t._version for t, tensor in zip(inputs, self.is_tensor) if tensor]
        self.packed = [pack(t) if tensor else t for t, tensor in zip(inputs, self.is_tensor)]
        self.recipe, self.layouts, self.unpack = recipe, layouts, unpack
        self.handles, self.values = 0, None

    def handle(self, index: int, saved: torch.Tensor) -> _Handle:
        self.handles += 1
        offset = self.layouts[index][2]
        return _Handle(self, index, (tuple(saved.shape), saved.stride(), saved.storage_offset() - offset))

    def value(self, index: int, view: tuple) -> torch.Tensor:
        values = self.values
        if values is None:
            inputs = [self.unpack(p) if tensor else p for p, tensor in zip(self.packed, self.is_tensor)]
            if [t._version for t, tensor in zip(inputs, self.is_tensor) if tensor] != self.versions:
                raise RuntimeError("fxplan: an input of a recomputed value was modified in place after the forward "
                                   "pass (as for a tensor autograd saved, the gradient would be wrong)")
            values = self.values = self.recipe(inputs)
            for x, (shape, stride, _) in zip(values, self.layouts):
                if tuple(x.shape) != shape or x.stride() != stride:
                    raise FxplanError(f"fxplan: a recomputed value came back with shape {tuple(x.shape)} and "
                                      f"strides {x.stride()} where the forward pass made {shape}, {stride}")
        self.handles -= 1
        if self.handles <= 0:
            self.values = None
        x = values[index]
        shape, stride, offset = view
        return x.as_strided(shape, stride, x.storage_offset() + offset)


class _Handle:
    """What autograd keeps of one saved tensor that a recipe makes again."""

    __slots__ = ("group", "index", "view")

    def __init__(self, group: _Recomputed, index: int, view: tuple):
        self.group, self.index, self.view = group, index, view

    def value(self) -> torch.Tensor:
        return self.group.value(self.index, self.view)


def plain_ops_only(x: torch.Tensor) -> bool:
    """Whether a call on ``x`` must run as the model's plain ops, not as a unit or region: grad off, autocast on
    for ``x``'s device (a device autocast does not know, such as ``meta``, has none) or functorch active."""
    device = x.device.type
    return not torch.is_grad_enabled() or torch._C._are_functorch_transforms_active() \
        or (torch.amp.is_autocast_available(device) and torch.is_autocast_enabled(device))


def call_recomputing(op, args: tuple, kwargs: dict, recipe: Recipe, inputs: tuple, dropped: tuple) -> Any:
    """``op(*args, **kwargs)``, keeping for its backward, in place of the tensors ``dropped`` (and views of
    them), ``inputs``, from which ``recipe`` makes them again there (module docstring)."""
    first = dropped[0]
    if isinstance(first, fx.Proxy) or plain_ops_only(first) or not _hooks_allowed():
        return op(*args, **kwargs)
    storages = {d.untyped_storage()._cdata: i for i, d in enumerate(dropped)}
    layouts = [(tuple(d.shape), d.stride(), d.storage_offset()) for d in dropped]
    outer = _outer_hooks()
    outer_pack, outer_unpack = outer if outer is not None else (_same, _same)
    # autograd keeps the hooks as long as what they packed: they must not hold the dropped tensors, nor the
    # inputs (the outer hooks may drop those: a recomputed segment's)
    live: list[Any] = [inputs, None]

    def pack(t: torch.Tensor):
        index = storages.get(t.untyped_storage()._cdata)
        if index is None:
            return outer_pack(t)
        if live[1] is None:
            live[1] = _Recomputed(recipe, live[0], layouts, outer_pack, outer_unpack)
        return live[1].handle(index, t)

    def unpack(packed):
        return packed.value() if isinstance(packed, _Handle) else outer_unpack(packed)

    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            return op(*args, **kwargs)
    finally:
        live.clear()


def saver_operands(node: fx.Node) -> list[fx.Node]:
    """The nodes a saver's operator reads, of a ``call_recomputing`` node (its module, its arguments): not the
    recipe's inputs, which it keeps for its backward and gives no gradient."""
    op, args, kwargs = node.args[:3]
    operands = [op] if isinstance(op, fx.Node) else []
    fx.node.map_arg((args, kwargs), operands.append)
    return list(dict.fromkeys(operands))


def _same(t):
    return t


#: PyTorch's stack of saved-tensor hooks (private; what composing with the hooks already active needs). Where a
#: release lacks it, no units are found and a saver runs as in the model.
_TOP_HOOKS = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)


def _outer_hooks():
    """The (pack, unpack) hooks active around a saver, or None."""
    try:
        return _TOP_HOOKS(False)
    except TypeError:  # releases whose function takes no argument
        return _TOP_HOOKS()


def _hooks_allowed() -> bool:
    """Whether saved-tensor hooks may be installed here (not under ``disable_saved_tensors_hooks``)."""
    enabled = getattr(torch._C._autograd, "_saved_tensors_hooks_is_enabled", None)
    return _TOP_HOOKS is not None and (enabled is None or enabled())


# ----------------------------------------------------------------------------------------------
# finding them


def find_units(cg) -> list[Unit]:
    """The recomputed-input units of the captured graph of ``cg`` (a cost graph of :func:`fxplan.costs.trace.trace`),
    in graph order (module docstring).

    A value joins in graph order where its node is cheap and :func:`recomputable`, updates no buffer (the trace's
    ``mutates``: a functional ``aten.batch_norm`` in training updates its running statistics, and running it again
    in backward updated them twice), its own backward does not
    keep it, nothing writes it or its inputs in place (the recipe runs on them after the forward pass), it is
    not the model's output, every node that saves it can be
    replaced by a call, and each of its inputs is a parameter, buffer or model input, a value that joined
    before, or one that something saves (so it stays, and keeping it for a saver costs nothing). Units are
    the connected groups of such values, joined where one saver saves values of two; a unit whose backward
    recomputes more than ``MAX_FORWARDS`` forward passes is left out."""
    if _TOP_HOOKS is None:
        return []
    gm = cg.graph["captured"].gm
    roots = alias_roots(gm.graph, gm)
    savers: dict[fx.Node, set[fx.Node]] = {}
    nodes = {n.name: n for n in gm.graph.nodes}
    for name, d in cg.nodes(data=True):
        for owner in d["saved_inputs"]:
            savers.setdefault(nodes[owner], set()).add(nodes[name])
        if d["saves_output"]:
            savers.setdefault(nodes[d["alias_of"] or name], set()).add(nodes[name])
    written = {roots[w] for n in gm.graph.nodes if n.op in _COMPUTE for w in [mutated_arg(n, gm)] if w is not None}
    in_output = {roots[a] for n in gm.graph.nodes if n.op == "output" for a in n.all_input_nodes}
    members: set[fx.Node] = set()
    for node in gm.graph.nodes:
        if node.op not in _COMPUTE or node.name not in cg:
            continue
        root = roots[node]
        if root is not node:  # a view: made again with the value it views
            if root in members:
                members.add(node)
            continue
        d = cg.nodes[node.name]
        if d["saves_output"] or d.get("flops", 1) or d.get("mutates") or node in written or node in in_output \
                or any(roots[a] in written for a in node.all_input_nodes) \
                or not recomputable(node, gm) or any(s.op not in _COMPUTE for s in savers.get(node, ())):
            continue
        if all(a in members or roots[a].op in ("placeholder", "get_attr")
               or (roots[a] not in members and savers.get(roots[a])) for a in node.all_input_nodes):
            members.add(node)
    forward = sum(d["T"] for _, d in cg.nodes(data=True))
    return [u for u in _units(gm, members, roots, savers)
            if sum(cg.nodes[name]["T"] for name in u.recomputed) <= MAX_FORWARDS * forward]


def _units(gm: fx.GraphModule, members: set[fx.Node], roots: dict, savers: dict) -> list[Unit]:
    """The members grouped into units: connected through the graph's edges between members, and through
    a saver that saves values of several."""
    group = {m: m for m in members}

    def find(m):
        while group[m] is not m:
            group[m] = group[group[m]]
            m = group[m]
        return m

    for m in members:
        for a in m.all_input_nodes:
            if a in members:
                group[find(a)] = find(m)
    by_saver: dict[fx.Node, list[fx.Node]] = {}
    for m in members:
        if roots[m] is m:
            for s in savers.get(m, ()):
                by_saver.setdefault(s, []).append(m)
    for saved in by_saver.values():
        for a, b in itertools.pairwise(saved):
            group[find(a)] = find(b)
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    units: dict[fx.Node, list[fx.Node]] = {}
    for s in sorted(by_saver, key=order.__getitem__):
        units.setdefault(find(by_saver[s][0]), []).append(s)
    found = []
    for savers_of in units.values():
        dropped = sorted({m for s in savers_of for m in by_saver[s]}, key=order.__getitem__)
        saved = tuple(tuple(m.name for m in sorted(by_saver[s], key=order.__getitem__)) for s in savers_of)
        needs = tuple(tuple(n.name for n in _recipe_nodes(by_saver[s], members, order)) for s in savers_of)
        found.append(Unit(tuple(m.name for m in dropped), tuple(s.name for s in savers_of), saved, needs))
    position = {n.name: i for n, i in order.items()}
    return sorted(found, key=lambda u: position[u.dropped[0]])


def _recipe_nodes(values: list[fx.Node], members: set[fx.Node], order: dict) -> list[fx.Node]:
    """The members that making ``values`` again runs, in graph order."""
    needed, stack = set(), list(values)
    while stack:
        n = stack.pop()
        if n not in needed:
            needed.add(n)
            stack.extend(a for a in n.all_input_nodes if a in members)
    return sorted(needed, key=order.__getitem__)


def recomputable(node: fx.Node, gm: fx.GraphModule) -> bool:
    """Whether running ``node`` again gives the same bits and changes nothing: a function or a stateless
    ``torch.nn`` module (no buffers, no hooks) that draws no random numbers, writes nothing and returns one
    tensor."""
    if node.op == "call_module":
        module = gm.get_submodule(str(node.target))
        if not type(module).__module__.startswith("torch.nn.") or list(module.buffers()) \
                or any(getattr(module, h, None) for h in ("_forward_hooks", "_forward_pre_hooks")):
            return False
    elif node.op != "call_function":
        return False
    value = node.meta.get("val", node.meta.get("example_value"))
    if value is not None and not isinstance(value, torch.Tensor):
        return False
    return not may_draw_random(node, gm) and mutated_arg(node, gm) is None \
        and not any(u.op == "call_function" and "getitem" in getattr(u.target, "__name__", "") for u in node.users)


# ----------------------------------------------------------------------------------------------
# the graph with them


def saver_node(graph: fx.Graph, nodes: dict[str, fx.Node], unit: Unit, saver: fx.Node,
               env: dict[fx.Node, fx.Node], attributes: dict[str, Any]) -> fx.Node:
    """The node of ``graph`` (a copy being made of the graph whose nodes are ``nodes``, ``env`` its nodes so
    far) that runs ``saver``, one of ``unit``'s, through :func:`call_recomputing`; its recipe becomes an
    attribute of the module (``attributes``)."""
    i = unit.savers.index(saver.name)
    recipe_nodes = [nodes[name] for name in unit.needs[i]]
    inside = set(recipe_nodes)
    external = list(dict.fromkeys(a for n in recipe_nodes for a in n.all_input_nodes if a not in inside))
    modules = [n for n in recipe_nodes if n.op == "call_module"]
    slot = {a: _Slot(k) for k, a in enumerate(external)}
    module_slot = {n: _Slot(len(external) + k) for k, n in enumerate(modules)}
    steps = []
    for k, n in enumerate(recipe_nodes):
        steps.append((module_slot.get(n, n.target), fx.node.map_arg(n.args, slot.__getitem__),
                      fx.node.map_arg(n.kwargs, slot.__getitem__)))
        slot[n] = _Slot(len(external) + len(modules) + k)
    dropped = [nodes[name] for name in unit.saved[i]]
    name = f"fxplan_recipe_{saver.name}"
    attributes[name] = Recipe(steps, tuple(slot[d].index for d in dropped))

    def module_of(n: fx.Node) -> fx.Node:
        return graph.create_node("get_attr", n.target, name=f"{n.name}_module")

    if saver.op == "call_module":
        op = module_of(saver)
    elif isinstance(saver.target, torch._ops.OpOverload):
        op = saver.target
    else:
        attributes[f"fxplan_operator_{saver.name}"] = Operator(saver.target)
        op = graph.get_attr(f"fxplan_operator_{saver.name}")
    inputs = (*(env[a] for a in external), *(module_of(n) for n in modules))
    arguments = (op, fx.node.map_arg(saver.args, env.__getitem__), fx.node.map_arg(saver.kwargs, env.__getitem__),
                 graph.get_attr(name), inputs, tuple(env[d] for d in dropped))
    return graph.call_function(call_recomputing, arguments, name=saver.name)


def parse_checked(gm: fx.GraphModule, name: str) -> Unit:
    """The unit a plan names (:attr:`Unit.conv`), checked against ``gm``: its savers are calls and its recipes'
    nodes can run again; FxplanError otherwise (a plan made for another model or version)."""
    try:
        unit = Unit.parse(name)
    except ValueError:
        raise FxplanError(f"fxplan: {name[:80]!r} names no recomputed-input unit") from None
    nodes = {n.name: n for n in gm.graph.nodes}
    for saver, needs in zip(unit.savers, unit.needs):
        if saver not in nodes or nodes[saver].op not in _COMPUTE \
                or any(n not in nodes or not recomputable(nodes[n], gm) for n in needs):
            raise FxplanError(f"fxplan: the recomputed inputs of node {saver!r} do not match this model's graph: "
                              "the plan was made for another model or version")
    return unit
