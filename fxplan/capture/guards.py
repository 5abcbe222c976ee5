"""What a capture cannot keep, found while capturing: each is refused (:class:`~fxplan.errors.TraceError`) where
the rewrite would differ from the model, or warned of where only a side effect would.

- **Hooks** (:func:`check_hooks`): a backward hook on a module the graph runs inline would not run; a forward
  hook's side effects (storing outputs) happen at capture only.
- **The model's own checkpoints** (:func:`own_checkpoints`): seen, so that a model re-running buffer updates in
  its checkpoints can be refused (:func:`fxplan.costs.trace.trace`), and a reentrant one's no_grad is not taken for
  a region of the model's.
- **Draws from numpy's or Python's global generator** (:func:`checked_for_host_draws`): a graph would repeat
  the numbers drawn while capturing.
- **Hooks on tensors** (:func:`tensor_hooks_refused`), which torch.export records without their effect on the
  gradients. (Custom autograd functions, which it would record the same way, are kept whole instead:
  :mod:`fxplan.capture.functions`.)
- **TorchScript modules** (:func:`refuse_torchscript`), which fake tensors cannot run.
"""

from __future__ import annotations

import contextlib
import logging
import operator
import random
import sys
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import torch
import torch.fx as fx

from fxplan.errors import TraceError

logger = logging.getLogger("fxplan")

Capture = TypeVar("Capture")  # what a capture returns (a capturers.Captured)


@contextlib.contextmanager
def replaced(owner: Any, name: str, value: Any) -> Iterator[None]:
    """``owner.name`` is ``value`` inside the block and what it was before after it: how the checks here watch
    what a forward calls (``torch.nn.Module.__setattr__``, ``torch.autograd.Function.apply``, ...)."""
    original = owner.__dict__[name] if isinstance(owner, type) else getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, original)


def checked_for_python_state(model: torch.nn.Module, name: str, capture_once: Callable[[], Any],
                             graph_of: Callable[[Any], fx.GraphModule]) -> Any:
    """``capture_once()`` (running ``model``'s forward), checked for plain attributes of its modules that the
    forward sets to new values (a number, string or flag: ``self.calls += 1``, a schedule's step): a graph holds
    the values read while capturing. Where the forward sets any, it is captured once more from the values the
    first capture left: the same graph (the forward resets the attribute before reading it) is kept; another one
    is refused with :class:`TraceError`, as the model's next call would read new values the graph never would.
    The attributes are put back either way. A module's ``training`` flag is left to ``train()``."""
    with _plain_attributes_set(model) as changed:
        first = capture_once()
    if not changed:
        return first
    try:
        for (owner, attribute), (_, last) in changed.items():  # as the forward left them (export puts them back)
            object.__setattr__(owner, attribute, last)
        with _plain_attributes_set(model):
            again = capture_once()
        same = _same_graph(graph_of(first), graph_of(again))
    finally:
        for (owner, attribute), (value, _) in changed.items():
            object.__setattr__(owner, attribute, value)
    if not same:
        names = {id(m): n or name for n, m in model.named_modules()}
        (owner, attribute), (old, _) = next(iter(changed.items()))
        raise TraceError(f"the forward of {name} changes {names[id(owner)]}.{attribute} (from {old!r}), and a graph "
                         "holds the values read while capturing: two captures gave different graphs, so the model's "
                         "next call would compute what the graph never would; keep such state in a buffer "
                         "(torch.Tensor), which the graph updates")
    return first


@contextlib.contextmanager
def _plain_attributes_set(model: torch.nn.Module) -> Iterator[dict[tuple[torch.nn.Module, str], tuple[Any, Any]]]:
    """(module, attribute) -> (the value before the block, the last value the block set), for each plain
    attribute of ``model``'s modules that the block sets to another value."""
    plain = (bool, int, float, str)
    modules = {id(m) for m in model.modules()}
    changed: dict[tuple[torch.nn.Module, str], Any] = {}
    original = torch.nn.Module.__setattr__

    def setattr_seen(module: torch.nn.Module, key: str, value: Any) -> None:
        old = module.__dict__.get(key)
        if (module, key) in changed:
            changed[module, key] = changed[module, key][0], value
        elif (id(module) in modules and key != "training" and isinstance(old, plain) and old is not value
                and old != value):
            changed[module, key] = old, value
        original(module, key, value)

    with replaced(torch.nn.Module, "__setattr__", setattr_seen):
        yield changed


def is_compiled(model: torch.nn.Module) -> bool:
    """Whether ``model`` is the module ``torch.compile`` returns (its forward runs compiled code)."""
    return isinstance(model, torch._dynamo.eval_frame.OptimizedModule)


def is_sharded(model: torch.nn.Module) -> bool:
    """Whether ``model`` or a module in it is sharded by FSDP (``fully_shard`` or ``FullyShardedDataParallel``)."""
    if not torch.distributed.is_available():
        return False
    from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel

    return any(isinstance(m, (FSDPModule, FullyShardedDataParallel)) for m in model.modules())


