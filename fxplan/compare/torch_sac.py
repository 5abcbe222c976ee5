"""PyTorch's own automatic selective activation checkpointing, as a peer: the plumbing of
:func:`fxplan.compare.peers.sac_ilp_peer`.

``torch.distributed._tools`` has the pieces and no function that joins them; this module joins them as torch's
tests do. On a fake copy of the model, one step each under ``MemTracker`` (module-wise memory),
``RuntimeEstimator`` (the module order) and ``SACEstimator`` (per module: every op call of its forward with its
output bytes and time, and which are views, in-place or random); ``ilp_utils.aggregate_stats`` and
``parse_module_info`` make the module tree (two kinds of module torch's tools fail on are adapted:
:func:`_drop_repeated_leaves`, :func:`_drop_modules_without_memory`); ``sac_ilp.sac_milp`` chooses the modules to
checkpoint and the share of each one's activation memory to discard under a budget in bytes
(:func:`smallest_budget`: the smallest it meets); ``sac_ilp.get_optimal_checkpointing_policy_per_module`` chooses,
per chosen module, which op outputs to keep for that share (where ``sac_milp`` discards a module wholly, the share
torch's own constraints keep anyway, a few bytes of BatchNorm counters: :func:`_forced_share`). :class:`SACForward`
runs each chosen module's forward under non-reentrant ``torch.utils.checkpoint`` with a selective-checkpoint policy
that keeps those outputs.

Time estimates. ``SACEstimator`` and ``RuntimeEstimator`` have two modes in torch 2.14.1 and both need an
accelerator: ``operator-level-cost-model`` (a roofline model) asserts ``torch.accelerator.is_available()``, and
``operator-level-benchmark`` times each op with accelerator events (on a machine without one: "Backend doesn't
support elapsedTime"). On the CPU (:data:`CPU_BENCHMARK`) ``SACEstimator``'s ops are timed here as torch's benchmark
mode times them on a GPU: on real tensors of the fake inputs' shapes and strides (random floats, zeros elsewhere, so
that indices are valid), one call, then the mean of three, by ``time.perf_counter``; a view gets 0 ms, as in torch's
mode, and so does an op that refuses such values, as torch's mode gives 0 ms to an op it cannot run (listed in
:attr:`EstimatorStats.untimed`). ``RuntimeEstimator`` is
run untimed there: ``sac_milp`` reads only the module order from it. A model built on ``meta`` (too large for real
tensors here) is priced instead (:data:`CPU_ROOFLINE`): each op's FLOPs and bytes moved at this CPU's measured speed,
fxplan's roofline (:meth:`fxplan.costs.timecost.DeviceSpeed.seconds`), nothing run on real tensors. Only the ILPs'
objective (recomputation time) depends on the times; their memory constraint is torch's estimate of bytes, which no
time changes.

Matching the chosen op outputs at run time. A selective-checkpoint policy is asked about each op call of the
forward; it is matched to ``SACEstimator``'s list by operator name and how many calls of that operator came before it
in the module's forward (``torch.utils.checkpoint`` caches by operator overload and count). ``SACEstimator`` records
a step on fake tensors, and a model may run other ops on fake tensors than on real ones (Hugging Face transformers
build an explicit causal mask for fake tensors and let SDPA make it for real ones): a call the list does not have is
recomputed, or kept if it writes in place (torch's rule for in-place ops), and the calls met so are counted
(:attr:`SACForward.unmatched`).
"""

from __future__ import annotations

import contextlib
import functools
import io
import logging
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_map
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from fxplan.capture.capturers import ExampleCall
from fxplan.capture.fakes import caches_kept_real, fake_copy, fake_mode_of, to_fake
from fxplan.costs.op_census import call_cost
from fxplan.costs.timecost import device_speed
from fxplan.errors import BudgetError, FxplanError

#: The runtime estimates made here on the CPU (module docstring); torch's two modes keep their own names.
CPU_BENCHMARK = "cpu-benchmark"
CPU_ROOFLINE = "cpu-roofline"
TORCH_MODES = ("operator-level-benchmark", "operator-level-cost-model")
RUNTIME_MODES = (CPU_BENCHMARK, CPU_ROOFLINE, *TORCH_MODES)


