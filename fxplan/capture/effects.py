"""Side effects of torch.fx nodes that a recomputing rewriter must respect.

A recomputation plan (Kusumoto et al., section 3) is an increasing sequence of lower sets of the
*data* graph. Two kinds of effects are invisible in data edges and matter once segments are re-run:

* **in-place ops** (``ReLU(inplace=True)``, ``operator.iadd``, ``x.add_(y)``, ``F.relu(x, inplace=True)``)
  change a value that other nodes, or a later recomputation, may read again;
* **random ops** (dropout, ``torch.rand``...) draw from the global generator, so their order decides
  which numbers each one gets.

This module only *classifies* nodes (what does a node mutate, which value does it alias, does it draw
random numbers); :mod:`fxplan.rewriter.codegen` decides what to do about it. It also offers
:func:`ordering_edges`, the extra edges a planner should add to its cost graph so that every plan it
finds keeps random draws and reads-after-mutation in program order.

The classification is deliberately conservative where it is cheap to be (a node that *may* return a
view of its input is treated as an alias) and name-based where nothing else is possible (a leaf
module's inside is opaque at module granularity).
"""

from __future__ import annotations

import functools
import inspect
import operator

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

COMPUTE_OPS = ("call_module", "call_function", "call_method")

#: ``operator`` in-place functions (``a += b`` traced on a non-proxy, or written explicitly).
INPLACE_OPERATORS = frozenset(
    {
        operator.iadd, operator.isub, operator.imul, operator.itruediv, operator.ifloordiv,
        operator.imod, operator.ipow, operator.iand, operator.ior, operator.ixor,
        operator.ilshift, operator.irshift, operator.imatmul,
    }
)

#: Tensor methods ending in ``_`` that do not write tensor data.
_NOT_DATA_INPLACE_METHODS = frozenset({"requires_grad_", "share_memory_", "retain_grad"})

#: Methods / functions that may return a view of (or the very same tensor as) their first input.
VIEW_METHODS = frozenset(
    {
        "view", "view_as", "reshape", "reshape_as", "flatten", "unflatten", "transpose", "permute",
        "t", "T", "mT", "squeeze", "unsqueeze", "expand", "expand_as", "narrow", "select",
        "chunk", "split", "tensor_split", "unbind", "as_strided", "contiguous", "detach",
        "diagonal", "unfold", "movedim", "moveaxis", "swapaxes", "swapdims", "real", "imag",
        "__getitem__", "type_as", "to", "float", "double", "half", "bfloat16", "cpu", "cuda",
    }
)
VIEW_FUNCTIONS = frozenset(
    {
        torch.flatten, torch.reshape, torch.transpose, torch.permute, torch.squeeze,
        torch.unsqueeze, torch.narrow, torch.select, torch.chunk, torch.split, torch.unbind,
        torch.t, torch.movedim, torch.diagonal, torch.detach, torch.tensor_split,
        torch.swapaxes, torch.as_strided, operator.getitem,
    }
)
VIEW_MODULES = (nn.Identity, nn.Flatten, nn.Unflatten)

#: Functions and methods that draw from the random number generator.
RANDOM_FUNCTIONS = frozenset(
    {
        F.dropout, F.dropout1d, F.dropout2d, F.dropout3d, F.alpha_dropout,
        F.feature_alpha_dropout, F.rrelu, F.gumbel_softmax, torch.dropout, torch.bernoulli,
        torch.rand, torch.rand_like, torch.randn, torch.randn_like, torch.randint,
        torch.randint_like, torch.randperm, torch.normal, torch.poisson, torch.multinomial,
        torch.alpha_dropout, torch.feature_dropout, torch.feature_alpha_dropout,
        torch.dropout_, torch.alpha_dropout_, torch.feature_dropout_, F.rrelu_,
        F.fractional_max_pool2d, F.fractional_max_pool3d, F.fractional_max_pool2d_with_indices,
        F.fractional_max_pool3d_with_indices,
    }
)
RANDOM_METHODS = frozenset(
    {
        "bernoulli", "bernoulli_", "uniform_", "normal_", "random_", "exponential_",
        "geometric_", "cauchy_", "log_normal_", "multinomial",
    }
)
RANDOM_MODULES = (nn.modules.dropout._DropoutNd, nn.RReLU, nn.FractionalMaxPool2d, nn.FractionalMaxPool3d)


