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

The "peak" objective needs no front: with cache m at L, the least peak any completion reaches is m + ψ(L),
since the cache held adds to every later move alike, so ψ(∅) (the smallest budget) is a single-label
bottleneck DP run backwards from V (:func:`_bottleneck`); ψ also prunes, in the other two DPs, every state
that no completion fits in the budget.

Two engines:

* the *family* engine (approximate DP over the pruned family {L_v}, and exact DP when the graph has at most
  ``FAMILY_LIMIT`` lower sets) lists only the moves whose segment can fit the budget, from an additive
  lower bound on F, and prices them with numpy (:class:`~fxplan.family.Family`,
  :meth:`BoundModel.pair_costs`); the forward DP fills each set's front from all states of its sources in
  one vectorised step. Without a budget ("peak", or "time" with a large one) it runs coarse to fine: a
  sub-family's plan bounds the optimum and so the moves and states the next pass needs.
* the *search* engine (exact DP on big lattices such as googlenet's ~280,000 lower sets) never forms pairs:
  from each reached lower set it enumerates only the supersets whose new segment can fit the budget, by a
  depth-first search that grows the segment and stops as soon as a lower bound on its cost (monotone in the
  segment) exceeds the budget.

Both exact engines stop with an :class:`FxplanError` (use the approximate DP) beyond ``max_states`` lower
sets, states or moves, and the search engine after ``time_limit`` seconds.
"""

from __future__ import annotations

import math
import time
import weakref
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np

from fxplan.costgraph import CostGraph
from fxplan.errors import BudgetError, FxplanError
from fxplan.family import Family
from fxplan.lowersets import GraphIndex, enumerate_lower_sets, iter_bits
from fxplan.memory_model import BoundModel, evaluate_chain, get_model
from fxplan.plans import Plan, _fmt_bytes

FAMILY_LIMIT = 20_000
"""Exact DP uses the family engine up to this many lower sets, the search engine above."""

COARSE_SETS = 256
"""The coarse-to-fine passes start from a sub-family of about this many sets (see :func:`_family_run`)."""

_EPS = 1e-6

DEFAULT_TIME_LIMIT = 600.0
"""Seconds after which the exact DP's search engine gives up (FxplanError) unless told otherwise."""

DEFAULT_MAX_STATES = 4_000_000
"""Lower sets plus DP states (or moves, in the family engine) the exact DP may hold at once (about 1 GB);
beyond it, an FxplanError that says to use the approximate DP."""

APPROX_MAX_MOVES = 30_000_000
"""Moves the approximate DP may price at once (about 1.2 GB); beyond it, an FxplanError."""


# ------------------------------------------------------------------------------------------ fronts
def _pareto_np(a: np.ndarray, m: np.ndarray, maximize: bool) -> np.ndarray:
    """Indices of the non-dominated (a, m) pairs: a minimised (maximised if ``maximize``), m minimised."""
    # a stable sort on the objective alone: the candidates arrive as runs already sorted (one per source
    # front), which timsort exploits; among equal objectives a larger cache may survive, which is harmless
    order = np.argsort(-a if maximize else a, kind="stable")
    ms = m[order]
    keep = np.ones(len(order), dtype=bool)
    if len(order) > 1:
        run = np.minimum.accumulate(ms)
        keep[1:] = ms[1:] < run[:-1] - _EPS
    return order[keep]


def _best(a: np.ndarray, m: np.ndarray, maximize: bool) -> int:
    order = np.lexsort((m, -a if maximize else a))
    return int(order[0])


# ------------------------------------------------------------------------------------------ planning context
@dataclass
class Context:
    """What one cost graph and memory model give every DP run: the index, the bound model, the families
    and the moves already priced. :func:`context` caches it per graph, so repeated solves on one graph
    (``fxplan.rewrite`` plans several budgets) build it once."""

    ix: GraphIndex
    bm: BoundModel
    families: dict = field(default_factory=dict)
    moves: dict = field(default_factory=dict)
    move_limit: dict = field(default_factory=dict)
    psi: dict = field(default_factory=dict)  # per family: (cap, ψ over the whole family's moves with F ≤ cap)

    def family(self, exact: bool, max_sets: int | None = None) -> Family | None:
        """The pruned family {L_v} (section 4.3), or all lower sets (None if more than ``max_sets``)."""
        key = "exact" if exact else "pruned"
        if key not in self.families:
            if exact:
                try:
                    sets = enumerate_lower_sets(self.ix, limit=max_sets)
                except FxplanError:
                    sets = None
                self.families[key] = None if sets is None else Family(self.ix, sets)
            else:
                self.families[key] = Family.pruned(self.ix)
        return self.families[key]


_CONTEXTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _fingerprint(cg: CostGraph) -> int:
    attrs = ("T", "M", "saved", "saves_output", "saved_inputs")
    nodes = tuple((v, *(repr(d.get(k)) for k in attrs)) for v, d in cg.nodes(data=True))
    return hash((nodes, tuple(cg.edges(data="order_only", default=False))))


def context(cg: CostGraph, memory_model=None) -> Context:
    """The planning context of ``cg`` under ``memory_model``, reused while the graph is unchanged."""
    model = get_model(memory_model)
    try:
        hash(model)
    except TypeError:  # an unhashable custom model: no caching
        ix = GraphIndex.build(cg)
        return Context(ix, model.bind(ix))
    key = _fingerprint(cg)
    held = _CONTEXTS.get(cg)
    if held is None or held[0] != key:
        held = (key, GraphIndex.build(cg), {})
        _CONTEXTS[cg] = held
    if model not in held[2]:
        held[2][model] = Context(held[1], model.bind(held[1]))
    return held[2][model]


# ------------------------------------------------------------------------------------------ family engine
@dataclass
class _Moves:
    """Moves between sets of a family, sorted by target then source, with their costs."""

    pi: np.ndarray
    pj: np.ndarray
    F: np.ndarray
    G: np.ndarray
    H: np.ndarray

    def restrict(self, keep: np.ndarray) -> _Moves:
        return _Moves(self.pi[keep], self.pj[keep], self.F[keep], self.G[keep], self.H[keep])


def _priced_moves(ctx: Context, fam: Family, cap: float, sources: np.ndarray, targets: np.ndarray) -> _Moves:
    """Moves L_i ⊊ L_j (i in ``sources``, j in ``targets``, increasing family indices) with F ≤ ``cap``.

    Candidates come from the additive lower bound of the memory model (:meth:`Family.moves`); only those
    are priced. Moves over the whole family are kept per family and reused for any smaller cap.
    """
    held = ctx.moves.get(id(fam))
    if held is not None and held[0] >= cap:
        mv = held[1]
        keep = mv.F <= cap + _EPS
        for sel, ends in ((sources, mv.pi), (targets, mv.pj)):
            if len(sel) < fam.S:
                mask = np.zeros(fam.S, dtype=bool)
                mask[sel] = True
                keep &= mask[ends]
        return mv.restrict(keep)
    wkey = ("lb", id(ctx.bm))
    if wkey not in fam.cache:
        fam.cache[wkey] = fam.sums(np.asarray(ctx.bm.lb_weights()[0], dtype=np.float64))
    pi, pj = fam.moves(fam.cache[wkey], cap, sources, targets, ctx.move_limit.get(id(fam), APPROX_MAX_MOVES))
    F, G, H = ctx.bm.pair_costs(fam, pi, pj)
    mv = _Moves(pi, pj, F, G, H)
    if np.isfinite(cap):
        mv = mv.restrict(F <= cap + _EPS)
    if len(sources) == len(targets) == fam.S:
        ctx.moves[id(fam)] = (cap, mv)
    return mv


def _bottleneck(fam: Family, sub: np.ndarray, mv: _Moves) -> tuple[np.ndarray, np.ndarray]:
    """ψ(L) = min over plans from L to V of max over their moves of (cache added since L + F), by set.

    With cache m at L, the best peak any completion reaches is m + ψ(L): the cache already held adds to
    every later move alike. So the smallest feasible budget is ψ(∅), a single-label bottleneck DP run from
    V backwards, ψ(L) = min_{L'} max(F(L, L'), G(L, L') + ψ(L')), and a state (a, m) at L can still fit a
    budget B only if m + ψ(L) ≤ B. Returns ψ (inf: V unreachable, -inf at V) and each set's best next set.
    """
    psi = np.full(fam.S, np.inf)
    psi[sub[-1]] = -np.inf
    nxt = np.full(fam.S, -1, dtype=np.int64)
    order = np.lexsort((mv.pj, mv.pi))
    pi, pj, F, G = mv.pi[order], mv.pj[order], mv.F[order], mv.G[order]
    firsts = np.flatnonzero(np.r_[True, pi[1:] != pi[:-1]]) if len(pi) else np.zeros(0, dtype=np.int64)
    ends = np.r_[firsts[1:], len(pi)]
    for i, p0, p1 in zip(pi[firsts][::-1].tolist(), firsts[::-1].tolist(), ends[::-1].tolist()):
        vals = np.maximum(F[p0:p1], G[p0:p1] + psi[pj[p0:p1]])
        k = int(vals.argmin())
        psi[i] = vals[k]
        nxt[i] = pj[p0 + k]
    return psi, nxt


def _family_dp(fam: Family, sub: np.ndarray, mv: _Moves, objective: str, budget: float | None,
               bound: float | None = None, psi: np.ndarray | None = None) -> list[int] | None:
    """Algorithm 1 (objective "time" or "memory") over the sets ``sub`` of ``fam`` (increasing, ∅ first, V
    last) with the moves ``mv``.

    Each set keeps the Pareto front of its states (a, m); a set's candidates are all states of all its
    sources, in increasing source order, gathered in one vectorised step. Two prunings drop states that
    can be neither optimal nor dominate one that can (a dominating state could follow the same completion),
    so the result is the same plan: ``bound`` ("time") drops states whose overhead exceeds it (overheads
    never decrease along a plan), ``psi`` (:func:`_bottleneck`) states that no completion fits in the budget.
    Returns the family indices of L_1..L_k, or None.
    """
    maximize = objective == "memory"
    lim = None if bound is None else bound + _EPS + 1e-9 * abs(bound)
    room = None if budget is None or psi is None else budget + _EPS - psi
    cap = 1024
    a = np.zeros(cap)
    m = np.zeros(cap)
    par = np.full(cap, -1, dtype=np.int64)
    own = np.zeros(cap, dtype=np.int64)
    fs = np.zeros(fam.S, dtype=np.int64)  # first state of each set
    fl = np.zeros(fam.S, dtype=np.int64)  # number of states of each set
    fl[sub[0]] = 1
    n_st = 1
    tgt = sub[1:]
    lo_all = np.searchsorted(mv.pj, tgt, side="left").tolist()
    hi_all = np.searchsorted(mv.pj, tgt, side="right").tolist()
    pi, F, G, H = mv.pi, mv.F, mv.G, mv.H
    for j, p0, p1 in zip(tgt.tolist(), lo_all, hi_all):
        if p0 == p1:
            continue
        src = pi[p0:p1]
        lens = fl[src]
        tot = int(lens.sum())
        if not tot:
            continue
        cum = np.cumsum(lens)
        rep = np.repeat(np.arange(p0, p1), lens)  # the move of each candidate
        idx = np.repeat(fs[src] - (cum - lens), lens) + np.arange(tot)
        mi = m[idx]
        nm = mi + G[rep]
        ok = None
        if budget is not None:
            ok = mi + F[rep] <= budget + _EPS
        if room is not None:
            ok = ok & (nm <= room[j])
        na = a[idx] + H[rep]
        if lim is not None:
            ok = (na <= lim) if ok is None else ok & (na <= lim)
        if ok is not None and not ok.all():
            idx, na, nm = idx[ok], na[ok], nm[ok]
            if not idx.size:
                continue
        keep = _pareto_np(na, nm, maximize)
        k = keep.size
        if n_st + k > cap:
            cap = max(2 * cap, n_st + k)
            own, a, m, par = (np.resize(x, cap) for x in (own, a, m, par))
        own[n_st:n_st + k] = j
        a[n_st:n_st + k] = na[keep]
        m[n_st:n_st + k] = nm[keep]
        par[n_st:n_st + k] = idx[keep]
        fs[j], fl[j] = n_st, k
        n_st += k
    last = sub[-1]
    if not fl[last]:
        return None
    lo = fs[last]
    s = lo + _best(a[lo:lo + fl[last]], m[lo:lo + fl[last]], maximize)
    chain = []
    while s > 0:
        chain.append(int(own[s]))
        s = par[s]
    return chain[::-1]


def _levels(S: int) -> list[np.ndarray]:
    """Sub-families for coarse-to-fine passes: every 8^k-th set (∅ and V always), coarsest first."""
    steps = [1]
    while S // steps[-1] > COARSE_SETS:
        steps.append(steps[-1] * 8)
    return [np.unique(np.concatenate([np.arange(0, S, step), [S - 1]])) for step in reversed(steps)]


def _chain_costs(ctx: Context, fam: Family, chain: list[int]) -> tuple[int, float, list[int]]:
    """(peak, overhead, peak of each segment) of a plan given as family indices, as :func:`evaluate_chain`."""
    pj = np.array(chain, dtype=np.int64)
    pi = np.r_[0, pj[:-1]]
    F, G, H = ctx.bm.pair_costs(fam, pi, pj)
    seg = [int(round(x)) for x in (np.cumsum(G) - G + F).tolist()]
    return max(seg), float(sum(H.tolist())), seg


def _min_peak_chain(ctx: Context, fam: Family) -> list[int]:
    """A plan of least peak over ``fam`` (:func:`_bottleneck`), coarse to fine.

    Only moves that fit a cap are listed, and the least peak has no cap a priori. A plan of a sub-family
    (every k-th set, ∅ and V) is a plan of the family, so its peak bounds the optimum: each pass lists
    the moves with F ≤ the previous pass's peak, and the last pass, over the whole family, is exact.
    """
    cap = math.inf
    for sub in _levels(fam.S):
        mv = _priced_moves(ctx, fam, cap, sub, sub)
        psi, nxt = _bottleneck(fam, sub, mv)
        if len(sub) == fam.S:
            ctx.psi[id(fam)] = (cap, psi)
        chain, k = [], int(sub[0])
        while k != sub[-1]:
            k = int(nxt[k])
            chain.append(k)
        cap = min(cap, _chain_costs(ctx, fam, chain)[0])
    return chain


def _settled_moves(ctx: Context, fam: Family, cap: float, sources: np.ndarray, targets: np.ndarray,
                   hsum: np.ndarray) -> _Moves:
    """The moves the "time" DP needs: into a set reachable from ∅ in one move that fits, only that move.

    Every plan reaching L caches at least ∂(L) (each member of ∂(L) is on the boundary of the segment that
    computes it), which is what the move from ∅ caches, and has overhead at least Σ_{v∈L} h(v). Where the
    move from ∅ reaches both bounds, its state dominates every other candidate at L (and comes first, so
    it is what the full DP keeps too): the other moves into L can be left out. At a large budget this turns
    #sets² moves into #sets.
    """
    tg = targets[targets != 0]
    F0, G0, H0 = ctx.bm.pair_costs(fam, np.zeros(len(tg), dtype=np.int64), tg)
    settled = (H0 <= hsum[tg] + _EPS + 1e-9 * np.abs(hsum[tg])) & (F0 <= cap + _EPS)
    if not settled.any():
        return _priced_moves(ctx, fam, cap, sources, targets)
    rest = _priced_moves(ctx, fam, cap, sources, tg[~settled])
    first = _Moves(np.zeros(int(settled.sum()), dtype=np.int64), tg[settled], F0[settled], G0[settled],
                   H0[settled])
    both = _Moves(*(np.concatenate([x, y]) for x, y in zip(
        (rest.pi, rest.pj, rest.F, rest.G, rest.H), (first.pi, first.pj, first.F, first.G, first.H))))
    return both.restrict(np.lexsort((both.pi, both.pj)))


def _family_run(ctx: Context, fam: Family, objective: str, budget: float | None) -> list[int] | None:
    """One DP over ``fam``: "peak" by :func:`_min_peak_chain`, "memory" and "time" by :func:`_family_dp`.

    With a budget, only the moves that fit it are listed and :func:`_bottleneck` prunes states that cannot
    finish within it. "time" runs coarse to fine like :func:`_min_peak_chain`: a sub-family's plan bounds
    the least overhead, and sets whose overhead lower bound (Σ of the model's ``h_weights``) exceeds it are
    left out of the next pass; sets that one move from ∅ reaches optimally get only that move
    (:func:`_settled_moves`).
    """
    if objective == "peak":
        return _min_peak_chain(ctx, fam)
    S = fam.S
    cap = math.inf if budget is None else float(budget)
    levels = [np.arange(S)] if objective == "memory" else _levels(S)
    bound = math.inf
    hsum = None
    chain = None
    for sub in levels:
        sources = targets = sub
        if np.isfinite(bound):
            if hsum is None:
                hsum = fam.sums(ctx.bm.h_weights())
            live = hsum[sub] <= bound + _EPS + 1e-9 * bound
            sources, targets = sub[live], sub[live | (sub == S - 1)]
        if objective == "time":
            hsum = fam.sums(ctx.bm.h_weights()) if hsum is None else hsum
            mv = _settled_moves(ctx, fam, cap, sources, targets, hsum)
        else:
            mv = _priced_moves(ctx, fam, cap, sources, targets)
        psi = None
        if budget is not None:
            # ψ over more moves (a larger cap) is no larger, so it prunes less but never wrongly
            held = ctx.psi.get(id(fam))
            psi = held[1] if held is not None and held[0] >= cap else _bottleneck(fam, sub, mv)[0]
        found = _family_dp(fam, sub, mv, objective, budget, bound if np.isfinite(bound) else None, psi)
        if found is not None:
            chain = found
            if objective == "time":
                bound = min(bound, _chain_costs(ctx, fam, chain)[1])
    return chain


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


def _too_big(what: str, limit: int) -> FxplanError:
    return FxplanError(
        f"the exact DP would hold more than {limit:,} {what} (about {limit * 250 / 2**30:.1f} GiB); use the "
        "approximate DP (solver='approx', or exact=False), or raise max_states if the memory is there"
    )


def _search_dp(bm: BoundModel, objective: str, budget: float | None, time_limit: float | None,
               max_states: int | None = DEFAULT_MAX_STATES) -> list[int] | None:
    """Algorithm 1 over all lower sets, enumerating only budget-feasible moves (module docstring).

    Holds at most ``max_states`` lower sets plus states (an :class:`FxplanError` beyond).
    """
    ix = bm.ix
    t0 = time.perf_counter()
    try:
        lsets = enumerate_lower_sets(ix, limit=max_states)
    except FxplanError:
        raise _too_big("lower sets", max_states) from None
    held = len(lsets)
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
        held -= len(cand) - len(front)
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
                held += 1
            if max_states is not None and held > max_states:
                raise _too_big("lower sets and DP states", max_states)
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
                    solver: str, seconds: float, costs: tuple[int, float, list[int]] | None = None) -> Plan:
    """Build a :class:`Plan` from lower sets L_1 ≺ … ≺ L_k = V (bitsets), evaluated under ``bm``.

    ``costs``: (peak, overhead, segment peaks) when already known (they must be what ``bm`` gives).
    """
    if not chain or chain[-1] != ix.full:
        raise FxplanError("a plan's last lower set must be V")
    peak, over, seg_peaks = evaluate_chain(bm, chain)[:3] if costs is None else costs
    segments, lowers, bounds, seg_T = [], [], [], []
    prev, kept_all, bd = 0, 0, 0
    for Lp in chain:
        Vp = Lp & ~prev
        bd = ix.next_boundary(bd, Lp, Vp)
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