def _tools() -> Any:
    """torch.distributed._tools' SAC pieces, or an :class:`FxplanError` saying what is missing."""
    try:
        from torch.distributed._tools import ilp_utils, mem_tracker, runtime_estimator, sac_estimator, sac_ilp
    except ImportError as exc:
        missing = getattr(exc, "name", None) or str(exc)
        raise FxplanError(f"PyTorch's automatic selective checkpointing (torch.distributed._tools.sac_ilp) cannot be "
                          f"imported ({missing}): it needs the packages pulp and pwlf (pip install pulp pwlf)") from exc
    return ilp_utils, mem_tracker, runtime_estimator, sac_estimator, sac_ilp


def default_runtime_mode(model: nn.Module) -> str:
    """torch's roofline model for a model on an accelerator that is there; :data:`CPU_ROOFLINE` for a model on
    ``meta`` (built too large for real tensors here); else :data:`CPU_BENCHMARK`."""
    devices = {p.device.type for p in model.parameters()}
    if devices - {"cpu", "meta"} and torch.accelerator.is_available():
        return TORCH_MODES[1]
    return CPU_ROOFLINE if "meta" in devices else CPU_BENCHMARK


def _real_like(x: Any) -> Any:
    if not isinstance(x, torch.Tensor):
        return x
    # the values on a flat storage, then the tensor's strides over it (an expanded tensor's overlap)
    size = 1 + sum((n - 1) * st for n, st in zip(x.shape, x.stride()) if n > 0) if x.numel() else 0
    flat = torch.empty(size, dtype=x.dtype, device=getattr(x, "fake_device", x.device))
    flat = flat.uniform_() if flat.is_floating_point() else flat.zero_()  # zeros: valid indices
    return flat.as_strided(x.shape, x.stride())


_VIEW_TAGS = (torch.Tag.inplace_view,)


def _cpu_timer(untimed: set[str]) -> Any:
    """An ``(func, args, kwargs) -> (fake output, ms)`` estimate for torch's estimators (module docstring)."""
    from torch.utils._mode_utils import no_dispatch
    from torch.utils._runtime_estimation import _VIEW_OPS

    def estimate(func: Any, args: Any, kwargs: Any) -> tuple[Any, float]:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func._overloadpacket in _VIEW_OPS or any(t in func.tags for t in _VIEW_TAGS):
            return out, 0.0
        try:
            with no_dispatch(), torch.no_grad():
                real_args, real_kwargs = tree_map(_real_like, (args, kwargs))
                func(*real_args, **real_kwargs)
                start = time.perf_counter()
                for _ in range(3):
                    func(*real_args, **real_kwargs)
                return out, (time.perf_counter() - start) / 3 * 1e3
        except Exception:  # an op that refuses made-up values: torch's benchmark mode gives it 0 ms too
            untimed.add(str(func))
            return out, 0.0

    return estimate


def _roofline_timer() -> Any:
    """An ``(func, args, kwargs) -> (fake output, ms)`` estimate from each op's FLOPs and bytes moved at this
    CPU's measured speed (:func:`fxplan.costs.timecost.device_speed`), without running it on real tensors."""
    speed = device_speed("cpu")

    def estimate(func: Any, args: Any, kwargs: Any) -> tuple[Any, float]:
        out, flops, moved = call_cost(func, args, kwargs or {})
        return out, 0.0 if moved == 0 else speed.seconds(flops, moved, 1) * 1e3

    return estimate


def _untimed(func: Any, args: Any, kwargs: Any) -> tuple[Any, float]:
    return func(*args, **(kwargs or {})), 0.0


