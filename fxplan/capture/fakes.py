"""Fake copies of models and inputs: measure, trace and capture a step without allocating anything.

Shared by :mod:`fxplan.measure.meter`, :mod:`fxplan.costs.trace`, :mod:`fxplan.planner.step_model` and
:mod:`fxplan.capture.capturers` (``torch.export`` runs on a fake copy), so none of them needs another for this.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import gc
import sys
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch._subclasses.fake_impls import _is_tensor_constructor
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensor,
    FakeTensorMode,
)
from torch._subclasses.meta_utils import is_sparse_any
from torch.utils._mode_utils import no_dispatch
from torch.utils._pytree import tree_leaves
from torch.utils.weak import WeakIdKeyDictionary

from fxplan.errors import FxplanError, user_frame

_kept_real_depth = 0
_scanned: list[functools._lru_cache_wrapper] = []  # the caches the last scan of caches_kept_real found
_LEFT_ALONE = frozenset(sys.stdlib_module_names) | {"fxplan", "torch", "torchgen", "triton", "sympy", "numpy",
                                                    "networkx"}


@contextlib.contextmanager
def caches_kept_real() -> Iterator[None]:
    """On the way out, clear every ``functools.lru_cache`` that gained entries inside the block.

    fxplan runs the model's Python on fake tensors, and a cache outside the model (a static method under
    ``lru_cache``, as Hugging Face's BEiT makes its relative position index) would keep a fake tensor made
    there and hand it to the user's next real step. A cache is pure by contract, so clearing it is safe; those of
    fxplan, torch, the standard library and the libraries torch computes with are left alone (they keep no model's
    tensors, and some hand out objects whose identity matters). Only the outermost block looks, and scans the heap
    once, on the way out (~0.1 s): a cache the previous scan found is cleared if it missed since the way in, any
    other if it holds entries.
    """
    global _kept_real_depth
    if _kept_real_depth:
        yield
        return
    misses = {id(cache): (cache, cache.cache_info().misses) for cache in _scanned}
    _kept_real_depth += 1
    try:
        yield
    finally:
        _kept_real_depth -= 1
        _scanned[:] = _lru_caches()
        for cache in _scanned:
            before, info = misses.get(id(cache)), cache.cache_info()
            if info.currsize if before is None else info.misses != before[1]:
                cache.cache_clear()


def _lru_caches() -> list[functools._lru_cache_wrapper]:
    """The ``lru_cache`` wrappers alive outside the packages left alone."""
    caches = [o for o in gc.get_objects() if type(o) is functools._lru_cache_wrapper]  # type(): no proxy runs
    return [c for c in caches if (getattr(c, "__module__", None) or "").partition(".")[0] not in _LEFT_ALONE]


def has_fake(model: torch.nn.Module, inputs) -> bool:
    """True if a parameter or an input is a fake tensor."""
    tensors = [*model.parameters(), *tree_leaves(inputs)]
    return any(isinstance(t, FakeTensor) for t in tensors)


def fake_mode_of(model: torch.nn.Module, inputs) -> FakeTensorMode:
    """The fake mode already used by the model or inputs, or a new one."""
    for t in [*tree_leaves(inputs), *model.parameters(), *model.buffers()]:
        if isinstance(t, FakeTensor):
            return t.fake_mode
    # Real tensors met while measuring (labels a loss_fn closes over, masks) are converted, not refused.
    return FakeMode(allow_non_fake_inputs=True)


def _grouped_mm_output(mat_a: torch.Tensor, mat_b: torch.Tensor, offs: torch.Tensor | None = None,
                       bias: torch.Tensor | None = None, out_dtype: torch.dtype | None = None):
    """(shape, dtype, device) of ``aten._grouped_mm`` where PyTorch's meta kernel refuses the call and the CPU
    kernel runs it (float32: transformers' mixture-of-experts layers, Mixtral and Qwen2-MoE, call it so on the
    CPU); None where the meta kernel applies. The CPU kernel's output is contiguous."""
    if mat_a.dtype in (torch.bfloat16, torch.float16):
        return None
    shapes = {(2, 3): (mat_a.shape[0], mat_b.shape[-1]),                    # tokens x experts' weights
              (3, 3): (mat_a.shape[0], mat_a.shape[1], mat_b.shape[-1]),    # batched
              (2, 2): ((offs.shape[0] if offs is not None else 1), mat_a.shape[0], mat_b.shape[-1]),  # over K
              (3, 2): (mat_a.shape[1], mat_b.shape[-1])}                    # over N
    shape = shapes.get((mat_a.dim(), mat_b.dim()))
    return None if shape is None else (shape, out_dtype or mat_a.dtype, mat_a.device)


