"""``fxplan compare``: fxplan's plans against vanilla PyTorch and its peers, measured in one run.

For each network every method (:func:`default_methods`) is prepared once and measured three ways:

1. **peak at the paper batch** (Kusumoto et al. 2019, Table 1) on fake tensors with
   :func:`fxplan.measure.measure_step` (exact, allocates nothing). Compiled peers cannot be measured
   this way (dispatch modes do not see compiled code), so their paper-batch peak is left empty;
2. **peak at a small batch** on a real step, every method with the same meter (``torch.profiler``
   allocation events on the CPU, the caching allocator on CUDA): the like-for-like column that
   includes ``torch.compile``;
3. **step time at the small batch**, repetitions interleaved across methods (method A, B, C, A, B, C,
   ...) so that load on the machine hits every method alike; the median over repetitions, divided by
   vanilla's, is the time ratio.

The recompute fraction is measured too: forward FLOPs recomputed in one step (FLOPs of the method's
step minus vanilla's, counted by ``torch.utils.flop_counter`` on fake tensors), divided by the FLOPs of
vanilla's forward. fxplan rows also carry the planner's own prediction.

A method that fails becomes a row that says why (``not applicable``, ``timed out``, ``crashed`` or
``error`` with the exception text); the other rows and the report are still produced.
"""

from __future__ import annotations

import contextlib
import copy
import signal
import statistics
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.utils._pytree import tree_leaves, tree_map

from fxplan import peers
from fxplan.errors import FxplanError
from fxplan.measure import GiB, fake_copy, measure_step, profiled_step_peak, resident_bytes

#: fxplan's methods: row name -> (strategy, solver). ``chen`` is Chen et al.'s plan (strategy ignored).
FXPLAN_METHODS = {
    "chen": ("time", "chen"),
    "approx-time": ("time", "approx"),
    "approx-memory": ("memory", "approx"),
    "exact-time": ("time", "exact"),
    "exact-memory": ("memory", "exact"),
}
DEFAULT_COMPILE_BUDGETS = (0.75, 0.5, 0.25)
DEFAULT_CURVE_POINTS = (0.25, 0.5, 0.75)


class MethodTimeout(FxplanError):
    """A method's preparation (e.g. the exact DP) ran past its time limit."""


@dataclass
class Row:
    """One method on one network. Bytes are whole-step peaks (parameters, gradients, activations...)."""

    network: str
    method: str
    family: str                                # "baseline", "peer" or "fxplan"
    status: str = "ok"                         # ok | not applicable | timed out | crashed | error
    note: str = ""
    main: bool = True                          # False: an extra point of the trade-off curve only
    batch: int = 0
    input_size: int = 0
    peak_bytes: int | None = None              # paper batch, fake tensors
    reduction: float | None = None             # 1 - peak / vanilla peak
    small_batch: int = 0
    small_input_size: int = 0
    small_peak_bytes: int | None = None        # small batch, real step, same meter for every method
    small_reduction: float | None = None
    small_meter: str = ""
    step_seconds: float | None = None          # median real step time at the small batch
    time_ratio: float | None = None            # step_seconds / vanilla's
    recompute_fraction: float | None = None    # measured: recomputed forward FLOPs / forward FLOPs
    planned_recompute_fraction: float | None = None
    predicted_peak_bytes: int | None = None
    budget_bytes: int | None = None
    budget: str = ""                           # what the method was given, in words
    plan_seconds: float | None = None          # wall time to produce the module (trace + solve + codegen)
    solve_seconds: float | None = None
    segments: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class Prepared:
    """What a method's ``prepare`` returns: the module to run, and what it knows about itself."""

    module: torch.nn.Module
    info: dict[str, Any] = field(default_factory=dict)   # Row fields to set (budget, plan numbers, note)
    fake_meter: bool = True                               # may be measured on fake tensors
    real_module: torch.nn.Module | None = None            # module for real steps, if not a copy of module


@dataclass
class Context:
    """One network being compared: the model, its inputs at both batches, and shared intermediate results."""

    network: str
    model: torch.nn.Module
    loss_fn: Callable[[Any], torch.Tensor]
    paper_inputs: tuple                  # fake tensors at the paper batch
    small_inputs: tuple                  # real tensors at the small batch, on ``device``
    device: torch.device
    time_limit: float | None
    vanilla_peak: int | None = None
    cache: dict[str, Any] = field(default_factory=dict)


