"""The DPs of Kusumoto et al. (sections 4.1-4.4) against exhaustive search on small random DAGs."""

from __future__ import annotations

import math
from unittest import mock

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from reference_dp import reference_solve

from fxplan.errors import BudgetError, FxplanError
from fxplan.solvers import dp, family_dp, time_kernel
from fxplan.solvers.costgraph import CostGraph
from fxplan.solvers.family import Family
from fxplan.solvers.lowersets import GraphIndex, enumerate_lower_sets, pruned_lower_sets, supersets_of
from fxplan.solvers.memory_model import AutogradModel, evaluate_chain, get_model

MODELS = ["paper", "autograd"]


@st.composite
def small_dags(draw, max_nodes: int = 6):
    """Random DAGs whose lower-set sequences are few enough to enumerate exhaustively."""
    n = draw(st.integers(1, max_nodes))
    nodes = [f"v{i}" for i in range(n)]
    edges = []
    for j in range(1, n):
        preds = draw(st.lists(st.integers(0, j - 1), min_size=1, max_size=min(j, 3), unique=True))
        edges += [(nodes[i], nodes[j]) for i in preds]
    T = {v: draw(st.integers(1, 9)) for v in nodes}
    M = {v: draw(st.integers(1, 40)) for v in nodes}
    cg = CostGraph.from_edges(nodes, edges, T, M)
    for e in edges:  # some edges only order the program (as the tracer's order_only edges) and carry no value
        if draw(st.integers(0, 5)) == 0:
            cg.edges[e]["order_only"] = True
    return cg


def exhaustive(cg: CostGraph, model: str, objective: str, budget: float | None):
    """Section 4.1: every increasing lower-set sequence, by DFS; returns (best value, best chain)."""
    ix = GraphIndex.build(cg)
    bm = get_model(model).bind(ix)
    best: list = [None, None]

    def better(v):
        if best[0] is None:
            return True
        return v > best[0] + 1e-9 if objective == "memory" else v < best[0] - 1e-9

    def rec(L, chain, a, m, peak):
        if L == ix.full:
            v = peak if objective == "peak" else a
            if better(v):
                best[:] = [v, list(chain)]
            return
        for Lp in supersets_of(ix, L):
            F, G, H = bm.transition(L, Lp)
            if budget is not None and m + F > budget:
                continue
            chain.append(Lp)
            rec(Lp, chain, a + H, m + G, max(peak, m + F))
            chain.pop()

    rec(0, [], 0.0, 0, 0)
    return best


def check_plan(cg: CostGraph, plan, budget):
    order = {v: i for i, v in enumerate(cg.topo_order())}
    flat = [v for seg in plan.segments for v in seg]
    assert sorted(flat) == sorted(cg.nodes), "segments partition V"
    done: set[str] = set()
    for seg, low in zip(plan.segments, plan.lower_sets):
        assert seg == sorted(seg, key=order.__getitem__), "each segment in topological order"
        done |= set(seg)
        assert set(low) == done and cg.is_lower_set(done), "L_i = V_1 ∪ … ∪ V_i is a lower set"
    if budget is not None:
        assert plan.predicted_peak_bytes <= budget


