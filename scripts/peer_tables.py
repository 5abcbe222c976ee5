"""fxplan against its peers, one table per network: does fxplan's front dominate each peer?

Usage: python scripts/peer_tables.py [NAME ...] [--batch-size N ...] [--input-size H] [--rounds R]
       [--threads K] [--block-class CLS] [--compile-budgets F ...] [--sac-budgets F ...] [--only ROW ...]
       [--markdown]

Rows (per network, real tensors on ``--device``: CUDA when present, else the CPU):

* ``vanilla``: the model as it is, the baseline of every ratio;
* ``blocks``: every instance of the model's repeated block class (``--block-class``, or the most frequent
  class among modules with two or more children: Bottleneck, _DenseLayer, GPT2Block) under non-reentrant
  ``torch.utils.checkpoint`` (:func:`fxplan.compare.peers.block_checkpoint_peer`); ``blocks-selective``: the same
  with selective activation checkpointing, keeping convolution and matrix-product outputs;
* ``hf-checkpointing``: a Hugging Face model's own ``gradient_checkpointing_enable()`` (non-reentrant;
  :func:`fxplan.compare.peers.hf_checkpointing_peer`), on transformers models only;
* ``torch.compile@F``: :func:`fxplan.compare.peers.compile_peer` at ``activation_memory_budget`` F (0.5, 0.25);
* ``sac-ilp@F``: PyTorch's automatic selective checkpointing (:func:`fxplan.compare.peers.sac_ilp_peer`:
  ``torch.distributed._tools``' ``SACEstimator`` and ``sac_milp``) at the budget F (0.5) of the way from the smallest
  its ILP meets to the unplanned peak, both in its own memory model;
* ``fxplan-smallest``: ``fxplan.rewrite(model, None)``, the smallest peak fxplan reaches;
  ``fxplan-middle``: the time-centric plan at the budget halfway between that peak and vanilla's;
  ``auto-checkpoint``: ``fxplan.auto_checkpoint`` on a copy of the model, the plan applied to its own modules at the
  smallest peak it reaches there;
* ``fxplan@PEER`` for every peer: the time-centric plan with the peer's measured peak as the budget, the
  point that should dominate it (no plan fits when the peer is below fxplan's smallest peak: said).

Every module is built first (planning, compiling); then each one's peak is measured on one real step with
one meter for all (:func:`fxplan.compare.driver.real_step_peak`: torch.profiler allocation events plus the
parameters, buffers and inputs on the CPU, the caching allocator's ``max_memory_allocated`` on CUDA),
beside the fake-tensor meter fxplan plans with where it applies (not
inside compiled code), so that the two can be checked against each other; then all are timed together by
:func:`fxplan.measure.timing.time_interleaved` (one warm-up round, ``--rounds`` rounds in rotated order,
``--threads`` threads). "ratio to vanilla" is the median and interquartile range of per-round ratios,
"within noise" when that range contains 1.0. "dominated by" names, for a peer, the fastest fxplan row
whose real peak is at or below the peer's and whose median step is no slower, with its per-round ratio
to the peer's step; otherwise "not dominated" and why.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

import models_zoo
from fxplan.api import rewrite
from fxplan.capture.fakes import model_copy
from fxplan.cli import parse_device
from fxplan.common.console import format_table
from fxplan.compare import peers
from fxplan.compare.driver import describe_input, real_step_peak
from fxplan.compare.methods import real_copy
from fxplan.errors import BudgetError
from fxplan.measure.meter import measure_step
from fxplan.measure.timing import (
    MIN_STEP_SECONDS,
    Timing,
    describe_ratio,
    fixed_threads,
    quartiles,
    time_interleaved,
    training_step,
)

MiB = 2**20
DEFAULT_BATCH = {"resnet50": 8, "densenet161": 4}
PEERS = ("blocks", "blocks-selective", "hf-checkpointing")
CPU = torch.device("cpu")
HEADER = ("row", "budget", "peak MiB", "fake-meter MiB", "vs vanilla", "step s", "ratio to vanilla (IQR)",
          "planning s", "dominated by")


@dataclass
class Row:
    """One module of one network's table and what was measured of it."""

    name: str
    family: str                      # baseline | peer | fxplan
    module: nn.Module | None = None  # None: it could not be built (``note`` says why)
    budget: str = "-"
    plan_seconds: float | None = None
    peak: int | None = None          # one real step, the one meter
    fake_peak: int | None = None     # fake tensors (fxplan.measure_step), where that meter applies
    timing: Timing | None = None
    note: str = ""