@dataclass
class Method:
    name: str
    family: str
    prepare: Callable[[Context], Prepared]
    main: bool = True


@dataclass
class Comparison:
    """Everything ``fxplan compare`` measured: rows, one-step memory timelines, and how it was run."""

    rows: list[Row]
    timelines: dict[str, dict[str, list[tuple[str, int]]]] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)

    def rows_for(self, network: str) -> list[Row]:
        return [r for r in self.rows if r.network == network]


# ------------------------------------------------------------------------------------------- methods


@contextlib.contextmanager
def time_limit(seconds: float | None) -> Iterator[None]:
    """Raise :class:`MethodTimeout` in the block after ``seconds`` (SIGALRM; main thread on Unix only)."""
    usable = seconds and hasattr(signal, "setitimer") and threading.current_thread() is threading.main_thread()
    if not usable:
        yield
        return

    def handler(signum, frame):
        raise MethodTimeout(f"timed out after {seconds:g} s")

    old = signal.signal(signal.SIGALRM, handler)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def _vanilla(ctx: Context) -> Prepared:
    return Prepared(peers.vanilla(ctx.model), {"budget": "-"})


def _checkpoint_sequential(ctx: Context) -> Prepared:
    module = peers.checkpoint_sequential_peer(ctx.model)
    n = len(module.chain)
    return Prepared(module, {"budget": f"{module.segments} segments of {n} steps", "segments": module.segments})


def _compiled(fraction: float) -> Callable[[Context], Prepared]:
    def prepare(ctx: Context) -> Prepared:
        real_model = _real_copy(ctx.model, ctx.device)
        module = peers.compile_peer(real_model, fraction)
        start = time.perf_counter()
        module.warm_up(ctx.small_inputs, ctx.loss_fn)
        return Prepared(module, {
            "budget": f"activation_memory_budget={fraction:g}", "plan_seconds": time.perf_counter() - start,
            "note": "compiled code is invisible to the fake-tensor meter: measured at the small batch only",
        }, fake_meter=False, real_module=module)

    return prepare


def fxplan_rewrite() -> Callable[..., torch.nn.Module]:
    """The lead's ``fxplan.rewrite`` (model, budget_gb, *, example_inputs, strategy, solver)."""
    import fxplan

    rewrite = getattr(fxplan, "rewrite", None)
    if rewrite is None:
        raise FxplanError("fxplan.rewrite is not available in this checkout (fxplan/__init__.py does not "
                          "export it yet), so fxplan's own plans cannot be measured")
    return rewrite


def _fxplan(strategy: str, solver: str, point: float | None = None) -> Callable[[Context], Prepared]:
    """fxplan at the smallest feasible budget (as in Table 1), or at ``point`` of the way from it to vanilla."""

    def prepare(ctx: Context) -> Prepared:
        rewrite = fxplan_rewrite()
        budget_gb = None
        label = "smallest feasible"
        if point is not None:
            lo, hi = _min_budget(ctx), ctx.vanilla_peak
            if hi is None:
                raise FxplanError("vanilla's peak is unknown, so no budget between it and the minimum can be set")
            budget_bytes = int(lo + point * (hi - lo))
            budget_gb = budget_bytes / GiB
            label = f"{budget_gb:.3f} GiB"
        start = time.perf_counter()
        with time_limit(ctx.time_limit if solver == "exact" else None):
            module = rewrite(ctx.model, budget_gb, example_inputs=ctx.paper_inputs, strategy=strategy,
                             solver=solver, loss_fn=ctx.loss_fn)
        seconds = time.perf_counter() - start
        plan = getattr(module, "fxplan_plan", None)
        info: dict[str, Any] = {"budget": label, "plan_seconds": seconds}
        if plan is not None:
            info.update(predicted_peak_bytes=plan.predicted_peak_bytes, budget_bytes=plan.budget_bytes,
                        planned_recompute_fraction=plan.recompute_fraction, solve_seconds=plan.solve_seconds,
                        segments=len(plan.segments))
        return Prepared(module, info)

    return prepare


