"""Where a rewritten model's extra step time goes: device kernels, or the host's launching of them.

For one zoo network, builds vanilla, block checkpointing (the peer) and fxplan's time-centric plan at the
peer's fake-meter peak; for each, one profiled step after a warm-up (torch.profiler): wall seconds, the
device's kernel seconds, the number of kernel launches, and fxplan's plan (recomputed fraction, predicted
extra seconds). Then the ops whose kernel time grows most from the peer to fxplan's plan.

Usage: python scripts/step_breakdown.py NAME [--batch-size N] [--input-size H] [--device cuda]
"""

from __future__ import annotations

import argparse
import collections
import time

import torch
from torch.profiler import ProfilerActivity, profile

import models_zoo
from fxplan.api import rewrite
from fxplan.compare import peers
from fxplan.measure.meter import measure_step
from fxplan.measure.timing import training_step


def profiled(step, device: torch.device) -> tuple[float, float, int, dict[str, float], dict[str, int]]:
    """(wall s, kernel s, kernel launches, kernel s per op name, calls per op name) of one call of ``step``
    after two warm-ups (on the CPU: the ops' own CPU seconds; no kernels)."""
    for _ in range(2):
        step()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        wall = time.perf_counter() - start
    per_op: dict[str, float] = collections.defaultdict(float)
    calls: dict[str, int] = collections.defaultdict(int)
    kernels, launches = 0.0, 0
    for event in prof.key_averages():
        seconds = (event.self_device_time_total if device.type == "cuda" else event.self_cpu_time_total) / 1e6
        if event.key.startswith("aten::"):
            per_op[event.key] += seconds
            calls[event.key] += event.count
        elif device.type == "cuda" and event.self_device_time_total > 0:
            kernels += seconds
            launches += event.count
    return wall, kernels, launches, per_op, calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("name")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--input-size", type=int, default=None)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    device = torch.device(args.device)
    entry = models_zoo.get(args.name)
    model = entry.build().to(device)
    inputs = tuple(t.to(device) for t in entry.example_inputs(args.batch_size, args.input_size))
    loss_fn = entry.loss
    peer = peers.block_checkpoint_peer(model)
    budget = measure_step(peer, inputs, fake=True, loss_fn=loss_fn).peak_bytes
    planned = rewrite(model, budget_bytes=budget, example_inputs=inputs, loss_fn=loss_fn)
    plan = planned.fxplan_plan
    print(f"{args.name}, batch {args.batch_size}, {device}: fxplan at the block peer's fake peak "
          f"({budget / 2**20:.1f} MiB): {len(plan.segments)} segments, recomputes {plan.recomputed_fraction:.0%} "
          f"of a forward, predicted +{plan.predicted_extra_seconds or 0:.4f} s")
    rows = {}
    for name, module in (("vanilla", peers.vanilla(model)), ("blocks", peer), ("fxplan", planned)):
        rows[name] = profiled(training_step(module, inputs, loss_fn, device), device)
        wall, kernels, launches, _, _ = rows[name]
        print(f"{name:8s} wall {wall:.4f} s, kernels {kernels:.4f} s, {launches} launches")
    grown = {op: rows["fxplan"][3][op] - rows["blocks"][3].get(op, 0.0) for op in rows["fxplan"][3]}
    print("ops whose time grows most from blocks to fxplan (s):")
    for op, extra in sorted(grown.items(), key=lambda kv: -kv[1])[:12]:
        print(f"  {op:40s} {extra:+.4f} s (blocks {rows['blocks'][3].get(op, 0.0):.4f} s), calls "
              f"{rows['blocks'][4].get(op, 0)} -> {rows['fxplan'][4][op]}")


if __name__ == "__main__":
    main()
