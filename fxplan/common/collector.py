"""Keeping Python's cyclic garbage collector off fxplan's critical path.

A full (generation 2) collection walks every object the process tracks: with torch loaded that is
hundreds of thousands. Measured with ``gc.callbacks`` (docs/planner.md, "Planning time"): about half the
rewrites of ResNet-50, DenseNet-161 or GPT-2 at half their peak ran one, of 0.2-0.4 s (a fake step is
0.2-0.9 s there; 0.01-0.04 s with the objects alive at entry frozen), and one DP solve at 10,000 nodes one
of 0.1 s. (A 10,000-node rewrite still spends about 3 s in 16 full collections of what it allocates itself.)

* :func:`paused`: the collector off for work that creates no reference cycles worth collecting (the DP
  solves: numpy arrays, lists and ints, freed by reference counting as usual).
* :func:`spared`: the objects that exist when the work starts (the model, torch's own) frozen out of
  collections (``gc.freeze``) and unfrozen after, so collections during the work walk only what it
  allocates and still free its cycles (a rewrite builds and drops a module per candidate measured).
  Skipped where something froze objects before (a forking server's ``gc.freeze()`` is left as it was).

Both leave the collector as they found it, on error too, and nest.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator

_frozen_by_us = False


@contextlib.contextmanager
def paused() -> Iterator[None]:
    """The cyclic collector disabled inside the block (if it was enabled), enabled again after."""
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


@contextlib.contextmanager
def spared() -> Iterator[None]:
    """The objects alive at entry kept out of collections inside the block (module docstring)."""
    global _frozen_by_us
    if _frozen_by_us or not gc.isenabled() or gc.get_freeze_count():
        yield
        return
    gc.freeze()
    _frozen_by_us = True
    try:
        yield
    finally:
        gc.unfreeze()
        _frozen_by_us = False
