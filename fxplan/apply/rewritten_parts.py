"""``fxplan.rewrite`` of a model in parts: each part rewritten and checkpointed whole, in a copy of the model's tree.

Where a model does not capture as a whole (:mod:`fxplan.apply.partial` finds its parts), ``fxplan.rewrite`` cannot
return one generated module for it. It returns the model's own class instead, with the modules on the way from the
root to each planned part copied (:func:`with_parts`) and each planned part replaced by its rewritten module (a
:class:`~fxplan.rewriter.codegen.SegmentedModule` of the part's own graph and its plan). Everything else is shared
with the user's model, as a rewritten module shares it: parameters, buffers and the modules off those ways. So the
forward, its signature and the other methods are the model's own, and the user's model is left as it was.

A part is one segment of the model's step, and not its last. A rewritten module recomputes every segment of its
plan but the last, whose backward runs on the values its forward made; so a planned part runs checkpointed as a
whole (:attr:`~fxplan.rewriter.codegen.SegmentedModule.fxplan_checkpointed_whole`): the forward keeps only the
part's inputs for it, and its backward recomputes it with its own plan inside, which bounds the part's own step
(the recursion of Chen et al. 2016, section 4.4: a segment is one operator, planned inside by the same scheme).
Without the outer checkpoint a rewritten part would keep its last segment's activations from its forward to its
backward, while the rest of the model runs: a chain of repeated layers, each rewritten on its own, would keep
nearly all they keep unplanned. The price is one more forward pass of each planned part, beside what its plan
recomputes, so for a budget the fewest parts that fit are planned (:mod:`fxplan.apply.partial`).
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from fxplan.apply.applied import Part, PartialPlan, input_shapes
from fxplan.apply.partial import PartsChosen, plan_in_parts, whole_peak_of
from fxplan.apply.parts import PartGroup, part_calls
from fxplan.capture.capturers import ExampleCall
from fxplan.errors import FxplanError
from fxplan.measure.meter import measure_step
from fxplan.rewriter.codegen import SegmentedModule
from fxplan.solvers.plans import Plan

#: ``fit(module, call, budget_bytes)``: the module rewritten for a budget of its own step (None: its smallest peak),
#: as ``fxplan.rewrite`` plans a whole model.
Fit = Callable[[torch.nn.Module, ExampleCall, "int | None"], torch.nn.Module]

#: ``apply(module, plan, call)``: the module rewritten with a plan made before, for a call of that structure.
Apply = Callable[[torch.nn.Module, Plan, ExampleCall], torch.nn.Module]


def checkpointed_whole(module: SegmentedModule) -> SegmentedModule:
    """``module`` (a rewritten part) run checkpointed as a whole in training (module docstring)."""
    module.fxplan_checkpointed_whole = True
    return module


@dataclass(frozen=True)
class RewrittenPart:
    """One part's rewrite as :mod:`fxplan.apply.partial` weighs it: the plan and its own step's peaks."""

    plan: Plan
    measured_peak_bytes: int
    vanilla_peak_bytes: int


@dataclass
class RewrittenParts:
    """The rewrite's route of planning in parts (:class:`fxplan.apply.partial.PartRoute`)."""

    fit: Fit
    apply: Apply
    name: str = "fxplan.rewrite"
    chains: bool = False  # each part is checkpointed whole: a chain of layers is planned layer by layer
    _unplanned: dict[int, int] = field(default_factory=dict)  # id(module) -> its own step's unplanned peak
    _rewritten: dict[tuple[int, int], torch.nn.Module] = field(default_factory=dict)  # (id(module), id(plan))

    def plan(self, module: torch.nn.Module, call: ExampleCall, budget: int | None) -> RewrittenPart:
        rewritten = self.fit(module, call, budget)
        plan = rewritten.fxplan_plan
        self._rewritten[id(module), id(plan)] = checkpointed_whole(rewritten)
        if id(module) not in self._unplanned:
            self._unplanned[id(module)] = measure_step(module, call, fake=True).peak_bytes
        return RewrittenPart(plan, rewritten.fxplan_measured_peak_bytes, self._unplanned[id(module)])

    def lowers(self, plan: RewrittenPart) -> bool:
        return True  # checkpointed whole, a part keeps only its inputs for its backward

    @contextlib.contextmanager
    def installed(self, model: torch.nn.Module, placed: list[tuple[PartGroup, RewrittenPart]]
                  ) -> Iterator[torch.nn.Module]:
        yield self.rewritten(model, placed)

    def rewritten(self, model: torch.nn.Module, placed: list[tuple[PartGroup, RewrittenPart]]) -> torch.nn.Module:
        """``model`` with each group's parts rewritten with its plan (:func:`with_parts`)."""
        modules = dict(model.named_modules())
        parts = {}
        for group, part in placed:
            for path in group.paths:
                key = id(modules[path]), id(part.plan)
                if key not in self._rewritten:
                    self._rewritten[key] = checkpointed_whole(self.apply(modules[path], part.plan, group.call))
                parts[path] = self._rewritten[key]
        return with_parts(model, parts)

    def planned_part(self, group: PartGroup, plan: RewrittenPart, path: str) -> Part:
        return Part(path, group.part_class, True, group.notes.get(path, ""), 0, plan.measured_peak_bytes,
                    plan.vanilla_peak_bytes, segments=plan.plan.num_segments)


