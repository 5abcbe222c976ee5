"""The live-storage tracker: the bytes of every tensor storage a step holds, as it runs.

A ``TorchDispatchMode`` that sees every op output, records the untyped storage behind it (keyed by
``storage._cdata``, since fake storages have no data pointer) and forgets it when the storage dies
(``weakref.finalize``) or follows it when Python code resizes it in place (``UntypedStorage.resize_``: FSDP2
gathers a layer's parameters into storages it grows before the layer runs and shrinks to nothing after). A sharded
tensor (``DTensor``) counts as its local shard. Summing the bytes of live storages gives the same peak as the CPU
allocator, and under ``FakeTensorMode`` it gives that peak without allocating anything. What a kernel allocates
and frees inside itself (its scratch, :mod:`fxplan.measure.scratch`) is added while the op runs.
"""

from __future__ import annotations

import contextlib
import itertools
import weakref
from collections.abc import Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

try:
    from torch.distributed.tensor import DTensor
except ImportError:  # a torch built without distributed
    DTensor = ()

from fxplan.measure.scratch import METADATA_QUERIES, call_figures, charged_bytes, output_storages, storage_bytes

#: Categories of the breakdown, in display order.
CATEGORIES = ("parameters", "gathered parameters", "buffers", "inputs", "activations", "gradients",
              "backward temporaries", "kernel scratch")
BACKWARD, SCRATCH, GATHERED = "backward temporaries", "kernel scratch", "gathered parameters"


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The tensor whose storage a process holds for ``t``: a ``DTensor``'s local shard, else ``t``."""
    return t._local_tensor if isinstance(t, DTensor) else t


class _StorageResizes:
    """Reports in-place storage resizes (``UntypedStorage.resize_``, called from Python) to the trackers active
    now. The method is wrapped while at least one tracker is active and restored after the last one exits."""

    def __init__(self):
        self.trackers: list[StorageTracker] = []
        self._own = None

    def enter(self, tracker: StorageTracker) -> None:
        if not self.trackers:
            self._own = torch.UntypedStorage.__dict__.get("resize_")  # None where it is StorageBase's
            original = torch.UntypedStorage.resize_

            def resize_(storage, size):
                out = original(storage, size)
                for t in self.trackers:
                    t.resized(storage)
                return out

            torch.UntypedStorage.resize_ = resize_
        self.trackers.append(tracker)

    def exit(self, tracker: StorageTracker) -> None:
        self.trackers.remove(tracker)
        if not self.trackers:
            if self._own is None:
                del torch.UntypedStorage.resize_
            else:
                torch.UntypedStorage.resize_ = self._own


_RESIZES = _StorageResizes()


def count_as_host(t: torch.Tensor) -> None:
    """Count ``t``'s storage, a copy an offloaded value keeps in host memory, as host bytes in every tracker active
    now, apart from the device's: on the CPU host and device are one memory, and the copy would count twice."""
    for tracker in _RESIZES.trackers:
        tracker.move_to_host(t.untyped_storage())


