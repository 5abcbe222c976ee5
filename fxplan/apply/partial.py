"""Planning in parts: a model whose step does not capture as a whole, planned in the submodules that do.

A model's forward can stop a fake step, and with it the capture, at data-dependent Python: torchvision's Faster R-CNN
draws the size of its images with ``.item()`` in training, a Hugging Face speech encoder decides its LayerDrop with
``if not skip_the_layer``. Most of its memory is often in submodules that are plain graphs all the same (a
detector's backbone and FPN, each encoder layer). :func:`plan_in_parts` finds the largest of them, from the top of
the model's module tree down, plans each as a whole model is planned, with its own fake step, and leaves the rest
to run eagerly, exactly as the model's code runs it. Two routes put the parts' plans in place (:class:`PartRoute`):
``fxplan.auto_checkpoint``'s checkpointed regions on the parts' own modules (:class:`CheckpointedParts`), and
``fxplan.rewrite``'s rewritten modules in place of the parts, in a copy of the model's module tree
(:mod:`fxplan.apply.rewritten_parts`). Either way only the parts change, so the model's own Python, its
data-dependent choices and its random draws included, runs once per step as written.

Which submodules can be parts, and how their calls are found, is :mod:`fxplan.apply.parts`.

The budget is of the whole step. A fake step of the whole model stops where its capture did, so the whole step is
measured on real steps of a copy (:data:`STEPS_MEASURED` of them in sequence, from the random state at planning time,
which is left as it was; the largest peak counts): the draws of a random model (LayerDrop) change its peak from step
to step, and the figure is of the steps measured. The parts share the excess of the unplanned peak over the budget in
proportion to what each can save (its own step's unplanned peak less its smallest, on fake tensors); while the whole
step measures above the budget, the excess measured is added and the parts are planned again, and the last resort
is every part's smallest plan. What is reported is what was measured.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import Any, Protocol

import torch
from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

from fxplan.apply import runtime
from fxplan.apply.applied import AppliedPlan, Part, PartialPlan, input_shapes
from fxplan.apply.parts import PartGroup, find_parts, random_state_kept, record_calls
from fxplan.apply.regions import RegionPlan
from fxplan.capture.capturers import ExampleCall
from fxplan.capture.fakes import DATA_DEPENDENT
from fxplan.common.console import format_bytes, format_count
from fxplan.errors import BudgetError, FxplanError, user_frame
from fxplan.measure.meter import device_of, measure_step
from fxplan.solvers.offload import fewest_fitting

logger = logging.getLogger("fxplan")

#: Real steps measured in sequence for one figure of the whole step (the largest counts).
STEPS_MEASURED = 2

#: At most this many shares of the budget are planned and measured before every part's smallest plan is taken.
MAX_TRIES = 3

#: ``plan_part(module, call, budget_bytes)``: a part's plan for a budget of its own step (None: its smallest), as
#: ``fxplan.auto_checkpoint`` finds one for a whole model; raises where the part does not capture.
PlanPart = Callable[[torch.nn.Module, ExampleCall, "int | None"], AppliedPlan]


class PartRoute(Protocol):
    """How the parts of a model are planned and put in place. A part's plan has ``measured_peak_bytes`` and
    ``vanilla_peak_bytes`` (its own step's, with and without it, on fake tensors)."""

    name: str  # the entry point, for messages
    chains: bool  # whether repeated layers that follow one another are planned as one chain

    def plan(self, module: torch.nn.Module, call: ExampleCall, budget: int | None) -> Any:
        """The part's plan for ``budget`` bytes of its own step (None: its smallest); raises where it does not
        capture, :class:`BudgetError` where nothing fits."""

    def lowers(self, plan: Any) -> bool:
        """Whether ``plan`` changes anything in its part's step."""

    def installed(self, model: torch.nn.Module, placed: list[tuple[PartGroup, Any]]
                  ) -> contextlib.AbstractContextManager[torch.nn.Module]:
        """A block inside which the module returned runs ``model`` with each group's plan on its parts."""

    def planned_part(self, group: PartGroup, plan: Any, path: str) -> Part | None:
        """The :class:`Part` of ``path`` planned with ``plan``, or None where ``plan`` leaves that part as it is."""


@dataclass
class CheckpointedParts:
    """``fxplan.auto_checkpoint``'s route: each part's plan is checkpointed regions on its own modules, installed on
    the model itself."""

    plan_part: PlanPart
    name: str = "fxplan.auto_checkpoint"
    chains: bool = True

    def plan(self, module: torch.nn.Module, call: ExampleCall, budget: int | None) -> AppliedPlan:
        return self.plan_part(module, call, budget)

    def lowers(self, plan: AppliedPlan) -> bool:
        return bool(plan.regions)

    @contextlib.contextmanager
    def installed(self, model: torch.nn.Module,
                  placed: list[tuple[PartGroup, AppliedPlan]]) -> Iterator[torch.nn.Module]:
        with runtime.installed(model, regions_placed(placed)):
            yield model

    def planned_part(self, group: PartGroup, plan: AppliedPlan, path: str) -> Part | None:
        regions = sum(r.path == path or r.path.startswith(path + ".") for r in group.place(plan))
        if not regions:
            return None
        return Part(path, group.part_class, True, group.notes.get(path, ""), regions, plan.measured_peak_bytes,
                    plan.vanilla_peak_bytes)


def regions_placed(placed: list[tuple[PartGroup, AppliedPlan]]) -> list[RegionPlan]:
    """The regions of each group's plan, on its parts' paths in the model."""
    return [r for g, plan in placed for r in g.place(plan)]


def data_dependent_cause(exc: BaseException, model: torch.nn.Module | None = None) -> BaseException | None:
    """The data-dependent op ``exc`` was raised from (fake tensors' exceptions, or a guard on a data-dependent
    symbolic value), following its causes; None where it was raised for another reason, or, given ``model``, where
    the op is not in the code of one of ``model``'s modules (a loss that reads its data, a backward's op: planning
    in parts cannot help those)."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, (*DATA_DEPENDENT, GuardOnDataDependentSymNode)):
            return exc if model is None or _in_forward(exc, model) else None
        exc = exc.__cause__ or exc.__context__
    return None


def _in_forward(exc: BaseException, model: torch.nn.Module) -> bool:
    """Whether ``exc`` was raised inside a method of a module of one of ``model``'s modules' classes (its forward, on
    the fake copy a step ran)."""
    classes = {type(m) for m in model.modules()}
    tb = exc.__traceback__
    while tb is not None:
        if type(tb.tb_frame.f_locals.get("self")) in classes:
            return True
        tb = tb.tb_next
    return False


@dataclass
class PartsChosen:
    """What planning in parts chose: every part (:class:`Part`, the model first), the plan of each group of planned
    parts, and the whole step's peaks, measured as ``meter`` says."""

    parts: list[Part]
    placed: list[tuple[PartGroup, Any]]
    peak_bytes: int
    vanilla_peak_bytes: int
    meter: str


def plan_in_parts(model: torch.nn.Module, call: ExampleCall, budget: int | None, failure: BaseException,
                  route: PartRoute, loss_fn: Callable[[Any], torch.Tensor] | None) -> PartsChosen:
    """The plan of ``model`` in parts for ``budget`` bytes of the whole step (None: the smallest peak), where its
    whole capture failed with ``failure`` (module docstring), planned and placed by ``route``. Raises
    :class:`BudgetError` naming the smallest peak measured where no share of the budget fits."""
    t0 = time.perf_counter()
    cause = data_dependent_cause(failure) or failure
    root = Part("", type(model).__name__, False, f"data-dependent code{user_frame(cause, model)}")
    logger.info("fxplan: %s does not capture as a whole (%s); planning its submodules that do",
                type(model).__name__, root.reason)
    parts, groups = find_parts(model, record_calls(model, call), lambda m, c: _tried(m, c, route), route.chains)
    if not groups:  # nothing to plan in parts: the capture's refusal says why
        logger.info("fxplan: no submodule of %s captures", type(model).__name__)
        raise failure
    parts.insert(0, root)
    meter = (f"the largest of {STEPS_MEASURED} real steps on the {device_of(model, (call.args, call.kwargs)).type} "
             "from the random state at planning time")
    vanilla = _whole_peak(model, call, route, [], loss_fn)
    chosen = {g.key: g.smallest for g in groups}
    peak = _whole_peak(model, call, route, _placed(groups, chosen), loss_fn)
    smallest = peak
    if budget is not None and budget >= vanilla:
        chosen, peak = {}, vanilla
    elif budget is not None and peak <= budget:
        excess = vanilla - budget
        for _ in range(MAX_TRIES):
            shared = _shared(groups, excess, route)
            if all(shared[g.key] is g.smallest for g in groups):
                break  # the shares are every part's smallest plan: measured already
            tried = _whole_peak(model, call, route, _placed(groups, shared), loss_fn)
            logger.info("fxplan: parts planned for %s less: whole step %s", format_bytes(excess), format_bytes(tried))
            if tried <= budget:
                chosen, peak = shared, tried
                break
            excess += tried - budget
    if peak >= vanilla:
        chosen, peak = {}, vanilla
    keep = None
    if budget is not None and chosen and not route.chains and peak <= budget:
        keep, peak = _fewest_planned(model, call, route, groups, chosen, budget, peak, loss_fn)
    if budget is not None and peak > budget:
        raise BudgetError(
            f"{route.name}: {type(model).__name__} planned in parts ({format_count(len(groups), 'kind')} of "
            f"part) does not fit {format_bytes(budget)} per step; the smallest measured is {format_bytes(smallest)} "
            f"({smallest} bytes, {meter})", smallest, advice=f"budget_bytes={smallest} is accepted.")
    placed = _placed(groups, chosen, keep)
    parts += _parts_planned(groups, chosen, route, keep)
    logger.info("fxplan: planned %s of %s: measured peak %s (unplanned %s), planned in %.1f s",
                format_count(sum(p.planned for p in parts), "part"), type(model).__name__, format_bytes(peak),
                format_bytes(vanilla), time.perf_counter() - t0)
    return PartsChosen(parts, placed, peak, vanilla, meter)


def checkpointed_in_parts(model: torch.nn.Module, call: ExampleCall, budget: int | None, failure: BaseException,
                          plan_part: PlanPart, loss_fn: Callable[[Any], torch.Tensor] | None) -> PartialPlan:
    """``fxplan.auto_checkpoint``'s plan of ``model`` in parts (:func:`plan_in_parts` on :class:`CheckpointedParts`):
    the regions to install on the model."""
    chosen = plan_in_parts(model, call, budget, failure, CheckpointedParts(plan_part), loss_fn)
    return PartialPlan(type(model).__qualname__, input_shapes(call), regions_placed(chosen.placed), chosen.peak_bytes,
                       chosen.vanilla_peak_bytes, budget, parts=chosen.parts, meter=chosen.meter)


def apply_in_parts(model: torch.nn.Module, plan: PartialPlan, call: ExampleCall,
                   loss_fn: Callable[[Any], torch.Tensor] | None) -> PartialPlan:
    """``plan``, made before, measured again on ``call`` (real steps): the plan to install."""
    if plan.model_class != type(model).__qualname__:
        raise FxplanError(f"this plan was made for {plan.model_class}, not {type(model).__qualname__}; plan this "
                          "model with fxplan.auto_checkpoint(model, ..., example_inputs=...)")
    peak = whole_peak_of(model, call, loss_fn, runtime.installed(model, plan.regions))
    return replace(plan, input_shapes=input_shapes(call), measured_peak_bytes=peak)


def _tried(module: torch.nn.Module, call: ExampleCall, route: PartRoute) -> Any:
    """The smallest plan of ``module`` on its own, or why it has none: the data-dependent code it stops at, the
    error its capture raised, or that no plan of its modules lowers its step."""
    try:
        plan = route.plan(module, call, None)
    except (FxplanError, RuntimeError, *DATA_DEPENDENT, GuardOnDataDependentSymNode) as exc:
        cause = data_dependent_cause(exc)
        if cause is not None:
            return f"data-dependent code{user_frame(cause, module)}"
        return f"does not capture ({type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''})"
    if not route.lowers(plan):
        return "captures, but no plan of it lowers its own step's peak"
    return plan


def _shared(groups: list[PartGroup], excess: int, route: PartRoute) -> dict[tuple, Any]:
    """Each group's plan for its share of ``excess`` bytes to save (module docstring)."""
    can = {g.key: max(0, g.smallest.vanilla_peak_bytes - g.smallest.measured_peak_bytes) for g in groups}
    total = sum(can[g.key] * (1 if g.chained else len(g.paths)) for g in groups)
    shared = {}
    for g in groups:
        share = excess * can[g.key] / total if total else 0
        if share >= can[g.key]:
            shared[g.key] = g.smallest
            continue
        try:
            shared[g.key] = route.plan(g.module, g.call, int(g.smallest.vanilla_peak_bytes - share))
        except BudgetError:
            shared[g.key] = g.smallest
    return shared


def _placed(groups: list[PartGroup], chosen: dict[tuple, Any],
            keep: set[str] | None = None) -> list[tuple[PartGroup, Any]]:
    """The groups that have a plan in ``chosen``, each with it; with ``keep``, only its parts at those paths."""
    placed = []
    for g in groups:
        paths = [p for p in g.paths if keep is None or p in keep]
        if g.key in chosen and paths:
            placed.append((g if paths == g.paths else replace(g, paths=paths), chosen[g.key]))
    return placed


def _fewest_planned(model: torch.nn.Module, call: ExampleCall, route: PartRoute, groups: list[PartGroup],
                    chosen: dict[tuple, Any], budget: int, peak: int,
                    loss_fn: Callable[[Any], torch.Tensor] | None) -> tuple[set[str], int]:
    """The fewest parts planned with ``chosen``, the model's first ones first, whose whole step fits ``budget``
    (all of them: ``peak``), and their step's peak; by bisection on the count. For routes without chains (the
    rewrite's): a part planned there costs one more forward pass of it, so none is planned that the budget does
    not need."""
    order = [path for path, _ in model.named_modules() if any(path in g.paths for g in groups if g.key in chosen)]

    def measure(k: int) -> tuple[int, int]:
        return k, _whole_peak(model, call, route, _placed(groups, chosen, set(order[:k])), loss_fn)

    count, fewest_peak = fewest_fitting((len(order), peak), len(order), measure, lambda step: step[1] <= budget)
    if count < len(order):
        logger.info("fxplan: %s of %s planned are enough for the budget: whole step %s", count, len(order),
                    format_bytes(fewest_peak))
    return set(order[:count]), fewest_peak


def _parts_planned(groups: list[PartGroup], chosen: dict[tuple, Any], route: PartRoute,
                   keep: set[str] | None = None) -> list[Part]:
    """A :class:`Part` for each part of the groups, with the plan chosen for it (its own step's peaks: of the chain
    for chained layers), but for those not in ``keep``."""
    out = []
    for g in groups:
        plan = chosen.get(g.key)
        for path in g.paths:
            planned = plan is not None and (keep is None or path in keep)
            part = route.planned_part(g, plan, path) if planned else None
            out.append(part or Part(path, g.part_class, False, "captures; left unplanned, the budget holds without it"))
    return out


def _whole_peak(model: torch.nn.Module, call: ExampleCall, route: PartRoute, placed: list[tuple[PartGroup, Any]],
                loss_fn: Callable[[Any], torch.Tensor] | None) -> int:
    """The largest peak of :data:`STEPS_MEASURED` real steps of ``model`` with ``placed`` on (``route``)."""
    return whole_peak_of(model, call, loss_fn, route.installed(model, placed))


def whole_peak_of(model: torch.nn.Module, call: ExampleCall, loss_fn: Callable[[Any], torch.Tensor] | None,
                   installed: contextlib.AbstractContextManager[Any]) -> int:
    """The largest peak of :data:`STEPS_MEASURED` real steps of copies of the module ``installed`` gives (None:
    ``model``), in sequence from the random state at planning time, which is left as it was."""
    try:
        with installed as module, random_state_kept(model, call):
            module = model if module is None else module
            return max(measure_step(module, call, fake=False, loss_fn=loss_fn).peak_bytes
                       for _ in range(STEPS_MEASURED))
    except RuntimeError as error:
        raise FxplanError(f"{type(model).__name__} with its parts planned does not "
                          f"train ({str(error).splitlines()[0][:200]}); the plan in parts is not applied") from error