def row_names(compile_budgets: Sequence[float], sac_budgets: Sequence[float] = (0.5,)) -> list[str]:
    """Every row a table can have, in table order."""
    own = ["vanilla", *PEERS, *(f"torch.compile@{f:g}" for f in compile_budgets),
           *(f"sac-ilp@{f:g}" for f in sac_budgets)]
    return [*own, "fxplan-smallest", "fxplan-middle", "auto-checkpoint", *(f"fxplan@{p}" for p in own[1:])]


def build_rows(model: nn.Module, inputs: tuple, loss_fn: Callable[[Any], torch.Tensor], *,
               wanted: Sequence[str], block: str | None = None, compile_budgets: Sequence[float] = (0.5, 0.25),
               sac_budgets: Sequence[float] = (0.5,), device: torch.device = CPU,
               log: Callable[[str], None] = print) -> list[Row]:
    """Build the ``wanted`` rows (vanilla always) and measure each one's peak on a real step; nothing timed.

    Peers first, so that each ``fxplan@PEER`` row can take the peer's measured peak as its budget.
    """
    rows = [Row("vanilla", "baseline", peers.vanilla(model))]
    for name in PEERS:
        if name in wanted:
            row = _built(name, "peer", lambda s=name: (_peer(model, s, block), None), log)
            if not row.note.startswith(peers.NotApplicable.__name__):
                rows.append(row)
    for f in compile_budgets:
        if f"torch.compile@{f:g}" in wanted:
            rows.append(_built(f"torch.compile@{f:g}", "peer", lambda f=f: _compiled(model, f, inputs, loss_fn, device),
                                log))
            rows[-1].budget = f"activation_memory_budget={f:g}"
    for f in sac_budgets:
        if f"sac-ilp@{f:g}" in wanted:
            rows.append(_built(f"sac-ilp@{f:g}", "peer", lambda f=f: _sac(model, f, inputs, loss_fn), log))
            plan = getattr(rows[-1].module, "fxplan_sac", None)
            if plan is not None:
                rows[-1].budget = (f"sac_milp {plan.budget_bytes / MiB:.1f} MiB ({f:g} of "
                                   f"{plan.smallest_budget_bytes / MiB:.1f}..{plan.baseline_peak_bytes / MiB:.1f}), "
                                   f"{len(plan.discard)} modules")
    for row in rows:
        _measure_peaks(row, inputs, loss_fn, device, log)
    vanilla_fake = rows[0].fake_peak
    if "fxplan-smallest" in wanted or "fxplan-middle" in wanted:
        smallest = _built("fxplan-smallest", "fxplan", lambda: _fxplan(model, inputs, loss_fn, None), log)
        smallest.budget = "smallest"
        _measure_peaks(smallest, inputs, loss_fn, device, log)
        if "fxplan-smallest" in wanted:
            rows.append(smallest)
        if "fxplan-middle" in wanted:
            if smallest.fake_peak is None or vanilla_fake is None:
                rows.append(Row("fxplan-middle", "fxplan", note="no middle budget: fxplan-smallest or vanilla "
                                "has no fake-meter peak"))
            else:
                middle = (smallest.fake_peak + vanilla_fake) // 2
                rows.append(_built("fxplan-middle", "fxplan", lambda: _fxplan(model, inputs, loss_fn, middle), log))
                rows[-1].budget = f"{middle / MiB:.1f} MiB"
                _measure_peaks(rows[-1], inputs, loss_fn, device, log)
    if "auto-checkpoint" in wanted:
        rows.append(_built("auto-checkpoint", "fxplan", lambda: _auto_checkpoint(model, inputs, loss_fn), log))
        if rows[-1].module is not None:
            applied = rows[-1].module.fxplan_plan
            rows[-1].budget = f"smallest, {len(applied.regions)} modules"
        _measure_peaks(rows[-1], inputs, loss_fn, device, log)
    excess = max(0, rows[0].peak - vanilla_fake) if rows[0].peak and vanilla_fake else 0
    for peer in [r for r in rows if r.family == "peer"]:
        name = f"fxplan@{peer.name}"
        if name not in wanted:
            continue
        if peer.peak is None:
            rows.append(Row(name, "fxplan", note=f"no budget: {peer.name} has no measured peak"))
            continue
        rows.append(_at_peer(name, peer.peak, excess, model, inputs, loss_fn, device, log))
    return rows


