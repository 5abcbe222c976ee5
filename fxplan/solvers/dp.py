"""Kusumoto et al.'s dynamic programs (2019, sections 4.2-4.4 and Algorithm 1) on a :class:`CostGraph`.

The DP walks increasing lower sets ∅ = L_0 ≺ L_1 ≺ … ≺ L_k = V. A state at lower set ``L`` is a pair
(a, m): ``m`` = M(U), the bytes of boundary values cached so far, and ``a`` the objective accumulated so far.
One move L → L' costs (F, G, H) from the memory model (:mod:`fxplan.solvers.memory_model`): it is allowed when
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
  lower bound on F, and prices them with numpy (:class:`~fxplan.solvers.family.Family`,
  :meth:`BoundModel.pair_costs`); the forward DP fills each set's front from all states of its sources in
  one vectorised step. Without a budget ("peak", or "time" with a large one) it runs coarse to fine: a
  sub-family's plan bounds the optimum and so the moves and states the next pass needs.
* the *search* engine (exact DP on lattices too big for the family engine that the compiled kernel below
  does not take: over ``COMPILED_FAMILY_LIMIT`` lower sets, or another memory model) never forms pairs:
  from each reached lower set it enumerates only the supersets whose new segment can fit the budget, by a
  depth-first search that grows the segment and stops as soon as a lower bound on its cost (monotone in the
  segment) exceeds the budget.

Under the autograd model a time-centric plan's overhead is the forward time of its last recomputed set, so
the time-centric DP at a budget needs one state per set: :mod:`fxplan.solvers.time_kernel` runs it compiled, for the
family engine where it would list many moves (``family_dp.KERNEL_MOVES``) and for the exact DP on lattices
between ``FAMILY_LIMIT`` and ``COMPILED_FAMILY_LIMIT`` sets. There the kernel also gives the exact DP's
smallest budget (whether a plan fits a budget is whether the kernel finds one: tested one byte under the
best peak known, from the approximate DP's, then by bisection) and its memory-centric plan.

Both exact engines stop with an :class:`FxplanError` (use the approximate DP) beyond ``max_states`` lower
sets, states or moves, and the search engine after ``time_limit`` seconds.
"""

from __future__ import annotations

import math
import time
from collections import defaultdict
from collections.abc import Iterator

from fxplan.common import collector
from fxplan.common.console import format_bytes
from fxplan.errors import BudgetError, FxplanError
from fxplan.solvers.costgraph import CostGraph
from fxplan.solvers.family_dp import EPS, Context, context, family_run, forget_context
from fxplan.solvers.lowersets import GraphIndex, enumerate_lower_sets, iter_bits
from fxplan.solvers.memory_model import BoundModel, evaluate_chain
from fxplan.solvers.plans import Plan

__all__ = ["COMPILED_FAMILY_LIMIT", "DEFAULT_MAX_STATES", "DEFAULT_TIME_LIMIT", "FAMILY_LIMIT", "Context",
           "context", "min_activation_bytes", "plan_from_chain", "solve", "forget_context"]

FAMILY_LIMIT = 20_000
"""Exact DP uses the family engine up to this many lower sets, the search engine above."""

COMPILED_FAMILY_LIMIT = 1_000_000
"""Above ``FAMILY_LIMIT``, the exact DP under a model the compiled kernel of :mod:`fxplan.solvers.time_kernel`
supports (the autograd model) runs it over all lower sets up to this many (googlenet's 130,121: its
time-centric plan at a budget, its smallest budget and its memory-centric plan about 3 s each, enumeration
included; per set about 1 KB of Python lists), the search engine above."""

DEFAULT_TIME_LIMIT = 600.0
"""Seconds after which the exact DP's search engine gives up (FxplanError) unless told otherwise."""

DEFAULT_MAX_STATES = 4_000_000
"""Lower sets plus DP states the exact DP may hold at once (about 1 GB; the family engine may list
``MOVES_PER_STATE`` times as many moves, about 40 bytes each); beyond it, an FxplanError that says to use
the approximate DP."""

