"""Graphs with units of recomputed inputs, derived from the captured graph's trace against traced.

Usage: python scripts/derived_units.py [NAME ...]   (names of scripts/heldout_exact.py; default: all of them)

For each model: the captured graph traced with ``probe_units=True``, the graph with every unit derived
(``fxplan.planner.splice.derived``) and traced (``fxplan.costs.trace.trace`` of ``with_regions``), seconds of each;
whether the two agree on every node's facts, the edges and the marks the rewriter reads, and on the gradient facts
(the derived graph takes the captured graph's: docs/rewrite.md); then, for three plans of each graph (no
segment, two segments cut at a third and at half of the nodes), the replayed peak against the peak measured on
fake tensors, bytes.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from heldout_exact import MODELS  # noqa: E402

from fxplan.capture.regions import regions_of, with_regions  # noqa: E402
from fxplan.costs.trace import trace  # noqa: E402
from fxplan.planner import splice  # noqa: E402
from fxplan.planner.plan_meter import PlanMeter  # noqa: E402
from fxplan.planner.replay import replay  # noqa: E402
from fxplan.planner.step_model import step_model  # noqa: E402
from fxplan.solvers.units import Unit  # noqa: E402


def timed(fn, *args, **kwargs):
    t0 = time.perf_counter()
    out = fn(*args, **kwargs)
    return time.perf_counter() - t0, out


def marks(gm) -> dict:
    return {n.name: (n.meta.get("fxplan_mutates"), n.meta.get("fxplan_fresh_output")) for n in gm.graph.nodes}


def same_facts(got, want) -> bool:
    return list(got.nodes) == list(want.nodes) and all(dict(got.nodes[v]) == dict(want.nodes[v]) for v in got) \
        and set(got.edges(data="order_only")) == set(want.edges(data="order_only")) \
        and marks(got.graph["gm"]) == marks(want.graph["gm"])


def main(names: list[str]) -> None:
    print("| model | units | trace s (probing) | derived s | traced s | facts equal | gradient facts equal | plan "
          "| derived: replayed / measured | traced: replayed / measured |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name in names:
        model, inputs = MODELS[name]()
        t_plain, plain = timed(trace, model, inputs, probe_units=True)
        units = [u for u in regions_of(plain) if isinstance(u, Unit)]
        if not units:
            print(f"| {name} | 0 | {t_plain:.2f} | - | - | - | - | - | - | - |")
            continue
        t_derived, got = timed(splice.derived, plain, units)
        t_traced, want = timed(trace, model, inputs, captured=with_regions(plain.graph["captured"], units))
        nodes = list(got.nodes)
        plans = {"no segment": [nodes], "cut at 1/3": [nodes[:len(nodes) // 3], nodes[len(nodes) // 3:]],
                 "cut at 1/2": [nodes[:len(nodes) // 2], nodes[len(nodes) // 2:]]}
        for k, (plan, segments) in enumerate(plans.items()):
            cells = []
            for cg in (got, want):
                replayed = replay(cg, step_model(cg, model, inputs, None), segments).peak_bytes
                measured = PlanMeter(cg, inputs, None).measure(segments, {})
                cells.append(f"{replayed} / {measured[0] if measured else 'rejected'}")
            head = f"| {name} | {len(units)} | {t_plain:.2f} | {t_derived:.2f} | {t_traced:.2f} | " \
                   f"{same_facts(got, want)} | {got.graph['gradients'] == want.graph['gradients']} |" if k == 0 \
                else "| | | | | | | |"
            print(f"{head} {plan} | {cells[0]} | {cells[1]} |", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:] or list(MODELS))
