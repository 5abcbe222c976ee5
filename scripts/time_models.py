"""How the node cost models of fxplan.costs.trace see a network: tracing time and each op kind's share of T.

Usage: python scripts/time_models.py [NAME] [--batch-size N] [--input-size H] [--threads K]

Traces the network once per cost model (flops, roofline, measured), prints the seconds each trace took,
the predicted forward seconds (time models) and the share of T per op kind (conv, bn, relu, add, ...),
beside the median of 3 real forward passes of the model for scale. The measured device speed (FLOP/s,
bandwidth, per-op seconds, and the op kinds priced at their own rate) used by the roofline is printed first.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict

import torch

import models_zoo
from fxplan.common.console import format_table
from fxplan.costs.timecost import device_speed
from fxplan.costs.trace import COST_MODELS, trace
from fxplan.measure.timing import fixed_threads


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("name", nargs="?", default="resnet50")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--input-size", type=int, default=112)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args()
    entry = models_zoo.get(args.name)
    torch.manual_seed(0)
    model = entry.build()
    inputs = entry.example_inputs(args.batch_size, args.input_size)
    with fixed_threads(args.threads):
        speed = device_speed("cpu")
        print(f"cpu, {args.threads} threads: {speed.flops_per_s / 1e9:.1f} GFLOP/s, "
              f"{speed.bytes_per_s / 1e9:.2f} GB/s, {1e6 * speed.op_seconds:.2f} us per op; priced apart: "
              + (", ".join(f"{kind} {rate / 1e9:.2f} GB/s" for kind, rate in speed.op_bytes_per_s.items()) or "none"))
        forwards = []
        with torch.no_grad():
            for _ in range(4):
                start = time.perf_counter()
                model(*inputs)
                forwards.append(time.perf_counter() - start)
        print(f"{args.name}, batch {args.batch_size}, {args.input_size}²: real forward "
              f"{statistics.median(forwards[1:]):.3f} s (median of 3 after a warm-up, no_grad)")
        rows = []
        for cm in [m for m in COST_MODELS if m != "paper"]:
            start = time.perf_counter()
            cg = trace(model, inputs, cost_model=cm)
            seconds = time.perf_counter() - start
            by_kind: dict[str, float] = defaultdict(float)
            for v in cg.nodes:
                by_kind[cg.nodes[v]["kind"]] += cg.nodes[v]["T"]
            total = sum(by_kind.values())
            unit = cg.graph["T_seconds"]
            shares = ", ".join(f"{k} {v / total:.1%}" for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1])[:5])
            rows.append((cm, f"{seconds:.1f}", f"{total * unit:.3f}" if unit else "-", shares))
    print(format_table(("cost model", "trace s", "forward s predicted", "share of T by kind"), rows))


if __name__ == "__main__":
    main()