MOVES_PER_STATE = 6


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
    lim = cap + EPS
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
            if s[1] < run - EPS:
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
                if budget is not None and m + Fv > budget + EPS:
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
         time_limit: float | None, max_states: int | None, max_sets: int | None = None) -> Solution | None:
    """One DP run: the family engine (approximate, or exact on small lattices), else the compiled kernel (the
    exact DP on larger lattices, where the model allows), else the search engine.

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
        if fam is not None and limit is not None and fam.S > limit:  # held for the compiled kernels
            fam = None
        elif fam is not None:
            ctx.move_limit[id(fam)] = None if max_states is None else MOVES_PER_STATE * max_states
        else:
            if engine == "family":
                raise _too_big("lower sets", max_states)
            ctx.families.pop("exact")  # too big for this limit; another call may allow more
    if fam is not None:
        found = family_run(ctx, fam, objective, budget, max_sets)
        return None if found is None else ([fam.sets[k] for k in found], ctx.chain_costs(fam, found))
    if engine == "auto" and (budget is not None or objective == "peak") and hasattr(ctx.bm, "time_terms"):
        limit = min(COMPILED_FAMILY_LIMIT, max_states or COMPILED_FAMILY_LIMIT)
        fam = ctx.family(True, limit)
        if fam is not None and fam.S <= limit:
            from fxplan.solvers import time_kernel  # numba: imported when first needed

            if objective == "peak":
                start = _run(ctx, "peak", None, False, engine, time_limit, max_states)[0]
                found = time_kernel.least_peak_chain(ctx, fam, [fam.sets.index(L) for L in start], EPS,
                                                     time_limit)
            elif objective == "memory":
                found = time_kernel.most_overhead_chain(ctx, fam, budget, EPS, time_limit)
            else:
                found = time_kernel.least_overhead_chain(ctx, fam, budget, EPS, time_limit)
            return None if found is None else ([fam.sets[k] for k in found], ctx.chain_costs(fam, found))
        if fam is None:
            ctx.families.pop("exact")
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
    return int(math.ceil(found[1][0] - EPS))


@collector.paused()
def min_activation_bytes(cg: CostGraph, *, exact: bool = False, memory_model=None, engine: str = "auto",
                         time_limit: float | None = DEFAULT_TIME_LIMIT,
                         max_states: int | None = DEFAULT_MAX_STATES) -> int:
    """The smallest budget (bytes) for which this DP finds a plan: min over plans of the predicted peak of the
    memory model (activations; what a step holds from its start, parameters and inputs, is not in it).

    Exact for the family searched (all lower sets if ``exact``, else the pruned family), found directly by
    the "peak" DP (module docstring), not by binary search. ``time_limit`` and ``max_states``: see
    :func:`solve`.
    """
    return _smallest_budget(context(cg, memory_model), exact, engine, time_limit, max_states)


@collector.paused()
def solve(cg: CostGraph, budget_bytes: int | None, *, strategy: str = "time", exact: bool = False,
          memory_model=None, engine: str = "auto", time_limit: float | None = DEFAULT_TIME_LIMIT,
          max_states: int | None = DEFAULT_MAX_STATES, max_sets: int | None = None) -> Plan:
    """Find a recomputation plan for ``cg`` within ``budget_bytes`` (Kusumoto et al., sections 4.2-4.4).

    ``strategy="time"``: least overhead with predicted peak ≤ budget (``None``: no limit).
    ``strategy="memory"``: greatest overhead at the smallest feasible budget (section 4.4); the budget, if
    given, must be at least that. ``exact``: all lower sets (section 4.2) instead of the pruned family
    {L_v} (section 4.3). ``memory_model``: ``"autograd"`` (default), ``"paper"`` or a model object.
    ``engine`` (exact DP only): ``"auto"``, ``"family"`` or ``"search"``. The exact DP stops with an
    :class:`FxplanError` that says to use the approximate DP after ``time_limit`` seconds (default
    ``DEFAULT_TIME_LIMIT``; ``None``: never) or when it would hold more than ``max_states`` lower sets and
    states (default ``DEFAULT_MAX_STATES``, about 1 GB; ``None``: no limit). ``max_sets`` (approximate
    DP, ``strategy="time"``): plan over at most that many sets of the family, the ones whose boundary is
    cheapest (:func:`fxplan.solvers.family_dp.family_run`): a feasible plan, optimal over those sets only.

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
            f"no {solver} plan fits the budget of {format_bytes(budget_bytes)} ({budget_bytes} bytes) under "
            f"the {bm.name!r} memory model; the smallest feasible budget is {format_bytes(min_b)} "
            f"({min_b} bytes).",
            min_feasible_bytes=min_b, advice="Raise the budget, or try exact=True or strategy='memory'.",
        )

    if strategy == "memory":
        b_star = _smallest_budget(ctx, *limits)
        if budget_bytes is not None and budget_bytes < b_star:
            raise fail(b_star)
        found = _run(ctx, "memory", b_star, *limits)
    else:
        found = _run(ctx, "time", budget_bytes, *limits, None if exact else max_sets)
        if found is None:
            raise fail(_smallest_budget(ctx, *limits))
    return plan_from_chain(ix, bm, found[0], budget=budget_bytes, strategy=strategy, solver=solver,
                           seconds=time.perf_counter() - t0, costs=found[1])
