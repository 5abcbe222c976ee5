"""The methods fxplan is compared against: vanilla PyTorch, ``checkpoint_sequential``, ``torch.compile``,
PyTorch's automatic selective checkpointing (``torch.distributed._tools.sac_ilp``) and, for Hugging Face
transformers, the library's own activation checkpointing.

Each peer turns a model into a module that runs one training step its way. Nothing here plans
anything; :mod:`fxplan.compare.driver` measures what these modules cost.

* **vanilla**: the model as it is (Kusumoto et al. 2019, section 5: "vanilla implementation of the
  forward and backward propagation without any recomputation").
* **checkpoint_sequential**: ``torch.utils.checkpoint.checkpoint_sequential`` with ``round(sqrt(n))``
  segments (Chen et al. 2016, section 4.1, the sqrt(n) plan). It needs a chain of modules, so
  :func:`as_sequential` checks, on the model's torch.fx graph with its top-level children as leaves,
  that ``forward`` really is a chain (each node consumes only the previous node's value), and only
  then flattens the children (and plain ``nn.Sequential`` children, recursively) into one
  ``nn.Sequential``. Anything else raises :class:`NotApplicable` with the reason.
* **torch.compile**: backend ``aot_eager`` (AOTAutograd's min-cut partitioner, no kernel fusion) with
  ``torch._functorch.config.activation_memory_budget`` set while the graph is compiled. The budget is
  a fraction of the saved-activation set, not bytes of peak. Compiled code is invisible to dispatch
  modes (hence to fake-tensor metering), so compiled peers are measured on real steps only.
* **checkpoint around each repeated block**: what a user writes by hand for a network built of
  repeated blocks (torchvision's ``Bottleneck`` and ``_DenseLayer``, transformers' ``GPT2Block``): every
  instance of the block class runs under non-reentrant ``torch.utils.checkpoint``, so only each block's
  inputs are kept and its forward is recomputed in backward. :func:`block_class` finds the class (the
  most frequent one among modules with two or more children). Its *selective* variant
  (``torch.utils.checkpoint.create_selective_checkpoint_contexts``) keeps the outputs of convolutions
  and matrix products inside each block and recomputes only the cheap ops between them
  (normalisations, activations, concatenations), as PyTorch's selective activation checkpointing does.
* **PyTorch's automatic selective checkpointing** (:func:`sac_ilp_peer`): ``torch.distributed._tools``'
  ``SACEstimator`` (with ``MemTracker`` and ``RuntimeEstimator``) estimates each module's memory, time and per-op
  trade-off on a fake copy of the model, ``sac_milp`` (a module-level ILP) chooses under a memory budget which modules
  to checkpoint and what share of each one's activation memory to discard, and
  ``get_optimal_checkpointing_policy_per_module`` which op outputs each chosen module keeps; those modules then run
  under ``torch.utils.checkpoint`` with a selective-checkpoint policy (:mod:`fxplan.compare.torch_sac`).
* **Hugging Face checkpointing**: ``model.activation_checkpointing_enable()`` (in older transformers
  ``gradient_checkpointing_enable()``), what LLM users turn on today: every decoder
  or encoder layer runs under non-reentrant ``torch.utils.checkpoint``, so only the layer inputs are
  kept and each layer's forward is recomputed in backward. Recomputation happens in ordinary eager code,
  which the fake-tensor meter sees, so these peers are measured like vanilla.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import math
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.fx
from torch import nn
from torch.utils._pytree import tree_map

from fxplan.errors import FxplanError


class NotApplicable(FxplanError):
    """A peer method cannot be applied to this model; the message says why."""

    progress_status = "not applicable"


# ---------------------------------------------------------------------------------------------- vanilla


def vanilla(model: nn.Module) -> nn.Module:
    """The model itself: the baseline every reduction and time ratio is relative to."""
    return model


# -------------------------------------------------------------------------------- checkpoint_sequential


class _TopLevelTracer(torch.fx.Tracer):
    """Traces only the root's own ``forward``: every direct child module is a leaf."""

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        return "." not in module_qualified_name or super().is_leaf_module(m, module_qualified_name)


