"""The choice between the graph as captured, the graph with every recomputed region and the graphs with some
of them, measured side by side.

Usage: python scripts/variant_choice.py NAME --fractions F [F ...] [--batch-size N] [--input-size H]
                                        [--rounds R] [--threads K]

For each budget (a fraction of vanilla's fake-tensor peak), the captured graph's search and the graph with
every region's (``fxplan.planner.variants``) choose their plan, and so does ``fxplan.rewrite``'s choice over all
graphs (``Searches.choose``), which may take a graph with some of the regions (``REGION_SUBSETS``); the
script says which graph that is. Every plan's step is then timed interleaved with vanilla's
(:func:`fxplan.measure.timing.time_interleaved`); the table gives each plan's measured peak as a fraction of
vanilla's, its recomputation, the predicted extra seconds (``Plan.predicted_extra_seconds``: the ranking
the choice uses) and the measured step ratio (median and interquartile range of per-round ratios;
``--rounds 0``: no real step, planning on fake tensors only). A model without convolution regions is searched
with its units of recomputed inputs (:mod:`fxplan.capture.recomputed_inputs`), shown the same way ("regions").
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

import models_zoo
from fxplan.common.console import format_table
from fxplan.costs.trace import trace
from fxplan.errors import BudgetError
from fxplan.measure.meter import measure_step
from fxplan.measure.timing import describe_ratio, fixed_threads, time_interleaved, training_step
from fxplan.planner.variants import Searches


def graph_name(variant, every: int) -> str:
    """'captured', 'regions' (every region) or 'regions K/N' (a subset)."""
    if not variant.regions:
        return "captured"
    return "regions" if len(variant.regions) == every else f"regions {len(variant.regions)}/{every}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("name")
    parser.add_argument("--fractions", nargs="+", type=float, required=True)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--input-size", type=int, default=224)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    entry = models_zoo.resolve(args.name)
    torch.manual_seed(0)
    model = entry.build()
    inputs = entry.example_inputs(args.batch_size, args.input_size)
    vanilla = measure_step(model, inputs, fake=True, loss_fn=entry.loss).peak_bytes
    start = time.perf_counter()
    searches = Searches(trace(model, inputs, probe_units=True), model, inputs, solver="approx", loss_fn=entry.loss)
    every = searches.with_regions()
    whole = [searches.plain] + ([every] if every else [])
    modules, taken = {"vanilla": model}, {}
    count = len(every.regions) if every else 0
    for fraction in args.fractions:
        budget = int(fraction * vanilla)
        for variant in whole:
            label = f"{graph_name(variant, count)}@{fraction:g}"
            try:
                modules[label] = variant.result(variant.search.choose(budget, "time"), budget)
            except BudgetError:
                print(f"{label}: no plan fits", flush=True)
        try:
            chosen = searches.choose(budget, "time")
        except BudgetError:
            taken[fraction] = "none fits"
            continue
        taken[fraction] = graph_name(chosen.variant, count)
        if chosen.variant not in whole:
            modules[f"{taken[fraction]}@{fraction:g}"] = chosen.variant.result(chosen.candidate, budget)
    print(f"{args.name}, batch {args.batch_size}, input size {args.input_size}: "
          f"planned in {time.perf_counter() - start:.1f} s; "
          "fxplan.rewrite takes: " + ", ".join(f"{f:g} -> {v}" for f, v in taken.items()), flush=True)
    timings = {}
    if args.rounds:
        with fixed_threads(args.threads):
            timings = time_interleaved({k: training_step(m, inputs, entry.loss) for k, m in modules.items()},
                                       baseline="vanilla", rounds=args.rounds, warmup=1,
                                       on_round=lambda r: print(r, file=sys.stderr, flush=True))
    rows = []
    for key, module in modules.items():
        plan = getattr(module, "fxplan_plan", None)
        extra = plan.predicted_extra_seconds if plan else None
        row = (key, f"{(plan.measured_peak_bytes if plan else vanilla) / vanilla:.3f}",
               f"{plan.recompute_fraction:.1%}" if plan else "0", "-" if extra is None else f"{extra:.3f}")
        t = timings.get(key)
        rows.append(row + ((f"{t.median:.3f}", describe_ratio(t.ratio, *(t.ratio_range or (None, None))))
                           if t else ()))
    print(format_table(("plan", "peak / vanilla", "recompute", "extra s predicted")
                       + (("step s", "ratio to vanilla") if timings else ()), rows))


if __name__ == "__main__":
    main()