@dataclass
class EstimatorStats:
    """What torch's estimators measured of one step of a model (on a fake copy), for its ILPs."""

    graph: Any                      # ilp_utils.Graph: the module tree with memory and time per module
    per_module: dict[str, Any]      # module FQN -> sac_estimator.SACStats (the op calls of its forward)
    root: str                       # the root's FQN (its class name), the prefix of every other
    runtime_mode: str
    untimed: set[str] = field(default_factory=set)
    dropped_repeats: list[str] = field(default_factory=list)  # leaf modules called more than once (kept once)
    no_memory: list[str] = field(default_factory=list)  # modules with nothing to discard, no checkpoint candidates

    @property
    def baseline_peak_bytes(self) -> int:
        """The unplanned step's peak as torch's ILP models it (parameters, gradients, activations)."""
        ilp_utils, *_ = _tools()
        return int(ilp_utils.get_peak_memory_runtime_baseline(self.graph)[0])

    @property
    def parameter_bytes(self) -> int:
        return int(self.graph.nodes[0]["param_per_module"])

    def path(self, fqn: str) -> str:
        """The module path (``transformer.h.0``) of a module FQN (``GPT2LMHeadModel.transformer.h.0``)."""
        return "" if fqn == self.root else fqn[len(self.root) + 1:]


@caches_kept_real()
def collect(model: nn.Module, call: ExampleCall, loss_fn: Any, runtime_mode: str) -> EstimatorStats:
    """Run torch's three estimators on one step of a fake copy of ``model`` (module docstring); the model, its
    buffers and the random state are left as they were."""
    if runtime_mode not in RUNTIME_MODES:
        raise FxplanError(f"unknown runtime mode {runtime_mode!r}; modes: {', '.join(RUNTIME_MODES)}")
    if runtime_mode in TORCH_MODES and not torch.accelerator.is_available():
        raise FxplanError(f"SACEstimator's {runtime_mode!r} mode needs an accelerator (CUDA) and this machine has "
                          f"none; use runtime_mode={CPU_BENCHMARK!r}, which times each op on the CPU")
    ilp_utils, mem_tracker, runtime_estimator, sac_estimator, _ = _tools()
    fake_mode = fake_mode_of(model, (call.args, call.kwargs))  # the inputs' own, where they are fake already
    fmodel = fake_copy(model, fake_mode)
    args, kwargs = to_fake((call.args, call.kwargs), fake_mode)
    untimed: set[str] = set()
    timer = _roofline_timer() if runtime_mode == CPU_ROOFLINE else _cpu_timer(untimed)
    devices = list(range(torch.cuda.device_count())) if torch.cuda.is_available() else []

    def step() -> None:
        loss_fn(fmodel(*args, **kwargs)).backward()
        for p in fmodel.parameters():
            p.grad = None

    with torch.random.fork_rng(devices=devices), fake_mode:
        memory = mem_tracker.MemTracker()
        memory.track_external(fmodel)
        with memory:
            step()
        # on the CPU: torch's benchmark mode, its timing replaced by the CPU's (module docstring)
        on_cpu = runtime_mode not in TORCH_MODES
        torch_mode = TORCH_MODES[0] if on_cpu else runtime_mode
        runtime = runtime_estimator.RuntimeEstimator()(estimate_mode_type=torch_mode)
        sac = sac_estimator.SACEstimator()(estimate_mode_type=torch_mode)
        if on_cpu:
            _set_estimate(runtime, "_estimate", _untimed)  # only its module order is used (module docstring)
            runtime._estimate_mode_type = runtime_mode
            _set_estimate(sac, "_estimate_runtime", timer)
        with contextlib.redirect_stdout(io.StringIO()), runtime:  # it prints its total time on exit
            step()
        with sac:
            out = fmodel(*args, **kwargs)
        del out
        device = next((p.device for p in model.parameters()), torch.device("cpu"))
        no_memory = _drop_modules_without_memory(sac)
        try:
            info = ilp_utils.aggregate_stats(fmodel, memory, runtime, sac, device)
        except KeyError as exc:
            raise FxplanError(f"torch's MemTracker has no snapshot {exc} of a module of {type(model).__name__} "
                              "(a module whose backward never runs?), so ilp_utils.aggregate_stats cannot model "
                              "this step") from exc
    dropped = _drop_repeated_leaves(info)
    graph = ilp_utils.parse_module_info(info)
    return EstimatorStats(graph, dict(sac.sac_mod_stats), graph.nodes[0]["fqn"], runtime_mode, untimed, dropped,
                          no_memory)