def _at_peer(name: str, peak: int, excess: int, model: nn.Module, inputs: tuple, loss_fn, device: torch.device,
             log: Callable[[str], None], tries: int = 3) -> Row:
    """fxplan's time-centric plan whose real-step peak is at most a peer's ``peak``.

    fxplan's budgets are in its own (fake-tensor) meter, which sees less than the real-step meter:
    ``excess`` bytes less on vanilla's step, and more on plans that recompute (DenseNet-161, batch 4,
    224²: 0.02% on vanilla, 3-6% on fxplan's plans). The budget is ``peak - excess``, lowered by what the
    module's real peak still exceeds ``peak`` by, at most ``tries`` plans in all; the last one is the row.
    """
    budget = peak - excess
    for _ in range(tries):
        row = _built(name, "fxplan", lambda b=budget: _fxplan(model, inputs, loss_fn, b), log)
        row.budget = f"{budget / MiB:.1f} MiB"
        _measure_peaks(row, inputs, loss_fn, device, log)
        if row.peak is None or row.peak <= peak:
            break
        budget -= row.peak - peak
    return row


def _built(name: str, family: str, build: Callable[[], tuple[nn.Module, float | None]],
           log: Callable[[str], None]) -> Row:
    """A row from ``build() -> (module, planning seconds or None)``; a failure becomes the row's note."""
    log(f"building {name}")
    try:
        module, seconds = build()
    except Exception as exc:  # one row failing must not cost the table its other rows
        kind = "no plan fits" if isinstance(exc, BudgetError) else type(exc).__name__
        return Row(name, family, note=f"{kind}: {str(exc).splitlines()[0] if str(exc) else ''}"[:300])
    return Row(name, family, module, plan_seconds=seconds)


def _peer(model: nn.Module, name: str, block: str | None) -> nn.Module:
    """One of ``PEERS`` made from ``model``; :class:`fxplan.compare.peers.NotApplicable` where it does not apply."""
    if name == "hf-checkpointing":
        return peers.hf_checkpointing_peer(model)
    return peers.block_checkpoint_peer(model, block, selective=name == "blocks-selective")


def _compiled(model: nn.Module, fraction: float, inputs: tuple, loss_fn,
              device: torch.device) -> tuple[nn.Module, float]:
    """A compiled copy of ``model`` (its own BatchNorm statistics), compiled by a warm-up step: (module, s)."""
    start = time.perf_counter()
    module = peers.compile_peer(real_copy(model, device), fraction)
    module.warm_up(inputs, loss_fn)
    return module, time.perf_counter() - start


def _sac(model: nn.Module, fraction: float, inputs: tuple, loss_fn) -> tuple[nn.Module, float]:
    """PyTorch's automatic selective checkpointing at ``fraction`` (a copy sharing the parameters): (module, s)."""
    start = time.perf_counter()
    module = peers.sac_ilp_peer(model, inputs, loss_fn, fraction)
    return module, time.perf_counter() - start


def _auto_checkpoint(model: nn.Module, inputs: tuple, loss_fn) -> tuple[nn.Module, float]:
    """``fxplan.auto_checkpoint`` on a copy of ``model`` (its own parameters), at its smallest peak: (module, s)."""
    from fxplan.apply.auto import auto_checkpoint

    start = time.perf_counter()
    module = auto_checkpoint(model_copy(model), example_inputs=inputs, loss_fn=loss_fn)
    return module, time.perf_counter() - start


def _fxplan(model: nn.Module, inputs: tuple, loss_fn, budget: int | None) -> tuple[nn.Module, float]:
    """fxplan's time-centric plan at ``budget`` bytes (None: the smallest peak it reaches): (module, s)."""
    start = time.perf_counter()
    module = rewrite(model, budget_bytes=budget, example_inputs=inputs, loss_fn=loss_fn)
    return module, time.perf_counter() - start


