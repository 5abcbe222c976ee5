"""``fxplan compare``: fxplan's plans against vanilla PyTorch and its peers, measured in one run.

For each network every method (:mod:`fxplan.compare.methods`) is prepared once and measured three ways:

1. **peak at the main batch** (the paper batch of Kusumoto et al. 2019, Table 1, for its networks; the
   zoo's realistic batch for the others) on fake tensors with :func:`fxplan.measure.meter.measure_step`
   (exact, allocates nothing). Compiled peers cannot be measured this way (dispatch modes do not see
   compiled code), so their main-batch peak is left empty;
2. **peak at a small batch** on a real step, every method with the same meter (``torch.profiler``
   allocation events on the CPU, the caching allocator on CUDA): the like-for-like column that
   includes ``torch.compile``;
3. **step time at the small batch** with :func:`fxplan.measure.timing.time_interleaved`: a fixed thread count,
   a warm-up round, then rounds that run every method once in a rotated order, so that load on the
   machine hits every method alike. The time ratio is the median over rounds of the method's step over
   vanilla's step of the same round, with the interquartile range of those per-round ratios; a range
   that contains 1.0 is shown as "within noise". Unless given, the small batch is the smallest of 4, 8,
   16, ... (up to 8 times the first and the main batch) at which a vanilla step takes 0.5 s
   (:func:`fxplan.measure.timing.batch_for_step`), so that timer and scheduler noise stay small.

A model too large for a real step here (a ``fake_only`` zoo entry) gets the first measurement only.
The recompute fraction is measured too: forward FLOPs recomputed in one step (FLOPs of the method's
step minus vanilla's, counted by ``torch.utils.flop_counter`` on fake tensors), divided by the FLOPs of
vanilla's forward. fxplan rows also carry the planner's own prediction: the recompute fraction, and the
step-time ratio predicted by the plan's time costs (``Plan.predicted_extra_seconds`` over a step taken
as three forward passes).

A method that fails becomes a row that says why (``not applicable``, ``timed out``, ``crashed`` or
``error`` with the exception text); the other rows and the report are still produced.
"""

from __future__ import annotations

import os
import platform
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch.utils._pytree import tree_map

from fxplan.capture.fakes import fake_copy, fake_mode_of, to_fake
from fxplan.common.console import Progress, filter_native_logs, format_count
from fxplan.compare import peers
from fxplan.compare.methods import Context, Method, MethodTimeout, default_methods, real_copy
from fxplan.measure.meter import cuda_step_stats, measure_step, profiled_step_peak
from fxplan.measure.timing import MIN_STEP_SECONDS, batch_for_step, fixed_threads, time_interleaved, training_step

#: fxplan plans in the order the memory timeline prefers them.
TIMELINE_PREFERENCE = ("approx-time", "exact-time", "approx-memory", "exact-memory", "chen")


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
    input_label: str = ""                      # "224²" for images, "seq 1024" for token sequences
    peak_bytes: int | None = None              # main batch, fake tensors
    reduction: float | None = None             # 1 - peak / vanilla peak
    small_batch: int = 0                       # 0: no real step (model measured on fake tensors only)
    small_input_size: int = 0
    small_peak_bytes: int | None = None        # small batch, real step, same meter for every method
    small_reduction: float | None = None
    small_meter: str = ""
    step_seconds: float | None = None          # median real step time at the small batch
    step_spread: float | None = None           # (slowest - fastest) / median of the timed steps
    time_ratio: float | None = None            # median over rounds of step / vanilla's step in that round
    ratio_low: float | None = None             # interquartile range of the per-round ratios
    ratio_high: float | None = None
    predicted_time_ratio: float | None = None  # fxplan: 1 + predicted extra seconds / (3 x forward seconds)
    predicted_extra_seconds: float | None = None  # fxplan: Plan.predicted_extra_seconds at the main batch
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
class Comparison:
    """Everything ``fxplan compare`` measured: rows, one-step memory timelines, and how it was run."""

    rows: list[Row]
    timelines: dict[str, dict[str, list[tuple[str, int]]]] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)

    def rows_for(self, network: str) -> list[Row]:
        return [r for r in self.rows if r.network == network]

    def networks(self) -> list[str]:
        """Network names in the order they were compared."""
        return list(dict.fromkeys(r.network for r in self.rows))

    def failed_networks(self, requested: Sequence[str] | None = None) -> list[str]:
        """Networks on which no requested method (a row name or series; default: every method) worked."""
        def asked(row: Row) -> bool:
            return requested is None or row.method in requested or row.method.split("@")[0] in requested

        return [net for net in self.networks()
                if not any(r.status == "ok" and asked(r) for r in self.rows_for(net))]