@settings(max_examples=80, deadline=None)
@given(small_dags(max_nodes=9), st.sampled_from(MODELS), st.booleans(), st.booleans())
def test_pair_costs_agree_with_transition(cg, model, pruned, dense):
    """The vectorised move costs, on both ways of looking up consumers, equal the scalar model."""
    ix = GraphIndex.build(cg)
    bm = get_model(model).bind(ix)
    fam = Family.pruned(ix) if pruned else Family(ix, enumerate_lower_sets(ix))
    if pruned:
        assert fam.sets == pruned_lower_sets(ix)
    fam.dense_counts = dense
    pi, pj = fam.moves(np.zeros(fam.S), math.inf, np.arange(fam.S))
    expected = [(i, j) for i, L in enumerate(fam.sets) for j, Lp in enumerate(fam.sets) if Lp != L and Lp & L == L]
    assert list(zip(pi.tolist(), pj.tolist())) == sorted(expected, key=lambda p: (p[1], p[0])), "sorted by target"
    F, G, H = bm.pair_costs(fam, pi, pj)
    for k, (i, j) in enumerate(zip(pi.tolist(), pj.tolist())):
        np.testing.assert_allclose((F[k], G[k], H[k]), bm.transition(fam.sets[i], fam.sets[j]), atol=1e-6)
    add, _ = bm.lb_weights()
    W = fam.sums(np.array(add))
    assert (W[pj] - W[pi] <= F + 1e-6).all(), "the additive bound never exceeds F"
    h = fam.sums(bm.h_weights())
    not_last = np.array([fam.sets[j] != ix.full for j in pj.tolist()], dtype=bool)
    assert (h[pj] - h[pi] <= H + 1e-6)[not_last].all()


def test_paper_model_is_equation_2():
    """Equation (2) computed by hand with CostGraph's set functions, on a graph with a skip edge."""
    cg = CostGraph.from_edges(
        "abcde", [("a", "b"), ("b", "c"), ("a", "c"), ("c", "d"), ("b", "e"), ("d", "e")],
        dict(a=1, b=2, c=3, d=4, e=5), dict(a=10, b=20, c=30, d=40, e=50))
    ix = GraphIndex.build(cg)
    bm = get_model("paper").bind(ix)
    L, Lp = {"a"}, {"a", "b", "c"}
    Vp = Lp - L
    dplus = cg.delta_plus(Lp) - Lp                      # {d, e}
    expected_F = 2 * cg.total_M(Vp) + cg.total_M(dplus) + cg.total_M(cg.delta_minus(dplus) - Lp)
    assert expected_F == 2 * 50 + 90 + 40             # δ⁻({d, e}) \ L' = {d}
    F, G, H = bm.transition(ix.mask(L), ix.mask(Lp))
    assert F == expected_F
    assert G == cg.total_M(cg.boundary(Lp) - L) == 50    # ∂(L') = {b, c}
    assert H == cg.total_T(Vp - cg.boundary(Lp)) == 0    # both new nodes are cached


@settings(max_examples=30, deadline=None)
@given(small_dags(), st.sampled_from(MODELS), st.sampled_from(["family", "search"]))
def test_exact_dp_equals_exhaustive_search(cg, model, engine):
    best_peak, _ = exhaustive(cg, model, "peak", None)
    assert dp.min_activation_bytes(cg, exact=True, memory_model=model, engine=engine) == math.ceil(best_peak)
    for budget in (best_peak, int(1.3 * best_peak), 2 * best_peak):
        want, _ = exhaustive(cg, model, "time", budget)
        plan = dp.solve(cg, budget, exact=True, memory_model=model, engine=engine)
        assert plan.overhead == pytest.approx(want)
        check_plan(cg, plan, budget)
        try:
            approx = dp.solve(cg, budget, exact=False, memory_model=model)
        except BudgetError as err:
            assert err.min_feasible_bytes > budget
        else:
            assert approx.overhead >= plan.overhead - 1e-9, "approximate DP never beats the exact one"
            check_plan(cg, approx, budget)
    want_mc, _ = exhaustive(cg, model, "memory", math.ceil(best_peak))
    mc = dp.solve(cg, None, strategy="memory", exact=True, memory_model=model, engine=engine)
    assert mc.overhead == pytest.approx(want_mc)
    assert mc.predicted_peak_bytes == math.ceil(best_peak)


