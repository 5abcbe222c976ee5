"""Which submodules of a model can be parts of a plan in parts (:mod:`fxplan.apply.partial`), found from its calls.

What a part is: a module with submodules, called once in the step with plain values (tensors, numbers, strings, None
and containers of them), that writes into none of its arguments in place and does not draw from Python's or numpy's
random generators (recomputation would draw again), and whose own step captures. A module that fails one of these is
left eager and its children are tried (:func:`find_parts`). The calls are recorded in one real forward of a copy of
the model (:func:`record_calls`: the calls' arguments copied, the random state left as it was). A module the recorded
step did not call (a layer LayerDrop dropped) is planned on the call of a sibling of the same structure where one was
called. Parts of one structure and call shapes (a model's repeated layers) share one plan (:class:`PartGroup`); where
asked, repeated layers that follow one another are planned as one chain (:class:`Chain`), since what checkpointing
a layer saves is what it holds while the later layers run.
"""

from __future__ import annotations

import contextlib
import random
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch.utils._pytree import tree_leaves, tree_map

from fxplan.apply.applied import SINGLE_LAYER, AppliedPlan, Part, input_shapes
from fxplan.apply.regions import RegionPlan
from fxplan.capture.capturers import ExampleCall
from fxplan.capture.guards import host_generators_kept
from fxplan.errors import FxplanError
from fxplan.measure.meter import device_of, real_copy

#: ``try_part(module, call)``: the smallest plan of a candidate part on its own, or a string saying why it has none.
TryPart = Callable[[torch.nn.Module, ExampleCall], Any]


@dataclass
class Recorded:
    """One module's calls in the recorded step."""

    call: ExampleCall | None = None  # the first call's arguments, copied
    count: int = 0
    odd: str | None = None  # the type of an argument that is not a plain value
    output: tuple | None = None  # the first call's output's shape and dtype, where it is one tensor
    writes: bool = False  # wrote into a tensor argument in place
    draws: bool = False  # drew from Python's or numpy's global generator


def record_calls(model: torch.nn.Module, call: ExampleCall) -> dict[str, Recorded]:
    """The calls of ``model``'s modules with submodules in one real forward of a copy (module docstring)."""
    copy = real_copy(model)
    records: dict[str, Recorded] = {}
    entered: dict[str, tuple[list[tuple[torch.Tensor, int]], Any]] = {}
    handles = []
    for path, module in copy.named_modules():
        if not path or not any(True for _ in module.children()):
            continue

        def before(_m, args, kwargs, path=path):
            r = records.setdefault(path, Recorded())
            r.count += 1
            leaves = tree_leaves((args, kwargs))
            odd = next((type(x).__name__ for x in leaves if not _plain(x)), None)
            r.odd = r.odd or odd
            if r.count == 1 and odd is None:
                r.call = ExampleCall(*tree_map(_copied, (tuple(args), dict(kwargs))))
            entered[path] = ([(t, t._version) for t in leaves if isinstance(t, torch.Tensor)], _host_states())

        def after(_m, _args, _kwargs, output, path=path):
            tensors, states = entered.pop(path, ([], None))
            r = records[path]
            if r.count == 1:
                r.output = _meta(output)
            r.writes = r.writes or any(t._version != version for t, version in tensors)
            r.draws = r.draws or (states is not None and not _same_host_states(states, _host_states()))

        handles.append(module.register_forward_pre_hook(before, with_kwargs=True))
        handles.append(module.register_forward_hook(after, with_kwargs=True))
    try:
        with random_state_kept(model, call), torch.enable_grad():
            copy(*call.args, **call.kwargs)
    finally:
        for h in handles:
            h.remove()
    return records


def _copied(x: Any) -> Any:
    if not isinstance(x, torch.Tensor):
        return x
    return x.detach().clone().requires_grad_(x.requires_grad)


def _plain(leaf: Any) -> bool:
    return leaf is None or isinstance(leaf, (torch.Tensor, bool, int, float, str, torch.dtype, torch.device))