def _measure_peaks(row: Row, inputs: tuple, loss_fn, device: torch.device, log: Callable[[str], None]) -> None:
    """The row's real-step peak (the one meter) and, outside compiled code, its fake-tensor peak."""
    if row.module is None:
        return
    log(f"measuring the peak of {row.name}")
    try:
        row.peak, _ = real_step_peak(row.module, inputs, loss_fn, device)
    except Exception as exc:
        row.module, row.note = None, f"crashed in a real step: {str(exc).splitlines()[0]}"[:300]
        return
    planned = getattr(row.module, "fxplan_measured_peak_bytes", None)
    if planned is not None:  # what fxplan planned with: the fake meter on the planned module
        row.fake_peak = planned
    elif not isinstance(row.module, peers.CompiledPeer):  # dispatch modes do not see compiled code
        row.fake_peak = measure_step(row.module, inputs, fake=True, loss_fn=loss_fn).peak_bytes


def time_rows(rows: list[Row], inputs: tuple, loss_fn, *, rounds: int, threads: int | None,
              device: torch.device = CPU, log: Callable[[str], None] = print) -> None:
    """Time every built row together (:func:`fxplan.measure.timing.time_interleaved`, vanilla the baseline)."""
    live = {r.name: r for r in rows if r.module is not None}
    steps = {name: training_step(r.module, inputs, loss_fn, device) for name, r in live.items()}
    timings = time_interleaved(steps, baseline="vanilla", rounds=rounds, warmup=1, threads=threads,
                               on_round=lambda s: log(f"timing {len(steps)} modules: {s}"))
    for name, t in timings.items():
        if t.error is not None:
            live[name].note = f"crashed in a timed step: {t.error}"[:300]
        else:
            live[name].timing = t


def dominated_by(peer: Row, rows: Sequence[Row]) -> str:
    """The fastest fxplan row at or below ``peer``'s real peak and no slower (median step), with its per-round
    ratio to the peer's step; else "not dominated" and why."""
    if peer.peak is None or peer.timing is None:
        return "-"
    below = [r for r in rows if r.family == "fxplan" and r.peak is not None and r.timing is not None
             and r.peak <= peer.peak]
    if not below:
        return "not dominated: no fxplan row at or below its peak"
    best = min(below, key=lambda r: r.timing.median)
    ratio = _ratio_to(best.timing, peer.timing)
    if best.timing.median <= peer.timing.median:
        return f"{best.name}: {ratio}"
    return f"not dominated: the fastest fxplan row at or below its peak, {best.name}, takes {ratio} its step"


def _ratio_to(t: Timing, other: Timing) -> str:
    """``t``'s steps over ``other``'s, per round where both ran every round (median and IQR), else of medians."""
    if len(t.samples) == len(other.samples):
        ratios = [a / b for a, b in zip(t.samples, other.samples)]
        low, high = quartiles(ratios)
        return describe_ratio(statistics.median(ratios), low, high)
    return describe_ratio(t.median / other.median, None, None)


def table(rows: Sequence[Row]) -> list[tuple]:
    """The rows of the printed table (``HEADER``)."""
    base = rows[0]
    out = []
    for r in rows:
        if r.module is None and r.peak is None:
            out.append((r.name, r.budget, "-", "-", "-", "-", r.note, "-", "-"))
            continue
        t = r.timing
        low, high = (t.ratio_range or (None, None)) if t else (None, None)
        out.append((
            r.name, r.budget, _mib(r.peak), _mib(r.fake_peak),
            f"{r.peak / base.peak - 1:+.1%}" if r.peak and base.peak else "-",
            f"{t.median:.3f}" if t else "-",
            describe_ratio(t.ratio, low, high) if t else (r.note or "-"),
            f"{r.plan_seconds:.1f}" if r.plan_seconds is not None else "-",
            dominated_by(r, rows) if r.family == "peer" else "",
        ))
    return out


def meter_check(rows: Sequence[Row]) -> str:
    """How far the real-step meter is from the fake-tensor meter on each row both measured."""
    both = [r for r in rows if r.peak and r.fake_peak]
    parts = [f"{r.name} {r.peak / r.fake_peak - 1:+.2%}" for r in both]
    return "real-step meter vs fake-tensor meter: " + (", ".join(parts) if parts else "no row has both")


def _mib(n: int | None) -> str:
    return "-" if n is None else f"{n / MiB:.1f}"