class StorageTracker(TorchDispatchMode):
    """Counts the bytes of every live tensor storage and the running peak.

    Storages that exist before tracking starts (parameters, inputs, ...) are added with
    :meth:`register`. Every storage that an op creates while the mode is active is charged to the current
    ``phase`` (a category name) and released when it is freed. ``peak_breakdown`` is the per-category
    split of live bytes at the moment of the peak.
    """

    def __init__(self, phase: str = "activations", device: torch.device | None = None):
        super().__init__()
        self.phase = phase
        self.device = device  # where a storage that was not tracked but grows in place is charged
        self.current_bytes = 0
        self.peak_bytes = 0
        self.ops = 0  # ATen calls seen: the work of the step, whatever the machine's speed
        # storage key -> (bytes, category, serial); keys are addresses and get reused, serials never.
        self._live: dict[int, tuple[int, str, int]] = {}
        self._serials = itertools.count()
        self._by_category: dict[str, int] = {}
        self.peak_breakdown: dict[str, int] = {}
        self.timeline: list[tuple[str, int]] | None = None
        # Serials of backward-created storages live at the peak, to tell gradients from temporaries later.
        self._backward_live: set[int] = set()
        self.peak_backward_serials: frozenset[int] = frozenset()
        # Host copies of offloaded values (:func:`count_as_host`): not device bytes, counted on their own.
        self._host: dict[int, int] = {}
        self.host_bytes = 0
        self.host_peak_bytes = 0

    def __enter__(self):
        _RESIZES.enter(self)
        return super().__enter__()

    def __exit__(self, *exc):
        _RESIZES.exit(self)
        return super().__exit__(*exc)

    def resized(self, storage: torch.UntypedStorage) -> None:
        """Follow an in-place resize of ``storage``: a tracked one counts its new size; one that was not tracked
        and grew (FSDP2's unsharded parameters, made when the model was sharded) counts from now on as
        gathered parameters."""
        key = storage._cdata
        entry = self._live.get(key)
        if entry is None:
            if storage.nbytes():
                self._add(storage, GATHERED, charged_bytes(storage.nbytes(), self.device))
            return
        nbytes, category, serial = entry
        new = charged_bytes(storage.nbytes(), self.device)
        self._live[key] = (new, category, serial)
        self._by_category[category] += new - nbytes
        self.current_bytes += new - nbytes
        self._note_peak()

    def move_to_host(self, storage: torch.UntypedStorage) -> None:
        """Count ``storage`` (tracked or not) as host memory from now on, and no longer as the device's."""
        key = storage._cdata
        if key in self._host:
            return
        self._release(key)
        nbytes = storage.nbytes()
        self._host[key] = nbytes
        self.host_bytes += nbytes
        self.host_peak_bytes = max(self.host_peak_bytes, self.host_bytes)
        weakref.finalize(storage, self._release_host, key)

    def _release_host(self, key: int) -> None:
        self.host_bytes -= self._host.pop(key, 0)

    def register(self, tensor: torch.Tensor, category: str) -> None:
        """Count an existing tensor's storage under ``category`` (once per storage; of a DTensor, its shard)."""
        tensor = local_tensor(tensor)
        self._add(tensor.untyped_storage(), category, storage_bytes(tensor))

    def record_timeline(self) -> None:
        """Keep (op name, live bytes) after every op, for memory-timeline plots."""
        self.timeline = []

    def _add(self, storage: torch.UntypedStorage, category: str, nbytes: int) -> None:
        """Count ``storage`` as ``nbytes`` (what the device's allocator takes for it, the real kernel's size where a
        fake one differs: :mod:`fxplan.measure.scratch`)."""
        key = storage._cdata
        if key in self._live or key in self._host:
            return
        serial = next(self._serials)
        self._live[key] = (nbytes, category, serial)
        self._by_category[category] = self._by_category.get(category, 0) + nbytes
        self.current_bytes += nbytes
        if category == BACKWARD:
            self._backward_live.add(serial)
        weakref.finalize(storage, self._release, key)
        self._note_peak()

    def _note_peak(self, scratch: int = 0) -> None:
        """A new peak if the live bytes, with ``scratch`` a kernel holds beside them, exceed it."""
        if self.current_bytes + scratch > self.peak_bytes:
            self.peak_bytes = self.current_bytes + scratch
            self.peak_breakdown = {**self._by_category, SCRATCH: scratch} if scratch else dict(self._by_category)
            self.peak_backward_serials = frozenset(self._backward_live)

    def _release(self, key: int) -> None:
        entry = self._live.pop(key, None)
        if entry is not None:
            nbytes, category, serial = entry
            self.current_bytes -= nbytes
            self._by_category[category] -= nbytes
            self._backward_live.discard(serial)

    def live_entry(self, tensor: torch.Tensor) -> tuple[int, str, int] | None:
        """(bytes, category, serial) of a live tracked tensor's storage, or None."""
        return self._live.get(local_tensor(tensor).untyped_storage()._cdata)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.ops += 1
        if func in METADATA_QUERIES:
            return out
        figures = call_figures(func, args, kwargs)
        outputs = [local_tensor(t) for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        for storage, nbytes in output_storages(figures, outputs):
            self._add(storage, self.phase, nbytes)
        self._note_peak(figures.scratch)  # the kernel held it beside its outputs
        if self.timeline is not None:
            self.timeline.append((str(func.overloadpacket.__name__), self.current_bytes))
        return out


@contextlib.contextmanager
def track_memory(*existing: torch.Tensor, phase: str = "activations") -> Iterator[StorageTracker]:
    """Track live tensor storages inside the ``with`` block.

    ``existing`` tensors (e.g. parameters and inputs) are counted from the start. Read
    ``tracker.peak_bytes`` and ``tracker.current_bytes`` inside or after the block.
    """
    tracker = StorageTracker(phase)
    for t in existing:
        tracker.register(t, "inputs")
    with tracker:
        yield tracker