# ATen ops whose real kernels take calls their fake kernels refuse: the op, and the output it gives then
_MISSING_FAKE_KERNELS = {torch.ops.aten._grouped_mm.default: _grouped_mm_output}


#: The most elements of a tensor whose values a fake step knows (:class:`FakeMode`): enough for lists of dimensions,
#: shapes and class indices, small enough that computing them for real costs nothing.
KNOWN_VALUES_LIMIT = 1024


class FakeMode(FakeTensorMode):
    """The fake tensor mode fxplan makes: PyTorch's, with the fake kernels it lacks for calls its real kernels
    run (:data:`_MISSING_FAKE_KERNELS`), and the values of small tensors built from shapes and constants alone.
    Fake tensors of a mode the caller made are measured in that mode.

    A tensor a factory op makes on the CPU from numbers (``torch.arange(2, x.dim())``, ``torch.tensor([1, 2])``,
    ``torch.ones(3)``), with no more than :data:`KNOWN_VALUES_LIMIT` elements, is made for real as well and kept as
    the fake tensor's ``constant``; PyTorch's fake mode then computes every op whose tensor inputs all have constants
    for real, so ``.tolist()`` and ``.item()`` of such a tensor (MONAI's ``DiceCELoss`` reduces over
    ``torch.arange(2, len(input.shape)).tolist()``) give the values the real step gets. Random and uninitialized
    factories (``randn``, ``empty``) are not evaluated, nor is anything computed from a model's inputs, parameters or
    buffers (they have no constant): an ``.item()`` of those still raises, and fxplan refuses it
    (:func:`data_dependent_error`). PyTorch keeps constants of one element only (``CONSTANT_NUMEL_LIMIT``); writing
    into a constant with a value it does not know forgets the constant, as PyTorch does."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # real tensor -> its fake, kept while the real one lives (see validate_and_convert_non_fake_tensors)
        self._converted = WeakIdKeyDictionary()

    def validate_and_convert_non_fake_tensors(self, func, converter, flat_args, args_spec):
        """PyTorch's conversion of the real tensors an op meets (labels a loss closes over), each fake kept alive
        while the real one is: its caller holds the real tensor through the step and after it, so its storage stays
        allocated on a real step, where a fake one only the step's autograd graph held would be freed with it."""
        converted = super().validate_and_convert_non_fake_tensors(func, converter, flat_args, args_spec)
        for real, fake in zip(flat_args, converted[0]):
            if fake is not real and isinstance(real, torch.Tensor) and not isinstance(real, FakeTensor):
                self._converted[real] = fake
        return converted

    def may_turn_const(self, t: torch.Tensor) -> bool:
        return t.numel() <= KNOWN_VALUES_LIMIT and not is_sparse_any(t) and not self.is_our_fake(t) \
            and t.device.type != "meta"

    def dispatch(self, func, types, args=(), kwargs=None):
        fill = _MISSING_FAKE_KERNELS.get(func)
        output = fill(*args, **(kwargs or {})) if fill is not None else None
        if output is None:
            out = super().dispatch(func, types, args, kwargs)
            return self._with_value(func, args, kwargs or {}, out) if _is_known_factory(func) else out
        shape, dtype, device = output
        return self.fake_tensor_converter.from_meta_and_device(self, torch.empty(shape, dtype=dtype, device="meta"),
                                                               device)

    def _with_value(self, func, args, kwargs, out):
        """``out``, the fake output of a factory call, made for real with its value kept where it is small and on
        the CPU (:class:`FakeMode`)."""
        if not isinstance(out, FakeTensor) or out.device.type != "cpu" or out.numel() > KNOWN_VALUES_LIMIT \
                or kwargs.get("pin_memory") or out.layout != torch.strided:
            return out
        with no_dispatch():
            real = func(*args, **kwargs)
        return self.fake_tensor_converter.from_real_tensor(self, real, make_constant=True)


@functools.cache
def _is_known_factory(func) -> bool:
    """True for an ATen factory op (no tensor argument, one tensor out) that is neither random nor uninitialized."""
    return isinstance(func, torch._ops.OpOverload) and _is_tensor_constructor(func) \
        and torch.Tag.nondeterministic_seeded not in func.tags and "empty" not in func.__name__