def _set_estimate(estimator: Any, attribute: str, timer: Any) -> None:
    if not hasattr(estimator, attribute):
        raise FxplanError(f"{type(estimator).__name__} has no attribute {attribute} in this torch "
                          f"({torch.__version__}): its CPU timing cannot be set; use an accelerator and one of "
                          f"{', '.join(TORCH_MODES)}")
    setattr(estimator, attribute, timer)


def _drop_modules_without_memory(sac: Any) -> list[str]:
    """Leave out of ``SACEstimator``'s statistics the modules whose op calls it gives no memory at all, so that
    ``aggregate_stats`` treats them as it treats leaves: never a checkpoint unit. Such a module has nothing to
    discard: besides views its only op is its last, whose output the estimator counts as the block's output (a
    Hugging Face ViT's patch embedding: a convolution, a view, a transpose), and torch's trade-off curve divides by
    that memory (a ZeroDivisionError). A module with memory but no time at all raises :class:`FxplanError`: the curve
    divides by its time too, and a free recomputation is not a thing to leave out. Returns the modules left out."""
    left_out = []
    for fqn, op_stats in list(sac.sac_mod_stats.items()):
        if sum(op_stats.memory) == 0:
            del sac.sac_mod_stats[fqn]
            sac.sac_mod_greedy_order_meta.pop(fqn, None)
            left_out.append(fqn)
        elif sum(op_stats.runtimes) == 0:
            raise FxplanError(f"torch's SACEstimator timed every op of {fqn} at 0 ms, and its trade-off curve "
                              "divides by the module's time")
    return left_out


def _drop_repeated_leaves(info: dict[str, Any]) -> list[str]:
    """Keep each module once in the module orders ``parse_module_info`` reads, where a leaf module (one that is
    never a checkpoint unit) runs more than once a step (torchvision's Bottleneck calls one ReLU three times):
    its first place in the pre-order (the tree), its last in the post-order (where its memory snapshot, the last
    call's, was taken). A module with children that runs more than once raises :class:`FxplanError`: the ILP has one
    node, one call's memory, for it. Returns the leaves so kept once."""
    order = info["mod_order"]
    leaves = {s["fqn"] for s in info["mod_stats"] if s["is_leaf"]}
    counts: dict[str, int] = defaultdict(int)
    for fqn in order["fw_pre_order"]:
        counts[fqn] += 1
    repeated = [fqn for fqn, n in counts.items() if n > 1]
    if not repeated:
        return []
    inner = [fqn for fqn in repeated if fqn not in leaves]
    if inner:
        raise FxplanError(f"{inner[0]} runs {counts[inner[0]]} times in one step; torch's sac_milp models each module "
                          "as one call, so it cannot plan a module with children that is called more than once")
    order["fw_pre_order"] = list(dict.fromkeys(order["fw_pre_order"]))
    post = order["fw_post_order"]
    order["fw_post_order"] = [fqn for i, fqn in enumerate(post) if fqn not in post[i + 1:]]
    return repeated


@dataclass
class SACPlan:
    """What torch's ILPs chose for one budget, and what they predicted of it."""

    budget_bytes: int
    smallest_budget_bytes: int       # the smallest budget sac_milp finds a plan under (:func:`smallest_budget`)
    baseline_peak_bytes: int         # torch's model of the unplanned peak
    predicted_peak_bytes: int        # sac_milp's upper bound on the planned peak
    recomputation_ms: float          # sac_milp's objective, in the runtime mode's milliseconds
    discard: dict[str, float]        # module path -> share of its activation memory discarded
    kept_calls: dict[str, tuple[int, int]]  # module path -> (op calls kept, op calls in its forward)
    runtime_mode: str
    untimed_ops: list[str] = field(default_factory=list)
    dropped_repeats: list[str] = field(default_factory=list)
    no_memory: list[str] = field(default_factory=list)

    def summary(self) -> str:
        mib = 2**20
        lines = [f"torch sac_milp: budget {self.budget_bytes / mib:.1f} MiB (its smallest feasible "
                 f"{self.smallest_budget_bytes / mib:.1f} MiB, its unplanned peak "
                 f"{self.baseline_peak_bytes / mib:.1f} MiB), predicted peak "
                 f"{self.predicted_peak_bytes / mib:.1f} MiB, recomputation {self.recomputation_ms:.2f} ms "
                 f"({self.runtime_mode})"]
        for path, share in self.discard.items():
            kept, calls = self.kept_calls[path]
            lines.append(f"  {path or '(root)'}: discard {share:.0%}, {kept} of {calls} op calls kept")
        return "\n".join(lines)


