"""Kusumoto et al.'s dynamic programs (2019, sections 4.2-4.4 and Algorithm 1) on a :class:`CostGraph`.

The DP walks increasing lower sets ∅ = L_0 ≺ L_1 ≺ … ≺ L_k = V. A state at lower set ``L`` is a pair
(a, m): ``m`` = M(U), the bytes of boundary values cached so far, and ``a`` the objective accumulated so far.
One move L → L' costs (F, G, H) from the memory model (:mod:`fxplan.memory_model`): it is allowed when
``m + F ≤ B`` and leads to ``(a', m + G)``. Three objectives share the machinery:

``"time"``    a = overhead so far, minimised: the time-centric strategy (Algorithm 1 as printed);
``"memory"``  a = overhead so far, maximised: the memory-centric strategy (section 4.4; the paper's
              "replace min with max at line 15") — run at the smallest feasible budget;
``"peak"``    a = peak so far, a' = max(a, m + F), minimised: the smallest feasible budget, exactly. The
              peak of a sequence is a bottleneck (max over moves) of a quantity that grows with the cache
              carried along the path, so instead of a binary search over budgets the DP keeps the Pareto
              front of (peak so far, cache so far) per lower set and reads the optimum at V.

Instead of the paper's dense table ``opt[L, t]``, each lower set keeps its Pareto front: the states not
dominated in (a, m) (a state with no better objective and no less cache is useless, section 4.2).

Two engines:

* the *family* engine (approximate DP over the pruned family {L_v}, and exact DP when the graph has at most
  ``FAMILY_LIMIT`` lower sets) evaluates the move costs of every pair of sets at once with numpy
  (:meth:`BoundModel.pair_matrices`) and then fills each set's front from all states of its subsets in one
  vectorised step;
* the *search* engine (exact DP on big lattices such as googlenet's ~327,000 lower sets) never forms pairs:
  from each reached lower set it enumerates only the supersets whose new segment can fit the budget, by a
  depth-first search that grows the segment and stops as soon as a lower bound on its cost (monotone in the
  segment) exceeds the budget.
"""

from __future__ import annotations

import math
import time
from collections import defaultdict
from collections.abc import Iterator

import numpy as np

from fxplan.costgraph import CostGraph
from fxplan.errors import BudgetError, FxplanError
from fxplan.lowersets import GraphIndex, enumerate_lower_sets, iter_bits, pruned_lower_sets
from fxplan.memory_model import BoundModel, evaluate_chain, get_model
from fxplan.plans import Plan, _fmt_bytes

FAMILY_LIMIT = 1500
"""Exact DP uses the vectorised family engine up to this many lower sets (pair matrices are #L² floats)."""

_EPS = 1e-6

DEFAULT_TIME_LIMIT = 600.0
"""Seconds after which the exact DP's search engine gives up (FxplanError) unless told otherwise."""


# ------------------------------------------------------------------------------------------ fronts
def _pareto_np(a: np.ndarray, m: np.ndarray, maximize: bool, tol: float = 0.0) -> np.ndarray:
    """Indices of the non-dominated (a, m) pairs: a minimised (maximised if ``maximize``), m minimised.

    With ``tol`` > 0 a pair is also dropped when a kept pair has an objective as good and a cache at most
    ``tol`` bytes larger (ε-dominance; see ``resolution`` in :func:`solve`).
    """
    if tol > 0:
        m = np.floor(m / tol)  # compare caches in buckets of tol bytes
    # a stable sort on the objective alone: the candidates arrive as runs already sorted (one per source
    # front), which timsort exploits; among equal objectives a larger cache may survive, which is harmless
    order = np.argsort(-a if maximize else a, kind="stable")
    ms = m[order]
    keep = np.ones(len(order), dtype=bool)
    if len(order) > 1:
        run = np.minimum.accumulate(ms)
        keep[1:] = ms[1:] < run[:-1] - (0.5 if tol > 0 else _EPS)
    return order[keep]


def _best(a: np.ndarray, m: np.ndarray, maximize: bool) -> int:
    order = np.lexsort((m, -a if maximize else a))
    return int(order[0])


