"""``fxplan.auto_checkpoint``: the plan for a budget, applied to the model's own modules, measured.

The planner's candidates (:class:`~fxplan.planner.variants.Searches`, the search ``fxplan.rewrite`` runs) are
plans of the captured graph; each is carried onto the model as checkpointed regions with per-op decisions
(:mod:`fxplan.apply.regions`), and the model so applied is measured on fake tensors (one step, exact). The search
starts from the rewrite's plan for the budget and, while the applied plan measures above the budget, asks the
planner for the plan of a budget lowered by the excess (twice as far again where the planner answers with a
plan measured already), down to the planner's smallest, which the last try takes if none fitted: what a plan loses in
the mapping is measured, never assumed. The answer is the first that fits; a :class:`~fxplan.errors.BudgetError`
names the smallest peak measured. Plans are kept per model class, input shapes and settings in this process, so
a second model of the same class and shapes is applied without planning again.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch

from fxplan.apply import runtime
from fxplan.apply.applied import AppliedPlan, PartialPlan, input_shapes
from fxplan.apply.eligible import module_tree, regionable_modules, repeated_blocks
from fxplan.apply.offloaded import OffloadedStep, RegionOffloads, call_nodes, without_offloads
from fxplan.apply.op_map import node_ops
from fxplan.apply.partial import apply_in_parts, checkpointed_in_parts, data_dependent_cause
from fxplan.apply.regions import MAPPINGS, RegionPlan, regions_for, worth_saving
from fxplan.capture.capturers import ExampleCall, as_call
from fxplan.capture.fakes import DATA_DEPENDENT, caches_kept_real, has_fake, refusing_data_dependent
from fxplan.capture.guards import host_generators_kept, is_compiled, is_sharded
from fxplan.common import collector, heartbeat
from fxplan.common.console import format_bytes, format_count
from fxplan.costs.host_link import host_link
from fxplan.costs.trace import trace
from fxplan.errors import BudgetError, FxplanError
from fxplan.measure.meter import device_of, measure_step
from fxplan.planner.offloading import seconds_per_T
from fxplan.planner.planning import check_choices, host_limit, whole_step_budget
from fxplan.planner.trust import NEGLIGIBLE
from fxplan.planner.variants import Searches
from fxplan.rewriter import offload as offload_runtime
from fxplan.solvers.plans import Plan

logger = logging.getLogger("fxplan")

#: At most this many plans are applied and measured before the search gives the smallest it found.
MAX_TRIES = 6

_KEPT: dict[tuple, AppliedPlan] = {}  # plans made in this process, by model class, input shapes and settings


@refusing_data_dependent
@caches_kept_real()
@collector.spared()
def auto_checkpoint(
    model: torch.nn.Module,
    budget_gb: float | None = None,
    *,
    example_inputs: Any,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    budget_bytes: int | None = None,
    strategy: str = "time",
    solver: str = "approx",
    plan: AppliedPlan | None = None,
    compile_backend: str | None = None,
    shard: Callable[[torch.nn.Module], Any] | None = None,
    offload: bool = False,
    host_bytes: int | None = None,
) -> torch.nn.Module:
    """Plan ``model`` for a budget and apply the plan to its own modules; returns ``model`` itself.

    The budget is the peak of one whole training step as :func:`fxplan.measure_step` measures it, in GiB
    (``budget_gb``) or bytes (``budget_bytes``); with neither, the smallest peak fxplan reaches this way.
    ``example_inputs`` is one call of the model (a tuple, a dict of keyword arguments or one tensor);
    ``loss_fn(output)`` the loss of the step (default: the sum of the outputs, or a Hugging Face output's
    ``loss``). The model keeps its class, modules, parameters, ``state_dict`` keys, hooks and ``forward``;
    some of its submodules run checkpointed (:mod:`fxplan.apply.runtime`). ``model.fxplan_plan`` is the
    :class:`AppliedPlan` (``summary()``, ``to_json()``); :func:`remove_checkpoints` takes it off again.
    ``plan`` applies a plan made before (for the same class; measured again on these inputs).

    ``compile_backend`` names the ``torch.compile`` backend the model will train under (``"inductor"``): the
    budget is then of the compiled step, and the unplanned model and each plan found are measured as
    :func:`fxplan.measure_step` measures a compiled module, one real step after one that compiles (so
    ``example_inputs`` must be real tensors, and every measurement compiles; ``torch._dynamo.reset()`` runs
    before each, so other compiled functions of the process compile again at their next call). Compile
    frees and fuses what eager code keeps, so a plan's compiled step often peaks well below its eager one. With
    ``"inductor"`` plans are priced as it runs them (``trace``'s ``cost_model="fused"``): a recomputed pointwise op
    or norm is fused into the kernels that read it and costs nothing, a matrix product costs its FLOPs.

    ``shard`` is the training script's function that shards a module in place (FSDP2's ``fully_shard`` on each
    layer, then on the root): the budget is then per rank, and every step is measured as
    :func:`fxplan.measure_step` measures with ``shard``, on a fake copy sharded by it, with the parameters and
    gradients as FSDP2 holds them (shards, and each layer's gathered while it runs). ``example_inputs`` is one
    rank's batch. Call it on every rank after ``init_process_group`` and before sharding the model itself; the
    planning exchanges nothing between ranks.

    ``offload=True`` adds the third choice (:mod:`fxplan.planner.offloading`): an op output a checkpointed module
    saves may be kept in host memory instead and brought back before backward reads it; the budget is then of the
    device's bytes, and ``host_bytes`` bounds the host copies. Values outside the checkpointed modules stay on the
    device.

    Raises :class:`BudgetError` whose ``min_feasible_bytes`` is the smallest peak measured.
    """
    if not isinstance(model, torch.nn.Module):
        raise FxplanError(f"fxplan.auto_checkpoint needs an nn.Module, got {type(model).__name__}")
    _refuse_wrapped(model)
    budget = whole_step_budget(budget_gb, budget_bytes)
    check_choices(strategy, solver)
    call = as_call(example_inputs)
    remove_checkpoints(model)
    shapes = input_shapes(call)
    key = (type(model).__qualname__, shapes, budget, strategy, solver, loss_fn, compile_backend, shard)
    if plan is None and key in _KEPT and _same_structure(model, _KEPT[key]):
        plan = _KEPT[key]
        logger.info("fxplan: applying the plan made for another %s of these shapes", type(model).__name__)
    if plan is not None and compile_backend is None and shard is None:
        compile_backend = plan.compile_backend  # a plan made for compiled steps is measured compiled (real inputs)
    if compile_backend is not None and shard is not None:
        raise FxplanError("compile_backend and shard cannot be used together yet: fxplan measures compiled steps "
                          "unsharded; plan with shard= for the per-rank budget of the eager step")
    if offload and (compile_backend is not None or shard is not None):
        raise FxplanError("offload=True cannot be used with compile_backend or shard yet: offloaded values are copied "
                          "by saved-tensor hooks of the eager, unsharded step")
    host = host_limit(offload, host_bytes)
    key += (offload, host)
    meter = _Meter(loss_fn, None if has_fake(model, (call.args, call.kwargs)) else compile_backend, shard)
    if isinstance(plan, PartialPlan):
        applied = apply_in_parts(model, plan, call, loss_fn)
        runtime.install(model, applied.regions)
        model.fxplan_plan = applied
        return model
    if plan is not None:
        return _apply_given(model, plan, call, meter)
    if compile_backend is not None and meter.compile_backend is None:
        raise FxplanError("compile_backend measures real compiled steps: give example_inputs as real tensors")
    with host_generators_kept():  # fake steps run the model's own forward, which may draw (SpecAugment's masks)
        try:
            applied = _search(model, call, budget, strategy=strategy, solver=solver, meter=meter,
                              offload=(offload, host))
        except (FxplanError, *DATA_DEPENDENT) as exc:  # data-dependent Python: planned in the parts that capture
            if data_dependent_cause(exc, model) is None or meter.differs or offload \
                    or has_fake(model, (call.args, call.kwargs)):
                raise
            applied = checkpointed_in_parts(model, call, budget, exc, functools.partial(
                _plan_part, strategy=strategy, solver=solver), loss_fn)
    _KEPT[key] = applied
    runtime.install(model, applied.regions)
    model.fxplan_plan = applied
    return model


def _plan_part(module: torch.nn.Module, call: ExampleCall, budget: int | None, *, strategy: str,
               solver: str) -> AppliedPlan:
    """The plan of one part of a model planned in parts (:mod:`fxplan.apply.partial`), as for a whole model."""
    return _search(module, call, budget, strategy=strategy, solver=solver, meter=_Meter(None))


def remove_checkpoints(model: torch.nn.Module) -> torch.nn.Module:
    """Take an applied plan off ``model``: every module runs its own forward again. Returns ``model``."""
    runtime.uninstall(model)
    model.__dict__.pop("fxplan_plan", None)
    return model


@dataclass(frozen=True)
class _Meter:
    """How the search measures a step: on fake tensors, compiled with a backend (real tensors), or as one rank of
    the model sharded by ``shard``."""

    loss_fn: Callable[[Any], torch.Tensor] | None
    compile_backend: str | None = None
    shard: Callable[[torch.nn.Module], Any] | None = None

    def peak(self, model: torch.nn.Module, call: ExampleCall, regions: list[RegionPlan]) -> int:
        """The peak of one step of ``model`` with ``regions`` on."""
        return self.peaks(model, call, regions)[0]

    def peaks(self, model: torch.nn.Module, call: ExampleCall, regions: list[RegionPlan]) -> tuple[int, int]:
        """The device peak of one step of ``model`` with ``regions`` on, and the host copies' peak."""
        if self.compile_backend is not None:
            return _compiled_peak(model, call, regions, self.loss_fn, self.compile_backend), 0
        with runtime.installed(model, regions):
            stats = measure_step(model, call, fake=True, loss_fn=self.loss_fn, shard=self.shard)
        return stats.peak_bytes, stats.host_peak_bytes

    def describe(self) -> str:
        return (f"compiled with {self.compile_backend}" if self.compile_backend else
                "sharded by shard=" if self.shard else "on fake tensors")

    @property
    def differs(self) -> bool:
        """Whether it measures otherwise than the fake unsharded step the regions are checked by."""
        return self.compile_backend is not None or self.shard is not None


def _apply_given(model: torch.nn.Module, plan: AppliedPlan, call: ExampleCall, meter: _Meter) -> torch.nn.Module:
    if plan.model_class != type(model).__qualname__:
        raise FxplanError(f"this plan was made for {plan.model_class}, not {type(model).__qualname__}; plan this "
                          "model with fxplan.auto_checkpoint(model, ..., example_inputs=...)")
    if plan.offloaded_calls and meter.differs:
        raise FxplanError("this plan offloads, and offloaded values are copied by saved-tensor hooks of the eager, "
                          "unsharded step: apply it without compile_backend or shard")
    measured, host = meter.peaks(model, call, plan.regions)
    runtime.install(model, plan.regions)
    model.fxplan_plan = replace(plan, input_shapes=input_shapes(call), measured_peak_bytes=measured,
                                compile_backend=meter.compile_backend, per_rank=meter.shard is not None,
                                host_peak_bytes=host)
    if plan.input_shapes != model.fxplan_plan.input_shapes:
        logger.warning("fxplan: this plan was made for input shapes %s and is applied for %s (measured peak %s)",
                       plan.input_shapes, model.fxplan_plan.input_shapes, format_bytes(measured))
    return model


def _search(model: torch.nn.Module, call: ExampleCall, budget: int | None, **how: Any) -> AppliedPlan:
    with heartbeat.beating(f"planning {type(model).__name__}'s modules"):
        return _search_plans(model, call, budget, **how)


def _search_plans(model: torch.nn.Module, call: ExampleCall, budget: int | None, *, strategy: str, solver: str,
                  meter: _Meter, offload: tuple[bool, int | None] = (False, None)) -> AppliedPlan:
    t0 = time.perf_counter()
    heartbeat.stage("measuring the unplanned step and tracing")
    loss_fn = meter.loss_fn
    regionable, unsharded = regionable_modules(model, call, loss_fn)
    vanilla = meter.peak(model, call, []) if meter.differs else unsharded
    unplanned = AppliedPlan(type(model).__qualname__, input_shapes(call), [], vanilla, vanilla, budget,
                            compile_backend=meter.compile_backend, per_rank=meter.shard is not None)
    if budget is not None and budget >= vanilla:
        logger.info("fxplan: the budget %s is above the unplanned peak %s: nothing to checkpoint",
                    format_bytes(budget), format_bytes(vanilla))
        return unplanned
    cg = trace(model, call, probe_units=solver != "chen", cost_model=_cost_model(meter))
    captured = cg.graph["captured"]
    ops = node_ops(model, captured, call)
    tree, blocks, worth = module_tree(model), repeated_blocks(model), worth_saving(cg)
    searches = Searches(cg, model, call, solver=solver, loss_fn=loss_fn)
    offloads = _region_offloads(model, call, cg, ops, loss_fn, offload[1]) if offload[0] else None
    logger.info("fxplan: traced %s (%d nodes) in %.1f s; applying plans to its modules", type(model).__name__,
                cg.number_of_nodes(), time.perf_counter() - t0)
    best: AppliedPlan | None = None
    # The planner's budgets are of the unsharded eager step: ask first for the budget moved by what the meter
    # takes off or adds to the unplanned step, then lower it by each excess measured.
    target = None if budget is None else budget + unsharded - vanilla
    tried, lowered, smallest_tried = set(), 0, False
    calls_seen: dict[tuple[str, ...], dict[str, dict[str, list[str]]]] = {}  # _matched's, by the regions' paths
    for attempt in range(MAX_TRIES):
        if attempt == MAX_TRIES - 1:
            target = None  # the last try, if none fitted: the planner's smallest plan
        if target is None and not (offloads is not None and attempt == 0):
            if smallest_tried:
                break
            smallest_tried = True
        least = offloads is not None and attempt == 0  # offloading first tries the plan of least recomputation
        try:
            graph_plan = _graph_plan(searches, target, strategy, least=least)
        except BudgetError:  # below the planner's smallest: try the smallest itself
            target = None
            continue
        signature = (tuple(map(tuple, graph_plan.segments)), tuple(graph_plan.regions or ()))
        if signature in tried:  # the planner's plan for a lower budget is one measured already: lower further
            lowered *= 2
            target = target - lowered if target is not None and lowered else None
            continue
        tried.add(signature)
        heartbeat.stage(f"measuring plan {attempt + 1} applied to the model's modules")
        mapped = replace(graph_plan, offloaded=list(cg.nodes)) if offloads else graph_plan  # all it could offload
        made = [_applied(model, call, cg, ops, graph_plan, without_offloads(regions_for(
            mapped, ops, captured.gm, tree, regionable, mapping=mapping, blocks=blocks, worth=worth)), vanilla,
            budget, loss_fn, calls_seen) for mapping in MAPPINGS]
        made = [a for a in made if a is not None]
        if meter.differs:
            made = _remeasured(model, call, made, meter)
        if not made:  # no mapping trains: try the smallest plan, which maps otherwise
            target = None
            continue
        if offloads is not None:  # a mapping's offloads come back when backward replays its module: measure each
            made = [_offloaded(offloads, a, budget, cg) for a in made]
        fitting = [a for a in made if budget is not None and a.measured_peak_bytes <= budget]
        applied = (min(fitting, key=lambda a: (a.time_fraction, a.measured_peak_bytes)) if fitting else
                   min(made, key=lambda a: (a.measured_peak_bytes, a.time_fraction)))
        logger.info("fxplan: plan %d: %s in %s, measured peak %s (asked %s)", attempt + 1,
                    format_count(len(applied.regions), "checkpointed module"), type(model).__name__,
                    format_bytes(applied.measured_peak_bytes),
                    "the smallest" if target is None else format_bytes(target))
        if best is None or _better(applied, best, budget):
            best = applied
        if least:  # then the plans of the budget, as without offloading
            continue
        if budget is None or applied.measured_peak_bytes <= budget:
            break
        if target is not None:
            lowered = applied.measured_peak_bytes - budget
            target -= lowered
    if best is None or best.measured_peak_bytes >= vanilla:
        logger.info("fxplan: no plan applied to %s's modules %s; the model is left as it is (fxplan.rewrite "
                    "plans it without the modules' boundaries)", type(model).__name__,
                    "trains" if best is None else "peaks below its unplanned step")
        best = unplanned
    if budget is not None and best.measured_peak_bytes > budget:
        smallest = best.measured_peak_bytes
        raise BudgetError(
            f"fxplan.auto_checkpoint: no plan applied to {type(model).__name__}'s modules fits "
            f"{format_bytes(budget)} per step; the smallest measured is "
            f"{format_bytes(smallest)} ({smallest} bytes); fxplan.rewrite, which is not bound to the model's "
            "modules, may reach lower.", smallest, advice=f"budget_bytes={smallest} is accepted.")
    logger.info("fxplan: applied %s to %s: measured peak %s (unplanned %s), planned in %.1f s",
                format_count(len(best.regions), "checkpointed module"), type(model).__name__,
                format_bytes(best.measured_peak_bytes), format_bytes(vanilla), time.perf_counter() - t0)
    return best


def _cost_model(meter: _Meter) -> str:
    """How plans are priced: as inductor runs the step where it is what the meter measures (pointwise ops fused
    into their readers, :mod:`fxplan.costs.trace`), else the eager step's roofline."""
    return "fused" if meter.compile_backend == "inductor" else "roofline"


def _graph_plan(searches: Searches, target: int | None, strategy: str, least: bool = False) -> Plan:
    """The planner's plan for ``target`` (None: its smallest), or (``least``) its plan of least recomputation."""
    if least:
        plain = searches.plain
        return plain.finished_plan(next(plain.search.by_recompute(others=False)), target)
    choice = searches.choose(target, strategy, report_smallest=False)
    return choice.variant.result(choice.candidate, target).fxplan_plan


def _region_offloads(model: torch.nn.Module, call: ExampleCall, cg: Any, ops: dict,
                     loss_fn: Callable[[Any], torch.Tensor] | None, host_limit: int | None) -> RegionOffloads:
    """The offloading choice for plans applied to ``model`` (:mod:`fxplan.apply.offloaded`), its steps fake."""
    T_seconds = seconds_per_T(cg)

    def measure(regions: list[RegionPlan]) -> OffloadedStep:
        with runtime.installed(model, regions), offload_runtime.recording() as records:
            stats = measure_step(model, call, fake=True, loss_fn=loss_fn)
        return OffloadedStep(stats.peak_bytes, stats.host_peak_bytes, list(records))

    seconds = {v: cg.nodes[v]["T"] * T_seconds for v in cg.topo_order()}
    return RegionOffloads(measure, call_nodes(ops), seconds, host_link(device_of(model, call)), host_limit)


def _offloaded(offloads: RegionOffloads, applied: AppliedPlan, budget: int | None, cg: Any) -> AppliedPlan:
    """``applied``, or the same regions offloading as few as ``budget`` needs (None: all) where that is better: it
    fits where ``applied`` does not, or costs less time (recomputation and exposed copies, as shares of a forward
    pass), or without a budget peaks lower."""
    fit = offloads.fit(applied.regions, budget)
    if fit is None:
        return applied
    forward = cg.total_T() * seconds_per_T(cg) or 1.0
    with_copies = replace(applied, regions=fit.regions, measured_peak_bytes=fit.step.peak_bytes,
                          host_peak_bytes=fit.step.host_peak_bytes, exposed_copy_fraction=fit.exposed_seconds / forward)
    return with_copies if _better(with_copies, applied, budget) else applied


def _applied(model: torch.nn.Module, call: ExampleCall, cg: Any, ops: dict, graph_plan: Plan,
             regions: list[RegionPlan], vanilla: int, budget: int | None,
             loss_fn: Callable[[Any], torch.Tensor] | None, calls_seen: dict) -> AppliedPlan | None:
    """``regions`` checked against the model's forward (:func:`_matched`), applied to it and measured (fake
    tensors); None where the step with them fails."""
    try:
        regions, peak = _matched(model, call, regions, loss_fn, calls_seen)
    except DATA_DEPENDENT:  # the step, not the mapping: refused by auto_checkpoint
        raise
    except RuntimeError as error:  # autograd or checkpointing refused the step: this mapping is not applied
        logger.info("fxplan: %s checkpointed as planned %s not train (%s); that mapping of the plan is left out",
                    format_count(len(regions), "module"), "does" if len(regions) == 1 else "do",
                    str(error).splitlines()[0][:200])
        return None
    return AppliedPlan(type(model).__qualname__, input_shapes(call), regions, peak, vanilla, budget, graph_plan,
                       _recompute_fraction(cg, ops, regions))


def _remeasured(model: torch.nn.Module, call: ExampleCall, made: list[AppliedPlan], meter: _Meter) -> list[AppliedPlan]:
    """``made`` with each plan's peak as ``meter`` measures it, less those whose step fails there (regions around a
    module that ``shard`` shards run FSDP2's hooks inside the checkpoint, which recomputation does not repeat
    alike); mappings with the same regions are measured once."""
    peaks: dict[tuple[RegionPlan, ...], int | None] = {}
    out = []
    for applied in made:
        key = tuple(applied.regions)
        if key not in peaks:
            try:
                peaks[key] = meter.peak(model, call, applied.regions)
            except DATA_DEPENDENT:  # the step, not the mapping: refused by auto_checkpoint
                raise
            except RuntimeError as error:
                logger.info("fxplan: %s checkpointed as planned %s not train %s (%s); that mapping is left out",
                            format_count(len(key), "module"), "does" if len(key) == 1 else "do", meter.describe(),
                            str(error).splitlines()[0][:200])
                peaks[key] = None
        if peaks[key] is not None:
            out.append(replace(applied, measured_peak_bytes=peaks[key], compile_backend=meter.compile_backend,
                               per_rank=meter.shard is not None))
    return out


def _compiled_peak(model: torch.nn.Module, call: ExampleCall, regions: list[RegionPlan],
                   loss_fn: Callable[[Any], torch.Tensor] | None, backend: str) -> int:
    """The peak of a real step of ``model`` with ``regions`` on, compiled with ``backend`` (compiled afresh)."""
    with runtime.installed(model, regions):
        torch._dynamo.reset()  # a cached graph of another plan of this model would be run, or recompiles exhausted
        try:
            peak = measure_step(torch.compile(model, backend=backend), call, loss_fn=loss_fn).peak_bytes
        finally:
            torch._dynamo.reset()
    logger.info("fxplan: %s compiled with %s: measured peak %s", format_count(len(regions), "checkpointed module"),
                backend, format_bytes(peak))
    return peak


def _better(a: AppliedPlan, b: AppliedPlan, budget: int | None) -> bool:
    """Whether ``a`` is the better answer for ``budget``: it fits where ``b`` does not; both fitting, it adds less
    time; neither, it peaks lower. Without a budget, the lower peak, unless the two are within ``NEGLIGIBLE``: then
    the one adding less time (the rewrite's smallest is chosen so too)."""
    fits_a = budget is None or a.measured_peak_bytes <= budget
    fits_b = budget is None or b.measured_peak_bytes <= budget
    if fits_a != fits_b:
        return fits_a
    if budget is None and abs(a.measured_peak_bytes - b.measured_peak_bytes) <= NEGLIGIBLE * b.measured_peak_bytes:
        return (a.time_fraction, a.measured_peak_bytes) < (b.time_fraction, b.measured_peak_bytes)
    if budget is None or not fits_a:
        return a.measured_peak_bytes < b.measured_peak_bytes
    return a.time_fraction < b.time_fraction


def _matched(model: torch.nn.Module, call: ExampleCall, regions: list[RegionPlan],
             loss_fn: Callable[[Any], torch.Tensor] | None,
             calls_seen: dict[tuple[str, ...], dict[str, dict[str, list[str]]]]) -> tuple[list[RegionPlan], int]:
    """``regions`` checked against the model's own forward in a fake step with the regions on, and that step's
    peak. An operator whose calls there are not the captured graph's (per operator, the same calls with the
    same output shapes) is marked unmatched, and its calls get the policy's default (a graph from torch.export
    can build an attention mask otherwise than the eager forward does); the decisions of the others fall on
    the calls they were made for. Where some operator is unmatched, the regions' decisions change and the step
    is measured again. The calls seen do not depend on the decisions: kept in ``calls_seen`` by the regions' paths,
    they check regions on the same modules again, which are then measured once."""
    paths = tuple(r.path for r in regions)
    seen = calls_seen.get(paths)
    peak = None
    if seen is None:
        with runtime.installed(model, regions), runtime.verifying() as seen:
            peak = measure_step(model, call, fake=True, loss_fn=loss_fn).peak_bytes
        calls_seen[paths] = seen
    checked = []
    for r in regions:
        expected, got = r.calls_by_op(), seen.get(r.path, {})
        unmatched = tuple(sorted(op for op in set(expected) | set(got) if expected.get(op) != got.get(op)))
        if unmatched:
            logger.debug("fxplan: module %s: %s calls differ from the captured graph's", r.path, ", ".join(unmatched))
        checked.append(replace(r, unmatched=unmatched))
    if peak is None or any(r.unmatched for r in checked):
        peak = _Meter(loss_fn).peak(model, call, checked)
    return checked, peak


def _recompute_fraction(cg: Any, ops: dict, regions: list[RegionPlan]) -> float:
    """The cost-graph share of one forward pass recomputed: nodes of the regions whose value is not saved."""
    total = cg.total_T()
    if not total:
        return 0.0
    by_path = {r.path: r for r in regions}
    calls_seen = dict.fromkeys(by_path, 0)  # per region, its op calls so far: the index into its decisions
    recomputed = 0.0
    for name, node in ops.items():
        path = next((p for p in node.scope if p in by_path), None)
        if path is None:
            continue
        first = calls_seen[path]
        calls_seen[path] += len(node.calls)
        saves = by_path[path].save[first:first + len(node.calls)]
        makers = [saved for call, saved in zip(node.calls, saves) if call.makes_value]
        if makers and not any(makers) and name in cg:  # no call that makes its value is saved: recomputed once
            recomputed += cg.nodes[name]["T"]
    return recomputed / total


def _same_structure(model: torch.nn.Module, plan: AppliedPlan) -> bool:
    names = {name for name, _ in model.named_modules()}
    return all(r.path in names for r in plan.regions)


def _refuse_wrapped(model: torch.nn.Module) -> None:
    """Models that another wrapper already owns are planned before it wraps them: say so in plain words."""
    if is_sharded(model):
        raise FxplanError(f"{type(model).__name__} is already sharded with FSDP: call fxplan.auto_checkpoint "
                          "before fully_shard (plan first, then shard)")
    if is_compiled(model):
        raise FxplanError("the model is compiled (torch.compile): call fxplan.auto_checkpoint on the module, then "
                          "compile it")
    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        raise FxplanError("the model is wrapped in DistributedDataParallel: call fxplan.auto_checkpoint on the "
                          "model before wrapping it")
