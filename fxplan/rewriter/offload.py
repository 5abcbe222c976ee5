"""Offloaded values at run time: kept for backward in host memory, brought back before backward reads them.

A plan's offloaded values (``Plan.offloaded``, node names) are values the forward pass would keep on the device
until backward reads them. The generated code marks each one as it is computed (:func:`mark`, a call after the
node). While the planned forward runs, an :class:`OffloadSession` is the ``saved_tensors_hooks`` pair: a tensor that
autograd saves, or that a checkpointed segment keeps as its input, whose storage is a marked value's is copied to
host memory, and the forward's own reference is then the last one on the device, dropped after its last use as
usual. Backward's first read copies it back. The copy is of the whole storage, so the tensor autograd gets back has
the same size, strides and offset, and tensors that shared the storage share the copy: the values are copied, never
changed, and the gradients are bitwise the original's.

On a CUDA device the copies run on a side stream. The device-to-host copy waits for the op that made the value (an
event of the compute stream) and the allocator is told the side stream uses it (``record_stream``), so the forward
never waits for a copy. When backward reads a value, the value saved before it (the next that backward reads, in
the usual reverse order) is copied back at once, on the side stream, so that one copy runs behind each value's
backward; the compute stream waits only for the copy of the value it reads. On the CPU (and in a fake step) the
host is the same memory and the copies are plain copies: what the tests compare gradients on. The meter counts the
host copies apart from the device's bytes (:func:`fxplan.measure.tracker.count_as_host`).

Values of the model's parameters, buffers and inputs are never offloaded: they stay on the device whatever backward
reads, so a host copy would only add a second device copy when it comes back.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch.utils._pytree import tree_leaves

from fxplan.measure.tracker import count_as_host

_ACTIVE = threading.local()


def mark(value: Any, name: str = "") -> None:
    """Mark the storages of ``value``'s tensors (the value of node ``name``) as offloaded for the session of the
    forward pass running now. Outside such a forward (eval, no grad, a recomputation in backward) it does nothing."""
    session = getattr(_ACTIVE, "session", None)
    if session is not None:
        session.mark(value, name)


@contextlib.contextmanager
def recording() -> Iterator[list[tuple[str, int]]]:
    """The values offloaded in the ``with`` block: (node name, bytes of its host copy), in the order the forward
    saved them, each storage once. What the planner learns which marked values autograd really saves from."""
    records: list[tuple[str, int]] = []
    outer = getattr(_ACTIVE, "records", None)
    _ACTIVE.records = records
    try:
        yield records
    finally:
        _ACTIVE.records = outer


def _storage_key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


def _whole_storage(t: torch.Tensor) -> torch.Tensor | None:
    """A one-dimensional view of all of ``t``'s storage in ``t``'s dtype, or None where the storage's bytes are not a
    whole number of elements (views of another dtype on it). A view, not ``set_``: a fake tensor that ``set_`` put on
    a storage keeps the storage alive to the end of the fake mode."""
    n, rest = divmod(t.untyped_storage().nbytes(), t.element_size())
    return None if rest else t.as_strided((n,), (1,), 0)


class _HostCopy:
    """One device storage copied to host memory, and brought back once backward first reads it."""

    def __init__(self, source: torch.Tensor, session: OffloadSession):
        self.session = session
        self.device = source.device
        self.on_device: torch.Tensor | None = None
        self.read = False  # whether backward has read it yet (a prefetched copy is on the device before that)
        self.index = 0  # its place in the session's order of copies
        self.arrived: torch.cuda.Event | None = None
        stream = session.stream
        if stream is None:
            self.host = source.to("cpu", copy=True)
            count_as_host(self.host)
            return
        self.host = torch.empty(source.shape, dtype=source.dtype, device="cpu", pin_memory=True)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            self.host.copy_(source, non_blocking=True)
        source.record_stream(stream)

    def fetch(self) -> None:
        """Start copying the value back to the device (at once where there is no side stream)."""
        if self.on_device is not None:
            return
        stream = self.session.stream
        if stream is None:
            self.on_device = self.host.to(self.device, copy=True)
            return
        with torch.cuda.stream(stream):
            self.on_device = self.host.to(self.device, non_blocking=True)
            self.arrived = torch.cuda.Event()
            self.arrived.record(stream)

    def storage_on_device(self) -> torch.Tensor:
        """The value's whole storage on the device, for the compute stream to read now."""
        self.fetch()
        if self.arrived is not None:
            current = torch.cuda.current_stream(self.device)
            current.wait_event(self.arrived)
            self.on_device.record_stream(current)
            self.arrived = None
        return self.on_device


