"""Which ATen ops each node of a captured graph runs, as a selective-checkpoint policy will see them.

A selective-checkpoint policy (``torch.utils.checkpoint.create_selective_checkpoint_contexts``) decides per op
call below autograd, and an op call is known by its operator and how many calls of that operator came before it
in the checkpointed region's forward (torch's own key, and torchtitan's). A plan decides per node of the captured
graph. :func:`node_ops` runs the captured graph once on fake tensors, with gradients on (so composite ops
decompose as they do in training), and records for every node the op calls it makes, in order: the operator,
whether the call made the node's value, whether it writes a tensor that existed before the node, and whether it
draws random numbers. :mod:`fxplan.apply.regions` counts them per region.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.checkpoint import SAC_IGNORED_OPS

from fxplan.capture.capturers import Captured, ExampleCall
from fxplan.capture.fakes import fake_copy, fake_mode_of, to_fake
from fxplan.costs.trace import placeholder_values


@dataclass(frozen=True)
class OpCall:
    """One op call a node makes: the operator's name (``aten.addmm.default``) and what the call does."""

    op: str
    makes_value: bool  # it returned the storage of the node's own value
    writes: tuple[int, ...] = ()  # storages (keys) it writes in place
    random: bool = False
    view: bool = False
    outputs: tuple[int, ...] = ()  # storages (keys) of what it returns
    shape: str = ""  # of its first tensor output (:func:`shape_of`): a check that a call is the one planned


@dataclass
class NodeOps:
    """The op calls of one node of the captured graph, and the module path it runs in (``""``: the root)."""

    name: str
    scope: tuple[str, ...]  # module paths from the outermost to the innermost
    calls: list[OpCall] = field(default_factory=list)
    value: tuple[int, ...] = ()  # storages (keys) of the node's value


def op_name(func: Any) -> str:
    return str(func)


def node_ops(model: torch.nn.Module, captured: Captured, call: ExampleCall) -> dict[str, NodeOps]:
    """Per node of ``captured.gm`` (in graph order), the op calls it makes on the example call's inputs."""
    gm = captured.gm
    args, kwargs = captured.interface.graph_inputs(call.args, call.kwargs)
    values = placeholder_values(gm, args, kwargs, type(model).__name__)
    fake_mode = fake_mode_of(model, (call.args, call.kwargs))
    runner = _Recorder(fake_copy(gm, fake_mode))
    with fake_mode, torch.enable_grad(), runner.mode:
        runner.run(*to_fake(values, fake_mode))
    return runner.nodes


def scope_of(node: fx.Node) -> tuple[str, ...]:
    """The module paths ``node`` runs in, outermost first (export marks a module's second call ``path@1``)."""
    stack = node.meta.get("nn_module_stack") or {}
    paths = []
    for value in stack.values():
        path = value[0] if isinstance(value, tuple) else str(value)
        path = path.split("@")[0]
        if path and path not in paths:
            paths.append(path)
    if node.op == "call_module" and node.target not in paths:
        paths.append(str(node.target))
    return tuple(paths)


def shape_of(output: Any) -> str:
    """The shape of the first tensor in an op's output, as the plan records it and a policy checks it."""
    first = next((t for t in tree_leaves(output) if isinstance(t, torch.Tensor)), None)
    return "" if first is None else "x".join(map(str, first.shape))


#: Ops that update the running statistics they are given (when ``training``, their sixth argument) although
#: their schema does not mark those arguments as written.
BUFFER_UPDATES = {torch.ops.aten.native_batch_norm.default, torch.ops.aten.cudnn_batch_norm.default,
                  torch.ops.aten.miopen_batch_norm.default}


def written_storages(func: Any, args: tuple, kwargs: dict) -> list[int]:
    """The storages an op call writes in place: its schema's written arguments, and a BatchNorm's running
    statistics in training."""
    written = []
    for i, argument in enumerate(func._schema.arguments):
        if argument.alias_info is not None and argument.alias_info.is_write:
            value = args[i] if i < len(args) else kwargs.get(argument.name)
            written += [storage_key(t) for t in tree_leaves(value) if isinstance(t, torch.Tensor)]
    if func in BUFFER_UPDATES and len(args) > 5 and args[5]:
        written += [storage_key(t) for t in args[3:5] if isinstance(t, torch.Tensor)]
    return written


def draws_random(func: Any, args: tuple, kwargs: dict) -> bool:
    """Whether the call draws random numbers: an op tagged as seeded, unless its only source of randomness, a
    ``dropout_p`` argument, is zero (attention kernels are tagged for their dropout, and draw nothing without it)."""
    if torch.Tag.nondeterministic_seeded not in func.tags:
        return False
    for i, argument in enumerate(func._schema.arguments):
        if argument.name == "dropout_p":
            value = args[i] if i < len(args) else kwargs.get("dropout_p", argument.default_value)
            return not (isinstance(value, (int, float)) and value == 0)
    return True


def storage_key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


class _Recording(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[Any, list[int], list[int], str, bool]] | None = None
        # every output stays alive while recording: storage keys are addresses, and a freed storage's is reused
        self.alive: list[Any] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.alive.append(out)
        if self.calls is not None and func not in SAC_IGNORED_OPS:
            outputs = [storage_key(t) for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
            self.calls.append((func, outputs, written_storages(func, args, kwargs), shape_of(out),
                               draws_random(func, args, kwargs)))
        return out


class _Recorder(fx.Interpreter):
    def __init__(self, gm: fx.GraphModule):
        super().__init__(gm, garbage_collect_values=False)  # values kept: their storage keys stay theirs
        self.mode = _Recording()
        self.nodes: dict[str, NodeOps] = {}

    def run_node(self, n: fx.Node) -> Any:
        self.mode.calls = []
        try:
            result = super().run_node(n)
        finally:
            made, self.mode.calls = self.mode.calls, None
        own = {storage_key(t) for t in tree_leaves(result) if isinstance(t, torch.Tensor)}
        producer = max((i for i, (_, outputs, *_) in enumerate(made) if own & set(outputs)), default=None)
        self.nodes[n.name] = NodeOps(n.name, scope_of(n), [
            OpCall(op_name(func), i == producer, tuple(written), random, func.is_view, tuple(outputs), shape)
            for i, (func, outputs, written, shape, random) in enumerate(made)], tuple(own))
        return result
