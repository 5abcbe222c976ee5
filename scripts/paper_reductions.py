"""Smallest measured peak fxplan reaches on each zoo network at its paper batch, against Table 1.

Usage: python scripts/paper_reductions.py [NAME ...] [--solver approx|exact]

For each network: the vanilla peak and the peak of ``fxplan.rewrite(model, None, strategy=...)``
(the smallest feasible budget), both measured with fxplan.measure_step on fake tensors with the zoo
loss, for the memory-centric and time-centric strategies; the plan's predicted peak beside the
measured one, its segments and recomputed regions (fxplan.capture.regions); the physical floor
(:func:`fxplan.measure.floor.physical_floor`, kernel scratch included: no plan of the same kernels peaks below it)
and the measured peak as a multiple of it; and Kusumoto et al.'s best reduction (Table 1) for comparison.
"""

from __future__ import annotations

import argparse
import sys
import time

from torch._subclasses.fake_tensor import FakeTensorMode

import fxplan
import models_zoo
from fxplan.common.console import format_table
from fxplan.measure.floor import physical_floor
from fxplan.measure.meter import GiB, measure_step

#: Kusumoto et al. (2019), Table 1: best reduction over all their methods.
PAPER_BEST_REDUCTION = {"pspnet": 0.71, "unet": 0.48, "resnet50": 0.62, "resnet152": 0.75, "vgg19": 0.36,
                        "densenet161": 0.81, "googlenet": 0.39}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", default=list(PAPER_BEST_REDUCTION))
    parser.add_argument("--solver", default="approx", choices=("approx", "exact"))
    args = parser.parse_args()
    rows = []
    for name in args.names:
        entry = models_zoo.get(name)
        model = entry.build()
        with FakeTensorMode():
            inputs = entry.example_inputs()
        vanilla = measure_step(model, inputs, fake=True, loss_fn=entry.loss).peak_bytes
        floor = physical_floor(model, inputs, loss_fn=entry.loss)
        print(f"{name} floor: {floor.describe()}", file=sys.stderr, flush=True)
        for strategy in ("memory", "time"):
            print(f"{name} {strategy}-centric ...", file=sys.stderr, flush=True)
            start = time.perf_counter()
            optimized = fxplan.rewrite(model, None, example_inputs=inputs, strategy=strategy, solver=args.solver,
                                       loss_fn=entry.loss)
            seconds = time.perf_counter() - start
            plan, measured = optimized.fxplan_plan, optimized.fxplan_measured_peak_bytes
            rows.append((name, f"{args.solver}-{strategy}", f"{vanilla / GiB:.2f}",
                         f"{plan.predicted_peak_bytes / GiB:.2f}", f"{measured / GiB:.2f}",
                         f"{1 - measured / vanilla:.1%}", f"{floor.bytes / GiB:.2f} ({1 - floor.bytes / vanilla:.1%})",
                         f"{measured / floor.bytes:.2f}x", f"{PAPER_BEST_REDUCTION[name]:.0%}",
                         plan.num_segments, len(plan.regions), f"{plan.recompute_fraction:.2f}", f"{seconds:.1f}"))
    print(format_table(("network", "method", "vanilla GiB", "predicted GiB", "measured GiB", "reduction",
                        "floor GiB (reduction)", "vs floor", "paper best", "segments", "regions", "recompute",
                        "seconds"), rows))


if __name__ == "__main__":
    main()