def is_compute(node: fx.Node) -> bool:
    """True for the nodes a plan partitions (everything but placeholders, attributes and output)."""
    return node.op in COMPUTE_OPS


def _module(gm: torch.nn.Module, target: str) -> torch.nn.Module | None:
    try:
        return gm.get_submodule(target)
    except AttributeError:
        return None


def mutated_position(node: fx.Node, gm: torch.nn.Module) -> tuple[str, int | str] | None:
    """Where the argument a node overwrites in place sits: ``("arg", i)``, ``("kwarg", name)`` or None.

    Recognised: ATen operators whose schema marks an argument as written (``aten.add_``,
    ``aten.silu_``, in graphs captured by torch.export), modules with ``inplace=True`` (ReLU, Dropout,
    Hardtanh, ...), ``operator.i*``, ``torch.*_`` functions (``torch.relu_``), functions called with
    ``inplace=True`` (``F.relu``), and tensor methods ending in a single underscore (``x.add_``), all of
    which overwrite their first tensor argument.
    """
    if node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload):
        return _schema_position(node, lambda a: a.alias_info is not None and a.alias_info.is_write)
    if node.op == "call_module":
        mod = _module(gm, str(node.target))
        if mod is not None and getattr(mod, "inplace", False) is True and node.args:
            return ("arg", 0)
        return None
    if node.op == "call_method":
        name = str(node.target)
        if (
            name.endswith("_") and not name.endswith("__") and name not in _NOT_DATA_INPLACE_METHODS
        ) or name in ("__iadd__", "__isub__", "__imul__", "__itruediv__"):
            return ("arg", 0)
        return None
    if node.op == "call_function":
        fn = node.target
        if fn in INPLACE_OPERATORS:
            return ("arg", 0)
        name = getattr(fn, "__name__", "")
        if (
            name.endswith("_") and not name.endswith("__") and getattr(fn, "__module__", "") in
            ("torch", "torch._C._VariableFunctions", "torch.nn.functional", "torch._C._nn")
        ):
            return ("arg", 0)
        if node.kwargs.get("inplace") is True:
            return ("arg", 0) if node.args else ("kwarg", "input")
        sig = _signature(fn)
        if sig is None:
            return None
        try:
            bound = sig.bind(*node.args, **node.kwargs)
        except TypeError:
            return None
        if bound.arguments.get("inplace") is True:
            first = next(iter(bound.arguments))
            return ("arg", 0) if node.args else ("kwarg", first)
    return None


def _schema_position(node: fx.Node, wanted) -> tuple[str, int | str] | None:
    """Position of the first schema argument of an ATen call for which ``wanted(argument)`` holds."""
    for i, argument in enumerate(node.target._schema.arguments):
        if wanted(argument):
            if i < len(node.args):
                return ("arg", i)
            return ("kwarg", argument.name) if argument.name in node.kwargs else None
    return None


def _aten_view_source(node: fx.Node) -> fx.Node | None:
    """The input an ATen op's result may alias: a schema alias set shared with a return, an input whose
    alias set goes into the wildcard (``Tensor(a -> *)``: the views in a list that ``split``, ``unbind`` or
    ``chunk`` return), or maybe-aliasing ops."""
    op = node.target
    returned = {a for r in op._schema.returns if r.alias_info is not None for a in r.alias_info.before_set}

    def aliased(a) -> bool:
        info = a.alias_info
        return info is not None and (bool(set(info.before_set) & returned)
                                     or ("*" in info.after_set and not info.is_write))

    pos = _schema_position(node, aliased)
    if pos is None and torch.Tag.maybe_aliasing_or_mutating in op.tags and node.args:
        pos = ("arg", 0)
    return _node_at(node, pos)


def _node_at(node: fx.Node, pos: tuple[str, int | str] | None) -> fx.Node | None:
    """The node passed at ``pos`` (``("arg", i)`` or ``("kwarg", name)``) of ``node``'s call, or None."""
    if pos is None:
        return None
    kind, key = pos
    value = node.args[key] if kind == "arg" else node.kwargs.get(key)  # type: ignore[index]
    return value if isinstance(value, fx.Node) else None


