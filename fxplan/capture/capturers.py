"""Capture: a model and example inputs → the torch.fx graph that fxplan plans and rewrites.

Two capturers, tried in this order:

* ``torch.fx.symbolic_trace`` at module granularity: readable graphs whose nodes are the model's own
  modules (``self.layer1.0.conv1``), the granularity of Kusumoto et al.'s graphs. It fails on most
  Hugging Face models (control flow on shapes, ``**kwargs`` signatures, slicing with proxies).
* ``torch.export`` (non-strict) on a fake-tensor copy of the model: an ATen-level graph of the step's
  forward (``aten.linear``, ``aten.layer_norm``, ``aten.scaled_dot_product_attention`` ...) that runs
  the same kernels as eager PyTorch, so outputs and gradients stay bitwise equal. It specialises on the
  example inputs' shapes and on the modules' train/eval flags.

Either way the captured :class:`torch.fx.GraphModule` owns *all* of the model's state, the very same
module, parameter and buffer objects under their original names: ``state_dict`` keys, parameter sharing
and non-persistent buffers are the model's own. Tensors the capture invents (constants) are kept as
non-persistent buffers, never as new ``state_dict`` entries (the rewritten module holds them as plain attributes,
not buffers), and nothing is left on the user's model.

A graph is a picture of one call in one mode. :class:`CallInterface` records that call (the train/eval
flag of every module, the input structure and, for export, the shapes) so that the rewritten module can
tell whether a later call is the one it was planned for; a call that is not (``eval()``, other input
shapes, other keyword arguments) runs the original ``forward`` instead, which is exact by definition.

The torch.export details are in :mod:`fxplan.capture.torch_export`, the output's container types in
:mod:`fxplan.capture.output_types` and the GraphModule that owns the model's state in
:mod:`fxplan.capture.graph_module`. :class:`CallInterface`, :func:`apply_function` and the tracer stay here: modules
saved with ``torch.save`` name them by this module's path.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils import _pytree as pytree

from fxplan.capture import guards
from fxplan.capture.fakes import caches_kept_real, fake_copy, fake_mode_of, to_fake
from fxplan.capture.functions import ORIGINAL_APPLY, calls_of_functions
from fxplan.capture.graph_module import owning_graph_module, resolve_attr
from fxplan.capture.guards import (
    check_hooks,
    checked_for_host_draws,
    checked_for_python_state,
    own_checkpoints,
    refuse_torchscript,
    tensor_hooks_refused,
)
from fxplan.capture.output_types import container_types, retyped
from fxplan.capture.torch_export import UnsupportedOutput, drop_checks, export_program, without_objects
from fxplan.errors import TraceError, first_line

logger = logging.getLogger("fxplan")


@dataclass
class ExampleCall:
    """Positional and keyword arguments of one call of a model."""

    args: tuple
    kwargs: dict[str, Any]


def as_call(example_inputs: Any) -> ExampleCall:
    """Example inputs as users give them: a tuple or list (positional), a dict (keyword) or one tensor."""
    if isinstance(example_inputs, ExampleCall):
        return example_inputs
    if isinstance(example_inputs, dict):
        if not all(isinstance(k, str) for k in example_inputs):
            raise TraceError("example_inputs given as a dict must map argument names (str) to values")
        return ExampleCall((), dict(example_inputs))
    if isinstance(example_inputs, torch.Tensor):
        return ExampleCall((example_inputs,), {})
    if isinstance(example_inputs, Sequence) and not isinstance(example_inputs, (str, bytes)):
        return ExampleCall(tuple(example_inputs), {})
    raise TraceError(
        f"example_inputs must be a tuple of positional arguments, a dict of keyword arguments or a tensor, "
        f"got {type(example_inputs).__name__}"
    )


def module_modes(model: torch.nn.Module) -> tuple[bool, ...]:
    """The train/eval flag of every module, in ``modules()`` order: what a captured graph is specialised on."""
    return tuple(m.training for m in model.modules())


class CallInterface:
    """How a call of the original model maps onto the captured graph, and whether it is the captured one.

    ``flat=False`` (symbolic_trace): the graph takes the model's own arguments and returns its own output.
    ``flat=True`` (export): the graph takes the pytree leaves of the call, normalised against the
    ``forward`` signature, and returns the leaves of the output, rebuilt with ``out_spec``.
    """

    def __init__(self, model: torch.nn.Module, call: ExampleCall, *, flat: bool, output_types: Any = None):
        self.signature = _signature(model)
        self.modes = module_modes(model)
        self.flat = flat
        #: for ``flat=False``: the dict types of the model's output that the graph returns as plain dicts
        self.output_types = output_types
        self.out_spec: pytree.TreeSpec | None = None
        self.in_spec: pytree.TreeSpec | None = None
        self.leaf_keys: tuple | None = None
        if flat:
            leaves, self.in_spec = pytree.tree_flatten(self.normalize(call.args, call.kwargs))
            self.leaf_keys = tuple(_leaf_key(x) for x in leaves)

    def normalize(self, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict[str, Any]]:
        """The call as export sees it: positional-only arguments as ``args``, every other one by name."""
        if self.signature is None:
            return tuple(args), dict(kwargs)
        bound = self.signature.bind(*args, **kwargs)
        bound.apply_defaults()
        positional: list[Any] = []
        named: dict[str, Any] = {}
        for name, value in bound.arguments.items():
            kind = self.signature.parameters[name].kind
            if kind is inspect.Parameter.POSITIONAL_ONLY:
                positional.append(value)
            elif kind is inspect.Parameter.VAR_POSITIONAL:
                positional.extend(value)
            elif kind is inspect.Parameter.VAR_KEYWORD:
                named.update(value)
            else:
                named[name] = value
        return tuple(positional), named

    def mismatch(self, model: torch.nn.Module, args: tuple, kwargs: dict[str, Any]) -> str | None:
        """Why this call is not the one the graph was captured for, or None if it is."""
        if module_modes(model) != self.modes:
            return "the train/eval mode of some module differs from the mode fxplan planned in"
        if not self.flat:
            return None
        try:
            leaves, spec = pytree.tree_flatten(self.normalize(args, kwargs))
        except TypeError as exc:
            return f"the arguments do not match the signature of forward ({exc})"
        if spec != self.in_spec:
            return "the call passes other arguments (or another structure) than the planned call"
        keys = tuple(_leaf_key(x) for x in leaves)
        if keys != self.leaf_keys:
            diff = next(f"{a} instead of {b}" for a, b in zip(keys, self.leaf_keys) if a != b)
            return f"an input differs from the planned call: {diff}"
        return None

    def graph_inputs(self, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict[str, Any]]:
        """The arguments to pass to the captured graph's ``forward``."""
        if not self.flat:
            return args, kwargs
        return tuple(pytree.tree_leaves(self.normalize(args, kwargs))), {}

    def output(self, graph_output: Any) -> Any:
        """The model's output built from what the captured graph returned."""
        if not self.flat:
            return retyped(graph_output, getattr(self, "output_types", None))
        return pytree.tree_unflatten(list(graph_output), self.out_spec)


