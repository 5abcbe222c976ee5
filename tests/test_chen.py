"""Chen et al.'s baseline plans (2016, sections 4.3-4.4, Algorithm 3, appendix A)."""

from __future__ import annotations

import pytest

from fxplan.errors import BudgetError, FxplanError
from fxplan.solvers import chen, dp
from fxplan.solvers.costgraph import CostGraph
from fxplan.solvers.lowersets import GraphIndex


def residual_chain(blocks: int, mb: int = 1 << 20) -> CostGraph:
    """x → (conv → relu → conv) + x → … : a ResNet-like chain of diamonds."""
    nodes, edges, prev = ["stem"], [], "stem"
    for b in range(blocks):
        c1, r, c2, add = (f"b{b}_{s}" for s in ("conv1", "relu", "conv2", "add"))
        nodes += [c1, r, c2, add]
        edges += [(prev, c1), (c1, r), (r, c2), (c2, add), (prev, add)]
        prev = add
    nodes.append("head")
    edges.append((prev, "head"))
    T = {v: 10 if "conv" in v else 1 for v in nodes}
    return CostGraph.from_edges(nodes, edges, T, dict.fromkeys(nodes, mb))


def test_split_points_are_the_block_outputs():
    cg = residual_chain(4)
    ix = GraphIndex.build(cg)
    names = [ix.names[v] for v in chen.split_points(ix)]
    # inside a block the skip edge jumps over conv1/relu/conv2, so only stem and the adds qualify
    assert names == ["stem", "b0_add", "b1_add", "b2_add", "b3_add"]


def test_algorithm_3_on_a_chain():
    nodes = [f"n{i}" for i in range(10)]
    cg = CostGraph.from_edges(nodes, list(zip(nodes, nodes[1:])), dict.fromkeys(nodes, 1),
                              dict.fromkeys(nodes, 1))
    ix = GraphIndex.build(cg)
    cands = chen.split_points(ix)
    assert cands == list(range(9))
    splits, x, y = chen.greedy_splits(ix, cands, 2)
    assert splits == [2, 5, 8] and x == 3 and y == 3  # temp exceeds 2 after every third node
    splits0, x0, y0 = chen.greedy_splits(ix, cands, 0)
    assert splits0 == cands and x0 == 9 and y0 == 1
    assert len(chen.grid_chains(ix, cands)) == 1 + chen.GRID_SIZE


@pytest.mark.parametrize("variant", ["sqrt", "greedy", "recursive"])
def test_plans_are_valid(variant):
    cg = residual_chain(9)
    plan = chen.solve(cg, variant=variant)
    order = {v: i for i, v in enumerate(cg.topo_order())}
    flat = [v for seg in plan.segments for v in seg]
    assert sorted(flat) == sorted(cg.nodes)
    assert flat == sorted(flat, key=order.__getitem__)
    assert all(cg.is_lower_set(low) for low in plan.lower_sets)
    assert plan.solver == "chen" and plan.strategy == variant
    vanilla = dp.solve(cg, None).predicted_peak_bytes
    assert plan.predicted_peak_bytes < vanilla
    if variant == "recursive":
        assert plan.children and plan.recompute_fraction > 1.0  # nested segments are recomputed again
    else:
        assert plan.num_segments > 2


def test_dp_is_never_worse_than_chen_at_chens_own_peak():
    cg = residual_chain(9)
    ch = chen.solve(cg, variant="greedy")
    plan = dp.solve(cg, ch.predicted_peak_bytes, exact=True)
    assert plan.overhead <= ch.overhead + 1e-9


def test_budget():
    cg = residual_chain(6)
    loose = chen.solve(cg, 10**12)
    assert loose.predicted_peak_bytes <= 10**12
    with pytest.raises(BudgetError) as info:
        chen.solve(cg, 1)
    assert info.value.min_feasible_bytes > 1
    with pytest.raises(FxplanError):
        chen.solve(cg, variant="log")
