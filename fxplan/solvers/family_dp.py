"""The family engine of the DP (:mod:`fxplan.solvers.dp`): Algorithm 1 over a :class:`~fxplan.solvers.family.Family`.

Kusumoto et al. (2019, sections 4.2-4.4) over the pruned family {L_v} (approximate DP) or over all lower
sets of a small lattice (exact DP). Moves are listed only where their segment can fit a cap and priced by
the memory model's vectorised ``pair_costs``; the smallest budget is the single-label bottleneck DP ψ run
backwards from V; the "time" and "memory" objectives keep Pareto fronts of (objective, cache) per set and
are pruned by ψ. Without a cap the engine runs coarse to fine (:func:`_levels`). :func:`context` keeps the
index, families and priced moves of a cost graph between solves. See docs/planner.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from fxplan.errors import FxplanError
from fxplan.solvers.costgraph import CostGraph
from fxplan.solvers.family import Family
from fxplan.solvers.lowersets import GraphIndex, enumerate_lower_sets
from fxplan.solvers.memory_model import BoundModel, get_model

COARSE_SETS = 256
"""The coarse-to-fine passes start from a sub-family of about this many sets (see :func:`family_run`)."""

PRICE_CHUNK = 1 << 19
"""Moves priced at once (bounds the temporary arrays of ``pair_costs``)."""

LEVEL_STEP = 8
"""Each coarse-to-fine pass keeps every LEVEL_STEP-th set of the next finer one."""

EPS = 1e-6

PRICED_LIMIT = 20_000_000
"""Priced moves a planning context keeps for later solves (about 0.6 GB); beyond it, only the latest."""

APPROX_MAX_MOVES = 30_000_000
"""Moves the approximate DP may price at once (about 1.2 GB); beyond it, an FxplanError."""

KERNEL_MOVES = 1_000_000
"""A "time" solve at a budget whose last pass would list more candidate moves than this (beyond those
from ∅ that settle their targets: :func:`_settled_moves`) runs the compiled DP of :mod:`fxplan.solvers.time_kernel`
instead, under models that provide it (the autograd model): it stores no moves, and at 10,000 nodes and 30%
of the single-segment peak takes about 1 s against 8-9 s (docs/planner.md). Below, this module's engine
is as fast and needs no compiled code loaded (about 0.3 s, once per process)."""


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
        keep[1:] = ms[1:] < run[:-1] - EPS
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
    priced: dict = field(default_factory=dict)  # per family: every move priced so far (:func:`_price`)
    least_peak: dict = field(default_factory=dict)  # per family: the plan of :func:`_min_peak_chain`

    def lb_sums(self, fam: Family) -> np.ndarray:
        """Per set of ``fam``, the sum of the model's additive lower bound on F: moves are listed by it."""
        return _lb_sums(self, fam)

    def chain_costs(self, fam: Family, chain: list[int]) -> tuple[int, float, list[int]]:
        """(peak, overhead, peak of each segment) of a plan given as indices of ``fam``."""
        return _chain_costs(self, fam, chain)

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


def _fingerprint(cg: CostGraph) -> int:
    """A hash of what the planner reads of ``cg`` (costs, what backward saves, edges): a changed graph gets
    a new planning context. Called once per solve, so kept cheap: values hashed as they are where they can."""
    edges = tuple(cg.edges(data="order_only", default=False))
    try:
        nodes = tuple((v, d.get("T"), d.get("M"), d.get("saved"), d.get("saves_output"),
                       None if (si := d.get("saved_inputs")) is None else tuple(si)) for v, d in cg.nodes(data=True))
        return hash((nodes, edges))
    except TypeError:  # an unhashable attribute value
        attrs = ("T", "M", "saved", "saves_output", "saved_inputs")
        return hash((tuple((v, *(repr(d.get(k)) for k in attrs)) for v, d in cg.nodes(data=True)), edges))


def forget_context(cg: CostGraph) -> None:
    """Drop the planning contexts kept on ``cg`` (:func:`context`), so that the next solve builds them again:
    for timing a solve from scratch."""
    cg.__dict__.pop("_fxplan_context", None)