class _Call(nn.Module):
    """A parameter-free step of the chain: ``fn(x, *args, **kwargs)`` (e.g. ``torch.flatten(x, 1)``)."""

    def __init__(self, fn: Callable[..., Any], args: tuple, kwargs: dict, label: str):
        super().__init__()
        self.fn, self.args, self.kwargs, self.label = fn, args, kwargs, label

    def forward(self, x: Any) -> Any:
        return self.fn(x, *self.args, **self.kwargs)

    def extra_repr(self) -> str:
        return self.label


def _flatten_children(module: nn.Module) -> list[nn.Module]:
    """Plain ``nn.Sequential`` containers are chains by definition: splice their children in."""
    if type(module) is nn.Sequential:
        return [leaf for child in module for leaf in _flatten_children(child)]
    return [module]


def as_sequential(model: nn.Module) -> nn.Sequential:
    """``model`` as an ``nn.Sequential`` with the same forward, or :class:`NotApplicable` saying why.

    The check is made on the torch.fx graph of ``model.forward`` with the top-level children as leaves:
    one input, then a chain of nodes each of which takes the previous node's value as its only tensor
    argument, and the output is the last value. Children become chain steps; parameter-free functions
    and methods between them (``torch.flatten(x, 1)``) become small wrapper modules. Parameters and
    buffers are shared with ``model`` (nothing is copied).
    """
    if isinstance(model, nn.Sequential) and type(model).forward is nn.Sequential.forward:
        return nn.Sequential(*_flatten_children(model))
    try:
        graph = _TopLevelTracer().trace(model)
    except Exception as exc:  # torch.fx raises many types
        raise NotApplicable(f"not applicable: forward is not traceable by torch.fx ({type(exc).__name__}: "
                            f"{str(exc).splitlines()[0] if str(exc) else ''})") from exc
    nodes = list(graph.nodes)
    placeholders = [n for n in nodes if n.op == "placeholder"]
    if len(placeholders) != 1:
        raise NotApplicable(f"not applicable: forward takes {len(placeholders)} inputs, a chain takes one")
    steps: list[nn.Module] = []
    prev = placeholders[0]
    used_children: set[str] = set()
    for n in nodes[1:]:
        if n.op == "output":
            if n.args[0] is not prev:
                raise NotApplicable("not applicable: forward returns something other than the last value "
                                    "of the chain (several outputs or a skip connection)")
            break
        if len(n.users) > 1 or (n.users and next(iter(n.users)) is not _next_node(nodes, n)):
            raise NotApplicable(f"not applicable: the value of '{n.name}' is used by more than the next "
                                "step (a branch or skip connection), so forward is not a chain")
        tensor_args = [a for a in _flat_args(n) if isinstance(a, torch.fx.Node)]
        if tensor_args != [prev]:
            raise NotApplicable(f"not applicable: '{n.name}' does not take exactly the previous value "
                                "(a branch, a skip connection or a parameter read), so forward is not a chain")
        if n.op == "call_module":
            if n.target in used_children:
                raise NotApplicable(f"not applicable: child '{n.target}' is called twice")
            used_children.add(n.target)
            if n.args[0] is not prev or len(n.args) != 1 or n.kwargs:
                raise NotApplicable(f"not applicable: child '{n.target}' is called with extra arguments")
            steps.extend(_flatten_children(model.get_submodule(n.target)))
        elif n.op == "call_function":
            if not n.args or n.args[0] is not prev:
                raise NotApplicable(f"not applicable: '{n.name}' does not take the chain value first")
            steps.append(_Call(n.target, tuple(n.args[1:]), dict(n.kwargs), n.format_node() or n.name))
        elif n.op == "call_method":
            if not n.args or n.args[0] is not prev:
                raise NotApplicable(f"not applicable: '{n.name}' does not take the chain value first")
            method = getattr(torch.Tensor, n.target)
            steps.append(_Call(method, tuple(n.args[1:]), dict(n.kwargs), f"Tensor.{n.target}"))
        else:
            raise NotApplicable(f"not applicable: forward reads '{n.target}' ({n.op}) outside the chain")
        prev = n
    unused = [name for name, _ in model.named_children() if name not in used_children]
    owned = [name for name, _ in model.named_parameters(recurse=False)] + [
        name for name, _ in model.named_buffers(recurse=False)]
    if owned:
        raise NotApplicable(f"not applicable: the model holds parameters or buffers of its own ({owned[0]})")
    seq = nn.Sequential(*steps)
    seq.fxplan_unused_children = unused  # type: ignore[attr-defined]  # reported, not fatal (e.g. aux heads off)
    return seq


