"""The Plan type: JSON round trip and the readable summary."""

from __future__ import annotations

from fxplan.solvers import chen, dp
from fxplan.solvers.costgraph import CostGraph
from fxplan.solvers.plans import Plan


def diamond_graph() -> CostGraph:
    nodes = ["a", "b", "c", "d", "e", "f"]
    edges = [("a", "b"), ("a", "c"), ("b", "d"), ("c", "d"), ("d", "e"), ("e", "f")]
    return CostGraph.from_edges(nodes, edges, dict.fromkeys(nodes, 2), dict.fromkeys(nodes, 3 << 20))


def test_json_round_trip():
    cg = diamond_graph()
    plan = dp.solve(cg, dp.min_activation_bytes(cg))
    again = Plan.from_json(plan.to_json())
    assert again == plan
    nested = chen.solve(cg, variant="recursive")
    assert Plan.from_json(nested.to_json(indent=1)) == nested


def test_summary_lists_segments_and_totals():
    cg = diamond_graph()
    plan = dp.solve(cg, dp.min_activation_bytes(cg))
    text = plan.summary()
    assert "predicted peak" in text and "approx-dp" in text
    assert sum(1 for line in text.splitlines() if line.strip().startswith("[")) == plan.num_segments
    assert "not recomputed" in text.splitlines()[-1]
    assert plan.lower_sets[-1] and set(plan.lower_sets[-1]) == set(cg.nodes)
    assert plan.boundaries[-1] == []