def _min_budget(ctx: Context) -> int:
    if "min_budget" not in ctx.cache:
        from fxplan.planning import min_budget_bytes

        ctx.cache["min_budget"] = min_budget_bytes(ctx.model, ctx.paper_inputs, solver="approx")
    return ctx.cache["min_budget"]


def default_methods(
    compile_budgets: Sequence[float] = DEFAULT_COMPILE_BUDGETS,
    curve_points: Sequence[float] = DEFAULT_CURVE_POINTS,
    *,
    exact: bool = True,
) -> list[Method]:
    """Vanilla, the peers, fxplan's five plans, then extra trade-off points (approx-time and chen at
    budgets ``curve_points`` of the way from the smallest feasible budget to vanilla's peak)."""
    methods = [Method("vanilla", "baseline", _vanilla),
               Method("checkpoint_sequential", "peer", _checkpoint_sequential)]
    methods += [Method(f"torch.compile@{f:g}", "peer", _compiled(f)) for f in compile_budgets]
    for name, (strategy, solver) in FXPLAN_METHODS.items():
        if exact or solver != "exact":
            methods.append(Method(name, "fxplan", _fxplan(strategy, solver)))
    for p in curve_points:
        methods.append(Method(f"approx-time@{p:g}", "fxplan", _fxplan("time", "approx", p), main=False))
        methods.append(Method(f"chen@{p:g}", "fxplan", _fxplan("time", "chen", p), main=False))
    return methods


# ------------------------------------------------------------------------------------------ measuring


def _real_copy(module: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    return copy.deepcopy(module).to(device)


def count_flops(module: torch.nn.Module, fake_inputs: tuple, loss_fn) -> tuple[int, int]:
    """(forward FLOPs, whole-step FLOPs) of one step of ``module`` on fake inputs; nothing is allocated."""
    from torch.utils.flop_counter import FlopCounterMode

    mode = next(x.fake_mode for x in tree_leaves(fake_inputs) if isinstance(x, FakeTensor))
    fake_module = fake_copy(module, mode)
    counter = FlopCounterMode(display=False)
    with mode, counter:
        loss = loss_fn(fake_module(*fake_inputs))
        forward = counter.get_total_flops()
        loss.backward()
    return forward, counter.get_total_flops()


def real_step_peak(module: torch.nn.Module, inputs: tuple, loss_fn, device: torch.device) -> tuple[int, str]:
    """Peak bytes of one real step of ``module`` (run in place), and the meter's name.

    CPU: ``torch.profiler`` allocation events (sees compiled code), with the tensors that exist before
    the step counted as resident. CUDA: the caching allocator's ``max_memory_allocated``.
    """
    module.zero_grad(set_to_none=True)
    if device.type == "cuda":
        resident = resident_bytes(module, inputs)
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        loss_fn(module(*inputs)).backward()
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device) - base + resident
        module.zero_grad(set_to_none=True)
        return peak, "cuda allocator"
    peak = profiled_step_peak(module, inputs, loss_fn)
    module.zero_grad(set_to_none=True)
    return peak, "torch.profiler allocation events"


def _step(module: torch.nn.Module, inputs: tuple, loss_fn, device: torch.device) -> float:
    module.zero_grad(set_to_none=True)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    loss_fn(module(*inputs)).backward()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


def _describe(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:400]


def _fail(row: Row, status: str, exc: BaseException, where: str) -> None:
    row.status = status
    row.note = (f"{where}: " if where else "") + _describe(exc)


# ------------------------------------------------------------------------------------------ the driver


