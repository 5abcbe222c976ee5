"""What a block of ATen ops costs and allocates, counted in one dispatch mode.

:mod:`fxplan.costs.trace` runs each node of the captured graph once on fake tensors under :class:`NodeCensus`,
which records in one pass what the cost graph needs of the node's forward: its FLOPs (the formulas of
``torch.utils.flop_counter``), the ops it runs and the bytes they move (:func:`op_traffic`),
the buffers it writes in place (:func:`fxplan.capture.effects.written_arguments`) and the most bytes of new storages
it holds at once (:class:`NewStorages`). One mode instead of a stack of four: each mode a dispatch passes
through costs Python time per op, and the trace runs every op of the model under them.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.flop_counter import flop_registry

from fxplan.capture.effects import written_arguments
from fxplan.measure.scratch import Figures, call_figures, output_storages, storage_bytes


def op_kind(func: Any, args: tuple) -> str:
    """What an ATen op is for pricing: its name, with its boolean arguments where it has any (a BatchNorm's
    ``training`` selects another kernel than evaluation's)."""
    flags = [a for a in args if isinstance(a, bool)]
    name = func._overloadpacket.__name__
    return f"{name}{flags}" if flags else name


def op_traffic(inputs: list[torch.Tensor], written: list[torch.Tensor], outputs: list[torch.Tensor]) -> int:
    """The bytes one ATen op moves: its tensor ``inputs`` plus what it writes (``outputs`` on new storages,
    and the arguments it writes in place, ``written``). A pure view (outputs alias an input, nothing
    written) moves nothing."""
    in_keys = {t.untyped_storage()._cdata for t in inputs}
    fresh = [t for t in outputs if t.untyped_storage()._cdata not in in_keys]
    if not fresh and not written:
        return 0
    return sum(_nbytes(t) for t in [*inputs, *fresh, *written])


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def tensors(value) -> list[torch.Tensor]:
    """The tensors in ``value`` (any nesting of containers), in pytree order."""
    if isinstance(value, torch.Tensor):
        return [value]
    if type(value) in (tuple, list):  # the common case (op arguments), without pytree's generality
        found: list[torch.Tensor] = []
        for item in value:
            if isinstance(item, torch.Tensor):
                found.append(item)
            elif item is not None and not isinstance(item, (int, float, bool, str)):
                found += tensors(item)
        return found
    return [t for t in tree_leaves(value) if isinstance(t, torch.Tensor)]


def buffer_names(module: torch.nn.Module) -> dict[int, tuple[str, ...]]:
    """The names of ``module``'s buffers by storage (``_cdata``), every name of a shared buffer: what
    :class:`NodeCensus` reports writes by."""
    names: dict[int, tuple[str, ...]] = {}
    for name, b in module.named_buffers(remove_duplicate=False):
        key = b.untyped_storage()._cdata
        names[key] = (*names.get(key, ()), name)
    return names


class NewStorages(TorchDispatchMode):
    """The most bytes live at once inside the ``with`` block beyond those live when it began (``peak_bytes``):
    storages it creates, less those made before it that it frees; a view of a tensor made before it (an
    op's output sharing an input's storage) is not new."""

    def __init__(self):
        super().__init__()
        self.current = self.peak_bytes = 0
        self._live: dict[int, int] = {}
        self._old: set[int] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self._note_old(tensors((args, kwargs)))
        out = func(*args, **kwargs)
        self._note_call(func, args, kwargs, tensors(out))
        return out

    def _note_call(self, func, args: tuple, kwargs: dict, outputs: list[torch.Tensor]) -> None:
        """The op's outputs, at the real kernel's sizes, and the scratch its kernel held beside them
        (:mod:`fxplan.measure.scratch`)."""
        figures = call_figures(func, args, kwargs)
        self._note_new(outputs, figures)
        self.peak_bytes = max(self.peak_bytes, self.current + figures.scratch)

    def _note_old(self, inputs: list[torch.Tensor]) -> None:
        for t in inputs:
            storage = t.untyped_storage()
            key = storage._cdata
            if key not in self._live and key not in self._old:
                self._old.add(key)
                weakref.finalize(storage, self._release_old, key, storage_bytes(t))

    def _note_new(self, outputs: list[torch.Tensor], figures: Figures) -> None:
        for storage, nbytes in output_storages(figures, outputs):
            key = storage._cdata
            if key not in self._live and key not in self._old:
                self._live[key] = nbytes
                self.current += nbytes
                self.peak_bytes = max(self.peak_bytes, self.current)
                weakref.finalize(storage, self._release, key)

    def _release(self, key: int) -> None:
        self.current -= self._live.pop(key, 0)

    def _release_old(self, key: int, nbytes: int) -> None:
        # a storage made before the block and freed in it (a saved tensor let go of mid-backward) lowers
        # the total, and its address may then be reused by a new one
        self._old.discard(key)
        self.current -= nbytes


class NodeCensus(NewStorages):
    """:class:`NewStorages`, and the FLOPs, ops, bytes moved (in all and per op kind) and buffers written of
    the ops run under it.

    ``buffer_names`` maps a storage (``_cdata``) to the names of the buffers on it; ``written`` lists those
    written, in the order first written; ``written_storages`` holds every storage written in place. FLOPs
    are counted as ``torch.utils.flop_counter.FlopCounterMode`` counts them: an op that decomposes is
    counted through the ops it decomposes into.
    """

    def __init__(self, buffer_names: dict[int, tuple[str, ...]]):
        super().__init__()
        self.buffer_names = buffer_names
        self.flops = self.bytes_moved = self.ops = 0
        self.op_bytes: dict[str, int] = {}  # bytes moved per op kind (:func:`op_kind`)
        self.written: list[str] = []
        self.written_storages: set[int] = set()  # every storage written in place (``_cdata``)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        inputs = tensors((args, kwargs))
        self._note_old(inputs)
        written = tensors(written_arguments(func, args, kwargs))
        for t in written:
            self.written_storages.add(t.untyped_storage()._cdata)
            for name in self.buffer_names.get(t.untyped_storage()._cdata, ()):
                if name not in self.written:
                    self.written.append(name)
        out = _counting_flops(self, func, args, kwargs)
        outputs = tensors(out)
        self._note_call(func, args, kwargs, outputs)
        self.ops += 1
        moved = op_traffic(inputs, written, outputs)
        self.bytes_moved += moved
        kind = op_kind(func, args)
        self.op_bytes[kind] = self.op_bytes.get(kind, 0) + moved
        return out


class _FlopsOnly(TorchDispatchMode):
    """Counts into ``census.flops`` the FLOPs of the ops an op decomposes into (:func:`_counting_flops`)."""

    def __init__(self, census: NodeCensus):
        super().__init__()
        self.census = census

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return _counting_flops(self.census, func, args, kwargs or {})


def _counting_flops(census: NodeCensus, func, args: tuple, kwargs: dict):
    """Run ``func``, adding its FLOPs to ``census.flops``; through the ops it decomposes into where it has a
    decomposition (``FlopCounterMode`` tries that first, whether or not the op has a formula)."""
    if _decomposes(func):
        with _FlopsOnly(census):
            out = func.decompose(*args, **kwargs)
        if out is not NotImplemented:
            return out
    out = func(*args, **kwargs)
    formula = flop_registry.get(func._overloadpacket)
    if formula is not None:
        census.flops += formula(*args, **kwargs, out_val=out)
    return out


_DECOMPOSES: dict = {}


def _decomposes(func) -> bool:
    """Whether ``func.decompose`` may do anything: the op has a CompositeImplicitAutograd kernel."""
    if func not in _DECOMPOSES:
        key = torch._C.DispatchKey.CompositeImplicitAutograd
        _DECOMPOSES[func] = func is not torch.ops.prim.device.default and (
            key in func.py_kernels or torch._C._dispatch_has_kernel_for_dispatch_key(func.name(), key))
    return _DECOMPOSES[func]


class _Count:
    flops = 0


def call_cost(func, args: tuple, kwargs: dict) -> tuple[Any, int, int]:
    """Run one ATen call: its output, its FLOPs (counted as :class:`NodeCensus` counts them) and the bytes it
    moves (:func:`op_traffic`), the quantities :meth:`fxplan.costs.timecost.DeviceSpeed.seconds` prices."""
    count = _Count()
    inputs = tensors((args, kwargs))
    written = tensors(written_arguments(func, args, kwargs))
    out = _counting_flops(count, func, args, kwargs)
    return out, count.flops, op_traffic(inputs, written, tensors(out))