# ------------------------------------------------------------------------------------------ measuring


def count_flops(module: torch.nn.Module, fake_inputs: tuple, loss_fn) -> tuple[int, int]:
    """(forward FLOPs, whole-step FLOPs) of one step of ``module`` on fake inputs; nothing is allocated."""
    from torch.utils.flop_counter import FlopCounterMode

    mode = fake_mode_of(module, fake_inputs)
    fake_module = fake_copy(module, mode)
    counter = FlopCounterMode(display=False)
    with mode, counter:
        loss = loss_fn(fake_module(*fake_inputs))
        forward = counter.get_total_flops()
        loss.backward()
    return forward, counter.get_total_flops()


def real_step_peak(module: torch.nn.Module, inputs: tuple, loss_fn, device: torch.device) -> tuple[int, str]:
    """Peak bytes of one real step of ``module`` (run in place), and the meter's name.

    The step of :func:`fxplan.measure_step`: the output held while backward runs. CPU: ``torch.profiler``
    allocation events (sees compiled code), with the tensors that exist before the step counted as resident;
    the profiler's native log lines are kept off stderr. CUDA: the caching allocator's
    ``max_memory_allocated`` (:func:`fxplan.measure.meter.cuda_step_stats`).
    """
    module.zero_grad(set_to_none=True)
    if device.type == "cuda":
        peak = cuda_step_stats(module, (tuple(inputs), {}), loss_fn, device).peak_bytes
        module.zero_grad(set_to_none=True)
        return peak, "cuda allocator"
    with filter_native_logs():
        peak = profiled_step_peak(module, inputs, loss_fn)
    module.zero_grad(set_to_none=True)
    return peak, "torch.profiler allocation events"


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
    repeats: int = 5,
    threads: int | None = None,
    time_limit_s: float | None = 120.0,
    device: torch.device | str = "cpu",
    progress: Progress | None = None,
    timeline: bool = True,
    real_steps: bool = True,
    input_label: str = "",
) -> tuple[list[Row], dict[str, list[tuple[str, int]]]]:
    """Measure every method on one network. ``make_inputs(batch, input_size)`` makes real CPU inputs.

    ``real_steps=False`` (a model built on the meta device) measures the main batch on fake tensors only.
    ``repeats`` timed rounds run with ``threads`` threads (None: torch's current count).
    Returns the rows (in ``methods`` order) and the memory timelines of one main-batch step for vanilla
    and for the first fxplan plan that worked (keys: method names).
    """
    device = torch.device(device)
    progress = progress or Progress(quiet=True)
    mode = fake_mode_of(model, ())  # the model's own fake mode, if its parameters are fake already
    with mode:
        paper_inputs = make_inputs(batch, input_size)
    paper_inputs = to_fake(tuple(paper_inputs), mode)
    small_inputs = None
    if real_steps:
        small_inputs = tuple(tree_map(lambda x: x.to(device) if isinstance(x, torch.Tensor) else x,
                                      list(make_inputs(small_batch, small_input_size))))
    else:
        small_batch = small_input_size = 0
    ctx = Context(network, model, loss_fn, paper_inputs, small_inputs, device, time_limit_s)
    rows: list[Row] = []
    live: dict[str, torch.nn.Module] = {}
    fake_modules: dict[str, torch.nn.Module] = {}
    flops: dict[str, tuple[int, int]] = {}
    for m in methods:
        row = Row(network, m.name, m.family, main=m.main, batch=batch, input_size=input_size,
                  input_label=input_label or f"{input_size}²", small_batch=small_batch,
                  small_input_size=small_input_size)
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
        if small_inputs is None:
            continue
        try:
            # On the CPU every method runs on the model's own parameters (the peers and fxplan's rewrites
            # share them), so memory does not grow with the number of methods; elsewhere: one copy each.
            real = prepared.real_module or (prepared.module if device.type == "cpu"
                                            else real_copy(prepared.module, device))
            with progress.step(f"{network}: {m.name}: peak at batch {small_batch} (real step)"):
                row.small_peak_bytes, row.small_meter = real_step_peak(real, small_inputs, loss_fn, device)
            live[m.name] = real
        except Exception as exc:
            _fail(row, "crashed", exc, f"one real step at batch {small_batch}")
    if small_inputs is not None:
        _time_interleaved(rows, live, small_inputs, loss_fn, device, repeats, threads, progress, network)
    _derive(rows, flops)
    timelines: dict[str, list[tuple[str, int]]] = {}
    if timeline:
        chosen = sorted((r.method for r in rows if r.family == "fxplan" and r.main and r.status == "ok"
                         and r.method in fake_modules),
                        key=lambda m: TIMELINE_PREFERENCE.index(m) if m in TIMELINE_PREFERENCE else 99)
        for name in ["vanilla", *chosen[:1]]:
            if name in fake_modules:
                with progress.step(f"{network}: memory timeline of {name}"):
                    stats = measure_step(fake_modules[name], paper_inputs, fake=True, loss_fn=loss_fn,
                                         timeline=True)
                timelines[name] = list(stats.timeline or [])
    return rows, timelines


