"""The checkpointed regions at run time: a module's ``forward`` under ``torch.utils.checkpoint`` with a policy.

:func:`install` gives each region's module an instance attribute ``forward``, a :class:`CheckpointedForward`
that calls the module's own forward under non-reentrant ``torch.utils.checkpoint`` with a selective-checkpoint
policy (:class:`RegionPolicy`) made from the region's decisions; :func:`uninstall` takes it away again. The
module's class, hooks, parameters and names are untouched (FSDP2's and Hugging Face's hooks run around the
checkpointed call), and torch.compile traces the checkpoint with its ``MUST_SAVE`` / ``MUST_RECOMPUTE``
decisions. Checkpointing keeps the random state of the forward pass for recomputation, so dropout masks are
drawn once.
"""

from __future__ import annotations

import contextlib
import functools
from collections import defaultdict
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils._pytree import tree_leaves
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from fxplan.apply.op_map import op_name, shape_of, storage_key, written_storages
from fxplan.apply.regions import RegionPlan
from fxplan.errors import FxplanError
from fxplan.rewriter import offload

#: While a verification step runs: per region path, per operator, the output shapes of the calls its policy was
#: asked about in the forward.
_SEEN: dict[str, dict[str, list[str]]] | None = None


class RegionPolicy:
    """The decisions of one region for one call of its forward: the ``n``-th call of an operator is saved or
    recomputed as the region's plan says. A call that writes in place into tensors the region made takes the
    decision of the call that made them: a saved value written again in recomputation would be written twice, and a
    write saved over a recomputed value would be lost to it (timm's DropPath: ``new_empty``, ``bernoulli_``, then
    ``div_`` in place). A call the plan has no decision for is recomputed, unless it writes a tensor the region did
    not make (saved, so that recomputation never writes it twice)."""

    def __init__(self, region: RegionPlan, decisions: dict[str, tuple[bool, ...]],
                 offloads: dict[str, tuple[bool, ...]] | None = None):
        self.region = region
        self.decisions = decisions
        self.offloads = offloads or {}  # per operator, whether each call's saved output goes to host memory
        self.position: dict[tuple[str, int], int] = {}  # (operator, its call's index) -> the call's index in the region
        if self.offloads:
            seen: dict[str, int] = defaultdict(int)
            for j, op in enumerate(region.ops):
                if op not in region.unmatched:
                    self.position[(op, seen[op])] = j
                    seen[op] += 1
        self.counts: dict[str, int] = defaultdict(int)
        self.made: dict[int, bool] = {}  # storages the region's forward made so far -> whether their maker was saved

    def __call__(self, ctx: Any, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        if ctx.is_recompute:
            return CheckpointPolicy.MUST_RECOMPUTE
        name = _name(func)
        output = getattr(ctx, "op_output", None)
        if _SEEN is not None:
            _SEEN.setdefault(self.region.path, {}).setdefault(name, []).append(shape_of(output))
        i = self.counts[name]
        self.counts[name] += 1
        flags = self.decisions.get(name)
        written = written_storages(func, args, kwargs)
        outside = any(s not in self.made for s in written)
        if written and not outside:
            decision = any(self.made[s] for s in written)
        elif flags is not None and i < len(flags):
            decision = flags[i]
        else:
            decision = outside
        for t in tree_leaves(output):
            if isinstance(t, torch.Tensor):
                self.made.setdefault(storage_key(t), decision)
        offloaded = self.offloads.get(name)
        if decision and offloaded is not None and i < len(offloaded) and offloaded[i]:
            # the checkpoint saves it through the session's hooks, which record it as the region's j-th call
            offload.mark(output, call_label(self.region.path, self.position[(name, i)]))
        return CheckpointPolicy.MUST_SAVE if decision else CheckpointPolicy.MUST_RECOMPUTE


def call_label(path: str, j: int) -> str:
    """How an offloaded call is named in :func:`fxplan.rewriter.offload.recording`: its region and index there."""
    return f"{path}#{j}"


@functools.lru_cache(maxsize=None)
def _name(func: Any) -> str:
    return op_name(func)


class CheckpointedForward:
    """A module's forward run under a checkpointed region (module docstring). Runs the forward as it is where
    nothing needs gradients (``torch.no_grad()``, inference)."""

    def __init__(self, module: torch.nn.Module, region: RegionPlan, previous: Any):
        self.module = module
        self.region = region
        self.previous = previous  # an instance ``forward`` the module had before (another library's wrapper)
        self.decisions = region.decisions()
        self.contexts = _contexts_of(region, self.decisions, region.offloads())

    def original(self, *args: Any, **kwargs: Any) -> Any:
        if self.previous is not None:
            return self.previous(*args, **kwargs)
        return type(self.module).forward(self.module, *args, **kwargs)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return self.original(*args, **kwargs)
        if not any(self.region.offload):
            return checkpoint(self.original, *args, use_reentrant=False, context_fn=self.contexts, **kwargs)
        # the calls the policy offloads are saved through the session's hooks (fxplan.rewriter.offload)
        resident = [*self.module.parameters(), *self.module.buffers(),
                    *(t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor))]
        device = next((t.device for t in resident), torch.device("cpu"))
        with offload.session_for(resident, device):
            return checkpoint(self.original, *args, use_reentrant=False, context_fn=self.contexts,
                              respect_saved_tensors_hooks=True, **kwargs)


