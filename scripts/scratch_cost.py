"""What counting kernel scratch (fxplan.measure.scratch) costs a planning run, side by side in one run.

Usage: python scripts/scratch_cost.py [MODEL] [--batch-size N] [--input-size H]

For a torchvision model (default resnet50, batch 8, 224²), three fresh processes one after the other, each
with the machine's device benchmark (``device_speed.json``) and nothing else in its cache folder at first: the
meters without scratch (``fxplan.measure.scratch.not_counted()``), with an empty scratch cache (every distinct ATen
call runs once on real tensors), and with the cache the second process wrote. Each measures one fake step and
then ``fxplan.rewrite`` at half that step's peak, and prints their seconds, the plan's measured peak and its
recomputation. The budgets differ between the first process and the others: half of a peak without and with
scratch.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from fxplan.common.cache import cache_file
from fxplan.costs import timecost


def child(model_name: str, batch: int, size: int, counted: bool) -> None:
    import torch
    import torchvision
    from torch._subclasses.fake_tensor import FakeTensorMode

    import fxplan
    from fxplan.measure import scratch

    torch.manual_seed(0)
    model = getattr(torchvision.models, model_name)(weights=None).train()
    with FakeTensorMode():
        x = torch.randn(batch, 3, size, size)
    with contextlib.nullcontext() if counted else scratch.not_counted():
        start = time.perf_counter()
        step = fxplan.measure_step(model, (x,), fake=True)
        stepped = time.perf_counter()
        optimized = fxplan.rewrite(model, budget_bytes=step.peak_bytes // 2, example_inputs=(x,))
        done = time.perf_counter()
    plan = optimized.fxplan_plan
    print(f"{stepped - start:.1f} | {done - stepped:.1f} | {step.peak_bytes / 2**20:.1f} | "
          f"{plan.measured_peak_bytes / 2**20:.1f} | {plan.recompute_fraction:.3f}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?", default="resnet50")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--input-size", type=int, default=224)
    parser.add_argument("--child", choices=["off", "on"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.model, args.batch_size, args.input_size, args.child == "on")
        return
    print(f"{args.model}, batch {args.batch_size}, {args.input_size}²")
    print("| scratch | first fake step s | rewrite at half its peak s | step peak MiB | plan peak MiB | recompute |")
    print("|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as cache_dir:
        # the same roofline costs in every process: the machine's device benchmark, if it has one
        speeds = cache_file(timecost.SPEEDS_FILE)
        if speeds.exists():
            shutil.copy(speeds, Path(cache_dir) / speeds.name)
        env = {**os.environ, "FXPLAN_CACHE_DIR": cache_dir}
        runs = (("not counted", "off"), ("counted, empty cache", "on"), ("counted, cache of the run before", "on"))
        for label, mode in runs:
            command = [sys.executable, __file__, args.model, "--batch-size", str(args.batch_size),
                       "--input-size", str(args.input_size), "--child", mode]
            out = subprocess.run(command, env=env, capture_output=True, text=True, check=True).stdout.strip()
            print(f"| {label} | {out.splitlines()[-1]} |", flush=True)


if __name__ == "__main__":
    main()
