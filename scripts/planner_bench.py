"""Planner benchmark: lower sets, DP solve times and plans on the zoo networks at the paper's batch.

Usage: python scripts/planner_bench.py [--nets resnet50,vgg19,...] [--model autograd|paper]
                                       [--exact-limit SECONDS] [--fraction 0.5] [--no-exact-tc]
                                       [--reference REV]

Each network is traced under FakeTensorMode (nothing allocated). "vanilla" is the memory model's peak of
the plan with one segment (no recomputation); the time-centric plans (approximate and exact DP) and Chen's
greedy plan are asked for ``fraction`` × vanilla. MC = memory-centric (smallest feasible budget);
"ExactDP+TC @min": the exact DP's smallest budget, then its time-centric plan there (seconds for both).
The exact DP is stopped after ``--exact-limit`` seconds per solve ("timeout"), or refuses a lattice over
its memory cap (``dp.DEFAULT_MAX_STATES``, "refused").
With ``--reference REV`` every DP solve is also run by the engine of git revision REV
(scripts/reference_engine.py), right after the current one, and its seconds are shown after a slash
("=" when it found the same plan, "≠" when not). Each engine first solves each network once untimed (the
approximate memory-centric plan): a process's first solve of a graph takes longer (about 0.05–0.13 s more on
DenseNet-161), which would otherwise fall on whichever engine is timed first.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from torch._subclasses.fake_tensor import FakeTensorMode

import models_zoo
from fxplan.costs.trace import trace
from fxplan.errors import BudgetError, FxplanError
from fxplan.solvers import chen, dp
from fxplan.solvers.lowersets import GraphIndex, count_lower_sets

NETS = ["resnet50", "resnet152", "vgg19", "densenet161", "googlenet", "unet", "pspnet"]
GiB = float(1 << 30)
COUNT_LIMIT = 2_000_000
"""Lower sets counted at most (twice the exact DP's compiled limit); a larger lattice shows as ">2,000,000"."""


def timed(fn, cg, *engines):
    for engine in engines:  # every solve from scratch
        if hasattr(engine, "forget_context"):
            engine.forget_context(cg)
        elif hasattr(engine, "_CONTEXTS"):  # a reference engine from before contexts were kept on the graph
            engine._CONTEXTS.clear()
    t0 = time.perf_counter()
    try:
        out = fn()
    except BudgetError as err:
        return "infeasible", time.perf_counter() - t0, err
    except FxplanError as err:  # the exact DP's time limit, or its memory cap
        return ("timeout" if "stopped after" in str(err) else "refused (memory cap)"), time.perf_counter() - t0, err
    return out, time.perf_counter() - t0, None


def fmt_plan(res, ref=None) -> str:
    out, secs, _ = res
    tail = ""
    if ref is not None:
        same = (isinstance(out, str) and out == ref[0]) or (
            not isinstance(out, str) and not isinstance(ref[0], str) and out.segments == ref[0].segments)
        tail = f" / {ref[1]:.2f}s {'=' if same else '≠'}"
    if isinstance(out, str):
        return f"{out} ({secs:.2f}s{tail})"
    return (f"{out.predicted_peak_bytes / GiB:.2f} GiB, {out.num_segments} seg, "
            f"rec {100 * out.recompute_fraction:.0f}% ({secs:.2f}s{tail})")


def bench(name: str, model: str, exact_limit: float, fraction: float, exact_tc: bool = True, ref=None) -> dict:
    entry = models_zoo.get(name)
    net = entry.build()
    with FakeTensorMode():
        inputs = entry.example_inputs()
    cg = trace(net, inputs)
    ix = GraphIndex.build(cg)
    t0 = time.perf_counter()
    try:
        n_lower: int | str = count_lower_sets(ix, limit=COUNT_LIMIT)
    except FxplanError:
        n_lower = f">{COUNT_LIMIT:,}"
    t_enum = time.perf_counter() - t0
    vanilla = dp.solve(cg, None, memory_model=model).predicted_peak_bytes
    budget = int(fraction * vanilla)
    row = dict(net=name, batch=entry.paper_batch, V=ix.n, L=n_lower, enum=t_enum, vanilla=vanilla / GiB)
    solves = {
        "approx_mc": lambda m: m.solve(cg, None, strategy="memory", memory_model=model),
        "approx_tc": lambda m: m.solve(cg, budget, memory_model=model),
        "exact_mc": lambda m: m.solve(cg, None, strategy="memory", exact=True, memory_model=model,
                                      time_limit=exact_limit),
        "exact_tc": lambda m: m.solve(cg, budget, exact=True, memory_model=model, time_limit=exact_limit),
        "exact_tc_min": lambda m: m.solve(cg, m.min_activation_bytes(cg, exact=True, memory_model=model,
                                                                 time_limit=exact_limit),
                                          exact=True, memory_model=model, time_limit=exact_limit),
    }
    for engine in (dp,) if ref is None else (dp, ref):  # warm-up: a process's first solves of a graph pay extra
        timed(lambda e=engine: solves["approx_mc"](e), cg, engine)
    for key, fn in solves.items():
        if key.startswith("exact_tc") and not exact_tc:
            row[key] = ("skipped", 0.0, None)
            continue
        row[key] = timed(lambda fn=fn: fn(dp), cg, dp)
        if ref is not None:
            row[key + "_ref"] = timed(lambda fn=fn: fn(ref), cg, ref)
    row["chen"] = timed(lambda: chen.solve(cg, budget, variant="greedy", memory_model=model), cg, dp)
    row["chen_free"] = timed(lambda: chen.solve(cg, None, variant="greedy", memory_model=model), cg, dp)
    return row


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nets", default=",".join(NETS))
    p.add_argument("--model", default="autograd")
    p.add_argument("--exact-limit", type=float, default=60.0)
    p.add_argument("--fraction", type=float, default=0.5)
    p.add_argument("--no-exact-tc", action="store_true", help="skip the exact time-centric solves")
    p.add_argument("--reference", default=None, help="git revision whose engine also runs every DP solve")
    args = p.parse_args(argv)
    ref = None
    if args.reference:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from reference_engine import load

        ref = load(args.reference)
    cols = ["network", "batch", "#V", "#L", "enum s", "vanilla GiB", "ApproxDP+MC", "ExactDP+MC",
            f"ApproxDP+TC @{args.fraction:.0%}", f"ExactDP+TC @{args.fraction:.0%}", "ExactDP+TC @min",
            f"Chen greedy @{args.fraction:.0%}", "Chen greedy (min peak)"]
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for name in args.nets.split(","):
        print(f"benchmarking {name} ...", file=sys.stderr, flush=True)
        r = bench(name, args.model, args.exact_limit, args.fraction, not args.no_exact_tc, ref)
        cells = [r["net"], str(r["batch"]), str(r["V"]), str(r["L"]), f"{r['enum']:.2f}",
                 f"{r['vanilla']:.2f}"] + [fmt_plan(r[k], r.get(k + "_ref")) for k in
                                           ("approx_mc", "exact_mc", "approx_tc", "exact_tc", "exact_tc_min", "chen",
                                            "chen_free")]
        print("| " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