def rewrite_in_parts(model: torch.nn.Module, call: ExampleCall, budget: int | None, failure: BaseException,
                     fit: Fit, apply: Apply, loss_fn: Callable[[Any], torch.Tensor] | None) -> torch.nn.Module:
    """``model`` rewritten in parts for ``budget`` bytes of the whole step (module docstring), where its whole
    capture failed with ``failure``."""
    route = RewrittenParts(fit, apply)
    chosen = plan_in_parts(model, call, budget, failure, route, loss_fn)
    return _marked(route.rewritten(model, chosen.placed), model, _plan_of(model, call, budget, chosen))


def apply_in_parts(model: torch.nn.Module, plan: PartialPlan, call: ExampleCall, apply: Apply,
                   loss_fn: Callable[[Any], torch.Tensor] | None) -> torch.nn.Module:
    """``model`` rewritten in parts with ``plan``, made before for a model of this class and configuration, its
    whole step measured again on ``call`` (real steps)."""
    if plan.model_class != type(model).__qualname__:
        raise FxplanError(f"this plan was made for {plan.model_class}, not {type(model).__qualname__}; plan this "
                          "model with fxplan.rewrite(model, ..., example_inputs=...)")
    calls = part_calls(model, call, list(plan.rewritten))
    modules = dict(model.named_modules())
    result = with_parts(model, {path: checkpointed_whole(apply(modules[path], part_plan, calls[path]))
                                for path, part_plan in plan.rewritten.items()})
    peak = whole_peak_of(model, call, loss_fn, contextlib.nullcontext(result))
    return _marked(result, model, PartialPlan(**{**vars(plan), "input_shapes": input_shapes(call),
                                                 "measured_peak_bytes": peak}))


def _plan_of(model: torch.nn.Module, call: ExampleCall, budget: int | None, chosen: PartsChosen) -> PartialPlan:
    rewritten = {path: part.plan for group, part in chosen.placed for path in group.paths}
    return PartialPlan(type(model).__qualname__, input_shapes(call), [], chosen.peak_bytes, chosen.vanilla_peak_bytes,
                       budget, parts=chosen.parts, meter=chosen.meter, rewritten=rewritten)


def _marked(result: torch.nn.Module, model: torch.nn.Module, plan: PartialPlan) -> torch.nn.Module:
    """``result`` with what fxplan's rewritten modules carry: the plan, its measured peak, the model it stands for."""
    result.__dict__.update(fxplan_plan=plan, fxplan_measured_peak_bytes=plan.measured_peak_bytes,
                           _fxplan_original=model)
    return result


def with_parts(model: torch.nn.Module, parts: dict[str, torch.nn.Module]) -> torch.nn.Module:
    """A copy of ``model`` with the submodule at each path of ``parts`` replaced by its module. Only the modules on
    the way from the root to a replaced part are copied (:func:`_shallow_copy`); the rest, parameters and buffers
    included, are ``model``'s own."""
    root = _shallow_copy(model)
    copied = {"": root}
    for path, part in parts.items():
        *ancestors, name = path.split(".")
        parent, at = root, ""
        for step in ancestors:
            at = f"{at}.{step}" if at else step
            if at not in copied:
                copied[at] = parent._modules[step] = _shallow_copy(parent._modules[step])
            parent = copied[at]
        parent._modules[name] = part
    return root


def _shallow_copy(module: torch.nn.Module) -> torch.nn.Module:
    """A new module of ``module``'s class with its attributes: the containers among them (submodules, parameters,
    buffers, hooks) are new, so that replacing a submodule or adding a hook leaves ``module`` as it was; what they
    hold is shared."""
    new = type(module).__new__(type(module))
    new.__dict__.update({k: copy.copy(v) if isinstance(v, (dict, set, list)) else v
                         for k, v in module.__dict__.items()})
    return new