def context(cg: CostGraph, memory_model=None) -> Context:
    """The planning context of ``cg`` under ``memory_model``, reused while the graph is unchanged.

    Kept on the graph object itself, so it lives exactly as long as the graph: a context refers to its
    graph (``GraphIndex.cg``), and a weakly keyed global cache of them never let go of any (every traced
    model, through the graph's ``gm``, stayed alive for the rest of the process)."""
    model = get_model(memory_model)
    try:
        hash(model)
    except TypeError:  # an unhashable custom model: no caching
        ix = GraphIndex.build(cg)
        return Context(ix, model.bind(ix))
    key = _fingerprint(cg)
    held = getattr(cg, "_fxplan_context", None)
    if held is None or held[0] != key:
        held = (key, GraphIndex.build(cg), {})
        cg._fxplan_context = held
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


def _price(ctx: Context, fam: Family, pi: np.ndarray, pj: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(F, G, H) of the moves (pi, pj), each priced by the memory model at most once per context.

    A move's costs depend on its two sets only, so the moves priced for one budget serve every later
    solve on the graph (``fxplan.rewrite`` solves up to ``frontier.FRONTIER`` budgets): only the moves not
    priced before are handed to ``pair_costs`` (in chunks of ``PRICE_CHUNK``, which bounds its temporary
    arrays). Held as sorted keys ``j * S + i``; dropped when more than ``PRICED_LIMIT`` are held.
    """
    keys = pj.astype(np.int64) * fam.S + pi
    memo = ctx.priced.get(id(fam))
    F, G, H = np.empty(len(pi)), np.empty(len(pi)), np.empty(len(pi))
    new = np.ones(len(pi), dtype=bool)
    if memo is not None and len(memo[0]):
        at = np.minimum(np.searchsorted(memo[0], keys), len(memo[0]) - 1)
        new = memo[0][at] != keys
        old = ~new
        for out, col in zip((F, G, H), memo[1:]):
            out[old] = col[at[old]]
    idx = np.flatnonzero(new)
    for lo in range(0, len(idx), PRICE_CHUNK):
        part = idx[lo:lo + PRICE_CHUNK]
        F[part], G[part], H[part] = ctx.bm.pair_costs(fam, pi[part], pj[part])
    if len(idx):
        add = idx[np.unique(keys[idx], return_index=True)[1]]
        cols = [keys[add], F[add], G[add], H[add]]
        if memo is not None and len(memo[0]) + len(add) <= PRICED_LIMIT:
            cols = [np.concatenate([a, b]) for a, b in zip(memo, cols)]
            order = np.argsort(cols[0], kind="stable")
            cols = [c[order] for c in cols]
        ctx.priced[id(fam)] = tuple(cols)
    return F, G, H


def _priced_moves(ctx: Context, fam: Family, cap: float, sources: np.ndarray, targets: np.ndarray) -> _Moves:
    """Moves L_i ⊊ L_j (i in ``sources``, j in ``targets``, increasing family indices) with F ≤ ``cap``.

    Candidates come from the additive lower bound of the memory model (:meth:`Family.moves`); only those
    are priced. Moves over the whole family are kept per family and reused for any smaller cap.
    """
    held = ctx.moves.get(id(fam))
    if held is not None and held[0] >= cap:
        mv = held[1]
        keep = mv.F <= cap + EPS
        for sel, ends in ((sources, mv.pi), (targets, mv.pj)):
            if len(sel) < fam.S:
                mask = np.zeros(fam.S, dtype=bool)
                mask[sel] = True
                keep &= mask[ends]
        return mv.restrict(keep)
    pi, pj = fam.moves(_lb_sums(ctx, fam), cap, sources, targets, ctx.move_limit.get(id(fam), APPROX_MAX_MOVES))
    mv = _Moves(pi, pj, *_price(ctx, fam, pi, pj))
    if np.isfinite(cap):
        mv = mv.restrict(mv.F <= cap + EPS)
    if len(sources) == len(targets) == fam.S:
        ctx.moves[id(fam)] = (cap, mv)
    return mv


def _lb_sums(ctx: Context, fam: Family) -> np.ndarray:
    """Per set, the sum of the model's additive lower bound on F (``lb_weights``): moves are listed by it."""
    key = ("lb", id(ctx.bm))
    if key not in fam.cache:
        fam.cache[key] = fam.sums(np.asarray(ctx.bm.lb_weights()[0], dtype=np.float64))
    return fam.cache[key]


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
    lim = None if bound is None else bound + EPS + 1e-9 * abs(bound)
    room = None if budget is None or psi is None else budget + EPS - psi
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
            ok = mi + F[rep] <= budget + EPS
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
    """Sub-families for coarse-to-fine passes: every LEVEL_STEP^k-th set (∅ and V always), coarsest first."""
    steps = [1]
    while S // steps[-1] > COARSE_SETS:
        steps.append(steps[-1] * LEVEL_STEP)
    return [np.unique(np.concatenate([np.arange(0, S, step), [S - 1]])) for step in reversed(steps)]


def _chain_costs(ctx: Context, fam: Family, chain: list[int]) -> tuple[int, float, list[int]]:
    """(peak, overhead, peak of each segment) of a plan given as family indices, as :func:`evaluate_chain`."""
    pj = np.array(chain, dtype=np.int64)
    pi = np.r_[0, pj[:-1]]
    F, G, H = _price(ctx, fam, pi, pj)
    seg = [int(round(x)) for x in (np.cumsum(G) - G + F).tolist()]
    return max(seg), float(sum(H.tolist())), seg


def _strided_chains_peak(ctx: Context, fam: Family, sub: np.ndarray) -> float:
    """The least peak of a few plans over the sets ``sub`` (increasing family indices, ∅ first, V last):
    for k = 1, 2, 4, ..., the plan that goes from each set to the first strict superset at least k places
    further on (V at the latest).

    A cap for the coarsest pass of :func:`_min_peak_chain` that costs a few hundred moves: any plan's peak
    bounds the least one, and without a cap that pass prices every pair of its sets, most of them long
    segments whose peak no plan of least peak needs."""
    best, k = math.inf, 1
    while k < len(sub):
        chain, at = [], 0
        while at < len(sub) - 1:
            later = np.arange(min(at + k, len(sub) - 1), len(sub))
            cur, cand = sub[at], sub[later]
            bigger = fam.size[cand] > fam.size[cur]
            ok = np.zeros(len(cand), dtype=bool)
            ok[bigger] = fam.subset(np.full(int(bigger.sum()), cur), cand[bigger])
            at = int(later[np.argmax(ok)])  # V, last, contains every set
            chain.append(int(sub[at]))
        best = min(best, _chain_costs(ctx, fam, chain)[0])
        k *= 2
    return best


def _min_peak_chain(ctx: Context, fam: Family) -> list[int]:
    """A plan of least peak over ``fam`` (:func:`_bottleneck`), coarse to fine.

    Only moves that fit a cap are listed, and the least peak has no cap a priori. A plan of a sub-family
    (every k-th set, ∅ and V) is a plan of the family, so its peak bounds the optimum: each pass lists
    the moves with F ≤ the previous pass's peak, and the last pass, over the whole family, is exact.
    The plan is kept in the context: the smallest budget, the memory-centric plan and a failed "time"
    solve all start from it.
    """
    if id(fam) in ctx.least_peak:
        return list(ctx.least_peak[id(fam)])
    levels = _levels(fam.S)
    cap = _strided_chains_peak(ctx, fam, levels[0]) if len(levels) > 1 else math.inf
    for sub in levels:
        mv = _priced_moves(ctx, fam, cap, sub, sub)
        psi, nxt = _bottleneck(fam, sub, mv)
        if not np.isfinite(psi[sub[0]]):  # the cap is some plan's peak: that plan's moves reach V
            raise FxplanError(f"internal error: no plan of peak at most {cap:.0f} bytes over {len(sub)} "
                              "lower sets, though one was found; please report it")
        if len(sub) == fam.S:
            ctx.psi[id(fam)] = (cap, psi)
        chain, k = [], int(sub[0])
        while k != sub[-1]:
            k = int(nxt[k])
            chain.append(k)
        cap = min(cap, _chain_costs(ctx, fam, chain)[0])
    ctx.least_peak[id(fam)] = tuple(chain)
    return chain


def _settled_moves(ctx: Context, fam: Family, cap: float, sources: np.ndarray, targets: np.ndarray,
                   hsum: np.ndarray, most: int | None = None) -> _Moves | None:
    """The moves the "time" DP needs: into a set reachable from ∅ in one move that fits, only that move.

    Every plan reaching L caches at least ∂(L) (each member of ∂(L) is on the boundary of the segment that
    computes it), which is what the move from ∅ caches, and has overhead at least Σ_{v∈L} h(v). Where the
    move from ∅ reaches both bounds, its state dominates every other candidate at L (and comes first, so
    it is what the full DP keeps too): the other moves into L can be left out. At a large budget this turns
    #sets² moves into #sets. None if the other moves would be more than ``most`` candidates to list and
    price (none are listed where the whole family's moves are held for this cap already).
    """
    tg = targets[targets != 0]
    first = _priced_moves(ctx, fam, cap, np.zeros(1, dtype=np.int64), tg)  # from ∅, only moves that can fit
    first = first.restrict(first.H <= hsum[first.pj] + EPS + 1e-9 * np.abs(hsum[first.pj]))
    unsettled = np.setdiff1d(tg, first.pj)
    held = ctx.moves.get(id(fam))
    if most is not None and (held is None or held[0] < cap) \
            and fam.candidate_count(_lb_sums(ctx, fam), cap, sources, unsettled) > most:
        return None
    if not len(first.pj):
        return _priced_moves(ctx, fam, cap, sources, targets)
    rest = _priced_moves(ctx, fam, cap, sources, unsettled)
    both = _Moves(*(np.concatenate([x, y]) for x, y in zip(
        (rest.pi, rest.pj, rest.F, rest.G, rest.H), (first.pi, first.pj, first.F, first.G, first.H))))
    return both.restrict(np.lexsort((both.pi, both.pj)))


def family_run(ctx: Context, fam: Family, objective: str, budget: float | None,
                max_sets: int | None = None) -> list[int] | None:
    """One DP over ``fam``: "peak" by :func:`_min_peak_chain`, "memory" and "time" by :func:`_family_dp`, or
    "time" at a budget by :mod:`fxplan.solvers.time_kernel` where the model allows and a pass would list more than
    ``KERNEL_MOVES`` candidate moves.

    With a budget, only the moves that fit it are listed and :func:`_bottleneck` prunes states that cannot
    finish within it. "time" runs coarse to fine like :func:`_min_peak_chain`: a sub-family's plan bounds
    the least overhead, and sets whose overhead lower bound (Σ of the model's ``h_weights``) exceeds it are
    left out of the next pass; sets that one move from ∅ reaches optimally get only that move
    (:func:`_settled_moves`).

    ``max_sets`` ("time" only): plan over at most that many sets: ∅, V and, in each of ``max_sets`` - 2
    equal windows of the others (in family order), the one whose boundary ∂(L) holds the fewest bytes
    (where a plan's cache is cheapest; ties: the earlier set). A plan of a
    sub-family is a plan of the family, so the result is feasible; it is optimal over the sub-family
    only. Moves grow as the square of the sets at a middle budget: this is what bounds a solve on graphs
    of 10,000 nodes (the frontier's grid, ``fxplan.planner.frontier``).
    """
    if objective == "peak":
        return _min_peak_chain(ctx, fam)
    S = fam.S
    cap = math.inf if budget is None else float(budget)
    levels = [np.arange(S)] if objective == "memory" else _levels(S)
    if objective == "time" and max_sets is not None and S > max(2, max_sets):
        key = ("cheapest", max_sets)
        if key not in fam.cache:  # per window of the inner sets, the one of least boundary bytes
            bsum = fam.boundary_sums(ctx.ix.M_np)
            edges = np.linspace(1, S - 1, max_sets - 1).astype(np.int64).tolist()
            inner = [a + int(np.argmin(bsum[a:b])) for a, b in zip(edges[:-1], edges[1:]) if b > a]
            fam.cache[key] = np.array([0, *inner, S - 1], dtype=np.int64)
        keep = fam.cache[key]
        levels = [keep[lv] for lv in _levels(len(keep))]
    bound = math.inf  # stays inf for "memory": only "time" bounds its objective
    hsum = fam.sums(ctx.bm.h_weights()) if objective == "time" else None
    chain = None
    for sub in levels:
        sources = targets = sub
        if np.isfinite(bound):
            live = hsum[sub] <= bound + EPS + 1e-9 * bound
            sources, targets = sub[live], sub[live | (sub == S - 1)]
        if objective == "time":
            kernel = budget is not None and max_sets is None and hasattr(ctx.bm, "time_terms")
            mv = _settled_moves(ctx, fam, cap, sources, targets, hsum, KERNEL_MOVES if kernel else None)
            if mv is None:
                from fxplan.solvers.time_kernel import least_overhead_chain  # numba: imported when first needed

                return least_overhead_chain(ctx, fam, budget, EPS)
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