# ------------------------------------------------------------------------------------------ family engine
class _Family:
    """A family of lower sets with the costs of every move between them (computed once, used by each run)."""

    def __init__(self, bm: BoundModel, sets: list[int]):
        ix = bm.ix
        self.sets = sets
        A = ix.to_matrix(sets)
        F, G, H = bm.pair_matrices(sets, A)
        sizes = A.sum(axis=1).astype(np.float64)
        Af = A.astype(np.float32)  # 0/1 entries: counts are exact in float32 below 2**24
        inter = Af @ Af.T
        valid = (inter == sizes[:, None]) & (sizes[None, :] > sizes[:, None])
        # row j of the transposes holds every move into sets[j]: contiguous gathers in the DP
        self.VT, self.FT, self.GT, self.HT = (np.ascontiguousarray(x.T) for x in (valid, F, G, H))


def _family_dp(fam: _Family, objective: str, budget: float | None, tol: float = 0.0) -> list[int] | None:
    """Algorithm 1 over the family (sorted by size, ∅ first, V last). Returns L_1..L_k or None."""
    sets = fam.sets
    S = len(sets)
    VT, FT, GT, HT = fam.VT, fam.FT, fam.GT, fam.HT
    if budget is not None:
        VT = VT & (FT <= budget + _EPS)
    maximize = objective == "memory"
    cap = 1024
    a = np.zeros(cap)
    m = np.zeros(cap)
    par = np.full(cap, -1, dtype=np.int64)
    own = np.zeros(cap, dtype=np.int64)
    start = np.zeros(S + 1, dtype=np.int64)
    start[1] = 1
    n_st = 1
    for j in range(1, S):
        src = np.flatnonzero(VT[j, :j])
        lens = start[src + 1] - start[src]
        tot = int(lens.sum())
        if tot:
            idx = np.repeat(start[src] - (np.cumsum(lens) - lens), lens) + np.arange(tot)
            oo = np.repeat(src, lens)
            f = FT[j, oo]
            if budget is not None:
                ok = m[idx] + f <= budget + _EPS
                idx, oo, f = idx[ok], oo[ok], f[ok]
        if tot and idx.size:
            if objective == "peak":
                na = np.maximum(a[idx], m[idx] + f)
            else:
                na = a[idx] + HT[j, oo]
            nm = m[idx] + GT[j, oo]
            if objective == "peak" and na.size > 1:
                # each source contributes a run with the cache decreasing; a state is dominated within its
                # run unless its new peak is below every later one of the run (a reset suffix minimum)
                base = na.min()
                span = na.max() - base + 1.0
                key = (na - base) + oo * span  # runs are contiguous, in increasing source index oo
                suf = np.minimum.accumulate(key[::-1])[::-1]
                alive = np.ones(na.size, dtype=bool)
                alive[:-1] = key[:-1] < suf[1:]
                idx, oo, na, nm = idx[alive], oo[alive], na[alive], nm[alive]
            keep = _pareto_np(na, nm, maximize, tol)
            k = keep.size
            if n_st + k > cap:
                cap = max(2 * cap, n_st + k)
                own, a, m, par = (np.resize(x, cap) for x in (own, a, m, par))
            own[n_st:n_st + k] = j
            a[n_st:n_st + k] = na[keep]
            m[n_st:n_st + k] = nm[keep]
            par[n_st:n_st + k] = idx[keep]
            n_st += k
        start[j + 1] = n_st
    lo, hi = start[S - 1], start[S]
    if lo == hi:
        return None
    s = lo + _best(a[lo:hi], m[lo:hi], maximize)
    chain = []
    while s > 0:
        chain.append(sets[own[s]])
        s = par[s]
    return chain[::-1]


# ------------------------------------------------------------------------------------------ search engine
def _successors(bm: BoundModel, L: int, cap: float) -> Iterator[tuple[int, float, float, float]]:
    """Lower sets L' ⊋ L with F(L, L') ≤ cap, with their (F, G, H); prunes on the monotone lower bound."""
    ix = bm.ix
    pred, succ = ix.pred, ix.succ
    addable = 0
    for i in iter_bits(ix.full & ~L):
        if not pred[i] & ~L:
            addable |= 1 << i
    stack = [(L, addable, 0, bm.inc_start(L))]
    lim = cap + _EPS
    while stack:
        cur, ad, lo, st = stack.pop()
        cand = ad >> lo << lo
        while cand:
            low = cand & -cand
            cand ^= low
            i = low.bit_length() - 1
            nxt = cur | low
            nst = bm.inc_add(st, L, nxt, i)
            if bm.inc_lb(nst) > lim:
                continue  # every superset of this segment costs at least as much
            nad = ad ^ low
            for j in iter_bits(succ[i]):
                if not pred[j] & ~nxt:
                    nad |= 1 << j
            Fv, Gv, Hv = bm.inc_eval(nst, L, nxt)
            if Fv <= lim:
                yield nxt, Fv, Gv, Hv
            stack.append((nxt, nad, i + 1, nst))