def refuse_torchscript(model: torch.nn.Module) -> None:
    """:class:`TraceError` naming the TorchScript modules in ``model`` (outermost only), if any."""
    scripted: list[str] = []
    for name, m in model.named_modules():
        if isinstance(m, torch.jit.ScriptModule) and not any(name.startswith(f"{s}.") for s in scripted):
            scripted.append(name or "the model")
    if scripted:
        raise TraceError(f"{type(model).__name__} holds TorchScript modules ({', '.join(scripted[:3])}"
                         f"{', ...' if len(scripted) > 3 else ''}), which fxplan's fake-tensor steps cannot run; "
                         "plan the model with the Python modules they were scripted from")


#: Where hooks that libraries register for themselves come from (weight normalisation, output capture):
#: what they do is the model's computation, which the capture keeps.
_LIBRARY_HOOKS = ("torch.", "transformers.", "timm.", "accelerate.", "peft.", "fxplan.")
_HOOK_TABLES = {"_forward_pre_hooks": "forward pre-hook", "_forward_hooks": "forward hook",
                "_backward_pre_hooks": "backward pre-hook", "_backward_hooks": "backward hook"}


def check_hooks(model: torch.nn.Module, gm: fx.GraphModule) -> None:
    """Backward hooks run only where the rewritten graph calls their module (a leaf of symbolic_trace): on any
    other module they would be lost, and the gradients with them, so they are refused (``TraceError``). Forward
    hooks are captured with the forward: what they return is kept, what else they do (storing outputs,
    logging) is not, so hooks that are not a library's own are warned of."""
    import torch.nn.modules.module as module_globals

    called = {str(node.target) for node in gm.graph.nodes if node.op == "call_module"}
    owners = [(name, mod) for name, mod in model.named_modules()] + [("", module_globals)]
    lost, user = [], []
    for name, owner in owners:
        for table, kind in _HOOK_TABLES.items():
            hooks = getattr(owner, table if owner is not module_globals else f"_global{table}", {})
            where = f"{kind} on {name or 'the model'}" if owner is not module_globals else f"global {kind}"
            if hooks and "backward" in kind and (owner is module_globals or name not in called):
                lost.append(where)
            for hook in hooks.values():
                function = getattr(hook, "func", hook)  # functools.partial
                if not (getattr(function, "__module__", None) or type(function).__module__ or "").startswith(
                        _LIBRARY_HOOKS):
                    user.append(where)
    if lost:
        raise TraceError(
            f"{type(model).__name__} has backward hooks ({', '.join(lost[:3])}{', ...' if len(lost) > 3 else ''}) on "
            "modules whose operations the captured graph runs without calling the module, so they would not run "
            "and the gradients would differ; remove them before fxplan.rewrite")
    if user:
        logger.warning(
            "fxplan: %s has hooks registered (%s%s): fxplan captures the forward with them, so what a hook returns "
            "is kept, but what it does besides (storing outputs in a list or dict, logging, counting) happens once "
            "while capturing, or, on a module the rewritten graph calls, again whenever backward recomputes it. "
            "Remove such hooks before fxplan.rewrite and take what they gather from the model's outputs",
            type(model).__name__, ", ".join(user[:3]), ", ..." if len(user) > 3 else "")


#: How many of the model's own checkpoint calls are running (:func:`own_checkpoints`): a reentrant checkpoint
#: runs its function under no_grad, which is not a region of the model's (the graph keeps the function's ops).
INSIDE_OWN_CHECKPOINT = [0]

#: What ``torch.utils.checkpoint.checkpoint`` calls by name on each call, newest torch first (private names: one
#: found is enough; with none, calls are not seen).
_CHECKPOINT_ENTRIES = (("_checkpoint_impl",), ("_checkpoint_without_reentrant_generator", "CheckpointFunction"))


@contextlib.contextmanager
def own_checkpoints() -> Iterator[list[str]]:
    """The ``torch.utils.checkpoint`` calls made inside the block, one entry each: the model's forward
    checkpointing parts of itself while it is captured. Seen through what ``checkpoint`` looks up by name when
    called, so a model importing ``checkpoint`` by name is seen too."""
    import torch.utils.checkpoint as module

    seen: list[str] = []
    names = next((names for names in _CHECKPOINT_ENTRIES if all(hasattr(module, n) for n in names)), ())
    originals = {name: getattr(module, name) for name in names}

    def seeing(name: str, original: Any) -> Any:
        if isinstance(original, type):  # an autograd.Function, called through .apply

            class Seen:
                @staticmethod
                def apply(*args: Any) -> Any:
                    seen.append(name)
                    INSIDE_OWN_CHECKPOINT[0] += 1
                    try:
                        return original.apply(*args)
                    finally:
                        INSIDE_OWN_CHECKPOINT[0] -= 1

            return Seen

        def call(*args: Any, **kwargs: Any) -> Any:
            seen.append(name)
            INSIDE_OWN_CHECKPOINT[0] += 1  # a reentrant one runs its function under no_grad
            try:
                return original(*args, **kwargs)
            finally:
                INSIDE_OWN_CHECKPOINT[0] -= 1

        return call

    with contextlib.ExitStack() as stack:
        for name, original in originals.items():
            stack.enter_context(replaced(module, name, seeing(name, original)))
        yield seen