def _next_node(nodes: list[torch.fx.Node], n: torch.fx.Node) -> torch.fx.Node:
    return nodes[nodes.index(n) + 1]


def _flat_args(n: torch.fx.Node) -> list[Any]:
    out: list[Any] = []
    torch.fx.node.map_aggregate((n.args, n.kwargs), out.append)
    return out


class CheckpointSequential(nn.Module):
    """Runs a chain of modules under ``checkpoint_sequential`` with ``segments`` segments in training.

    Non-reentrant checkpointing (``use_reentrant=False``), as PyTorch recommends. Outside training or
    without grad it is the plain chain.
    """

    def __init__(self, chain: nn.Sequential, segments: int):
        super().__init__()
        self.chain = chain
        self.segments = segments

    def forward(self, x: torch.Tensor) -> Any:
        if not (self.training and torch.is_grad_enabled()):
            return self.chain(x)
        return torch.utils.checkpoint.checkpoint_sequential(self.chain, self.segments, x, use_reentrant=False)


def checkpoint_sequential_peer(model: nn.Module) -> CheckpointSequential:
    """``model`` under ``checkpoint_sequential`` with round(sqrt(n)) segments over its n chain steps."""
    chain = as_sequential(model)
    n = len(chain)
    if n < 2:
        raise NotApplicable(f"not applicable: the chain has only {n} step")
    return CheckpointSequential(chain, max(1, round(math.sqrt(n)))).train(model.training)


# ------------------------------------------------------------------------------------------ torch.compile


@contextlib.contextmanager
def activation_budget(fraction: float) -> Iterator[None]:
    """Set ``torch._functorch.config.activation_memory_budget`` for compilations inside the block."""
    if not 0.0 <= fraction <= 1.0:
        raise FxplanError(f"activation_memory_budget must be in [0, 1], got {fraction}")
    import torch._functorch.config as fconfig

    with fconfig.patch(activation_memory_budget=fraction):
        yield