def _search_dp(bm: BoundModel, objective: str, budget: float | None, time_limit: float | None,
               limit: int | None = None) -> list[int] | None:
    """Algorithm 1 over all lower sets, enumerating only budget-feasible moves (module docstring)."""
    ix = bm.ix
    t0 = time.perf_counter()
    lsets = enumerate_lower_sets(ix, limit=limit)
    maximize = objective == "memory"
    pending: dict[int, list[tuple[float, float, object]]] = defaultdict(list)
    pending[0].append((0.0, 0.0, None))
    fronts: dict[int, list[tuple[float, float, object]]] = {}
    inf = math.inf
    for L in lsets:
        cand = pending.pop(L, None)
        if not cand:
            continue
        cand.sort(key=(lambda s: (-s[0], s[1])) if maximize else (lambda s: (s[0], s[1])))
        front, run = [], inf
        for s in cand:
            if s[1] < run - _EPS:
                front.append(s)
                run = s[1]
        fronts[L] = front
        if L == ix.full:
            break
        if time_limit is not None and time.perf_counter() - t0 > time_limit:
            raise FxplanError(
                f"exact DP stopped after {time_limit:.0f} s ({len(fronts)} of {len(lsets)} lower sets "
                "done); use the approximate DP (exact=False) or a larger time_limit"
            )
        mmin = front[-1][1]
        cap = inf if budget is None else budget - mmin
        peak = objective == "peak"
        for Lp, Fv, Gv, Hv in _successors(bm, L, cap):
            bucket = pending[Lp]
            best_peak = inf
            # front: objective ascending (descending for "memory"), cache strictly descending
            for k in range(len(front) - 1, -1, -1):
                a, m, _ = front[k]
                if budget is not None and m + Fv > budget + _EPS:
                    break  # caches only grow towards the front's start
                if peak:
                    na = a if a > m + Fv else m + Fv
                    if na >= best_peak:
                        continue  # a state with less cache already reaches a lower peak
                    best_peak = na
                else:
                    na = a + Hv
                bucket.append((na, m + Gv, (L, k)))
    if ix.full not in fronts:
        return None
    front = fronts[ix.full]
    s = front[0]
    chain = []
    L = ix.full
    while s[2] is not None:
        chain.append(L)
        L, k = s[2]
        s = fronts[L][k]
    return chain[::-1]


# ------------------------------------------------------------------------------------------ plans
def plan_from_chain(ix: GraphIndex, bm: BoundModel, chain: list[int], *, budget: int | None, strategy: str,
                    solver: str, seconds: float) -> Plan:
    """Build a :class:`Plan` from lower sets L_1 ≺ … ≺ L_k = V (bitsets), evaluated under ``bm``."""
    if not chain or chain[-1] != ix.full:
        raise FxplanError("a plan's last lower set must be V")
    peak, over, seg_peaks, _ = evaluate_chain(bm, chain)
    segments, lowers, bounds, seg_T = [], [], [], []
    prev, kept_all = 0, 0
    for Lp in chain:
        Vp = Lp & ~prev
        bd = ix.boundary(Lp)
        kept_all |= bd
        segments.append(ix.names_of(Vp))
        lowers.append(ix.names_of(Lp))
        bounds.append(ix.names_of(bd & Vp))
        seg_T.append(ix.tsum(Vp))
        prev = Lp
    total_T = ix.tsum(ix.full)
    return Plan(
        segments=segments,
        lower_sets=lowers,
        boundaries=bounds,
        predicted_peak_bytes=int(peak),
        segment_peak_bytes=seg_peaks,
        overhead=float(over),
        recompute_fraction=(sum(seg_T[:-1]) / total_T) if total_T else 0.0,
        paper_overhead_fraction=(ix.tsum(ix.full & ~kept_all) / total_T) if total_T else 0.0,
        budget_bytes=None if budget is None else int(budget),
        strategy=strategy,
        solver=solver,
        memory_model=bm.name,
        solve_seconds=seconds,
        total_T=total_T,
        segment_T=seg_T,
    )