def peer_table(model: nn.Module, inputs: tuple, loss_fn, *, wanted: Sequence[str], rounds: int,
               threads: int | None, block: str | None = None, compile_budgets: Sequence[float] = (0.5, 0.25),
               sac_budgets: Sequence[float] = (0.5,), device: torch.device = CPU,
               log: Callable[[str], None] = print) -> tuple[list[Row], list[tuple]]:
    """One network's table: build and meter the ``wanted`` rows, then time them together (module docstring)."""
    with fixed_threads(threads):
        rows = build_rows(model, inputs, loss_fn, wanted=wanted, block=block, compile_budgets=compile_budgets,
                          sac_budgets=sac_budgets, device=device, log=log)
        time_rows(rows, inputs, loss_fn, rounds=rounds, threads=threads, device=device, log=log)
    return rows, table(rows)


def markdown(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """The table in Markdown, to paste into docs/results.md."""
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(map(str, r)) + " |" for r in rows])


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", default=["resnet50", "densenet161"])
    parser.add_argument("--batch-size", type=int, nargs="+",
                        help="one per network, or one for all (default: resnet50 8, densenet161 4, others 8)")
    parser.add_argument("--input-size", type=int, default=224)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--block-class", help="the block class to checkpoint (default: found per network)")
    parser.add_argument("--compile-budgets", type=float, nargs="+", default=[0.5, 0.25])
    parser.add_argument("--sac-budgets", type=float, nargs="+", default=[0.5],
                        help="sac-ilp budgets: fractions of the way from its ILP's smallest budget to the "
                        "unplanned peak")
    parser.add_argument("--only", nargs="+", metavar="ROW", help="rows to build (vanilla always); 'fxplan@peers': "
                        "fxplan at every chosen peer's peak")
    parser.add_argument("--markdown", action="store_true", help="print Markdown tables")
    parser.add_argument("--device", default=None, help="device of every step (default: cuda if present, else cpu)")
    args = parser.parse_args(argv)
    device = parse_device(args.device)
    models_zoo.resolve_all(args.names)
    batches = args.batch_size or [DEFAULT_BATCH.get(n, 8) for n in args.names]
    if len(batches) == 1:
        batches = batches * len(args.names)
    if len(batches) != len(args.names):
        parser.error(f"give one --batch-size for all networks or one per network ({len(args.names)})")
    names = row_names(args.compile_budgets, args.sac_budgets)
    wanted = list(names)
    if args.only:
        wanted = [n for n in names if n in args.only or (n.startswith("fxplan@") and "fxplan@peers" in args.only)]
        unknown = set(args.only) - set(names) - {"fxplan@peers"}
        if unknown:
            parser.error(f"unknown rows {', '.join(sorted(unknown))}; rows: {', '.join(names)}, fxplan@peers")
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else f"{os.cpu_count()}-core CPU"
    print(f"{where}; {args.threads} threads, {args.rounds} interleaved rounds "
          f"after one warm-up; torch {torch.__version__}", flush=True)
    for name, batch in zip(args.names, batches):
        entry = models_zoo.get(name)
        torch.manual_seed(0)
        model = entry.build().to(device)
        inputs = tuple(t.to(device) for t in entry.example_inputs(batch, args.input_size))
        rows, cells = peer_table(model, inputs, entry.loss, wanted=wanted, rounds=args.rounds, threads=args.threads,
                                 block=args.block_class, compile_budgets=args.compile_budgets,
                                 sac_budgets=args.sac_budgets, device=device,
                                 log=lambda s, n=name: print(f"{n}: {s}", file=sys.stderr, flush=True))
        block = next((r.module.fxplan_block_class for r in rows if hasattr(r.module, "fxplan_block_class")), None)
        print(f"\n{name}, batch {batch}, {describe_input(entry.kind, args.input_size)}"
              + (f" (block class: {block})" if block else ""))
        print(markdown(HEADER, cells) if args.markdown else format_table(HEADER, cells))
        print(meter_check(rows), flush=True)
        if rows[0].timing and rows[0].timing.median < MIN_STEP_SECONDS:
            print(f"warning: a vanilla step takes {rows[0].timing.median:.2f} s, under {MIN_STEP_SECONDS} s: "
                  "its ratios are less certain", flush=True)


if __name__ == "__main__":
    main()