def compare_network(
    network: str,
    model: torch.nn.Module,
    loss_fn: Callable[[Any], torch.Tensor],
    make_inputs: Callable[[int, int | None], tuple],
    *,
    batch: int,
    input_size: int,
    small_batch: int,
    small_input_size: int,
    methods: Sequence[Method],
    repeats: int = 3,
    time_limit_s: float | None = 120.0,
    device: torch.device | str = "cpu",
    progress: Any = None,
    timeline: bool = True,
) -> tuple[list[Row], dict[str, list[tuple[str, int]]]]:
    """Measure every method on one network. ``make_inputs(batch, input_size)`` makes real CPU inputs.

    Returns the rows (vanilla first, in ``methods`` order) and the memory timelines of one paper-batch
    step for vanilla and for the first fxplan plan that worked (keys: method names).
    """
    device = torch.device(device)
    progress = progress or _Silent()
    with FakeTensorMode() as mode:
        paper_inputs = make_inputs(batch, input_size)
    paper_inputs = tuple(tree_map(lambda x: mode.from_tensor(x) if isinstance(x, torch.Tensor)
                                  and not isinstance(x, FakeTensor) else x, list(paper_inputs)))
    small_inputs = tuple(tree_map(lambda x: x.to(device) if isinstance(x, torch.Tensor) else x,
                                  list(make_inputs(small_batch, small_input_size))))
    ctx = Context(network, model, loss_fn, paper_inputs, small_inputs, device, time_limit_s)
    rows: list[Row] = []
    live: dict[str, torch.nn.Module] = {}
    fake_modules: dict[str, torch.nn.Module] = {}
    flops: dict[str, tuple[int, int]] = {}
    for m in methods:
        row = Row(network, m.name, m.family, main=m.main, batch=batch, input_size=input_size,
                  small_batch=small_batch, small_input_size=small_input_size)
        rows.append(row)
        try:
            with progress.step(f"{network}: preparing {m.name}"):
                prepared = m.prepare(ctx)
        except peers.NotApplicable as exc:
            row.status, row.note = "not applicable", str(exc).removeprefix("not applicable: ")
            continue
        except MethodTimeout as exc:
            row.status, row.note = "timed out", f"{exc} (planning)"
            continue
        except Exception as exc:  # any failure of one method must not stop the comparison
            _fail(row, "error", exc, "preparing")
            continue
        for key, value in prepared.info.items():
            setattr(row, key, value)
        if prepared.fake_meter:
            try:
                with progress.step(f"{network}: {m.name}: peak at batch {batch} (fake tensors)"):
                    row.peak_bytes = measure_step(prepared.module, paper_inputs, fake=True,
                                                  loss_fn=loss_fn).peak_bytes
                    flops[m.name] = count_flops(prepared.module, paper_inputs, loss_fn)
                fake_modules[m.name] = prepared.module
            except Exception as exc:
                _fail(row, "crashed", exc, f"one step at batch {batch} (fake tensors)")
                continue
        if m.name == "vanilla":
            ctx.vanilla_peak = row.peak_bytes
        try:
            # On the CPU every method runs on the model's own parameters (the peers and fxplan's rewrites
            # share them), so memory does not grow with the number of methods; elsewhere: one copy each.
            real = prepared.real_module or (prepared.module if device.type == "cpu"
                                            else _real_copy(prepared.module, device))
            with progress.step(f"{network}: {m.name}: peak at batch {small_batch} (real step)"):
                row.small_peak_bytes, row.small_meter = real_step_peak(real, small_inputs, loss_fn, device)
            live[m.name] = real
        except Exception as exc:
            _fail(row, "crashed", exc, f"one real step at batch {small_batch}")
    _time_interleaved(rows, live, small_inputs, loss_fn, device, repeats, progress, network)
    _derive(rows, flops)
    timelines: dict[str, list[tuple[str, int]]] = {}
    if timeline:
        preference = ["approx-time", "exact-time", "approx-memory", "exact-memory", "chen"]
        chosen = sorted((r.method for r in rows if r.family == "fxplan" and r.main and r.status == "ok"
                         and r.method in fake_modules),
                        key=lambda m: preference.index(m) if m in preference else len(preference))
        for name in ["vanilla", *chosen[:1]]:
            if name in fake_modules:
                with progress.step(f"{network}: memory timeline of {name}"):
                    stats = measure_step(fake_modules[name], paper_inputs, fake=True, loss_fn=loss_fn,
                                         timeline=True)
                timelines[name] = list(stats.timeline or [])
    return rows, timelines