@settings(max_examples=30, deadline=None)
@given(small_dags(max_nodes=8), st.sampled_from(MODELS), st.floats(1.0, 3.0), st.booleans())
def test_strategies_are_consistent(cg, model, factor, exact):
    b_min = dp.min_activation_bytes(cg, exact=exact, memory_model=model)
    if exact:
        assert b_min <= dp.min_activation_bytes(cg, exact=False, memory_model=model)
    budget = int(factor * b_min)
    tc = dp.solve(cg, budget, exact=exact, memory_model=model)
    mc = dp.solve(cg, budget, strategy="memory", exact=exact, memory_model=model)
    check_plan(cg, tc, budget)
    check_plan(cg, mc, budget)
    assert mc.predicted_peak_bytes <= tc.predicted_peak_bytes
    assert tc.predicted_peak_bytes == evaluate_chain(
        get_model(model).bind(GraphIndex.build(cg)), [GraphIndex.build(cg).mask(s) for s in tc.lower_sets])[0]
    assert 0.0 <= tc.recompute_fraction <= 1.0


def test_infeasible_budget_reports_the_minimum():
    cg = CostGraph.from_edges("abc", [("a", "b"), ("b", "c")], dict(a=1, b=1, c=1),
                              dict(a=30 << 20, b=30 << 20, c=30 << 20))
    b_min = dp.min_activation_bytes(cg)
    with pytest.raises(BudgetError) as info:
        dp.solve(cg, b_min - 1)
    assert info.value.min_feasible_bytes == b_min
    assert "smallest feasible budget" in str(info.value) and "MiB" in str(info.value)
    with pytest.raises(BudgetError):
        dp.solve(cg, b_min - 1, strategy="memory")
    assert dp.solve(cg, b_min).predicted_peak_bytes <= b_min


def test_chain_time_centric_trades_memory_for_time():
    n = 12
    nodes = [f"n{i}" for i in range(n)]
    cg = CostGraph.from_edges(nodes, list(zip(nodes, nodes[1:])), dict.fromkeys(nodes, 1),
                              dict.fromkeys(nodes, 100))
    free = dp.solve(cg, None)
    assert free.num_segments == 1 and free.overhead == 0 and free.recompute_fraction == 0
    tight = dp.solve(cg, dp.min_activation_bytes(cg))
    assert tight.num_segments > 1 and tight.recompute_fraction > 0
    assert tight.predicted_peak_bytes < free.predicted_peak_bytes


def test_autograd_model_uses_saved_attributes():
    cg = CostGraph.from_edges("abc", [("a", "b"), ("b", "c")], dict(a=1, b=1, c=1), dict(a=10, b=20, c=40))
    ix = GraphIndex.build(cg)
    base = get_model("autograd").bind(ix).transition(0, ix.full)
    # default: b saves a, c saves b; nothing saves c
    assert base[0] == (10 + 20) + 0 + 0 + 0 + max(10, 20 + 10, 40 + 20)
    cg.nodes["c"].update(saves_output=True, saved_inputs=(), saved=7)
    after = get_model(AutogradModel(transient=0.0)).bind(GraphIndex.build(cg)).transition(0, ix.full)
    assert after[0] == 10 + 40 + 7
    assert after[2] == 0.0, "the last segment is not recomputed"


def test_bad_arguments():
    cg = CostGraph.from_edges("ab", [("a", "b")], dict(a=1, b=1), dict(a=1, b=1))
    with pytest.raises(FxplanError):
        dp.solve(cg, 10, strategy="fast")
    with pytest.raises(FxplanError):
        dp.solve(cg, 10, memory_model="nope")
    with pytest.raises(FxplanError):
        dp.solve(cg, -1)


@settings(max_examples=30, deadline=None)
@given(small_dags(max_nodes=7), st.sampled_from(MODELS))
def test_search_engine_move_costs_agree_with_transition(cg, model):
    ix = GraphIndex.build(cg)
    bm = get_model(model).bind(ix)
    for L in enumerate_lower_sets(ix):
        seen = []
        for Lp, F, G, H in dp._successors(bm, L, math.inf):
            seen.append(Lp)
            assert (F, G, H) == pytest.approx(bm.transition(L, Lp))
        assert sorted(seen) == sorted(supersets_of(ix, L)), "with no budget every superset is visited"


