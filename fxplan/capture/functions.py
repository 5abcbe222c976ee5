"""Calls of ``torch.autograd.Function`` subclasses kept whole in torch.export's graphs.

torch.export traces through a Function's forward and records none of its backward (pytorch/pytorch#106388), so a
graph of a model calling a straight-through estimator, a gradient reversal or a fused GELU (Hugging Face Bloom's
MLP) would differentiate the forward's ops instead of the function's own backward. While fxplan exports,
:func:`functions_as_ops` turns every such call into one call of the opaque op ``fxplan::autograd_function``
(its output metadata from the function's forward on fake tensors), and :func:`calls_of_functions` then makes each
of those nodes a call of :func:`apply_function_flat`, which calls the function itself: its own forward and
backward run, as in eager PyTorch. symbolic_trace's tracer does the same with
:func:`fxplan.capture.capturers.apply_function` (its graphs need no op: the tracer makes the node itself).

A call is recorded with its non-tensor arguments as constants in the node (``None``, bools, numbers, strings:
what a JSON text holds). A function called with anything else (a module, a dtype, a callable), returning values
that are not tensors, or writing to its inputs in place is refused with a :class:`~fxplan.errors.TraceError`
naming it: the node could not stand for the call.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.fx as fx
from torch.utils import _pytree as pytree

from fxplan.capture.guards import TRANSPARENT_FUNCTIONS, replaced
from fxplan.errors import TraceError

#: ``torch.autograd.Function.apply`` as torch defines it (the capturers replace it while they trace).
ORIGINAL_APPLY = torch.autograd.Function.__dict__["apply"]
_CONSTANTS = (type(None), bool, int, float, str)


#: the functions recorded in ops, by their names in the ops (a deterministic name per class, so that two captures
#: of one forward give the same graph)
_FUNCTIONS: dict[str, type] = {}
#: the structure of a recorded call's output, by (function name, layout), from its forward on fake tensors
_OUT_SPECS: dict[tuple[str, str], pytree.TreeSpec] = {}


@torch.library.custom_op("fxplan::autograd_function", mutates_args=())
def _autograd_function_op(tensors: list[torch.Tensor], function: str, layout: str) -> list[torch.Tensor]:
    raise RuntimeError("fxplan::autograd_function only stands for a call while torch.export traces; the "
                       "captured graph calls the function itself")


@_autograd_function_op.register_fake
def _(tensors: list[torch.Tensor], function: str, layout: str) -> list[torch.Tensor]:
    cls = _FUNCTIONS[function]
    args, kwargs = _arguments(layout, tensors)
    versions = [t._version for t in tensors]
    with torch.no_grad(), replaced(torch.autograd.Function, "apply", ORIGINAL_APPLY):
        out = cls.apply(*args, **kwargs)
    if [t._version for t in tensors] != versions:
        raise TraceError(f"{_name(cls)}, a torch.autograd.Function with a backward of its own, writes to its "
                         "inputs in place, which fxplan cannot record in an exported graph")
    leaves, _OUT_SPECS[function, layout] = pytree.tree_flatten(out)
    if not all(isinstance(t, torch.Tensor) for t in leaves):
        raise TraceError(f"{_name(cls)} returns values that are not tensors, which fxplan cannot record as the "
                         "output of one graph node")
    inputs = {t.untyped_storage()._cdata for t in tensors}
    # the op's outputs may not alias its inputs (a gradient reversal returns a view): a copy stands for them
    return [t.clone() if t.untyped_storage()._cdata in inputs else t for t in leaves]


def _recorded_name(cls: type) -> str:
    """``cls``'s name in the ops, made once: module and qualified name (numbered where two classes share it)."""
    name, n = _name(cls), 1
    while _FUNCTIONS.setdefault(name, cls) is not cls:
        n += 1
        name = f"{_name(cls)}#{n}"
    return name


def _name(function: type) -> str:
    return f"{function.__module__}.{function.__qualname__}"


def _layout(function: type, args: tuple, kwargs: dict[str, Any]) -> tuple[str, list[torch.Tensor]]:
    """The JSON text that rebuilds ``(args, kwargs)`` from their tensors, and those tensors."""
    leaves, spec = pytree.tree_flatten((args, kwargs))
    tensors = [leaf for leaf in leaves if isinstance(leaf, torch.Tensor)]
    constants = [None if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves]
    bad = [leaf for leaf in leaves if not isinstance(leaf, (torch.Tensor, *_CONSTANTS))]
    if bad:
        raise TraceError(f"the forward calls {_name(function)}, a torch.autograd.Function with a backward of its "
                         f"own, with an argument of type {type(bad[0]).__name__}, which fxplan cannot record "
                         "(tensors, None, bools, numbers and strings only)")
    tensor_at = [isinstance(leaf, torch.Tensor) for leaf in leaves]
    return json.dumps([pytree.treespec_dumps(spec), tensor_at, constants]), tensors


def _arguments(layout: str, tensors: Sequence[torch.Tensor]) -> tuple[tuple, dict[str, Any]]:
    """``(args, kwargs)`` of a recorded call, rebuilt from its layout (:func:`_layout`) and tensors."""
    spec, tensor_at, constants = json.loads(layout)
    given = iter(tensors)
    leaves = [next(given) if is_tensor else constant for is_tensor, constant in zip(tensor_at, constants)]
    return pytree.tree_unflatten(leaves, pytree.treespec_loads(spec))


def apply_function_flat(function: type, layout: str, *tensors: torch.Tensor) -> list[torch.Tensor]:
    """``function.apply`` on the arguments rebuilt from ``layout`` and ``tensors``, its output's tensors in a
    list: a call recorded in an exported graph (module docstring), run by the function's own forward and
    backward."""
    args, kwargs = _arguments(layout, tensors)
    return pytree.tree_leaves(function.apply(*args, **kwargs))


@contextlib.contextmanager
def functions_as_ops() -> Iterator[None]:
    """While torch.export traces in the block, each call of a Function with a backward of its own (not one of
    ``TRANSPARENT_FUNCTIONS``) with a tensor among its arguments is one ``fxplan::autograd_function`` op."""

    def apply(cls: type, *args: Any, **kwargs: Any) -> Any:
        leaves = pytree.tree_leaves((args, kwargs))
        if f"{cls.__module__}.".startswith(TRANSPARENT_FUNCTIONS) or not any(
                isinstance(leaf, torch.Tensor) for leaf in leaves):
            return ORIGINAL_APPLY.__get__(None, cls)(*args, **kwargs)
        layout, tensors = _layout(cls, args, kwargs)
        function = _recorded_name(cls)
        flat = torch.ops.fxplan.autograd_function(tensors, function, layout)
        return pytree.tree_unflatten(list(flat), _OUT_SPECS[function, layout])

    with replaced(torch.autograd.Function, "apply", classmethod(apply)):
        yield


def calls_of_functions(graph: fx.Graph, constants: dict[str, Any]) -> None:
    """Make each ``fxplan::autograd_function`` node of an exported ``graph`` a call of the function itself
    (:func:`apply_function_flat`); the function classes join ``constants`` (attributes of the graph's module)."""
    names: dict[type, str] = {}
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not torch.ops.fxplan.autograd_function.default:
            continue
        tensors, name, layout = node.args
        cls = _FUNCTIONS[name]
        if cls not in names:
            names[cls] = f"_fxplan_function_{len(names)}"
            constants[names[cls]] = cls
        with graph.inserting_before(node):
            function = graph.create_node("get_attr", names[cls])
        node.target = apply_function_flat
        node.args = (function, layout, *tensors)