Solution = tuple[list[int], tuple[int, float, list[int]]]


def _run(ctx: Context, objective: str, budget: float | None, exact: bool, engine: str,
         time_limit: float | None, max_states: int | None) -> Solution | None:
    """One DP run: the family engine (approximate, or exact on small lattices), else the search engine.

    Returns the plan (bitsets L_1..L_k) with its (peak, overhead, segment peaks), or None.
    """
    if engine not in ("auto", "family", "search"):
        raise FxplanError(f"engine must be 'auto', 'family' or 'search', not {engine!r}")
    fam = None
    if not exact:
        fam = ctx.family(False)
    elif engine != "search":
        limit = max_states if engine == "family" else min(FAMILY_LIMIT, max_states or FAMILY_LIMIT)
        fam = ctx.family(True, limit)
        if fam is not None:
            ctx.move_limit[id(fam)] = max_states
        if fam is None:
            if engine == "family":
                raise _too_big("lower sets", max_states)
            ctx.families.pop("exact")  # too big for this limit; another call may allow more
    if fam is not None:
        found = _family_run(ctx, fam, objective, budget)
        return None if found is None else ([fam.sets[k] for k in found], _chain_costs(ctx, fam, found))
    if objective == "peak" and budget is None:
        # bound the search by what the approximate DP achieves; the exact optimum is no larger
        budget = _run(ctx, "peak", None, False, engine, time_limit, max_states)[1][0]
    found = _search_dp(ctx.bm, objective, budget, time_limit, max_states)
    return None if found is None else (found, evaluate_chain(ctx.bm, found)[:3])