#: Ops whose schema does not mark the running statistics they update in training (args 3, 4; flag 5).
_UNANNOTATED_NORM_WRITES = frozenset({"native_batch_norm", "cudnn_batch_norm", "miopen_batch_norm"})


def written_arguments(func: torch._ops.OpOverload, args: tuple, kwargs: dict) -> list:
    """The argument values an ATen op call writes in place: from its schema, plus the batch-norm
    kernels whose schemas omit the running statistics they update when ``training`` is true."""
    schema = func._schema
    values = []
    for i, argument in enumerate(schema.arguments):
        value = args[i] if i < len(args) else kwargs.get(argument.name)
        if argument.alias_info is not None and argument.alias_info.is_write:
            values.append(value)
        elif schema.name.split("::")[-1] in _UNANNOTATED_NORM_WRITES and i in (3, 4):
            training = args[5] if len(args) > 5 else kwargs.get("training")
            if training:
                values.append(value)
    return values


def _signature(fn: object) -> inspect.Signature | None:
    try:
        return _cached_signature(fn)
    except TypeError:  # unhashable callable
        return _signature_uncached(fn)


def _signature_uncached(fn: object) -> inspect.Signature | None:
    try:
        sig = inspect.signature(fn)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return None
    return sig if "inplace" in sig.parameters else None


_cached_signature = functools.lru_cache(maxsize=None)(_signature_uncached)


def mutated_arg(node: fx.Node, gm: torch.nn.Module) -> fx.Node | None:
    """The node whose value ``node`` overwrites in place, or None (see :func:`mutated_position`)."""
    return _node_at(node, mutated_position(node, gm))


def view_source(node: fx.Node, gm: torch.nn.Module) -> fx.Node | None:
    """The input ``node`` may return an alias of (a view, or the same tensor), or None.

    In-place ops alias the value they overwrite; view ops, ``getitem``, ``Identity``/``Flatten``
    and dropout (which returns its input unchanged in eval mode or with p=0) alias their input.
    Where :func:`fxplan.costs.trace.trace` ran the node and saw it return new storage
    (``meta["fxplan_fresh_output"]``), it aliases nothing: ops that only *may* alias (dropout with
    p > 0, ``aten.batch_norm``, tagged ``maybe_aliasing_or_mutating``) are then known not to.
    """
    mutated = mutated_arg(node, gm)
    if mutated is not None:
        return mutated
    if node.meta.get("fxplan_fresh_output"):
        return None  # the trace saw it return new storage (dropout with p > 0, a batch norm)
    if node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload):
        return _aten_view_source(node)
    first = node.args[0] if node.args else None
    if not isinstance(first, fx.Node):
        return None
    if node.op == "call_method" and node.target in VIEW_METHODS:
        return first
    if node.op == "call_function" and node.target in VIEW_FUNCTIONS:
        return first
    if node.op == "call_module":
        mod = _module(gm, str(node.target))
        if isinstance(mod, VIEW_MODULES + (nn.modules.dropout._DropoutNd,)):
            return first
    return None


def is_random(node: fx.Node, gm: torch.nn.Module) -> bool:
    """True if running ``node`` may draw from the random number generator.

    Leaf modules count when they contain a dropout-like module or carry a non-zero ``dropout``
    attribute (``nn.MultiheadAttention``, ``nn.LSTM``, ``nn.TransformerEncoderLayer``).
    """
    if node.op == "call_module":
        mod = _module(gm, str(node.target))
        if mod is None:
            return False
        for sub in mod.modules():
            if isinstance(sub, RANDOM_MODULES):
                return True
            p = getattr(sub, "dropout", 0.0)
            if isinstance(p, float) and p > 0.0:
                return True
        return False
    if node.op == "call_method":
        return str(node.target) in RANDOM_METHODS
    if node.op == "call_function":
        if isinstance(node.target, torch._ops.OpOverload):
            return torch.Tag.nondeterministic_seeded in node.target.tags
        if isinstance(node.target, torch._ops.HigherOrderOperator):
            return True  # a region (e.g. under no_grad) whose inside is not inspected: keep it in order
        return node.target in RANDOM_FUNCTIONS
    return False


