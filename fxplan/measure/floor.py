"""The physical floor of a training step: the least peak any recomputation plan could reach.

Whatever a plan drops and recomputes, it runs the same ops as a plain step (some of them more than
once), and each op needs all its operands and results live at once: a forward op its inputs and
output, a backward op the values it saved, the gradient arriving and the gradients it produces. Beside
that working set, some storages exist for the whole step or from their creation on, under every plan:

* parameters, buffers, inputs and gradients the model already holds (from the start);
* the gradients of the parameters, from the op that creates them to the end of the step;
* the model's output and the loss, which the training loop holds until backward is done
  (``out = model(x); loss = loss_fn(out); loss.backward()``, the step :func:`fxplan.measure_step`
  measures).

An op's working set includes its kernel's scratch (:mod:`fxplan.measure.scratch`): what the kernel allocates and
frees inside itself is live beside its operands under every plan too (oneDNN's convolution backward on a
CPU, cuDNN's workspaces on CUDA).

:func:`physical_floor` runs one plain step on fake tensors (nothing is allocated) under a dispatch mode
that sees every ATen op, and returns the largest sum over the ops of (working set + what is held at that
op), counting every storage once, as the meter does. No plan of the same ops can peak below it; a plan's
measured peak divided by the floor says how much room recomputation has left.

The held gradients are those created before the op *in the plain step's order*; a plan keeps the
backward order of the autograd engine on chain-like networks, so this is the floor for those; on graphs
where a plan changes the order of independent backward branches the floor is a close estimate.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from fxplan.capture.capturers import as_call
from fxplan.capture.fakes import fake_copy, fake_mode_of, tensor_attributes, to_fake
from fxplan.common.console import format_bytes
from fxplan.errors import FxplanError
from fxplan.measure.meter import default_loss, existing_grads, fresh_autocast_cache
from fxplan.measure.scratch import scratch_bytes, storage_bytes


@dataclass
class Floor:
    """The physical floor of one step (bytes) and where it is reached.

    ``resident_bytes``: parameters, buffers, inputs, existing gradients; ``op_bytes``: the working set
    of the op at the floor (its operands and results, resident storages excluded, and its kernel's
    scratch, also given alone as ``scratch_bytes``); ``held_bytes``: the parameter gradients, output and
    loss already created by then and not operands of that op.
    """

    bytes: int
    resident_bytes: int
    op_bytes: int
    held_bytes: int
    op: str
    backward: bool
    scratch_bytes: int = 0

    def describe(self) -> str:
        phase = "backward" if self.backward else "forward"
        return (f"{format_bytes(self.bytes)} at {self.op} ({phase}): {format_bytes(self.op_bytes)} of operands "
                f"and results ({format_bytes(self.scratch_bytes)} of it kernel scratch), "
                f"{format_bytes(self.held_bytes)} of gradients/output held, "
                f"{format_bytes(self.resident_bytes)} resident")


class _OpWorkingSets(TorchDispatchMode):
    """Records, per ATen op, the storages of its operands and results (key -> bytes), its kernel's scratch,
    and the op that created each storage."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple[str, bool, dict[int, int], int]] = []
        self.backward = False
        self.created: dict[int, int] = {}  # storage key -> index of the op that created it (latest)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        working: dict[int, int] = {}
        for leaf in tree_leaves((args, kwargs)):
            if isinstance(leaf, torch.Tensor):
                working[leaf.untyped_storage()._cdata] = storage_bytes(leaf)
        for leaf in tree_leaves(out):
            if isinstance(leaf, torch.Tensor):
                key = leaf.untyped_storage()._cdata
                if key not in working:
                    self.created[key] = len(self.ops)
                working[key] = storage_bytes(leaf)
        self.ops.append((str(func), self.backward, working, scratch_bytes(func, args, kwargs or {})))
        return out


def physical_floor(model: torch.nn.Module, example_inputs: Sequence[Any], *,
                   loss_fn: Callable[[Any], torch.Tensor] | None = None) -> Floor:
    """The least peak (bytes) of one training step of ``model`` that any recomputation plan can reach.

    Same step and counting as :func:`fxplan.measure_step` (module docstring); run on fake tensors, so
    nothing is allocated and the caller's model is untouched.
    """
    if not isinstance(model, torch.nn.Module):
        raise FxplanError(f"physical_floor needs an nn.Module, got {type(model).__name__}")
    loss_fn = loss_fn or default_loss
    call = as_call(example_inputs)
    inputs = (call.args, call.kwargs)
    fake_mode = fake_mode_of(model, inputs)
    fm, fi = fake_copy(model, fake_mode), to_fake(inputs, fake_mode)
    rec = _OpWorkingSets()
    with fake_mode:
        resident: dict[int, int] = {}
        for t in [*fm.parameters(), *fm.buffers(), *tensor_attributes(fm), *existing_grads(fm), *tree_leaves(fi)]:
            if isinstance(t, torch.Tensor):
                resident[t.untyped_storage()._cdata] = storage_bytes(t)
        with fresh_autocast_cache(), rec:
            out = fm(*fi[0], **fi[1])
            loss = loss_fn(out)
            rec.backward = True
            loss.backward()
        held = [t for t in [*tree_leaves(out), loss] if isinstance(t, torch.Tensor)]
        held += [p.grad for p in fm.parameters() if p.grad is not None]
        # storages created during the step and held from creation on: (key, bytes, index of creation)
        held_since = {}
        for t in held:
            key = t.untyped_storage()._cdata
            if key not in resident and key in rec.created:
                held_since[key] = (storage_bytes(t), rec.created[key])
        del out, loss, held
    base = sum(resident.values())
    best: Floor | None = None
    for i, (name, backward, working, scratch) in enumerate(rec.ops):
        op_bytes = sum(b for k, b in working.items() if k not in resident) + scratch
        held_bytes = sum(b for k, (b, j) in held_since.items() if j < i and k not in working)
        total = base + op_bytes + held_bytes
        if best is None or total > best.bytes:
            best = Floor(total, base, op_bytes, held_bytes, name, backward, scratch)
    if best is None:
        raise FxplanError("the step ran no op; nothing to measure")
    return best