class _Offloaded:
    """What autograd keeps for one saved tensor on an offloaded storage: the host copy and the tensor's geometry."""

    __slots__ = ("copy", "size", "stride", "offset")

    def __init__(self, copy: _HostCopy, t: torch.Tensor):
        self.copy, self.size, self.stride, self.offset = copy, t.size(), t.stride(), t.storage_offset()


class OffloadSession:
    """The ``saved_tensors_hooks`` of one planned forward pass (module docstring). ``resident`` are the storage keys
    of tensors that outlive the step (parameters, buffers, inputs), which are never offloaded."""

    def __init__(self, resident: Iterable[torch.Tensor], device: torch.device):
        self.resident = {_storage_key(t) for t in resident}
        self.marked: dict[int, str] = {}  # storage key -> the node that marked it
        # by live storage, version and dtype; weak, so that a copy dies with the last saved tensor that needs it
        self.copies: weakref.WeakValueDictionary[tuple, _HostCopy] = weakref.WeakValueDictionary()
        self.order: list[weakref.ref[_HostCopy]] = []  # in the order the forward saved them
        real_cuda = device.type == "cuda" and torch.cuda.is_available()
        self.stream = torch.cuda.Stream(device) if real_cuda else None

    def mark(self, value: Any, name: str) -> None:
        for t in tree_leaves(value):
            if isinstance(t, torch.Tensor) and t.layout == torch.strided:
                key = _storage_key(t)
                if key not in self.resident and key not in self.marked:
                    self.marked[key] = name
                    # storage keys are addresses, reused once the storage dies: forget it then
                    weakref.finalize(t.untyped_storage(), self._forget, key)

    def _forget(self, key: int) -> None:
        self.marked.pop(key, None)
        for stale in [k for k in self.copies if k[0] == key]:
            del self.copies[stale]

    def pack(self, t: torch.Tensor) -> Any:
        key = _storage_key(t)
        if key not in self.marked:
            return t
        version = (key, t._version, t.dtype)  # a storage written in place since is copied again
        copy = self.copies.get(version)
        if copy is None:
            source = _whole_storage(t)
            if source is None:
                return t
            copy = _HostCopy(source, self)
            self.copies[version] = copy
            records = getattr(_ACTIVE, "records", None)
            if records is not None:
                records.append((self.marked[key], source.untyped_storage().nbytes()))
            copy.index = len(self.order)
            self.order.append(weakref.ref(copy))
        return _Offloaded(copy, t)

    def unpack(self, packed: Any) -> torch.Tensor:
        if not isinstance(packed, _Offloaded):
            return packed
        first_read = not packed.copy.read
        on_device = packed.copy.storage_on_device()
        if first_read:  # one prefetch per value backward reads, however many saved tensors share it
            packed.copy.read = True
            self._prefetch_before(packed.copy)
        return on_device.as_strided(packed.size, packed.stride, packed.offset)

    def _prefetch_before(self, copy: _HostCopy) -> None:
        """Start bringing back the nearest value saved before ``copy`` that is not back yet: backward reads the
        values in about the reverse of the order the forward saved them."""
        for ref in reversed(self.order[:copy.index]):
            earlier = ref()
            if earlier is not None and earlier.on_device is None:
                earlier.fetch()
                return

    @contextlib.contextmanager
    def active(self) -> Iterator[OffloadSession]:
        """The hooks and :func:`mark` in effect for the ``with`` block (one forward pass)."""
        outer = getattr(_ACTIVE, "session", None)
        _ACTIVE.session = self
        try:
            with torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack):
                yield self
        finally:
            _ACTIVE.session = outer


def session_for(resident: Iterable[torch.Tensor], device: torch.device) -> contextlib.AbstractContextManager:
    """A new :class:`OffloadSession`, active for the ``with`` block."""
    return OffloadSession(resident, device).active()