def _host_states() -> tuple[Any, Any]:
    numpy = sys.modules.get("numpy")
    return random.getstate(), numpy.random.get_state() if numpy is not None else None


def _same_host_states(a: tuple[Any, Any], b: tuple[Any, Any]) -> bool:
    if a[0] != b[0]:
        return False
    if a[1] is None or b[1] is None:
        return a[1] is b[1]
    return a[1][2:] == b[1][2:] and bool((a[1][1] == b[1][1]).all())


@dataclass
class PartGroup:
    """Parts of one structure and call shapes with one plan (``smallest``: its smallest), made for ``module``: the
    first part itself, its plan repeated on the others, or, where ``chained``, a :class:`Chain` of them all."""

    key: tuple
    paths: list[str]
    module: torch.nn.Module
    call: ExampleCall
    smallest: Any  # the plan of the part search's route
    notes: dict[str, str]  # path -> how it came to be planned with the group's plan
    chained: bool = False

    @property
    def part_class(self) -> str:
        return type(self.module.layers[0] if self.chained else self.module).__name__

    def place(self, plan: AppliedPlan) -> list[RegionPlan]:
        """``plan``'s regions on the parts' paths in the model."""
        if not self.chained:
            return [replace(r, path=f"{path}.{r.path}" if r.path else path)
                    for path in self.paths for r in plan.regions]
        placed = []
        for r in plan.regions:  # a chain's modules are layers.<i>[.rest]
            _, index, *rest = r.path.split(".", 2)
            placed.append(replace(r, path=".".join([self.paths[int(index)], *rest])))
        return placed


class Chain(torch.nn.Module):
    """Repeated layers of a model (siblings of one structure, each called with the last one's output and the first's
    other arguments), called one after another: the step their plan is made for. A layer's own step peaks in its
    own backward, which checkpointing it does not lower; in the model, each layer's saved values are held while
    the later ones run, and that is what checkpointing the layers saves."""

    def __init__(self, layers: list[torch.nn.Module], call: ExampleCall):
        super().__init__()
        self.layers = torch.nn.ModuleList(layers)
        self.rest, self.extra = call.args[1:], call.kwargs

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x, *self.rest, **self.extra)
        return x


def _record_of(records: dict[str, Recorded], modules: dict[str, torch.nn.Module], path: str,
               parent: str) -> tuple[Recorded | None, str]:
    """The recorded calls of the module at ``path`` (child of ``parent``), and how they were found: its own, or,
    where the step recorded did not call it (a layer LayerDrop dropped), a sibling's of the same structure."""
    if path in records:
        return records[path], ""
    sibling = next((p for p in _children(modules[parent], parent) if p in records
                    and _structure(modules[p]) == _structure(modules[path])), None)
    if sibling is None:
        return None, ""
    return records[sibling], f"not called in the step recorded: planned on the call of {sibling}"


def part_calls(model: torch.nn.Module, call: ExampleCall, paths: list[str]) -> dict[str, ExampleCall]:
    """The call of each part at ``paths`` in a step of ``model`` on ``call``, as planning in parts finds it; an
    :class:`FxplanError` where one cannot be a part so (a plan made for another model or call)."""
    records, modules = record_calls(model, call), dict(model.named_modules())
    calls = {}
    for path in paths:
        record = _record_of(records, modules, path, path.rpartition(".")[0])[0] if path in modules else None
        reason = "not in this model" if path not in modules else _not_a_part(modules[path], record)
        if reason is not None:
            raise FxplanError(f"the plan in parts names {path}, which cannot be a part of this "
                              f"{type(model).__name__} called so ({reason}); plan this model instead")
        calls[path] = record.call
    return calls