def _time_interleaved(rows, live, inputs, loss_fn, device, repeats, progress, network) -> None:
    """Median step time per method, repetitions interleaved across methods (one warm-up step each)."""
    by_name = {r.method: r for r in rows}
    samples: dict[str, list[float]] = {name: [] for name in live}
    with progress.step(f"{network}: timing {len(live)} methods x {repeats} interleaved steps "
                       f"at batch {rows[0].small_batch}"):
        for rep in range(repeats + 1):
            for name in list(samples):
                try:
                    seconds = _step(live[name], inputs, loss_fn, device)
                except Exception as exc:
                    _fail(by_name[name], "crashed", exc, "timed step")
                    del samples[name]
                    continue
                if rep > 0:
                    samples[name].append(seconds)
    for name, s in samples.items():
        if s:
            by_name[name].step_seconds = statistics.median(s)


def _derive(rows: list[Row], flops: dict[str, tuple[int, int]]) -> None:
    """Reductions, time ratios and measured recompute fractions relative to the vanilla row."""
    base = next((r for r in rows if r.method == "vanilla"), None)
    if base is None:
        return
    for r in rows:
        if r.peak_bytes is not None and base.peak_bytes:
            r.reduction = 1.0 - r.peak_bytes / base.peak_bytes
        if r.small_peak_bytes is not None and base.small_peak_bytes:
            r.small_reduction = 1.0 - r.small_peak_bytes / base.small_peak_bytes
        if r.step_seconds is not None and base.step_seconds:
            r.time_ratio = r.step_seconds / base.step_seconds
        if r.method in flops and "vanilla" in flops and flops["vanilla"][0]:
            fwd, total = flops["vanilla"]
            r.recompute_fraction = max(0.0, (flops[r.method][1] - total) / fwd)


class _Silent:
    def step(self, what: str):
        return contextlib.nullcontext()


# ------------------------------------------------------------------------------------- zoo and CLI


def compare_zoo(
    names: Sequence[str],
    *,
    batch_size: int | None = None,
    input_size: int | None = None,
    small_batch: int | None = None,
    small_input_size: int | None = None,
    methods: Sequence[Method] | None = None,
    progress: Any = None,
    **kwargs: Any,
) -> Comparison:
    """:func:`compare_network` on zoo networks (``models_zoo``); the paper's batch and size by default.

    A network that cannot even be built gets one error row; the others go on.
    """
    import models_zoo

    methods = list(methods) if methods is not None else default_methods()
    comparison = Comparison([], {}, _meta(names, batch_size, small_batch, kwargs))
    for name in names:
        where = "building the network"
        try:
            entry = models_zoo.get(name)
            torch.manual_seed(0)
            model = entry.build()
            batch = batch_size or entry.paper_batch
            size = input_size or entry.input_size
            sb = small_batch or max(entry.min_batch, min(batch, 4))
            ss = small_input_size or entry.quick_input_size or size
            where = "comparing"
            rows, timelines = compare_network(
                name, model, entry.loss, lambda b, s, e=entry: e.example_inputs(batch_size=b, input_size=s),
                batch=batch, input_size=size, small_batch=sb, small_input_size=ss, methods=methods,
                progress=progress, **kwargs)
        except Exception as exc:  # one network's failure must not cost the others their rows
            row = Row(name, "vanilla", "baseline")
            _fail(row, "error", exc, where)
            comparison.rows.append(row)
            continue
        comparison.rows.extend(rows)
        comparison.timelines[name] = timelines
    return comparison


def _meta(names, batch_size, small_batch, kwargs) -> dict[str, Any]:
    import os
    import platform

    return {
        "networks": list(names), "torch": torch.__version__, "python": platform.python_version(),
        "machine": f"{os.cpu_count()}-core CPU" + (f", {torch.cuda.get_device_name()}" if torch.cuda.is_available()
                                                   else ""),
        "repeats": kwargs.get("repeats", 3), "time_limit_s": kwargs.get("time_limit_s", 120.0),
        "started": time.strftime("%Y-%m-%d %H:%M:%S"),
    }