def _contexts_of(region: RegionPlan, decisions: dict[str, tuple[bool, ...]],
                 offloads: dict[str, tuple[bool, ...]]) -> Any:
    """The ``context_fn`` of a region's checkpoint: a plain function, the kind torch.compile traces a
    selective checkpoint with (it refuses bound methods and closures made while it traces), giving each call of
    the forward a fresh policy."""

    def contexts():
        # A saved call that writes a buffer in place (BatchNorm's num_batches_tracked.add_) returns that buffer,
        # whose version torch's check of cached tensors sees move; no call of a region overwrites a saved value
        # otherwise (fxplan.apply.regions), so the check is off.
        return create_selective_checkpoint_contexts(RegionPolicy(region, decisions, offloads),
                                                    allow_cache_entry_mutation=True)

    return contexts


def install(model: torch.nn.Module, regions: list[RegionPlan]) -> None:
    """Give every region's module its checkpointed forward (module docstring)."""
    modules = dict(model.named_modules())
    missing = [r.path for r in regions if r.path not in modules]
    if missing:
        raise FxplanError(f"the plan names modules {type(model).__name__} does not have ({', '.join(missing[:3])}): "
                          "it was made for another model; plan this one (fxplan.auto_checkpoint without plan=)")
    for region in regions:
        module = modules[region.path]
        previous = module.__dict__.get("forward")
        if isinstance(previous, CheckpointedForward):
            previous = previous.previous
        module.forward = CheckpointedForward(module, region, previous)


def uninstall(model: torch.nn.Module) -> int:
    """Take every checkpointed forward off ``model``'s modules (each gets back what it had); how many."""
    removed = 0
    for module in model.modules():
        current = module.__dict__.get("forward")
        if isinstance(current, CheckpointedForward):
            if current.previous is not None:
                module.forward = current.previous
            else:
                del module.forward
            removed += 1
    return removed


@contextlib.contextmanager
def installed(model: torch.nn.Module, regions: list[RegionPlan]) -> Iterator[None]:
    """``regions`` on ``model`` inside the block (:func:`install`), taken off again after it."""
    install(model, regions)
    try:
        yield
    finally:
        uninstall(model)


def verifying() -> _Verification:
    """A context in which every region's policy records the operators its forward runs (:data:`_SEEN`)."""
    return _Verification()


class _Verification:
    def __enter__(self) -> dict[str, dict[str, list[str]]]:
        global _SEEN
        _SEEN = {}
        return _SEEN

    def __exit__(self, *exc: Any) -> None:
        global _SEEN
        _SEEN = None