def find_parts(model: torch.nn.Module, records: dict[str, Recorded], try_part: TryPart,
               chains: bool) -> tuple[list[Part], list[PartGroup]]:
    """The parts of ``model`` (module docstring), each tried with ``try_part``, repeated layers as one :class:`Chain`
    where ``chains``: the modules left eager, with why, and the groups of planned parts."""
    modules = dict(model.named_modules())
    parts: list[Part] = []
    groups: dict[tuple, PartGroup] = {}
    failures: dict[tuple, str] = {}

    def record_of(path: str, parent: str) -> tuple[Recorded | None, str]:
        return _record_of(records, modules, path, parent)

    def key_of(path: str, parent: str) -> tuple | None:
        record, _ = record_of(path, parent)
        if _not_a_part(modules[path], record) is not None:
            return None
        return _structure(modules[path]), input_shapes(record.call)

    def chain_from(path: str, parent: str, key: tuple) -> list[str]:
        """``path`` and the siblings after it of its key, where its output can be their input."""
        siblings = _children(modules[parent], parent)
        record, _ = record_of(path, parent)
        first = record.call.args[0] if record.call.args else None
        if not isinstance(first, torch.Tensor) or record.output != _meta(first):
            return [path]
        run = [path]
        for p in siblings[siblings.index(path) + 1:]:
            if key_of(p, parent) != key:
                break
            run.append(p)
        return run

    def visit(path: str, parent: str) -> None:
        module = modules[path]
        record, note = record_of(path, parent)
        reason = _not_a_part(module, record)
        if reason is None:
            key = (_structure(module), input_shapes(record.call))
            if key in groups:
                group = groups[key]
                if path not in group.paths:
                    group.paths.append(path)
                    group.notes[path] = note or f"the plan of {group.paths[0]} (same structure and shapes)"
                return
            if key not in failures:
                run = chain_from(path, parent, key) if chains else [path]
                if len(run) > 1:
                    chain = Chain([modules[p] for p in run], record.call)
                    call = ExampleCall(record.call.args[:1], {})
                    outcome = try_part(chain, call)
                    if not isinstance(outcome, str):
                        notes = {p: f"planned with {run[0]} to {run[-1]} as one chain of layers" for p in run}
                        groups[key] = PartGroup(key, run, chain, call, outcome, notes, chained=True)
                        return
                outcome = try_part(module, record.call)
                if not isinstance(outcome, str):
                    groups[key] = PartGroup(key, [path], module, record.call, outcome, {path: note})
                    return
                failures[key] = outcome
            reason = failures[key]
        parts.append(Part(path, type(module).__name__, False, reason))
        for child in _children(module, path):
            visit(child, path)

    for child in _children(model, ""):
        visit(child, "")
    return parts, list(groups.values())


def _meta(x: Any) -> tuple | None:
    return (tuple(x.shape), x.dtype) if isinstance(x, torch.Tensor) else None


def _children(module: torch.nn.Module, path: str) -> list[str]:
    return [f"{path}.{name}" if path else name for name, _ in module.named_children()]


def _structure(module: torch.nn.Module) -> tuple:
    """What makes two modules the same for a plan: class, submodules' names and classes, state's shapes."""
    return (type(module).__qualname__, tuple((n, type(m).__qualname__) for n, m in module.named_modules()),
            tuple((n, tuple(t.shape), t.dtype) for n, t in [*module.named_parameters(), *module.named_buffers()]))


def _not_a_part(module: torch.nn.Module, record: Recorded | None) -> str | None:
    """Why ``module`` cannot be a part (module docstring), or None."""
    if not any(True for _ in module.children()):
        return SINGLE_LAYER
    if record is None:
        return "not called in the step recorded"
    if record.odd is not None:
        return f"called with an argument of type {record.odd} (fxplan plans calls of tensors and plain values)"
    if record.count > 1:
        return f"called {record.count} times in one step (a checkpointed module is called once)"
    if record.writes:
        return "writes into its input in place (recomputation would run it from the values written)"
    if record.draws:
        return "draws from Python's or numpy's random generator (recomputation would draw again)"
    return None



@contextlib.contextmanager
def random_state_kept(model: torch.nn.Module, call: ExampleCall) -> Iterator[None]:
    """torch's generators (the CPU's, and the model's CUDA device's) and Python's and numpy's left as they were."""
    device = device_of(model, (call.args, call.kwargs))
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), host_generators_kept():
        yield
