"""Lower-set enumeration and the pruned family against brute force (Kusumoto et al., sections 2, 4.3)."""

from __future__ import annotations

import itertools

import networkx as nx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fxplan.errors import FxplanError
from fxplan.solvers.costgraph import CostGraph
from fxplan.solvers.lowersets import (
    GraphIndex,
    count_lower_sets,
    enumerate_lower_sets,
    pruned_lower_sets,
    supersets_of,
)


@st.composite
def dags(draw, max_nodes: int = 9):
    n = draw(st.integers(1, max_nodes))
    nodes = [f"v{i}" for i in range(n)]
    pairs = [(i, j) for j in range(n) for i in range(j)]
    chosen = draw(st.lists(st.sampled_from(pairs), unique=True, max_size=len(pairs))) if pairs else []
    perm = draw(st.permutations(nodes))  # insertion order need not be topological
    T = {v: draw(st.integers(1, 9)) for v in nodes}
    M = {v: draw(st.integers(1, 50)) for v in nodes}
    return CostGraph.from_edges(perm, [(nodes[i], nodes[j]) for i, j in chosen], T, M)


def brute_lower_sets(cg: CostGraph) -> set[frozenset[str]]:
    nodes = list(cg.nodes)
    out = set()
    for r in range(len(nodes) + 1):
        for combo in itertools.combinations(nodes, r):
            if cg.is_lower_set(combo):
                out.add(frozenset(combo))
    return out


@settings(max_examples=60, deadline=None)
@given(dags())
def test_enumeration_equals_brute_force(cg):
    ix = GraphIndex.build(cg)
    sets = enumerate_lower_sets(ix)
    named = [frozenset(ix.names_of(s)) for s in sets]
    assert len(named) == len(set(named)), "each lower set exactly once"
    assert set(named) == brute_lower_sets(cg)
    assert count_lower_sets(ix) == len(sets)
    assert count_lower_sets(ix, limit=len(sets)) == len(sets)
    if len(sets) > 1:
        with pytest.raises(FxplanError, match=f"more than {len(sets) - 1} lower sets"):
            count_lower_sets(ix, limit=len(sets) - 1)
    assert [s.bit_count() for s in sets] == sorted(s.bit_count() for s in sets)


@settings(max_examples=40, deadline=None)
@given(dags())
def test_pruned_family_is_ancestor_closures(cg):
    ix = GraphIndex.build(cg)
    fam = {frozenset(ix.names_of(s)) for s in pruned_lower_sets(ix)}
    expected = {frozenset(nx.ancestors(cg, v) | {v}) for v in cg.nodes} | {frozenset(), frozenset(cg.nodes)}
    assert fam == expected
    assert all(cg.is_lower_set(s) for s in fam)


@settings(max_examples=40, deadline=None)
@given(dags(max_nodes=7), st.data())
def test_set_functions_match_costgraph(cg, data):
    ix = GraphIndex.build(cg)
    pos = {v: i for i, v in enumerate(ix.names)}
    assert all(pos[u] < pos[w] for u, w in cg.edges), "topological numbering"
    sets = enumerate_lower_sets(ix)
    L = data.draw(st.sampled_from(sets))
    names = ix.names_of(L)
    assert set(ix.names_of(ix.boundary(L))) == cg.boundary(names)
    assert set(ix.names_of(ix.delta_plus(L))) == cg.delta_plus(names)
    assert set(ix.names_of(ix.delta_minus(L))) == cg.delta_minus(names)
    assert ix.msum(L) == cg.total_M(names)
    sup = list(supersets_of(ix, L))
    assert sorted(sup) == sorted(s for s in sets if s & L == L and s != L)


def parallel_chains(k: int, length: int) -> CostGraph:
    """A source, k parallel chains of ``length`` nodes, a sink joining them (googlenet-like width)."""
    nodes = ["src"] + [f"c{i}_{j}" for i in range(k) for j in range(length)] + ["sink"]
    edges = []
    for i in range(k):
        edges.append(("src", f"c{i}_0"))
        edges += [(f"c{i}_{j}", f"c{i}_{j + 1}") for j in range(length - 1)]
        edges.append((f"c{i}_{length - 1}", "sink"))
    return CostGraph.from_edges(nodes, edges, dict.fromkeys(nodes, 1), dict.fromkeys(nodes, 8))


def test_wide_graph_with_a_quarter_million_lower_sets():
    # ∅, V, and with the source in: any prefix of each chain, (length + 1) ** k choices
    k, length = 5, 11
    sets = enumerate_lower_sets(parallel_chains(k, length))
    assert len(sets) == 2 + (length + 1) ** k == 248_834
    assert len(set(sets)) == len(sets)


def test_limit_refuses_huge_lattices():
    import pytest

    from fxplan.errors import FxplanError

    with pytest.raises(FxplanError, match="approximate DP"):
        enumerate_lower_sets(parallel_chains(4, 6), limit=100)


def test_order_only_edges_shape_lower_sets_but_carry_no_value():
    cg = CostGraph.from_edges("abc", [("a", "b"), ("b", "c"), ("a", "c")], dict.fromkeys("abc", 1),
                              dict.fromkeys("abc", 1))
    cg.edges["a", "c"]["order_only"] = True
    ix = GraphIndex.build(cg)
    assert {frozenset(ix.names_of(s)) for s in enumerate_lower_sets(ix)} == brute_lower_sets(cg)
    assert ix.names_of(ix.boundary(ix.mask("a"))) == ["a"]
    assert ix.names_of(ix.boundary(ix.mask("ab"))) == ["b"], "c reads b only; the a → c edge is order"