def fake_copy(model: torch.nn.Module, fake_mode: FakeTensorMode) -> torch.nn.Module:
    """A private copy of ``model`` whose parameters and buffers are fake tensors of ``fake_mode``.

    The copy has the same structure (and, for a GraphModule, the same graph and node names), and the
    parameters' ``.grad``, where set, as fake tensors too; ``torch.Generator`` attributes are shared (a fake
    step does not draw from them, and a capture must record the model's own). Nothing real is allocated. A model that is
    fake already gets new fake tensors of the same shapes (``copy.deepcopy`` of a fake tensor would
    put it in a new fake mode, which cannot be mixed with the inputs').
    """
    memo: dict[int, Any] = {}
    attributes = tensor_attributes(model)
    tensors = {id(t): t for t in [*model.parameters(), *model.buffers(), *attributes]}
    tensors.update({id(p.grad): p.grad for p in model.parameters() if p.grad is not None})
    alone = _alone_on_storage(tensors.values())
    for p in model.parameters():
        if id(p) not in memo:
            fake = _fake_parameter(p, fake_mode, id(p) in alone)
            if p.grad is not None:
                fake.grad = _fresh(p.grad, fake_mode, id(p.grad) in alone)
            memo[id(p)] = fake
    for b in _made_up_constants(model):  # their values known to the fake step (FakeMode), as in eager code
        if id(b) not in memo:
            memo[id(b)] = fake_mode.fake_tensor_converter.from_real_tensor(fake_mode, b, make_constant=True)
    for b in [*model.buffers(), *attributes]:
        if id(b) not in memo:
            memo[id(b)] = _fresh(b, fake_mode, id(b) in alone)
    for m in model.modules():  # a generator the model draws from by argument is the model's own, not a copy
        for value in vars(m).values():
            if isinstance(value, torch.Generator):
                memo[id(value)] = value
    return model_copy(model, memo)


def tensor_attributes(model: torch.nn.Module) -> list[torch.Tensor]:
    """The tensors ``model``'s modules hold as plain attributes, neither parameters nor buffers (the constants of a
    rewritten module, a tensor a user keeps on a module): state a step starts with, like buffers, which fake copies
    convert and meters count as there before the step. Tensors computed from parameters (``weight_norm``'s weight)
    are left out: they are made again in each step."""
    found: dict[int, torch.Tensor] = {}
    for m in model.modules():
        for value in vars(m).values():
            if isinstance(value, torch.Tensor) and not isinstance(value, torch.nn.Parameter) and value.is_leaf:
                found.setdefault(id(value), value)
    return list(found.values())


def _made_up_constants(model: torch.nn.Module) -> list[torch.Tensor]:
    """The small real CPU tensors a capture made up from the values of the model's Python (``torch.export`` lifts
    ``torch.tensor(x.shape)`` in a forward to a constant; ``_fxplan_constants`` names them): a fake copy keeps their
    values, so an ``.item()`` of them in the graph gives what eager code gets (:class:`FakeMode`)."""
    found = []
    for m in model.modules():
        for name in m.__dict__.get("_fxplan_constants", ()):
            t = getattr(m, name, None)
            if isinstance(t, torch.Tensor) and not isinstance(t, FakeTensor) and t.device.type == "cpu" \
                    and t.layout == torch.strided and t.numel() <= KNOWN_VALUES_LIMIT:
                found.append(t)
    return found


def model_copy(model: torch.nn.Module, memo: dict[int, Any] | None = None) -> torch.nn.Module:
    """``copy.deepcopy(model, memo)``, or an :class:`FxplanError` naming the tensor attribute that cannot be
    copied: a tensor computed from parameters and kept on a module (the old ``torch.nn.utils.weight_norm`` and
    ``spectral_norm`` keep ``weight`` so), which ``deepcopy`` refuses with a RuntimeError of its own."""
    try:
        return copy.deepcopy(model, memo)
    except RuntimeError as exc:
        computed = [f"{name or type(model).__name__}.{attr}" for name, m in model.named_modules()
                    for attr, value in vars(m).items()
                    if isinstance(value, torch.Tensor) and not value.is_leaf]
        if not computed or "deepcopy" not in str(exc):
            raise
        raise FxplanError(
            f"fxplan copies the model to trace and measure it, and {', '.join(computed[:3])} "
            f"{'is a tensor' if len(computed) == 1 else 'are tensors'} computed from parameters and kept on the "
            "module, which copy.deepcopy refuses (torch.nn.utils.weight_norm and spectral_norm keep the weight "
            "so). Use torch.nn.utils.parametrizations.weight_norm / spectral_norm instead, which fxplan plans "
            "exactly") from exc