def _leaf_key(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return ("tensor", tuple(x.shape), x.dtype, x.device.type, x.requires_grad)
    if isinstance(x, (int, float, bool, str, type(None), torch.dtype, torch.device)):
        return ("value", x)
    return ("object", type(x).__name__, id(x))


def _signature(model: torch.nn.Module) -> inspect.Signature | None:
    try:
        return inspect.signature(model.forward)
    except (TypeError, ValueError):
        return None


@dataclass
class Captured:
    """A captured model: the graph (owning the model's state) and how calls map onto it."""

    gm: fx.GraphModule
    method: str
    interface: CallInterface
    #: the forward called ``torch.utils.checkpoint`` while it was captured (the graph holds its ops once)
    checkpoints_itself: bool = False


def _captured(model: torch.nn.Module, gm: fx.GraphModule, method: str, interface: CallInterface) -> Captured:
    """The record of a capture. The graph carries the model and the interface too: the rewritten module
    needs them to tell planned calls from others and to rebuild the output (:mod:`fxplan.rewriter.codegen`)."""
    gm.meta["fxplan_call"] = (model, interface)
    check_hooks(model, gm)
    return Captured(gm, method, interface)


@caches_kept_real()
def capture(model: torch.nn.Module, example_inputs: Any) -> Captured:
    """Capture ``model`` for the call ``example_inputs`` (real or fake tensors); the model is not changed.

    Tries ``symbolic_trace`` and then ``torch.export`` (see the module docstring). Raises
    :class:`~fxplan.errors.TraceError` naming what each capturer stopped at, where, and what to do.
    """
    if not isinstance(model, torch.nn.Module):
        raise TraceError(f"fxplan captures nn.Module objects, got {type(model).__name__}")
    call = as_call(example_inputs)
    _check_call(model, call)
    refuse_torchscript(model)
    if guards.is_compiled(model):
        raise TraceError(f"{type(model._orig_mod).__name__} is already compiled (torch.compile): plan the module "
                         "first, then compile what fxplan returns")

    def once() -> Captured:
        try:
            gm = checked_for_python_state(model, type(model).__name__, lambda: symbolic_trace_module(model),
                                          lambda gm: gm)
            _check_arguments(model, gm, call)
            interface = CallInterface(model, call, flat=False, output_types=gm.meta.get("fxplan_output_types"))
            return _captured(model, gm, "symbolic_trace", interface)
        except TraceError as fx_error:
            logger.info("fxplan: capturing %s with torch.export (symbolic_trace cannot trace its forward)",
                        type(model).__name__)
            logger.debug("fxplan: symbolic_trace of %s failed: %s", type(model).__name__, fx_error)
            return export_after(model, call, fx_error)

    with own_checkpoints() as seen:
        captured = checked_for_host_draws(model, once)
    captured.checkpoints_itself |= bool(seen)
    return captured


def export_after(model: torch.nn.Module, call: ExampleCall, fx_error: TraceError) -> Captured:
    """:func:`export_module` where symbolic_trace failed with ``fx_error`` (or gave a graph that does not
    run); a :class:`TraceError` naming both failures if export fails too."""
    try:
        with own_checkpoints() as seen, tensor_hooks_refused(model):
            captured = checked_for_host_draws(model, lambda: export_module(model, call))
        captured.checkpoints_itself = bool(seen)
        return captured
    except TraceError as export_error:
        raise TraceError(
            f"fxplan could not capture {type(model).__name__}.\n"
            f"- torch.fx.symbolic_trace: {fx_error}\n- torch.export (non-strict): {export_error}"
        ) from export_error


# ----------------------------------------------------------------------------------------------
# symbolic_trace


def symbolic_trace_module(model: torch.nn.Module) -> fx.GraphModule:
    """``symbolic_trace`` at module granularity, as a GraphModule owning all of ``model``'s state.

    A submodule whose Python code updates its own buffers in place (a BatchNorm subclass counting
    ``num_batches_tracked``, timm's ``BatchNormAct2d``, a module keeping running statistics) is kept as
    one leaf node, as torch.nn's modules are: tracing into it would run the updates once, at trace time,
    and leave them out of the graph; as a leaf it runs its own code at every call. Updates made by the
    root module, or by a module to another's buffers, still refuse the trace (``TraceError``).
    """
    if isinstance(model, fx.GraphModule):
        return model
    leaves: set[str] = set()
    while True:
        graph, constants, changed, output_types = _trace_once(model, leaves)
        owners = {name.rpartition(".")[0] for name in changed}
        if not changed:
            gm = owning_graph_module(model, graph, constants)
            gm.meta["fxplan_output_types"] = output_types
            return gm
        if "" in owners or owners <= leaves:
            raise TraceError(
                f"tracing ran in-place updates of buffers {changed[:3]} in Python (e.g. a module counting "
                "calls in a buffer of the model itself), so the graph would miss them"
            )
        leaves |= owners


def _trace_once(model: torch.nn.Module, leaves: set[str]) -> tuple[fx.Graph, dict[str, Any], list[str], Any]:
    """The graph of one ``symbolic_trace`` with the modules at the paths ``leaves`` kept as leaves, the tensor
    constants the tracer made, the buffers tracing updated in place (put back as they were) and the output's
    container types (:func:`retyped`)."""
    tracer = _LocatingTracer(leaves)
    had = set(model.__dict__)
    buffers = {name: (b, b._version, b.detach().clone() if _has_values(b) else None)
               for name, b in model.named_buffers()}
    try:
        graph = tracer.trace(model)
    except Exception as exc:  # torch.fx raises many types; all mean "not traceable"
        where = tracer.fxplan_path[-1] if tracer.fxplan_path else type(model).__name__
        raise TraceError(
            f"stopped inside module '{where}' ({type(exc).__name__}: {first_line(exc)}); typical causes are "
            "Python control flow on tensor values or shapes, or a forward(**kwargs) signature"
        ) from exc
    finally:
        # The tracer stores tensor constants (``_tensor_constant0``) on the model it traces: move them off.
        constants = {k: model.__dict__.pop(k) for k in set(model.__dict__) - had}
        changed = _rebind(model, buffers) + _restore(buffers)
    return graph, constants, changed, tracer.fxplan_output_types


def _rebind(model: torch.nn.Module, buffers: dict[str, tuple[torch.Tensor, int, torch.Tensor | None]]) -> list[str]:
    """Put back every buffer tracing replaced (``self.count = self.count + 1`` in forward); return their names.
    A graph would hold the new value as a constant and never update the buffer."""
    rebound = []
    for name, (buf, _, _) in buffers.items():
        owner_path, _, leaf = name.rpartition(".")
        owner = model.get_submodule(owner_path)
        if owner._buffers.get(leaf) is not buf:
            owner._buffers[leaf] = buf
            rebound.append(name)
    return rebound


def _restore(buffers: dict[str, tuple[torch.Tensor, int, torch.Tensor | None]]) -> list[str]:
    """Put back every buffer whose value changed; return the names of those updated in place.

    An in-place update shows in the buffer's version counter (Python code that updates a buffer, which is
    what tracing runs, bumps it), also where it leaves the value as it was (``mean.mul_(0.9)`` on zeros)
    and on fake and meta buffers, which have no values to compare or restore.
    """
    changed = []
    with torch.no_grad():
        for name, (buf, version, saved) in buffers.items():
            if saved is not None and not torch.equal(buf, saved):
                buf.copy_(saved)
                changed.append(name)
            elif buf._version != version:
                changed.append(name)
    return changed


def _has_values(t: torch.Tensor) -> bool:
    """False for fake and meta tensors, whose values cannot be read."""
    return not (t.is_meta or isinstance(t, FakeTensor))


class _LocatingTracer(fx.Tracer):
    """A tracer that remembers the module path it is inside, to name it when tracing fails, and keeps the
    modules at the paths ``leaves`` as leaves besides torch.nn's. Its graphs record it as their tracer class, and
    ``torch.load`` re-traces a GraphModule with a subclass of that class made without arguments (every module a
    leaf), so ``leaves`` has a default."""

    def __init__(self, leaves: set[str] | frozenset[str] = frozenset()):
        super().__init__()
        self.fxplan_path: list[str] = []
        self.fxplan_leaves = leaves
        self.fxplan_dicts: dict[int, tuple[dict, type]] = {}  # id of a dict made for the graph -> (it, its type)
        self.fxplan_output_types: Any = None

    def create_arg(self, a: Any) -> Any:
        # torch.fx records every dict as a plain dict (an OrderedDict comes back as a dict); remember the type
        made = super().create_arg(a)
        if isinstance(a, dict) and type(made) is not type(a):
            self.fxplan_dicts[id(made)] = (made, type(a))
        return made

    def is_leaf_module(self, m: torch.nn.Module, module_qualified_name: str) -> bool:
        return module_qualified_name in self.fxplan_leaves or super().is_leaf_module(m, module_qualified_name)

    def trace(self, root: Any, concrete_args: dict[str, Any] | None = None) -> fx.Graph:
        self.fxplan_modes = _grad_and_autocast_modes()
        functions: dict[type, str] = {}

        def apply(cls: type, *args: Any, **kwargs: Any) -> Any:
            if (f"{cls.__module__}.".startswith(guards.TRANSPARENT_FUNCTIONS)
                    or not any(isinstance(a, fx.Proxy) for a in pytree.tree_leaves((args, kwargs)))):
                return ORIGINAL_APPLY.__get__(None, cls)(*args, **kwargs)
            # one node calling the function, so that its own backward runs (tracing into its forward loses it);
            # the class is an attribute of the root, which the capture keeps as a constant
            if cls not in functions:
                functions[cls] = f"_fxplan_function_{len(functions)}"
                setattr(self.root, functions[cls], cls)
            function = self.create_proxy("get_attr", functions[cls], (), {})
            return self.create_proxy("call_function", apply_function, (function, *args), kwargs)

        with guards.replaced(torch.autograd.Function, "apply", classmethod(apply)):
            return super().trace(root, concrete_args)

    def create_node(self, kind: str, target: Any, args: Any, kwargs: Any, name: str | None = None,
                    type_expr: Any = None) -> fx.Node:
        # symbolic_trace runs ``with torch.no_grad():`` (or autocast) while tracing and records nothing of it:
        # the graph would compute, and differentiate, what the model's region does not
        if (kind.startswith("call_") and not guards.INSIDE_OWN_CHECKPOINT[0]
                and _grad_and_autocast_modes() != self.fxplan_modes):
            raise RuntimeError("a grad-mode or autocast region inside forward (torch.no_grad, torch.autocast), "
                               "which symbolic_trace does not record")
        if kind == "output":
            self.fxplan_output_types = container_types(args[0], self.fxplan_dicts)
        return super().create_node(kind, target, args, kwargs, name, type_expr)


    def call_module(self, m, forward, args, kwargs):
        self.fxplan_path.append(self.path_of_module(m) or type(m).__name__)
        out = super().call_module(m, forward, args, kwargs)
        self.fxplan_path.pop()
        return out


def apply_function(function: type, *args: Any, **kwargs: Any) -> Any:
    """``function.apply(*args, **kwargs)``: a captured call of a ``torch.autograd.Function``, which runs its own
    backward."""
    return function.apply(*args, **kwargs)


def _grad_and_autocast_modes() -> tuple:
    """Grad mode, inference mode and autocast's state (enabled, dtype) on the CPU and CUDA."""
    return (torch.is_grad_enabled(), torch.is_inference_mode_enabled(),
            *((torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)) for d in ("cpu", "cuda")))


