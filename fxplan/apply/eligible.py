"""Which of a model's modules may become checkpointed regions (:mod:`fxplan.apply.regions`), found in one fake step.

A region's decisions are for one call of its module, and recomputation calls it again with the same arguments, so
a region is a module the step calls exactly once, with arguments that are plain values (tensors, numbers, strings,
None and containers of them), and that does not write into its arguments in place: checkpoint runs it again from
them in backward (an ``nn.ReLU(inplace=True)`` of its own fails there, and with it every region of the mapping).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from fxplan.capture.capturers import ExampleCall
from fxplan.common.console import format_count
from fxplan.measure.meter import measure_step

logger = logging.getLogger("fxplan")


def regionable_modules(model: torch.nn.Module, call: ExampleCall,
                       loss_fn: Callable[[Any], torch.Tensor] | None) -> tuple[set[str], int]:
    """The modules that may be regions (module docstring), and the peak of the unplanned fake step that found them."""
    counts: dict[str, int] = {}
    others: dict[str, str] = {}  # module path -> the type of an argument that is not plain
    entered: dict[str, list[tuple[torch.Tensor, int]]] = {}  # module path -> its tensor arguments and versions
    writers: dict[str, str] = {}  # module path -> its class, for modules writing into an argument in place
    handles = []
    for path, module in model.named_modules():
        def before(_m, args, kwargs, path=path):
            counts[path] = counts.get(path, 0) + 1
            leaves = torch.utils._pytree.tree_leaves((args, kwargs))
            odd = next((leaf for leaf in leaves if not _plain(leaf)), None)
            if odd is not None:
                others[path] = type(odd).__name__
            entered[path] = [(t, t._version) for t in leaves if isinstance(t, torch.Tensor)]

        def after(m, _args, _kwargs, _output, path=path):
            if any(t._version != version for t, version in entered.pop(path, ())):
                writers[path] = type(m).__name__

        handles.append(module.register_forward_pre_hook(before, with_kwargs=True))
        handles.append(module.register_forward_hook(after, with_kwargs=True))
    try:
        peak = measure_step(model, call, fake=True, loss_fn=loss_fn).peak_bytes
    finally:
        for h in handles:
            h.remove()
    if others:
        named = sorted(others)
        hint = ("; a Hugging Face model trained with use_cache=False (model.config.use_cache = False) keeps no cache "
                "and lets fxplan checkpoint its layers") if any(t.endswith("Cache") for t in others.values()) else ""
        logger.info("fxplan: %s called with objects other than tensors (%s: %s%s) left unchanged%s",
                    format_count(len(named), "module"), named[0], others[named[0]],
                    f", and {len(named) - 1} more" if len(named) > 1 else "", hint)
    if writers:
        named = sorted(writers)
        logger.info("fxplan: %s writing into %s in place (%s: %s%s) not checkpointed: recomputation would run %s "
                    "from the values written", format_count(len(named), "module"),
                    "its input" if len(named) == 1 else "their inputs", named[0], writers[named[0]],
                    f", and {len(named) - 1} more" if len(named) > 1 else "", "it" if len(named) == 1 else "them")
    return {path for path, n in counts.items() if n == 1 and path not in others and path not in writers}, peak


def _plain(leaf: Any) -> bool:
    return leaf is None or isinstance(leaf, (torch.Tensor, bool, int, float, str, torch.dtype, torch.device))


def module_tree(model: torch.nn.Module) -> dict[str, list[str]]:
    """Each module's path -> the paths of its children."""
    tree: dict[str, list[str]] = {}
    for path, module in model.named_modules():
        tree[path] = [f"{path}.{name}" if path else name for name, _ in module.named_children()]
    return tree


def repeated_blocks(model: torch.nn.Module) -> frozenset[str]:
    """The paths of the items of the model's module lists and sequences: its repeated blocks."""
    return frozenset(f"{path}.{name}" if path else name for path, module in model.named_modules()
                     if isinstance(module, (torch.nn.ModuleList, torch.nn.Sequential))
                     for name, _ in module.named_children())