def _budgeted_backend(name: str, fraction: float) -> Callable[..., Any]:
    """A backend object of its own for each peer, compiling under its own budget.

    Dynamo guards on the backend object, not on the module object (parameters are graph inputs), so two
    copies of one model compiled with the same backend would share one graph, the first budget's. A
    distinct backend per peer keeps their graphs apart without ``torch._dynamo.reset()``.
    """
    from torch._dynamo.backends.registry import lookup_backend

    inner = lookup_backend(name)

    def backend(gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
        with activation_budget(fraction):
            return inner(gm, example_inputs)

    backend.__name__ = f"{name}_budget_{fraction:g}"
    return backend


class CompiledPeer(nn.Module):
    """``torch.compile(model, backend="aot_eager")`` compiled under an activation-memory budget.

    Compilation is lazy (it happens on the first call), so :meth:`warm_up` must run one step inside
    :func:`activation_budget`; later calls reuse that graph. Each peer compiles with a backend object of its own
    (:func:`_budgeted_backend`), which keeps graphs compiled under different budgets apart;
    ``torch._dynamo.reset()`` is deliberately not called, since it would drop the other peers' graphs and
    recompile them while they are being timed.
    """

    def __init__(self, model: nn.Module, fraction: float, backend: str = "aot_eager"):
        super().__init__()
        self.fraction = fraction
        self.backend = backend
        self.model = model
        self.compiled = torch.compile(model, backend=_budgeted_backend(backend, fraction))

    def forward(self, *args: Any) -> Any:
        with activation_budget(self.fraction):
            return self.compiled(*args)

    def warm_up(self, inputs: tuple, loss_fn: Callable[[Any], torch.Tensor]) -> None:
        """Compile (forward and backward graphs) by running one step on ``inputs``."""
        with activation_budget(self.fraction):
            loss_fn(self.compiled(*inputs)).backward()
        self.model.zero_grad(set_to_none=True)


def compile_peer(model: nn.Module, fraction: float) -> CompiledPeer:
    """A compiled copy-free wrapper of ``model`` (call :meth:`CompiledPeer.warm_up` before measuring)."""
    return CompiledPeer(model, fraction)


# ------------------------------------------------------------------------------ checkpoint around each block

#: Containers are not blocks: they have no computation of their own to checkpoint as one unit.
_CONTAINERS = (nn.Sequential, nn.ModuleList, nn.ModuleDict)


def _matmul_ops() -> list[Any]:
    """The aten ops whose outputs the selective variant keeps: convolutions, matrix products, and the fused
    attention kernels (matrix products inside)."""
    names = ["convolution", "mm", "addmm", "bmm", "baddbmm",
             "_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_for_cpu",
             "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention"]
    return [getattr(torch.ops.aten, n).default for n in names if hasattr(torch.ops.aten, n)]


def block_class(model: nn.Module, name: str | None = None) -> type[nn.Module]:
    """The class of ``model``'s repeated block: the class named ``name`` (its ``__name__`` or qualified name),
    or else the most frequent class among the submodules with at least two child modules (containers such
    as ``nn.Sequential`` and the root excluded; ties go to the class met first in ``named_modules`` order,
    the outer one, so GPT-2's ``GPT2Block`` wins over the ``GPT2Attention`` inside each).

    Raises :class:`NotApplicable` if no class occurs twice, or ``name`` matches no submodule.
    """
    modules = [m for _, m in model.named_modules() if m is not model]
    if name is not None:
        for m in modules:
            cls = type(m)
            if name in (cls.__name__, cls.__qualname__, f"{cls.__module__}.{cls.__qualname__}"):
                return cls
        known = sorted({type(m).__name__ for m in modules})
        raise NotApplicable(f"not applicable: no submodule of class {name!r}; the model's classes are "
                            f"{', '.join(known)}")
    counts = Counter(type(m) for m in modules
                     if not isinstance(m, _CONTAINERS) and len(list(m.children())) >= 2)
    if not counts:
        raise NotApplicable("not applicable: no submodule has two or more child modules (no repeated block)")
    most = max(counts.values())
    cls = next(c for c, n in counts.items() if n == most)  # counts keeps first-seen order
    if most < 2:
        raise NotApplicable(f"not applicable: no block class occurs twice (most frequent: {cls.__name__}, once)")
    return cls


class CheckpointedBlock(nn.Module):
    """One block run under non-reentrant ``torch.utils.checkpoint`` in training (``selective``: keeping the
    outputs of convolutions and matrix products, recomputing the rest). Outside training or without grad
    it is the plain block."""

    def __init__(self, block: nn.Module, selective: bool = False):
        super().__init__()
        self.block = block
        self.selective = selective

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if not (self.training and torch.is_grad_enabled()):
            return self.block(*args, **kwargs)
        # checkpoint re-reads its arguments in backward, and a caller may change a list it passed after the
        # call (torchvision's _DenseBlock appends each layer's output to the list it gives every layer):
        # the block gets containers of its own, the tensors in them unchanged.
        args, kwargs = tree_map(lambda x: x, (args, kwargs))
        if self.selective:
            from torch.utils.checkpoint import create_selective_checkpoint_contexts

            context_fn = functools.partial(create_selective_checkpoint_contexts, _matmul_ops())
            return torch.utils.checkpoint.checkpoint(self.block, *args, use_reentrant=False, context_fn=context_fn,
                                                     **kwargs)
        return torch.utils.checkpoint.checkpoint(self.block, *args, use_reentrant=False, **kwargs)

    def extra_repr(self) -> str:
        return "selective=True" if self.selective else ""


def block_checkpoint_peer(model: nn.Module, cls: type[nn.Module] | str | None = None, *,
                          selective: bool = False) -> nn.Module:
    """A copy of ``model`` in which every instance of the block class ``cls`` (a class, a class name, or None:
    :func:`block_class` finds it) is wrapped in :class:`CheckpointedBlock`. Parameters and buffers are
    shared with ``model`` (only module objects are copied), and ``model`` itself is left as it is.

    Blocks inside blocks are not wrapped again: the outermost instance is checkpointed. Raises
    :class:`NotApplicable` if the model has no such block.
    """
    if cls is None or isinstance(cls, str):
        cls = block_class(model, cls)
    shared = {id(t): t for t in (*model.parameters(), *model.buffers())}
    peer = copy.deepcopy(model, shared)
    if isinstance(peer, cls):
        raise NotApplicable(f"not applicable: the model itself is a {cls.__name__}; checkpoint its blocks instead")
    wrapped = _wrap_blocks(peer, cls, selective)
    if wrapped == 0:
        raise NotApplicable(f"not applicable: the model has no submodule of class {cls.__name__}")
    peer.fxplan_block_class = cls.__name__  # type: ignore[assignment]  # reported beside the peer
    peer.fxplan_blocks = wrapped  # type: ignore[assignment]
    return peer.train(model.training)


def _wrap_blocks(parent: nn.Module, cls: type[nn.Module], selective: bool) -> int:
    """Replace each outermost ``cls`` instance below ``parent`` by its :class:`CheckpointedBlock`; how many."""
    count = 0
    for name, child in list(parent.named_children()):
        if isinstance(child, cls):
            setattr(parent, name, CheckpointedBlock(child, selective))
            count += 1
        else:
            count += _wrap_blocks(child, cls, selective)
    return count


# ------------------------------------------------------------------------------ Hugging Face checkpointing


def hf_checkpointing_peer(model: nn.Module) -> nn.Module:
    """A copy of a transformers model with its own activation checkpointing on, sharing ``model``'s parameters
    and buffers (nothing is copied but the module objects; ``model`` itself is left as it is).

    Raises :class:`NotApplicable` for a model that is not a transformers ``PreTrainedModel`` supporting it.
    """
    if not getattr(model, "supports_gradient_checkpointing", False):
        raise NotApplicable("not applicable: not a Hugging Face transformers model that supports gradient "
                            "checkpointing")
    shared = {id(t): t for t in (*model.parameters(), *model.buffers())}
    peer = copy.deepcopy(model, shared)
    if hasattr(peer, "activation_checkpointing_enable"):  # newer transformers
        peer.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        peer.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return peer.train(model.training)


# ------------------------------------------------------------------ PyTorch's automatic selective checkpointing


def sac_ilp_peer(model: nn.Module, example_inputs: Any, loss_fn: Callable[[Any], torch.Tensor] | None = None,
                 memory_budget_fraction: float = 0.5, *, runtime_mode: str | None = None) -> nn.Module:
    """A copy of ``model`` checkpointed as PyTorch's automatic selective activation checkpointing chooses for a
    budget, sharing ``model``'s parameters and buffers (only module objects are copied; ``model`` is left as it is).

    On a fake copy, torch's ``MemTracker``, ``RuntimeEstimator`` and ``SACEstimator`` measure one step
    (``loss_fn(model(*example_inputs)).backward()``; ``example_inputs`` as :func:`fxplan.measure_step` takes them,
    ``loss_fn`` by default the sum of the floating-point outputs); ``sac_milp`` chooses the
    modules to checkpoint and the share of each one's activation memory to discard, and
    ``get_optimal_checkpointing_policy_per_module`` the op outputs each keeps; each chosen module's forward then runs
    under non-reentrant ``torch.utils.checkpoint`` with a selective-checkpoint policy that keeps exactly those
    (:mod:`fxplan.compare.torch_sac` says how op calls are matched). Recomputation is exact (checkpointing replays
    the forward's random state), so losses and gradients are those of ``model``; a BatchNorm that is recomputed
    updates its running statistics a second time, as under any ``torch.utils.checkpoint``.

    The budget handed to ``sac_milp`` is ``memory_budget_fraction`` of the way from the smallest budget it finds a
    plan under (bisection, :func:`fxplan.compare.torch_sac.smallest_budget`) to the unplanned step's peak as torch's
    ILP models it: 0 is the smallest, 1 the unplanned peak (no checkpointing), as fxplan's own ``approx-time@P``
    points are placed. The bytes are ``sac_milp``'s memory model, not a measured peak: the peer's measured peak may
    be above or below its budget.

    ``runtime_mode``: how op times are estimated. torch's ``operator-level-cost-model`` (roofline, the default for a
    model on an accelerator) and ``operator-level-benchmark`` both need an accelerator in torch 2.14.1 (the first
    asserts one, the second times with its events) and raise :class:`FxplanError` without one; on the CPU the
    default is ``cpu-benchmark``, each op timed on the CPU as torch's benchmark mode times it on a GPU, and for a model
on ``meta`` ``cpu-roofline``, each op priced by its FLOPs and bytes at the CPU's measured speed. The times
    steer only which modules and op outputs the ILPs prefer to recompute; the memory model is torch's either way.

    ``peer.fxplan_sac`` is the :class:`fxplan.compare.torch_sac.SACPlan` (``summary()``); each checkpointed
    module's ``forward`` is a :class:`fxplan.compare.torch_sac.SACForward`. Needs the packages ``pulp`` and ``pwlf``.
    Raises :class:`FxplanError` where torch's tools cannot model the step (a module with children called twice in one
    step, an accelerator mode without an accelerator).
    """
    from fxplan.capture.capturers import as_call
    from fxplan.compare import torch_sac
    from fxplan.measure.meter import default_loss

    if not 0.0 <= memory_budget_fraction <= 1.0:
        raise FxplanError(f"memory_budget_fraction must be in [0, 1], got {memory_budget_fraction}")
    mode = runtime_mode or torch_sac.default_runtime_mode(model)
    stats = torch_sac.collect(model, as_call(example_inputs), loss_fn or default_loss, mode)
    smallest = torch_sac.smallest_budget(stats)
    budget = int(smallest + memory_budget_fraction * (stats.baseline_peak_bytes - smallest))
    plan, decisions = torch_sac.solve(stats, budget, smallest)
    shared = {id(t): t for t in (*model.parameters(), *model.buffers())}
    peer = copy.deepcopy(model, shared)
    torch_sac.install(peer, decisions)
    peer.fxplan_sac = plan  # type: ignore[assignment]  # reported beside the peer
    return peer.train(model.training)


__all__ = [
    "CheckpointSequential", "CheckpointedBlock", "CompiledPeer", "NotApplicable", "activation_budget",
    "as_sequential", "block_checkpoint_peer", "block_class", "checkpoint_sequential_peer", "compile_peer",
    "hf_checkpointing_peer", "sac_ilp_peer", "vanilla",
]