@st.composite
def wider_dags(draw, max_nodes: int = 14):
    """Random DAGs with skips and fan-out, large enough for the coarse-to-fine passes and dense counts."""
    cg = draw(small_dags(max_nodes=max_nodes))
    for v in list(cg.nodes)[::3]:
        cg.nodes[v]["saves_output"] = draw(st.booleans())
    return cg


@settings(max_examples=50, deadline=None)
@given(wider_dags(), st.sampled_from(MODELS), st.booleans(), st.floats(1.0, 2.5), st.integers(1, 3))
def test_sparse_engine_gives_the_dense_engines_plans(cg, model, exact, factor, coarse):
    """Same smallest budget and the same plans (segments) as the dense engine the sparse one replaced."""
    exact = exact and cg.number_of_nodes() <= 9  # the oracle prices every pair of the lattice in Python
    old = family_dp.COARSE_SETS
    family_dp.COARSE_SETS = coarse  # force coarse-to-fine passes even on small graphs
    try:
        chain, b_min = reference_solve(cg, None, strategy="memory", exact=exact, memory_model=model)
        assert dp.min_activation_bytes(cg, exact=exact, memory_model=model) == b_min
        ctx = dp.context(cg, model)
        fam = ctx.family(exact)
        for sub in family_dp._levels(fam.S):  # the coarsest pass's cap is a plan's peak: never below the least
            assert family_dp._strided_chains_peak(ctx, fam, sub) >= b_min
        mc = dp.solve(cg, None, strategy="memory", exact=exact, memory_model=model)
        ix = GraphIndex.build(cg)
        assert [ix.mask(s) for s in mc.lower_sets] == chain
        budget = int(factor * b_min)
        want, _ = reference_solve(cg, budget, exact=exact, memory_model=model)
        got = dp.solve(cg, budget, exact=exact, memory_model=model)
        assert [ix.mask(s) for s in got.lower_sets] == want
    finally:
        family_dp.COARSE_SETS = old


def test_context_follows_graph_changes():
    cg = CostGraph.from_edges("abc", [("a", "b"), ("b", "c")], dict(a=1, b=1, c=1), dict(a=10, b=20, c=40))
    before = dp.min_activation_bytes(cg)
    assert dp.context(cg) is dp.context(cg), "one context per graph and model"
    cg.nodes["b"]["M"] = 2000
    assert dp.min_activation_bytes(cg) > before, "a changed graph is planned anew"


def test_exact_dp_memory_is_capped():
    nodes = ["src"] + [f"c{i}_{j}" for i in range(5) for j in range(6)] + ["sink"]
    edges = [("src", f"c{i}_0") for i in range(5)] + [(f"c{i}_5", "sink") for i in range(5)]
    edges += [(f"c{i}_{j}", f"c{i}_{j + 1}") for i in range(5) for j in range(5)]
    cg = CostGraph.from_edges(nodes, edges, dict.fromkeys(nodes, 1), dict.fromkeys(nodes, 8))
    for engine in ("auto", "family", "search"):
        with pytest.raises(FxplanError, match="approximate DP"):
            dp.solve(cg, None, strategy="memory", exact=True, engine=engine, max_states=1000)
    assert dp.solve(cg, None, strategy="memory", exact=False).num_segments >= 1


def _final_cache(cg: CostGraph, plan) -> int:
    ix = GraphIndex.build(cg)
    return evaluate_chain(get_model("autograd").bind(ix), [ix.mask(s) for s in plan.lower_sets])[3]