def may_draw_random(node: fx.Node, gm: torch.nn.Module) -> bool:
    """False only where running ``node`` certainly draws no random numbers: what a recomputed segment needs
    to know to skip saving and restoring the generators (:class:`fxplan.rewriter.recompute.Segment`).

    Certain are: ATen ops without the ``nondeterministic_seeded`` tag; functions of ``torch`` and
    ``torch.nn.functional``, Python's operators and builtins, tensor methods, and ``torch.nn`` modules, where
    :func:`is_random` does not name them (torch functions by their ATen ops' tags where they have one).
    Anything else (a user's function or module left whole by the tracer, a region not inspected) may.
    """
    if node.op in ("placeholder", "output", "get_attr"):
        return False
    if node.op == "call_module":
        mod = _module(gm, str(node.target))
        return mod is None or any(_module_may_draw(m) for m in mod.modules())
    if is_random(node, gm):
        return True
    if node.op == "call_method":
        return False
    target = node.target
    if target is torch._assert:
        return False
    if isinstance(target, torch._ops.OpOverload):
        return False  # is_random read its tags
    module = getattr(target, "__module__", None) or ""
    if module in ("_operator", "operator", "builtins", "math", "torch.nn.functional"):
        return False
    if module == "torch" or module.startswith("torch."):
        packet = getattr(torch.ops.aten, getattr(target, "__name__", ""), None)
        if isinstance(packet, torch._ops.OpOverloadPacket):
            return any(torch.Tag.nondeterministic_seeded in getattr(packet, o).tags for o in packet.overloads())
    return True


def _module_may_draw(mod: nn.Module) -> bool:
    """One module's own forward (not its children's) may draw: a user's, a random ``torch.nn`` one (a dropout
    of probability 0 draws nothing), or one with a non-zero ``dropout`` attribute."""
    if isinstance(mod, nn.modules.dropout._DropoutNd):
        return mod.p > 0
    p = getattr(mod, "dropout", 0.0)
    return (isinstance(mod, RANDOM_MODULES) or not type(mod).__module__.startswith("torch.nn.")
            or (isinstance(p, float) and p > 0.0))


def alias_roots(graph: fx.Graph, gm: torch.nn.Module) -> dict[fx.Node, fx.Node]:
    """Map every node to the node that owns the storage it may alias (itself if fresh)."""
    root: dict[fx.Node, fx.Node] = {}
    for node in graph.nodes:
        src = view_source(node, gm) if is_compute(node) else None
        root[node] = root.get(src, src) if src is not None else node
    return root


def ordering_edges(gm: fx.GraphModule) -> list[tuple[str, str]]:
    """Program-order constraints between compute nodes that data edges do not express.

    * consecutive random ops: ``(r_i, r_{i+1})``, so random draws keep their order;
    * an in-place op ``n`` and every later reader of a value it overwrote: ``(n, r)``, so readers
      that expect the overwritten value stay after it;
    * consecutive readers of a value read by three or more nodes: backward sums their gradient
      contributions in the reverse of the order they ran in, and a sum of three or more floats
      depends on its order, so keeping them in order keeps gradients bitwise equal.

    A planner that adds these edges to its cost graph (as order-only edges: they carry no value, so
    memory formulas should ignore them) never produces a plan that
    :func:`fxplan.rewriter.codegen.segment_module` rejects for its *order*. (Readers *before* an in-place op
    need no edge: the rewriter copies the value first when a plan moves such a reader past the op.
    The one rejection left is an in-place op that must be copied while a view of its operand, taken
    before it, is read after it.)
    """
    nodes = list(gm.graph.nodes)
    pos = {n: i for i, n in enumerate(nodes)}
    root = alias_roots(gm.graph, gm)
    edges: list[tuple[str, str]] = []
    randoms = [n for n in nodes if is_compute(n) and is_random(n, gm)]
    edges += [(a.name, b.name) for a, b in zip(randoms, randoms[1:])]
    for n in nodes:
        readers = sorted((r for r in n.users if is_compute(r)), key=pos.__getitem__)
        if len(readers) >= 3:
            edges += [(a.name, b.name) for a, b in zip(readers, readers[1:])]
    for n in nodes:
        if not is_compute(n):
            continue
        a = mutated_arg(n, gm)
        if a is None:
            continue
        members = [m for m in nodes if root[m] is root[a]]
        for m in members:
            for r in m.users:
                if is_compute(r) and pos[r] > pos[n] and (n.name, r.name) not in edges:
                    edges.append((n.name, r.name))
    return edges
