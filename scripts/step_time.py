"""Real step time of vanilla PyTorch vs fxplan's time- and memory-centric rewrites, measured in one run.

Usage: python scripts/step_time.py [NAME ...] [--batch-size N] [--input-size H] [--repeats R]

For each network (small batch, real CPU tensors, or CUDA when available): plans a memory-centric
rewrite at the smallest budget and a time-centric rewrite halfway between that peak and vanilla's,
then times forward + backward of the three models interleaved (vanilla, time, memory, vanilla, ...)
so that machine noise hits them alike, and prints the median step times and their ratios.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

import fxplan
import models_zoo
from fxplan.console import format_table
from fxplan.measure import GiB, measure_step


def timed_step(model, inputs, loss_fn, device) -> float:
    start = time.perf_counter()
    loss_fn(model(*inputs)).backward()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", default=["resnet50", "vgg19", "densenet161"])
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--input-size", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    rows = []
    for name in args.names:
        entry = models_zoo.get(name)
        torch.manual_seed(0)
        model = entry.build().to(device)
        size = args.input_size or entry.quick_input_size
        inputs = tuple(t.to(device) for t in entry.example_inputs(args.batch_size, size))
        vanilla_peak = measure_step(model, inputs, fake=True, loss_fn=entry.loss).peak_bytes
        print(f"{name}: planning ...", file=sys.stderr, flush=True)
        memory = fxplan.rewrite(model, None, example_inputs=inputs, strategy="memory", loss_fn=entry.loss)
        # At a small batch parameters dominate and 50% of vanilla is often infeasible: the time-centric
        # budget is halfway between the smallest peak reached and the vanilla peak.
        middle = (memory.fxplan_measured_peak_bytes + vanilla_peak) / 2
        models = {
            "vanilla": model,
            "time@middle": fxplan.rewrite(model, middle / GiB, example_inputs=inputs, loss_fn=entry.loss),
            "memory": memory,
        }
        times: dict[str, list[float]] = {k: [] for k in models}
        for rep in range(args.repeats + 1):
            print(f"{name}: round {rep + 1}/{args.repeats + 1}", file=sys.stderr, flush=True)
            for label, m in models.items():
                m.zero_grad(set_to_none=True)
                elapsed = timed_step(m, inputs, entry.loss, device)
                if rep:  # the first round warms up allocators and caches
                    times[label].append(elapsed)
        base = statistics.median(times["vanilla"])
        for label, m in models.items():
            plan = getattr(m, "fxplan_plan", None)
            peak = getattr(m, "fxplan_measured_peak_bytes", None) or vanilla_peak
            median = statistics.median(times[label])
            rows.append((name, label, f"{peak / GiB:.3f}", f"{1 - peak / vanilla_peak:.1%}",
                         f"{plan.recompute_fraction:.2f}" if plan else "0.00", f"{median:.3f}",
                         f"{median / base:.2f}"))
    shape = f"batch {args.batch_size}" + (f", input {args.input_size}" if args.input_size else "")
    print(f"device: {device}, {shape}, median of {args.repeats} interleaved steps")
    print(format_table(("network", "model", "peak GiB", "reduction", "recompute", "step s", "ratio"), rows))


if __name__ == "__main__":
    main()
