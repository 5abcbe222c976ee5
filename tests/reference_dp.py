"""The family engine as it was before the sparse one (commit 35c586f), as a test oracle.

Every pair of sets of the family is priced with the scalar model (:meth:`BoundModel.transition`), and
the DP gathers all states of all subsets for each set, as the original dense engine did; the peak
objective keeps Pareto fronts of (peak, cache). Slow (#family² pairs) and simple on purpose.
"""

from __future__ import annotations

import math

import numpy as np

from fxplan.solvers.lowersets import GraphIndex, enumerate_lower_sets, pruned_lower_sets
from fxplan.solvers.memory_model import evaluate_chain, get_model

EPS = 1e-6


def _pareto(a, m, maximize):
    order = np.argsort(-a if maximize else a, kind="stable")
    ms = m[order]
    keep = np.ones(len(order), dtype=bool)
    if len(order) > 1:
        keep[1:] = ms[1:] < np.minimum.accumulate(ms)[:-1] - EPS
    return order[keep]


def _dp(sets, F, G, H, valid, objective, budget):
    maximize = objective == "memory"
    states = {0: [(0.0, 0.0, None)]}
    for j in range(1, len(sets)):
        cand = []
        for i in range(j):
            if not valid[i, j] or (budget is not None and F[i, j] > budget + EPS):
                continue
            run = []
            for k, (a, m, _) in enumerate(states.get(i, [])):
                if budget is not None and m + F[i, j] > budget + EPS:
                    continue
                na = max(a, m + F[i, j]) if objective == "peak" else a + H[i, j]
                run.append((na, m + G[i, j], (i, k)))
            if objective == "peak":  # within a source's run, a state is dominated by a later lower peak
                run = [s for x, s in enumerate(run) if all(s[0] < t[0] for t in run[x + 1:])]
            cand += run
        if cand:
            a = np.array([c[0] for c in cand])
            m = np.array([c[1] for c in cand])
            states[j] = [cand[k] for k in _pareto(a, m, maximize)]
    last = states.get(len(sets) - 1)
    if not last:
        return None
    best = min(range(len(last)), key=lambda k: ((-1 if maximize else 1) * last[k][0], last[k][1], k))
    chain, s, j = [], last[best], len(sets) - 1
    while s[2] is not None:
        chain.append(sets[j])
        j, k = s[2]
        s = states[j][k]
    return chain[::-1]


def reference_solve(cg, budget, *, strategy="time", exact=False, memory_model=None):
    """(chain of lower sets as bitsets, or None; the smallest budget) as the dense engine computed them."""
    ix = GraphIndex.build(cg)
    bm = get_model(memory_model).bind(ix)
    sets = enumerate_lower_sets(ix) if exact else pruned_lower_sets(ix)
    S = len(sets)
    F, G, H = np.zeros((S, S)), np.zeros((S, S)), np.zeros((S, S))
    valid = np.zeros((S, S), dtype=bool)
    for i, L in enumerate(sets):
        for j, Lp in enumerate(sets):
            if Lp != L and Lp & L == L:
                valid[i, j] = True
                F[i, j], G[i, j], H[i, j] = bm.transition(L, Lp)
    peak_chain = _dp(sets, F, G, H, valid, "peak", None)
    b_min = int(math.ceil(evaluate_chain(bm, peak_chain)[0] - EPS))
    if strategy == "memory":
        return _dp(sets, F, G, H, valid, "memory", b_min), b_min
    return _dp(sets, F, G, H, valid, "time", budget), b_min