def checked_for_host_draws(model: torch.nn.Module, capture_once: Callable[[], Capture]) -> Capture:
    """``capture_once()``, checked for draws from numpy's or Python's global random generator (the model's
    forward drawing while it is captured): a graph holds what was drawn as constants and repeats it at every
    call. Where the forward draws, it is captured once more from the generators as the first capture left
    them: the same graph (a LayerDrop at probability 0 draws and drops nothing) is kept, with a warning;
    another one is refused with :class:`TraceError`. The generators are left as they were."""
    before = _host_generator_states()
    captured = capture_once()
    drew = [name for name, b, a in zip(("random", "numpy.random"), before, _host_generator_states())
            if not _same_state(b, a)]
    if not drew:
        return captured
    try:
        again = capture_once()
    finally:
        _set_host_generator_states(before)
    source = f"{' and '.join(drew)}'s global generator"
    if not _same_graph(captured.gm, again.gm):
        raise TraceError(
            f"the forward of {type(model).__name__} draws random numbers from {source}, and two captures gave "
            "different graphs: a captured graph would hold the numbers drawn while capturing and repeat them at "
            "every call, where the model draws new ones. Draw them with torch (torch.rand, torch.bernoulli, "
            "torch.randperm), whose ops the graph records, or turn that random step off for training with fxplan")
    logger.warning("fxplan: the forward of %s draws from %s, but two captures gave the same graph, so what it "
                   "draws changes nothing planned; the rewritten module does not draw, so that generator's sequence "
                   "will differ from the model's", type(model).__name__, source)
    return captured


@contextlib.contextmanager
def host_generators_kept() -> Iterator[None]:
    """Python's and numpy's global random generators left as they were on the way in: for a step fxplan runs of
    the model's own forward, which may draw from them (the captured graph does not)."""
    before = _host_generator_states()
    try:
        yield
    finally:
        _set_host_generator_states(before)


def _host_generator_states() -> tuple[Any, Any]:
    numpy = sys.modules.get("numpy")
    return random.getstate(), numpy.random.get_state() if numpy is not None else None


def _set_host_generator_states(states: tuple[Any, Any]) -> None:
    random.setstate(states[0])
    if states[1] is not None:
        sys.modules["numpy"].random.set_state(states[1])


def _same_graph(a: fx.GraphModule, b: fx.GraphModule) -> bool:
    """The same code over equal constants (the model's own state is the same objects in both)."""
    if a.code != b.code:
        return False
    for node in a.graph.nodes:
        if node.op == "get_attr":
            x, y = operator.attrgetter(str(node.target))(a), operator.attrgetter(str(node.target))(b)
            if x is not y and not (isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor)
                                   and x.shape == y.shape and x.dtype == y.dtype and torch.equal(x, y)):
                return False
    return True


@contextlib.contextmanager
def tensor_hooks_refused(model: torch.nn.Module) -> Iterator[None]:
    """Raise :class:`TraceError` if the block (an export of ``model``) registers a hook on a tensor: torch.export
    does not record ``Tensor.register_hook``, so the gradient the hook changes would differ."""
    registered: list[bool] = []
    original = torch.Tensor.register_hook

    def register_hook(self: torch.Tensor, hook: Any) -> Any:
        registered.append(True)
        return original(self, hook)

    with replaced(torch.Tensor, "register_hook", register_hook):
        yield
    if registered:
        raise TraceError(f"the forward of {type(model).__name__} registers a hook on a tensor "
                         "(Tensor.register_hook), which torch.export does not record, so the gradients the hook "
                         "changes would differ (symbolic_trace cannot take the hook function either); remove the "
                         "hook to plan the model")


#: autograd.Function classes a capture may trace through: torch.library custom ops' (torch.export records the op,
#: whose registered autograd runs), and checkpoint's own (its backward recomputes).
TRANSPARENT_FUNCTIONS = ("torch.utils.checkpoint.", "torch._library.")


def _same_state(a: Any, b: Any) -> bool:
    """Equal generator states (numpy's hold an array)."""
    if isinstance(a, tuple) and isinstance(b, tuple):
        return len(a) == len(b) and all(_same_state(x, y) for x, y in zip(a, b))
    if hasattr(a, "shape"):
        return hasattr(b, "shape") and a.shape == b.shape and bool((a == b).all())
    return a == b