def _compiled_and_not(cg: CostGraph, budget: int, exact: bool):
    """The time-centric plan at ``budget`` by the compiled DP and by the family engine (BudgetError as a value)."""
    old = family_dp.KERNEL_MOVES
    plans = []
    try:
        for threshold in (-1, math.inf):
            family_dp.KERNEL_MOVES = threshold
            dp.forget_context(cg)
            try:
                plans.append(dp.solve(cg, budget, exact=exact))
            except BudgetError as err:
                plans.append(err.min_feasible_bytes)
    finally:
        family_dp.KERNEL_MOVES = old
    return plans


def _assert_same_optimum(cg: CostGraph, budget: int, exact: bool) -> None:
    compiled, engine = _compiled_and_not(cg, budget, exact)
    if isinstance(engine, int):
        assert compiled == engine, "both find no plan, and report the same smallest budget"
        return
    assert compiled.overhead == pytest.approx(engine.overhead, rel=1e-9, abs=1e-9)
    assert _final_cache(cg, compiled) <= _final_cache(cg, engine), "ties: the least cache"
    check_plan(cg, compiled, budget)


@settings(max_examples=60, deadline=None)
@given(wider_dags(), st.booleans(), st.floats(1.0, 2.5))
def test_compiled_time_dp_finds_the_family_engines_optimum(cg, exact, factor):
    """fxplan.solvers.time_kernel: the least overhead of the family engine (exhaustive search: the test above), with
    no more cache at the end, on the pruned family and on all lower sets."""
    exact = exact and cg.number_of_nodes() <= 10
    _assert_same_optimum(cg, int(factor * dp.min_activation_bytes(cg, exact=exact)), exact)


def test_compiled_time_dp_on_a_long_graph_with_skips():
    """Hundreds of sets, long skip connections, nodes that save their outputs: the same optimum at budgets
    from the smallest to the single-segment peak (the pruning by known overheads and by ∅'s reach at work)."""
    rng = np.random.default_rng(0)
    n = 400
    nodes = [f"v{i}" for i in range(n)]
    # two interleaved chains (a set's size and its forward time order sets differently), joined now and then
    edges = [(nodes[i - 2], nodes[i]) for i in range(2, n)] + [(nodes[i - 1], nodes[i]) for i in range(1, n, 9)]
    edges += [(nodes[i], nodes[i + int(rng.integers(2, 40))]) for i in range(0, n - 40, 7)]
    cg = CostGraph.from_edges(nodes, edges, {v: int(rng.integers(1, 1000)) for v in nodes},
                              {v: int(rng.integers(1, 100)) for v in nodes})
    for v in nodes[::5]:
        cg.nodes[v]["saves_output"] = True
    low, high = dp.min_activation_bytes(cg), dp.solve(cg, None).predicted_peak_bytes
    for f in (0.0, 0.1, 0.3, 0.6, 1.0):
        _assert_same_optimum(cg, int(low + f * (high - low)), exact=False)


@settings(max_examples=40, deadline=None)
@given(wider_dags(max_nodes=10), st.floats(1.0, 2.5))
def test_compiled_exact_dp_equals_the_family_engine(cg, factor):
    """The exact time-centric DP on lattices over FAMILY_LIMIT (forced here) runs the compiled kernel: the
    family engine's overhead (exhaustive search: tests above), and the same refusal where nothing fits."""
    budget = int(factor * dp.min_activation_bytes(cg, exact=True))
    want = dp.solve(cg, budget, exact=True)
    with mock.patch.object(dp, "FAMILY_LIMIT", 0):
        dp.forget_context(cg)
        got = dp.solve(cg, budget, exact=True)
        with pytest.raises(BudgetError):
            dp.solve(cg, dp.min_activation_bytes(cg, exact=True) - 1, exact=True)
    assert got.overhead == pytest.approx(want.overhead, rel=1e-9, abs=1e-9)
    check_plan(cg, got, budget)