def _run(ix: GraphIndex, bm: BoundModel, objective: str, budget: float | None, exact: bool, engine: str,
         time_limit: float | None, cache: dict) -> list[int] | None:
    """One DP run; ``cache`` keeps the family and its move costs between runs of one solve."""
    if exact and engine == "search":
        return _search_dp(bm, objective, budget, time_limit)
    if "family" not in cache:
        if not exact:
            sets = pruned_lower_sets(ix)
        elif engine == "family":
            sets = enumerate_lower_sets(ix)
        else:
            try:
                sets = enumerate_lower_sets(ix, limit=FAMILY_LIMIT)
            except FxplanError:
                sets = None
        cache["family"] = None if sets is None else _Family(bm, sets)
    if cache["family"] is None:  # exact DP on a lattice too big for pair matrices
        if objective == "peak" and budget is None:
            # bound the search by what the approximate DP achieves; the exact optimum is no larger
            approx = _family_dp(_Family(bm, pruned_lower_sets(ix)), "peak", None)
            budget = evaluate_chain(bm, approx)[0]
        return _search_dp(bm, objective, budget, time_limit)
    return _family_dp(cache["family"], objective, budget)


def min_budget_bytes(cg: CostGraph, *, exact: bool = False, memory_model=None, engine: str = "auto",
                     time_limit: float | None = DEFAULT_TIME_LIMIT) -> int:
    """The smallest budget (bytes) for which this DP finds a plan: min over plans of the predicted peak.

    Exact for the family searched (all lower sets if ``exact``, else the pruned family), found directly by
    the "peak" DP (module docstring), not by binary search.
    """
    ix = GraphIndex.build(cg)
    bm = get_model(memory_model).bind(ix)
    chain = _run(ix, bm, "peak", None, exact, engine, time_limit, {})
    if chain is None:  # cannot happen: the single segment V is always a plan
        raise FxplanError("no plan found")
    return int(math.ceil(evaluate_chain(bm, chain)[0] - _EPS))


def solve(cg: CostGraph, budget_bytes: int | None, *, strategy: str = "time", exact: bool = False,
          memory_model=None, engine: str = "auto", time_limit: float | None = DEFAULT_TIME_LIMIT) -> Plan:
    """Find a recomputation plan for ``cg`` within ``budget_bytes`` (Kusumoto et al., sections 4.2-4.4).

    ``strategy="time"``: least overhead with predicted peak ≤ budget (``None``: no limit).
    ``strategy="memory"``: greatest overhead at the smallest feasible budget (section 4.4); the budget, if
    given, must be at least that. ``exact``: all lower sets (section 4.2) instead of the pruned family
    {L_v} (section 4.3). ``memory_model``: ``"autograd"`` (default), ``"paper"`` or a model object.
    ``engine`` (exact DP only): ``"auto"``, ``"family"`` or ``"search"``; ``time_limit`` (seconds) stops
    the exact search engine with an :class:`FxplanError` (default ``DEFAULT_TIME_LIMIT``; ``None``: never).

    Raises :class:`BudgetError` (with ``min_feasible_bytes``) when no plan fits the budget.
    """
    if strategy not in ("time", "memory"):
        raise FxplanError(f"strategy must be 'time' or 'memory', not {strategy!r}")
    if budget_bytes is not None and budget_bytes < 0:
        raise FxplanError(f"budget_bytes must be non-negative, not {budget_bytes}")
    t0 = time.perf_counter()
    ix = GraphIndex.build(cg)
    bm = get_model(memory_model).bind(ix)
    solver = "exact-dp" if exact else "approx-dp"

    def fail(min_b: int) -> BudgetError:
        return BudgetError(
            f"no {solver} plan fits the budget of {_fmt_bytes(budget_bytes)} ({budget_bytes} bytes) under "
            f"the {bm.name!r} memory model; the smallest feasible budget is {_fmt_bytes(min_b)} "
            f"({min_b} bytes). Raise the budget, or try exact=True or strategy='memory'.",
            min_feasible_bytes=min_b,
        )

    if strategy == "memory":
        cache: dict = {}
        chain = _run(ix, bm, "peak", None, exact, engine, time_limit, cache)
        b_star = int(math.ceil(evaluate_chain(bm, chain)[0] - _EPS))
        if budget_bytes is not None and budget_bytes < b_star:
            raise fail(b_star)
        chain = _run(ix, bm, "memory", b_star, exact, engine, time_limit, cache)
    else:
        chain = _run(ix, bm, "time", budget_bytes, exact, engine, time_limit, {})
        if chain is None:
            raise fail(min_budget_bytes(cg, exact=exact, memory_model=memory_model, engine=engine,
                                        time_limit=time_limit))
    return plan_from_chain(ix, bm, chain, budget=budget_bytes, strategy=strategy, solver=solver,
                           seconds=time.perf_counter() - t0)