def smallest_budget(stats: EstimatorStats, tolerance: float = 1e-3) -> int:
    """The smallest budget in bytes under which ``sac_milp`` finds a plan, to ``tolerance`` of the unplanned peak
    (bisection: feasibility only grows with the budget). Its model of the unplanned peak is always feasible."""
    *_, sac_ilp = _tools()
    logger = logging.getLogger(sac_ilp.__name__)

    def feasible(budget: float) -> bool:
        level = logger.level
        logger.setLevel(logging.CRITICAL)  # the probes below the smallest budget fail by design: not errors
        try:
            return sac_ilp.sac_milp(stats.graph, memory_budget=budget / 2**30)[2] >= 0
        finally:
            logger.setLevel(level)

    high = stats.baseline_peak_bytes * (1 + 1e-6)
    low = 2.0 * stats.parameter_bytes  # parameters and their gradients: below anything a step can peak at
    if feasible(low):
        return int(low)
    while high - low > tolerance * stats.baseline_peak_bytes:
        middle = (low + high) / 2
        low, high = (low, middle) if feasible(middle) else (middle, high)
    return int(high)


def solve(stats: EstimatorStats, budget_bytes: int,
          smallest: int | None = None) -> tuple[SACPlan, dict[str, dict[str, tuple[bool, ...]]]]:
    """torch's ``sac_milp`` at ``budget_bytes``, then its per-module op ILP for each chosen module: the plan, and
    per module path the decisions per operator name (keep the n-th call or not). ``smallest``: the smallest
    feasible budget, if known (recorded in the plan).

    Raises :class:`fxplan.errors.BudgetError` where ``sac_milp`` finds no solution."""
    *_, sac_ilp = _tools()
    discard, recompute_ms, peak = sac_ilp.sac_milp(stats.graph, memory_budget=budget_bytes / 2**30)
    if peak < 0:
        raise BudgetError(f"torch's sac_milp found no plan under {budget_bytes / 2**20:.1f} MiB (its model of the "
                          f"unplanned peak: {stats.baseline_peak_bytes / 2**20:.1f} MiB)",
                          advice="give it a larger budget fraction")
    decisions: dict[str, dict[str, tuple[bool, ...]]] = {}
    kept_calls: dict[str, tuple[int, int]] = {}
    for fqn, share in discard.items():
        op_stats = stats.per_module[fqn]
        kept_share = max(0.0, 1.0 - share, _forced_share(op_stats))
        keep = sac_ilp.get_optimal_checkpointing_policy_per_module(op_stats, memory_budget=kept_share)
        if len(keep) != len(op_stats.func_names):
            raise FxplanError(f"torch's get_optimal_checkpointing_policy_per_module found no policy for {fqn} keeping "
                              f"{kept_share:.1%} of its activation memory")
        by_name: dict[str, list[bool]] = defaultdict(list)
        for name, k in zip(op_stats.func_names, keep):
            by_name[name].append(bool(k))
        path = stats.path(fqn)
        decisions[path] = {name: tuple(flags) for name, flags in by_name.items()}
        kept_calls[path] = (sum(keep), len(keep))
    plan = SACPlan(budget_bytes, smallest if smallest is not None else smallest_budget(stats),
                   stats.baseline_peak_bytes, int(peak), float(recompute_ms),
                   {stats.path(f): s for f, s in discard.items()}, kept_calls, stats.runtime_mode,
                   sorted(stats.untimed), stats.dropped_repeats, stats.no_memory)
    return plan, decisions