def _time_interleaved(rows, live, inputs, loss_fn, device, repeats, threads, progress, network) -> None:
    """Step times of every live method by :func:`fxplan.measure.timing.time_interleaved`, vanilla the baseline."""
    by_name = {r.method: r for r in rows}
    steps = {name: training_step(module, inputs, loss_fn, device) for name, module in live.items()}
    with progress.step(f"{network}: timing {format_count(len(live), 'method')} x "
                       f"{format_count(repeats, 'interleaved round')} "
                       f"at batch {rows[0].small_batch}") as step:
        timings = time_interleaved(steps, baseline="vanilla" if "vanilla" in steps else None, rounds=repeats,
                                   warmup=1, threads=threads, on_round=step.update)
    for name, t in timings.items():
        row = by_name[name]
        if t.error is not None:
            _fail(row, "crashed", t.error, "timed step")
            continue
        row.step_seconds, row.step_spread, row.time_ratio = t.median, t.spread, t.ratio
        row.ratio_low, row.ratio_high = t.ratio_range or (None, None)


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
        if r.method in flops and "vanilla" in flops and flops["vanilla"][0]:
            fwd, total = flops["vanilla"]
            r.recompute_fraction = max(0.0, (flops[r.method][1] - total) / fwd)


# ------------------------------------------------------------------------------------------ zoo entries