def _check_call(model: torch.nn.Module, call: ExampleCall) -> None:
    """A TraceError, before any capture, when the example inputs do not fit ``model.forward``."""
    sig = _signature(model)
    if sig is None:
        return
    try:
        sig.bind(*call.args, **call.kwargs)
    except TypeError as exc:
        params = [p for p in sig.parameters.values() if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
        required = [p for p in params if p.default is p.empty]
        count = f"{len(params)}" if len(required) == len(params) else f"{len(required)} to {len(params)}"
        names = ", ".join(p.name for p in params)
        raise TraceError(f"{type(model).__name__}.forward takes {count} inputs ({names}), got "
                         f"{len(call.args)} positional and {len(call.kwargs)} keyword example inputs: {exc}") from exc


def _check_arguments(model: torch.nn.Module, gm: fx.GraphModule, call: ExampleCall) -> None:
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    names = [str(n.target).lstrip("*") for n in placeholders]
    if any(str(n.target).startswith("*") for n in placeholders):
        raise TraceError("forward takes *args or **kwargs, which symbolic_trace cannot represent")
    sig = inspect.Signature([inspect.Parameter(n, inspect.Parameter.POSITIONAL_OR_KEYWORD) for n in names])
    try:
        bound = sig.bind_partial(*call.args, **call.kwargs)
    except TypeError as exc:
        raise TraceError(f"{type(model).__name__}.forward({', '.join(names)}) cannot take the example "
                         f"inputs: {exc}") from exc
    required = [n for n, p in zip(names, placeholders) if not p.args]
    missing = [n for n in required if n not in bound.arguments]
    if missing:
        raise TraceError(f"{type(model).__name__}.forward({', '.join(names)}) needs {missing} in the example "
                         "inputs")


# ----------------------------------------------------------------------------------------------
# torch.export


def export_module(model: torch.nn.Module, call: ExampleCall) -> Captured:
    """Capture with non-strict ``torch.export`` on a fake copy of ``model`` (nothing real runs or changes)."""
    interface = CallInterface(model, call, flat=True)
    args, kwargs = interface.normalize(call.args, call.kwargs)
    fake_mode = fake_mode_of(model, (args, kwargs))
    fake_model = fake_copy(model, fake_mode)
    fake_args, fake_kwargs = to_fake((args, kwargs), fake_mode)
    try:
        ep = checked_for_python_state(fake_model, type(model).__name__,
                                      lambda: export_program(fake_model, fake_args, fake_kwargs),
                                      lambda ep: ep.module())
    except UnsupportedOutput as exc:
        # A key/value cache is an inference object a graph cannot return; Hugging Face's own gradient
        # checkpointing turns it off in training. The graph computes exactly what the call computes
        # (the cache is filled and dropped), and its output leaves the object out.
        logger.warning("fxplan: the output of %s holds a %s, which a graph cannot return; planned training "
                       "calls return the output without it", type(model).__name__, exc.type_name)
        original_forward = fake_model.forward
        fake_model.forward = lambda *a, **k: without_objects(original_forward(*a, **k))
        ep = export_program(fake_model, fake_args, fake_kwargs)
    exported = ep.module()
    graph = exported.graph
    interface.out_spec = graph._codegen.pytree_info.out_spec
    graph._codegen = fx.graph.CodeGen()
    drop_checks(graph)
    graph.eliminate_dead_code()
    state = {name for name, _ in model.named_parameters(remove_duplicate=False)}
    state |= {name for name, _ in model.named_buffers(remove_duplicate=False)}
    constants: dict[str, Any] = {}
    for node in graph.nodes:
        if node.op == "get_attr" and str(node.target) not in state:
            # Constants export made up (lifted tensors, no_grad region bodies) live at the root under
            # names of their own, wherever export put them.
            name = f"_fxplan_constant_{len(constants)}"
            constants[name] = resolve_attr(exported, str(node.target))
            node.target = name
    calls_of_functions(graph, constants)
    gm = owning_graph_module(model, graph, constants)
    gm.graph.lint()
    return _captured(model, gm, "torch.export", interface)