def _forced_share(op_stats: Any) -> float:
    """The share of a module's op memory that torch's per-op ILP must keep whatever its budget: in-place ops that
    write a tensor the module did not make (BatchNorm's ``num_batches_tracked.add_``), the in-place ops on those, and
    random ops where ``force_store_random``. ``sac_milp`` may discard a module's memory wholly (a share of 1), which
    leaves the per-op ILP a budget of 0 and no solution; it gets this share instead, a few bytes on BatchNorm."""
    forced = {op for op, parent in op_stats.inplace_ops if op == parent}
    if op_stats.force_store_random:
        forced |= set(op_stats.rand_ops)
    grew = True
    while grew:
        more = {op for op, parent in op_stats.inplace_ops if parent in forced} - forced
        forced |= more
        grew = bool(more)
    total = sum(op_stats.memory)
    return min(1.0, sum(op_stats.memory[i] for i in forced) / total * (1 + 1e-9)) if total else 0.0


def _is_inplace(func: Any) -> bool:
    from torch.testing._internal.composite_compliance import is_inplace

    return is_inplace(func)


@functools.lru_cache(maxsize=1)
def _estimator_skips() -> frozenset[Any]:
    from torch.distributed._tools.sac_estimator import OPS_TO_ALWAYS_SKIP

    return frozenset(OPS_TO_ALWAYS_SKIP)


class SACPolicy:
    """One call of a module's forward: the ``n``-th call of an operator is kept or recomputed as the decisions say;
    a call they do not have is recomputed, or kept if it writes in place (module docstring)."""

    def __init__(self, decisions: dict[str, tuple[bool, ...]], unmatched: dict[str, int]):
        self.decisions = decisions
        self.unmatched = unmatched
        self.counts: dict[str, int] = defaultdict(int)

    def __call__(self, ctx: Any, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        if func in _estimator_skips():  # ops SACEstimator leaves out of its lists (clone, lift_fresh)
            return CheckpointPolicy.PREFER_RECOMPUTE
        name = func._overloadpacket.__name__
        i = self.counts[name]
        self.counts[name] += 1
        flags = self.decisions.get(name, ())
        if i < len(flags):
            keep = flags[i]
        else:
            self.unmatched[name] += 1
            keep = _is_inplace(func)  # as SACEstimator classifies it
        return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE


class SACForward:
    """A module's forward under non-reentrant ``torch.utils.checkpoint`` with a :class:`SACPolicy`; the plain
    forward where nothing needs gradients."""

    def __init__(self, module: nn.Module, decisions: dict[str, tuple[bool, ...]]):
        self.previous = module.__dict__.get("forward")  # an instance forward another library set
        self.module_type = type(module)
        self.module = module
        self.decisions = decisions
        self.unmatched: dict[str, int] = defaultdict(int)  # op calls with no decision, by operator, over all calls

    def original(self, *args: Any, **kwargs: Any) -> Any:
        if self.previous is not None:
            return self.previous(*args, **kwargs)
        return self.module_type.forward(self.module, *args, **kwargs)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return self.original(*args, **kwargs)
        # checkpoint re-reads its arguments in backward: containers of its own, the tensors in them unchanged
        args, kwargs = tree_map(lambda x: x, (args, kwargs))
        contexts = functools.partial(_contexts, self.decisions, self.unmatched)
        return checkpoint(self.original, *args, use_reentrant=False, context_fn=contexts, **kwargs)


def _contexts(decisions: dict[str, tuple[bool, ...]], unmatched: dict[str, int]) -> Any:
    # torch's per-module ILP keeps an in-place op together with the op whose output it writes (dropout on the CPU:
    # empty_like, bernoulli_, div_), so an output it keeps is written after it is cached; torch.utils.checkpoint's
    # check of cached tensors would refuse the very policy the ILP chose, so it is off.
    return create_selective_checkpoint_contexts(SACPolicy(decisions, unmatched), allow_cache_entry_mutation=True)


def install(model: nn.Module, decisions: dict[str, dict[str, tuple[bool, ...]]]) -> dict[str, SACForward]:
    """Give each chosen module of ``model`` (by path; ``""``: the root) a :class:`SACForward`."""
    installed = {}
    for path, module_decisions in decisions.items():
        module = model.get_submodule(path)
        forward = SACForward(module, module_decisions)
        module.forward = forward
        installed[path] = forward
    return installed


__all__ = ["CPU_BENCHMARK", "CPU_ROOFLINE", "RUNTIME_MODES", "SACForward", "SACPlan", "SACPolicy", "EstimatorStats",
           "collect", "default_runtime_mode", "install", "smallest_budget", "solve"]