def _smallest_budget(ctx: Context, exact: bool, engine: str, time_limit: float | None,
                     max_states: int | None) -> int:
    found = _run(ctx, "peak", None, exact, engine, time_limit, max_states)
    if found is None:  # cannot happen: the single segment V is always a plan
        raise FxplanError("no plan found")
    return int(math.ceil(found[1][0] - _EPS))


def min_budget_bytes(cg: CostGraph, *, exact: bool = False, memory_model=None, engine: str = "auto",
                     time_limit: float | None = DEFAULT_TIME_LIMIT,
                     max_states: int | None = DEFAULT_MAX_STATES) -> int:
    """The smallest budget (bytes) for which this DP finds a plan: min over plans of the predicted peak.

    Exact for the family searched (all lower sets if ``exact``, else the pruned family), found directly by
    the "peak" DP (module docstring), not by binary search. ``time_limit`` and ``max_states``: see
    :func:`solve`.
    """
    return _smallest_budget(context(cg, memory_model), exact, engine, time_limit, max_states)


def solve(cg: CostGraph, budget_bytes: int | None, *, strategy: str = "time", exact: bool = False,
          memory_model=None, engine: str = "auto", time_limit: float | None = DEFAULT_TIME_LIMIT,
          max_states: int | None = DEFAULT_MAX_STATES) -> Plan:
    """Find a recomputation plan for ``cg`` within ``budget_bytes`` (Kusumoto et al., sections 4.2-4.4).

    ``strategy="time"``: least overhead with predicted peak ≤ budget (``None``: no limit).
    ``strategy="memory"``: greatest overhead at the smallest feasible budget (section 4.4); the budget, if
    given, must be at least that. ``exact``: all lower sets (section 4.2) instead of the pruned family
    {L_v} (section 4.3). ``memory_model``: ``"autograd"`` (default), ``"paper"`` or a model object.
    ``engine`` (exact DP only): ``"auto"``, ``"family"`` or ``"search"``. The exact DP stops with an
    :class:`FxplanError` that says to use the approximate DP after ``time_limit`` seconds (default
    ``DEFAULT_TIME_LIMIT``; ``None``: never) or when it would hold more than ``max_states`` lower sets and
    states (default ``DEFAULT_MAX_STATES``, about 1 GB; ``None``: no limit).

    Raises :class:`BudgetError` (with ``min_feasible_bytes``) when no plan fits the budget.
    """
    if strategy not in ("time", "memory"):
        raise FxplanError(f"strategy must be 'time' or 'memory', not {strategy!r}")
    if budget_bytes is not None and budget_bytes < 0:
        raise FxplanError(f"budget_bytes must be non-negative, not {budget_bytes}")
    t0 = time.perf_counter()
    ctx = context(cg, memory_model)
    ix, bm = ctx.ix, ctx.bm
    solver = "exact-dp" if exact else "approx-dp"
    limits = (exact, engine, time_limit, max_states)

    def fail(min_b: int) -> BudgetError:
        return BudgetError(
            f"no {solver} plan fits the budget of {_fmt_bytes(budget_bytes)} ({budget_bytes} bytes) under "
            f"the {bm.name!r} memory model; the smallest feasible budget is {_fmt_bytes(min_b)} "
            f"({min_b} bytes). Raise the budget, or try exact=True or strategy='memory'.",
            min_feasible_bytes=min_b,
        )

    if strategy == "memory":
        b_star = _smallest_budget(ctx, *limits)
        if budget_bytes is not None and budget_bytes < b_star:
            raise fail(b_star)
        found = _run(ctx, "memory", b_star, *limits)
    else:
        found = _run(ctx, "time", budget_bytes, *limits)
        if found is None:
            raise fail(_smallest_budget(ctx, *limits))
    return plan_from_chain(ix, bm, found[0], budget=budget_bytes, strategy=strategy, solver=solver,
                           seconds=time.perf_counter() - t0, costs=found[1])
