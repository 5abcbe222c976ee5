"""Real step time of vanilla PyTorch vs fxplan's time-centric rewrites under each node cost model, one run.

Usage: python scripts/step_time.py [NAME ...] [--batch-size N] [--input-size H] [--rounds R]
       [--threads K] [--cost-models flops roofline ...] [--fractions F ...]

For each network (real tensors on the CPU, or CUDA when available) and each cost model of
``fxplan.costs.trace`` (``flops``: the time model before fxplan.costs.timecost; ``roofline``: the default): the
time-centric plan at the smallest budget fxplan reaches (nested plans and recomputed regions included, as
``fxplan.rewrite(model, None)`` chooses: :mod:`fxplan.planner.variants`), and at the budget halfway between that
smallest measured peak (the least over the cost models) and vanilla's, and at ``--fractions`` of vanilla's
peak (none by default). All modules are then timed together by
:func:`fxplan.measure.timing.time_interleaved` (warm-up round, rotated interleaved rounds, fixed thread count);
the table gives each one's median step, its ratio to vanilla as the median and interquartile range of
per-round ratios ("within noise" when that range contains 1.0), and the predicted
(Plan.predicted_extra_seconds) against the measured extra seconds per step.
"""

from __future__ import annotations

import argparse
import sys

import torch

import models_zoo
from fxplan.common.console import format_table
from fxplan.costs.trace import trace
from fxplan.errors import BudgetError
from fxplan.measure.meter import GiB, measure_step
from fxplan.measure.timing import MIN_STEP_SECONDS, describe_ratio, fixed_threads, time_interleaved, training_step
from fxplan.planner.variants import Searches


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", default=["resnet50", "densenet161"])
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--input-size", type=int, default=112)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--cost-models", nargs="+", default=["flops", "roofline"])
    parser.add_argument("--fractions", nargs="*", type=float, default=[],
                        help="also plan at these fractions of vanilla's peak (a fraction no plan reaches: said)")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    print(f"device: {device}, {args.threads} threads, batch {args.batch_size}, {args.input_size}², "
          f"{args.rounds} interleaved rounds after 1 warm-up round; ratio: median (interquartile range) of "
          "per-round ratios to vanilla", flush=True)
    with fixed_threads(args.threads):
        for name in args.names:  # one table per network, printed as soon as it is measured
            rows = measure_network(name, args, device)
            print(format_table(("network", "model", "cost model", "peak GiB", "vs vanilla", "recompute", "step s",
                                "ratio to vanilla", "extra s predicted", "extra s measured"), rows), flush=True)


def measure_network(name: str, args: argparse.Namespace, device: torch.device) -> list[tuple]:
    entry = models_zoo.get(name)
    torch.manual_seed(0)
    model = entry.build().to(device)
    inputs = tuple(t.to(device) for t in entry.example_inputs(args.batch_size, args.input_size))
    vanilla_peak = measure_step(model, inputs, fake=True, loss_fn=entry.loss).peak_bytes
    searches = {}
    for cm in args.cost_models:
        print(f"{name}: tracing and searching ({cm})", file=sys.stderr, flush=True)
        searches[cm] = Searches(trace(model, inputs, cost_model=cm, probe_units=True), model, inputs, solver="approx",
                                loss_fn=entry.loss)
    smallest = min(s.lowest() for s in searches.values())
    middle = (smallest + vanilla_peak) // 2
    budgets = [("time@middle", middle), ("time@smallest", None)]
    budgets += [(f"time@{f:.0%}", int(f * vanilla_peak)) for f in args.fractions]
    modules = {"vanilla": model}
    for cm, search in searches.items():
        for label, budget in budgets:
            print(f"{name}: planning {label} ({cm})", file=sys.stderr, flush=True)
            try:
                chosen = search.choose(budget, "time")
                modules[f"{label}|{cm}"] = chosen.variant.result(chosen.candidate, budget)
            except BudgetError as exc:
                print(f"{name}: {label} ({cm}): no plan fits; {exc.min_feasible_bytes / GiB:.3f} GiB is the least",
                      flush=True)
    steps = {k: training_step(m, inputs, entry.loss, device) for k, m in modules.items()}
    timings = time_interleaved(steps, baseline="vanilla", rounds=args.rounds, warmup=1,
                               on_round=lambda r: print(f"{name}: {r}", file=sys.stderr, flush=True))
    base = timings["vanilla"].median
    if base < MIN_STEP_SECONDS:
        print(f"warning: a vanilla step of {name} takes {base:.2f} s, under {MIN_STEP_SECONDS} s: raise "
              "--batch-size for timings that mean something", file=sys.stderr)
    rows = []
    for key, m in modules.items():
        label, _, cm = key.partition("|")
        plan = getattr(m, "fxplan_plan", None)
        t = timings[key]
        peak = plan.measured_peak_bytes if plan else vanilla_peak
        low, high = t.ratio_range or (None, None)
        extra = plan.predicted_extra_seconds if plan else None
        recompute = "0" if not plan else f"{plan.recompute_fraction:.1%}" + (
            f" ({len(plan.regions)} regions)" if plan.regions else "")
        rows.append((name, label, cm or "-", f"{peak / GiB:.3f}", f"{peak / vanilla_peak - 1:+.1%}", recompute,
                     f"{t.median:.3f}",
                     describe_ratio(t.ratio, low, high),
                     "-" if extra is None else f"{extra:.3f}",
                     "-" if not plan else f"{t.median - base:+.3f}"))
    return rows


if __name__ == "__main__":
    main()