def compare_models(
    entries: Sequence[Any],
    *,
    batch_size: int | None = None,
    input_size: int | None = None,
    small_batch: int | None = None,
    small_input_size: int | None = None,
    methods: Sequence[Method] | None = None,
    progress: Progress | None = None,
    **kwargs: Any,
) -> Comparison:
    """:func:`compare_network` on ``models_zoo.ZooEntry`` objects (``models_zoo.resolve_all(names)`` turns
    model names into entries, all checked before any work starts); each
    entry's main batch and size by default. A network that cannot be built gets one error row; the
    others go on.
    """
    methods = list(methods) if methods is not None else default_methods()
    comparison = Comparison([], {}, run_meta([e.name for e in entries], kwargs))
    auto_batch = small_batch is None
    for entry in entries:
        batch = batch_size or entry.paper_batch
        size = input_size or entry.input_size
        where = "building the network"
        try:
            with (progress or Progress(quiet=True)).step(f"{entry.name}: building"):
                torch.manual_seed(0)
                model = entry.build()
            def make(b: int, s: int, e=entry) -> tuple:
                return e.example_inputs(batch_size=b, input_size=s)

            small_size = small_input_size or entry.quick_input_size or size
            small = small_batch or max(entry.min_batch, min(batch, 4))
            if auto_batch and not entry.fake_only:
                where = "choosing the batch of the timed steps"
                with (progress or Progress(quiet=True)).step(f"{entry.name}: choosing the batch of the timed steps"):
                    small, seconds = timed_batch(model, entry.loss, make, small, batch, small_size,
                                                 kwargs.get("device", "cpu"), kwargs.get("threads"))
                if seconds < MIN_STEP_SECONDS:
                    comparison.meta.setdefault("warnings", []).append(
                        f"{entry.name}: a vanilla step at batch {small} takes {seconds:.2f} s, under "
                        f"{MIN_STEP_SECONDS} s: its time ratios are less certain (give --small-batch)")
            where = "comparing"
            rows, timelines = compare_network(
                entry.name, model, entry.loss, make,
                batch=batch, input_size=size,
                small_batch=small,
                small_input_size=small_size,
                methods=methods, progress=progress, real_steps=not entry.fake_only,
                input_label=describe_input(entry.kind, size), **kwargs)
        except Exception as exc:  # one network's failure must not cost the others their rows
            row = Row(entry.name, "vanilla", "baseline", batch=batch, input_size=size,
                      input_label=describe_input(entry.kind, size))
            _fail(row, "error", exc, where)
            comparison.rows.append(row)
            continue
        comparison.rows.extend(rows)
        comparison.timelines[entry.name] = timelines
    return comparison


def timed_batch(model: torch.nn.Module, loss_fn, make_inputs, start: int, main_batch: int, input_size: int,
                device: torch.device | str, threads: int | None) -> tuple[int, float]:
    """The batch of the timed steps (:func:`fxplan.measure.timing.batch_for_step` from ``start``, at most 8 times it
    and the main batch) and the seconds of a vanilla step there. The model runs on a copy (its BatchNorm
    statistics stay as they were)."""
    device = torch.device(device)
    probe = real_copy(model, device)

    def step_at(b: int) -> float:
        inputs = tuple(x.to(device) if isinstance(x, torch.Tensor) else x for x in make_inputs(b, input_size))
        return training_step(probe, inputs, loss_fn, device)()

    with fixed_threads(threads):
        return batch_for_step(step_at, start, most=max(start, min(main_batch, 8 * start)))


def describe_input(kind: str, size: int) -> str:
    """How an input size reads in a report: ``seq 1024`` for token sequences, ``224²`` for images."""
    return f"seq {size}" if kind == "language" else f"{size}²"


def run_meta(names: Sequence[str], kwargs: dict[str, Any]) -> dict[str, Any]:
    """How the comparison was run: networks, versions, machine, repetitions, time limit, start time."""
    return {
        "networks": list(names), "torch": torch.__version__, "python": platform.python_version(),
        "machine": f"{os.cpu_count()}-core CPU" + (f", {torch.cuda.get_device_name()}" if torch.cuda.is_available()
                                                   else ""),
        "repeats": kwargs.get("repeats", 5), "threads": kwargs.get("threads") or torch.get_num_threads(),
        "time_limit_s": kwargs.get("time_limit_s", 120.0),
        "started": time.strftime("%Y-%m-%d %H:%M:%S"),
    }


__all__ = [
    "Comparison", "Row", "TIMELINE_PREFERENCE", "compare_models", "compare_network",
    "count_flops", "describe_input", "real_step_peak", "run_meta", "timed_batch",
]