def _fake_parameter(p: torch.Tensor, fake_mode: FakeTensorMode, alone: bool) -> torch.Tensor:
    """A fake parameter like ``p``: what ``nn.Parameter(fake)`` returns for a tensor subclass (the fake tensor
    itself, flagged as a parameter), without the detach through the fake mode it makes on the way (on a
    10,000-node model with 12,000 parameters, about 2 s of the trace)."""
    fake = _fresh(p.detach(), fake_mode, alone).requires_grad_(p.requires_grad)
    fake._is_param = True  # as nn.Parameter.__new__ marks a subclass instance; isinstance(fake, Parameter) holds
    return fake


def _fresh(t: torch.Tensor, fake_mode: FakeTensorMode, alone: bool = False) -> torch.Tensor:
    """A fake tensor of ``fake_mode`` like ``t`` (real or fake), sharing nothing with it. A fake one, or a real one
    ``alone`` on its storage (:func:`_alone_on_storage`), is made new of its shape and strides; any other real one
    is converted (``from_tensor``, which keeps views of one storage on one fake storage, as the meters count them,
    at ~0.6 ms a tensor: 2 s of a 3,000-node model's 3,600 parameters)."""
    if isinstance(t, FakeTensor) or alone:
        with fake_mode:
            return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device)
    return fake_mode.from_tensor(t)


def _alone_on_storage(tensors: Iterable[torch.Tensor]) -> set[int]:
    """The ids of the plain strided tensors among ``tensors`` (real, not on the meta device) that are the only one on
    their storage and span all of it, so that a new tensor of the same shape and strides has a storage of the same
    bytes."""
    on_storage: dict[int, list[torch.Tensor]] = {}
    for t in tensors:
        if not isinstance(t, FakeTensor) and t.layout == torch.strided:
            on_storage.setdefault(t.untyped_storage()._cdata, []).append(t)
    alone = set()
    for group in on_storage.values():
        t = group[0]
        if len(group) == 1 and type(t) in (torch.Tensor, torch.nn.Parameter) and t.device.type != "meta" \
                and not t.is_quantized and t.storage_offset() == 0 \
                and t.untyped_storage().nbytes() == t.numel() * t.element_size():
            alone.add(id(t))
    return alone


def without_values(inputs: Any) -> Any:
    """``inputs`` with the values of their fake tensors forgotten: inputs a fake mode made (the command line's, from
    ``torch.ones`` or ``torch.arange``) are data a step must not decide on (:class:`FakeMode`). Returns ``inputs``."""
    for t in tree_leaves(inputs):
        if isinstance(t, FakeTensor):
            t.constant = None
    return inputs


def to_fake(inputs: Any, fake_mode: FakeTensorMode) -> Any:
    """``inputs`` (any nesting of tuples, lists, dicts) with every real tensor converted to a fake one of
    ``fake_mode`` (others unchanged); a tuple stays a tuple."""

    def convert(x):
        if isinstance(x, FakeTensor) or not isinstance(x, torch.Tensor):
            return x
        return fake_mode.from_tensor(x)

    return torch.utils._pytree.tree_map(convert, inputs)


#: What fake tensors raise at an op whose output's size or value depends on its inputs' values.
DATA_DEPENDENT = (DataDependentOutputException, DynamicOutputShapeException)


def data_dependent_error(exc: Exception, what: str, error: type[FxplanError] = FxplanError) -> FxplanError:
    """The error to raise when ``what`` (a step, a graph's run) stopped at a data-dependent op (``exc``, one of
    :data:`DATA_DEPENDENT`): fxplan measures and plans on fake tensors, which hold no values."""
    op = getattr(exc, "func", None) or type(exc).__name__
    return error(
        f"{what} cannot run on fake tensors{user_frame(exc)}: {op} makes an output whose size or value depends on the "
        "values of its inputs (a boolean-mask index or assignment, nonzero, .item(), ...), and fake tensors hold "
        "shapes, not values. fxplan measures and plans on fake tensors, so it cannot plan this model as written; an op "
        "of fixed output size in its place lets it (h[mask] = v -> torch.where(mask[..., None], v, h); a loss "
        "over h[mask] -> one over h weighted by the mask). fxplan.measure_step(..., fake=False) measures the "
        "step on real tensors.")


def refusing_data_dependent(fn):
    """``fn(model, ...)`` (an entry point: ``fxplan.rewrite``, ``plan``, ``min_budget_bytes``, ``auto_checkpoint``)
    with a data-dependent op met on fake tensors anywhere inside (the capture, the trace, the loss probed, a step
    measured) raised as :func:`data_dependent_error`, naming the user's line, instead of PyTorch's own exception."""

    @functools.wraps(fn)
    def entry_point(model, *args, **kwargs):
        try:
            return fn(model, *args, **kwargs)
        except DATA_DEPENDENT as exc:
            raise data_dependent_error(exc, f"one training step of {type(model).__name__}") from exc

    return entry_point
