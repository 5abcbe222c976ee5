"""Canonical vs nested plans against the physical floor, per zoo network, at the paper's batch and input.

Usage: python scripts/nested_floor.py [NAME ...]

For each network, all measured with fxplan.measure_step on fake tensors (exact) with the zoo loss:
the vanilla peak; the smallest peak of the canonical plans (fxplan's search before nesting,
``Search.smallest``); the smallest with nested plans (``Search.lowest``: what ``fxplan.rewrite(model,
None)`` returns now); the physical floor (:func:`fxplan.measure.floor.physical_floor`), and each peak as a
multiple of the floor; the recomputation each plan costs (forward FLOP-weighted time cost of the nodes
re-run per step, divided by one forward pass; a node re-run by two nested checkpoints counts twice);
the depth of nesting and the seconds of the nested search (shared machine: indicative only).
"""

from __future__ import annotations

import argparse
import sys
import time

from torch._subclasses.fake_tensor import FakeTensorMode

import models_zoo
from fxplan.common.console import format_table
from fxplan.costs.trace import trace
from fxplan.measure.floor import physical_floor
from fxplan.measure.meter import GiB, measure_step
from fxplan.planner.search import Search

NAMES = ("pspnet", "unet", "resnet50", "resnet152", "vgg19", "densenet161", "googlenet")


def _depth(plan) -> int:
    return 1 + max((_depth(c) for c in plan.children.values()), default=0)


def _cell(b: int, vanilla: int) -> str:
    return f"{b / GiB:.2f} ({1 - b / vanilla:.1%})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", default=list(NAMES))
    args = parser.parse_args()
    rows = []
    for name in args.names:
        print(f"{name} ...", file=sys.stderr, flush=True)
        entry = models_zoo.get(name)
        model = entry.build()
        with FakeTensorMode():
            inputs = entry.example_inputs()
        vanilla = measure_step(model, inputs, fake=True, loss_fn=entry.loss).peak_bytes
        floor = physical_floor(model, inputs, loss_fn=entry.loss).bytes
        search = Search(trace(model, inputs), model, inputs, solver="approx", loss_fn=entry.loss)
        flat = search.smallest()
        start = time.perf_counter()
        low = search.lowest()
        seconds = time.perf_counter() - start
        size = f"{inputs[0].shape[-1]}², {inputs[0].shape[0]}"
        rows.append((name, size, f"{vanilla / GiB:.2f}", _cell(flat.measured, vanilla), _cell(low.measured, vanilla),
                     _cell(floor, vanilla),
                     f"{flat.measured / floor:.2f}", f"{low.measured / floor:.2f}", f"{flat.recompute:.2f}",
                     f"{low.recompute:.2f}", _depth(low.plan), f"{seconds:.1f}"))
        print(" | ".join(map(str, rows[-1])), file=sys.stderr, flush=True)  # progress: each row as it comes
    print(format_table(("network", "input, batch", "vanilla GiB", "canonical GiB", "nested GiB", "floor GiB",
                        "canonical/floor", "nested/floor", "recompute canonical", "recompute nested", "depth",
                        "nested search s"), rows))


if __name__ == "__main__":
    main()