@settings(max_examples=60, deadline=None)
@given(wider_dags(max_nodes=10))
def test_compiled_exact_dp_finds_the_smallest_budget_and_the_memory_centric_plan(cg):
    """Above FAMILY_LIMIT (forced here), the exact DP's smallest budget comes from the compiled kernel's tests
    of budgets below the approximate DP's, and its memory-centric plan from the kernel (through the set that
    could end a plan with the greatest overhead, else maximising over all sets): the family engine's smallest
    budget and overhead (exhaustive search: tests above)."""
    want_budget = dp.min_activation_bytes(cg, exact=True)
    want = dp.solve(cg, None, strategy="memory", exact=True)
    with mock.patch.object(dp, "FAMILY_LIMIT", 0):
        dp.forget_context(cg)
        got_budget = dp.min_activation_bytes(cg, exact=True)
        got = dp.solve(cg, None, strategy="memory", exact=True)
    assert got_budget == want_budget
    assert got.overhead == pytest.approx(want.overhead, rel=1e-9, abs=1e-9)
    assert _final_cache(cg, got) >= _final_cache(cg, want) - 1e-6, "the family engine's is the least"
    check_plan(cg, got, want_budget)


def _parallel_chains(chains: int, length: int, T, M) -> CostGraph:
    """``chains`` chains of ``length`` nodes from "src" to "sink"; ``T()`` and ``M()`` give each node's costs, in
    node order (src, the chains one after the other, sink)."""
    rows = [[f"c{i}_{j}" for j in range(length)] for i in range(chains)]
    nodes = ["src", *(v for row in rows for v in row), "sink"]
    edges = [("src", row[0]) for row in rows] + [(row[-1], "sink") for row in rows]
    edges += [(a, b) for row in rows for a, b in zip(row, row[1:])]
    return CostGraph.from_edges(nodes, edges, {v: T() for v in nodes}, {v: M() for v in nodes})


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_compiled_exact_dp_on_a_wide_lattice(seed):
    """Parallel chains (2,403 lower sets: side chains like GoogLeNet's auxiliary heads multiply them), random
    costs: the compiled smallest budget, memory-centric plan and time-centric plan at that budget equal the
    family engine's (the approximate DP's smallest budget is above the exact one on these seeds)."""
    rng = np.random.default_rng(seed)
    cg = _parallel_chains(4, 6, lambda: int(rng.integers(1, 1000)), lambda: int(rng.integers(1, 100)))
    for v in list(cg.nodes)[::3]:
        cg.nodes[v]["saves_output"] = True

    def solves():
        dp.forget_context(cg)
        low = dp.min_activation_bytes(cg, exact=True)
        return low, dp.solve(cg, None, strategy="memory", exact=True), dp.solve(cg, low, exact=True)

    want = solves()
    with mock.patch.object(dp, "FAMILY_LIMIT", 0):
        got = solves()
    assert got[0] == want[0]
    for g, w in zip(got[1:], want[1:]):
        assert g.overhead == pytest.approx(w.overhead, rel=1e-9, abs=1e-9)
        check_plan(cg, g, got[0])


def test_compiled_exact_dp_honours_its_time_limit():
    """The compiled kernel plans CHUNK sets per call and checks the time limit between calls (the smallest budget
    and the memory-centric plan too)."""
    cg = _parallel_chains(4, 8, lambda: 1, lambda: 8)
    budget = dp.solve(cg, None).predicted_peak_bytes // 2
    with mock.patch.object(dp, "FAMILY_LIMIT", 0), mock.patch.object(time_kernel, "CHUNK", 64):
        with pytest.raises(FxplanError, match="stopped after"):
            dp.solve(cg, budget, exact=True, time_limit=0.0)
        for smallest in (lambda: dp.min_activation_bytes(cg, exact=True, time_limit=0.0),
                         lambda: dp.solve(cg, None, strategy="memory", exact=True, time_limit=0.0)):
            dp.forget_context(cg)
            with pytest.raises(FxplanError, match="stopped after"):
                smallest()
        assert dp.solve(cg, budget, exact=True).overhead == pytest.approx(
            dp.solve(cg, budget, exact=True, engine="family").overhead)