def _floats(text: str) -> list[float]:
    try:
        return [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise FxplanError(f"expected comma-separated numbers, got {text!r}") from None


def add_compare_parser(subparsers: Any) -> Any:
    """Register ``fxplan compare MODEL... [--batch-size N] [--out DIR]`` on an argparse subparsers object."""
    p = subparsers.add_parser(
        "compare", help="measure fxplan's plans against vanilla, checkpoint_sequential and torch.compile",
        description="Measure every method on each zoo network and write report.md/.json/.html and PNG plots.")
    p.add_argument("models", nargs="+", metavar="MODEL", help="zoo network names (see 'fxplan zoo')")
    p.add_argument("--batch-size", type=int, default=None, help="batch for peaks (default: the paper's)")
    p.add_argument("--input-size", type=int, default=None, help="image side for peaks (default: the paper's)")
    p.add_argument("--small-batch", type=int, default=None,
                   help="batch of the real steps (timing, like-for-like peaks; default min(4, batch))")
    p.add_argument("--small-input-size", type=int, default=None, help="input size of the real steps")
    p.add_argument("--out", default="fxplan-compare", help="report directory (default ./fxplan-compare)")
    p.add_argument("--repeats", type=int, default=3, help="timed steps per method, interleaved (default 3)")
    p.add_argument("--time-limit", type=float, default=120.0, help="seconds allowed for an exact DP (default 120)")
    p.add_argument("--compile-budgets", default=",".join(f"{f:g}" for f in DEFAULT_COMPILE_BUDGETS),
                   help="activation_memory_budget values for torch.compile, comma-separated ('' for none)")
    p.add_argument("--curve-points", default=",".join(f"{f:g}" for f in DEFAULT_CURVE_POINTS),
                   help="extra budgets for the trade-off curve, as fractions of the way from the smallest "
                        "feasible budget to vanilla's peak ('' for none)")
    p.add_argument("--no-exact", action="store_true", help="skip the exact DP rows")
    p.add_argument("--device", default=None, help="device of the real steps (default: cuda if present, else cpu)")
    p.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    p.set_defaults(func=cmd_compare)
    return p


def _command_line(args: Any) -> str:
    """The ``fxplan compare`` command that reproduces this run (non-default options only)."""
    parts = ["fxplan", "compare", *args.models]
    defaults = {"batch_size": None, "input_size": None, "small_batch": None, "small_input_size": None,
                "out": "fxplan-compare", "repeats": 3, "time_limit": 120.0, "device": None,
                "compile_budgets": ",".join(f"{f:g}" for f in DEFAULT_COMPILE_BUDGETS),
                "curve_points": ",".join(f"{f:g}" for f in DEFAULT_CURVE_POINTS)}
    for name, default in defaults.items():
        value = getattr(args, name, default)
        if value != default:
            parts += [f"--{name.replace('_', '-')}", repr(value) if value == "" else str(value)]
    if getattr(args, "no_exact", False):
        parts.append("--no-exact")
    return " ".join(parts)


def cmd_compare(args: Any) -> int:
    """Handler of ``fxplan compare``: run, print the summary table, write the report; exit code."""
    from fxplan.cli import Progress
    from fxplan.report import summary_table, write_report

    for name in ("batch_size", "input_size", "small_batch", "small_input_size", "repeats"):
        value = getattr(args, name, None)
        if value is not None and value < 1:
            raise FxplanError(f"--{name.replace('_', '-')} must be a positive integer")
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    methods = default_methods(_floats(args.compile_budgets), _floats(args.curve_points), exact=not args.no_exact)
    comparison = compare_zoo(
        args.models, batch_size=args.batch_size, input_size=args.input_size, small_batch=args.small_batch,
        small_input_size=args.small_input_size, methods=methods, progress=Progress(args.quiet),
        repeats=args.repeats, time_limit_s=args.time_limit if args.time_limit > 0 else None, device=device)
    comparison.meta["command"] = _command_line(args)
    paths = write_report(comparison, args.out)
    print(summary_table(comparison))
    print()
    print("report: " + ", ".join(str(p) for p in paths))
    return 0


__all__ = [
    "Comparison", "Context", "FXPLAN_METHODS", "Method", "MethodTimeout", "Prepared", "Row",
    "add_compare_parser", "cmd_compare", "compare_network", "compare_zoo", "count_flops", "default_methods",
    "real_step_peak", "time_limit",
]
