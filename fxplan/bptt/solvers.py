"""Dynamic programs for memory-efficient BPTT (Gruslys et al. 2016, sections 3.1-3.4, appendix A).

All three policies are solved by one engine. A sub-problem is "back-propagate ``t`` steps whose start
hidden state is already stored, with ``m`` units of memory". The first decision is either

* push a **hidden** state after ``y`` forward steps (``1 <= y < t``), eq. (1)/(6)::

      Q1(t, m, y) = y + C(y, m) + C(t - y, m - 1)

* or keep the **internal** state (the autograd graph) of step ``y`` (``1 <= y <= t``), eq. (4)/(7)/(10)::

      Q2(t, m, y) = y + C(y - 1, m) + C(t - y, m - a(y)),   a(1) = beta, a(y > 1) = alpha

and ``C(t, m) = min`` over both (eq. (9)); ``D``/``H`` record the argmin position and kind.
``C(0, m) = 0`` for every ``m`` and ``C(t >= 1, m <= 0) = inf``.

Memory units and what the DP guarantees (checked by :mod:`fxplan.bptt.schedule`):

``"hsm"`` (3.1)  ``m`` hidden states, the sub-problem's start state included; one working internal state
                 (the step being back-propagated) on top. Only hidden pushes, plus the y = t "working"
                 step, which reproduces the boundary ``C(t, 1) = t(t+1)/2``. ``C(t, m >= t) = 2t - 1``.
``"ism"`` (3.2)  ``m`` internal states, the one being back-propagated included. ``C(t, m >= t) = t``.
``"msm"`` (3.3)  ``m`` hidden-state units; an internal state costs ``alpha`` units, or ``beta`` (3.4)
                 when its input hidden state is already stored (y = 1). Stored states count, the working
                 one does not (as in HSM), so ``C(t, 1) = t(t+1)/2`` and ``C(t, m >= alpha*t) = t``.

The rows are computed one sequence length ``t`` at a time, vectorised over all memory sizes with numpy,
by one of three methods that give identical tables (:func:`_solve_dp`). Positions ``2 <= y < t``: where
the columns ``C(., m)`` involved are convex in ``t`` (HSM and ISM; checked as the rows fill, not assumed)
the cost is convex in ``y`` and its smallest minimiser never decreases with ``t``, so a walk from the
previous minimiser finds it in O(1) amortised steps (the speed-up the paper's appendix A mentions;
:func:`_solve_walk`). MSM's columns are not convex, so for MSM a window of positions is evaluated exactly
and the columns' lower convex hulls prove that no other position does better (:mod:`fxplan.bptt.hull_dp`).
The reference scans every position, bounded by ``Q >= t + y - 1`` with the best ``y = 1`` choice as upper
bound.
"""

from __future__ import annotations

import functools
import math

import numpy as np

from fxplan.bptt.hull_dp import T_LIMIT, cost_table, solve_tables
from fxplan.bptt.policy import HIDDEN, INF, INTERNAL, POLICIES, Policy
from fxplan.bptt.schedule import simulate
from fxplan.errors import BudgetError, FxplanError

__all__ = ["HIDDEN", "INF", "INTERNAL", "POLICIES", "Policy", "optimal_cost", "solve"]

def _check_tm(t: int, m: int) -> None:
    if not isinstance(t, (int, np.integer)) or t < 1:
        raise FxplanError(f"sequence length t must be a positive integer, got {t!r}")
    if not isinstance(m, (int, np.integer)) or m < 1:
        raise FxplanError(
            f"memory m must be a positive integer number of slots, got {m!r}; "
            "one slot (the initial hidden state) is the least any policy can run with"
        )


def _alpha_beta(policy: str, alpha: int | None, beta: int | None) -> tuple[int | None, int | None]:
    if policy in ("hsm", "ism", "chen_recursive"):
        return None, None
    if alpha is None:
        raise FxplanError(
            f"policy {policy!r} needs alpha: the size of an internal state (the activations autograd "
            "saves for one step, input hidden state included) in units of one hidden state, e.g. alpha=5"
        )
    if int(alpha) != alpha or alpha < 1:
        raise FxplanError(f"alpha must be an integer >= 1 (internal/hidden size ratio), got {alpha!r}")
    if beta is None:
        beta = alpha
    if int(beta) != beta or not 1 <= beta <= alpha:
        raise FxplanError(
            f"beta must be an integer with 1 <= beta <= alpha={alpha} (internal state without its "
            f"input hidden state, section 3.4; usually alpha - 1), got {beta!r}"
        )
    return int(alpha), int(beta)



def _keep_better(q: np.ndarray, kind: int, best: np.ndarray, bd: np.ndarray, bh: np.ndarray) -> None:
    """Row-wise: where min over y of ``q`` (columns are y = 2, 3, ...) beats ``best``, record it in place."""
    j = np.argmin(q, axis=1)
    v = q[np.arange(len(q)), j]
    better = v < best
    best[:] = np.where(better, v, best)
    bd[:] = np.where(better, j + 2, bd)
    bh[:] = np.where(better, kind, bh)


def _scan(CT, t, pad, use_hidden, alpha, work, best, bd, bh) -> None:
    """Positions y = 2 .. t - 1 by exhaustive scan, within the bound ``Q >= t + y - 1`` (module docstring)."""
    m_max = len(best)
    ylim = np.minimum(np.minimum(best, work) - t + 1, t - 1)
    ylim = np.maximum.accumulate(ylim[::-1])[::-1]  # non-increasing envelope, so chunks are prefixes
    a = 0
    while a < m_max and ylim[a] >= 2:
        yl = int(ylim[a])
        b = int(np.searchsorted(-ylim, -(yl // 2), side="right"))  # columns whose bound is > yl/2
        b = max(b, a + 1)
        ca, cb = pad + 1 + a, pad + 1 + b  # CT rows for m = a+1 .. b
        ys = np.arange(2, yl + 1)
        if use_hidden:
            # Q1 = y + C(y, m) + C(t - y, m - 1), y = 2 .. yl (< t)
            q = CT[ca:cb, 2 : yl + 1] + CT[ca - 1 : cb - 1, t - 2 : t - yl - 1 : -1]
            _keep_better(q + ys, HIDDEN, best[a:b], bd[a:b], bh[a:b])
        if alpha is not None:
            # Q2 = y + C(y - 1, m) + C(t - y, m - alpha), y = 2 .. yl (< t)
            q = CT[ca:cb, 1:yl] + CT[ca - alpha : cb - alpha, t - 2 : t - yl - 1 : -1]
            _keep_better(q + ys, INTERNAL, best[a:b], bd[a:b], bh[a:b])
        a = b


def _walk(flat, width: int, rows: np.ndarray, shift: int, lag: int, t: int, start: np.ndarray
          ) -> tuple[np.ndarray, np.ndarray]:
    """Smallest minimiser over y in [start, t - 1] of y + C(y - lag, m) + C(t - y, m - shift) for CT rows
    ``rows`` (= pad + m), walking right while the next position is strictly better: exact when that
    function is convex in y (see :func:`_solve_walk`). Returns (y, value)."""
    y = start.copy()
    a_rows, b_rows = rows * width, (rows - shift) * width
    f = y + flat[a_rows + y - lag] + flat[b_rows + t - y]
    live = np.flatnonzero(y < t - 1)
    while live.size:
        yn = y[live] + 1
        fn = yn + flat[a_rows[live] + yn - lag] + flat[b_rows[live] + t - yn]
        adv = fn < f[live]
        live = live[adv]
        y[live] = yn[adv]
        f[live] = fn[adv]
        live = live[y[live] < t - 1]
    return y, f


def _solve_walk(t_max: int, m_max: int, use_hidden: bool, alpha: int | None, beta: int | None,
                walk: bool = True):
    """Fill C, D, H for the generic two-choice recurrence; see the module docstring.

    ``alpha is None`` disables internal pushes except the working step y = t (HSM).

    Positions y = 2 .. t - 1 (the convexity speed-up of appendix A): Q1(y) = y + A(y) + B(t - y) with
    A = C(., m) and B = C(., m - 1) (for Q2, A(y) = C(y - 1, m), B = C(., m - alpha)). Where both columns
    are convex in t (checked as the rows are filled, not assumed), Q is convex in y, so a walk right from
    any y at or below the smallest minimiser finds it; and that minimiser never decreases with t (for y
    below the one at t - 1, Q_t(y) - Q_t(y*) = Q_{t-1}(y) - Q_{t-1}(y*) + ΔB(t - y) - ΔB(t - y*) > 0 as ΔB does not
    decrease). So each (t, m) costs O(1) amortised instead of O(t). Rows whose columns are not convex
    so far fall back to the exhaustive scan, so the tables are exact either way (``walk=False``: always
    scan). HSM and ISM columns are convex (appendix B); MSM columns are not (96 of 100 rows at t = 1000,
    alpha = 5, beta = 4 have a negative second difference), so here MSM scans (see :mod:`.hull_dp`).
    """
    CT, pad = cost_table(t_max, m_max, alpha, beta)
    flat = CT.reshape(-1)
    width = t_max + 1
    DT = np.zeros((m_max + 1, t_max + 1), dtype=np.int64)
    HT = np.zeros((m_max + 1, t_max + 1), dtype=np.int8)
    cols = slice(pad + 1, pad + m_max + 1)  # m = 1 .. m_max
    ms = np.arange(1, m_max + 1)
    convex = np.ones(pad + m_max + 1, dtype=bool)  # per CT row: convex over t = 1 .. (last row filled)
    kinds = []  # (kind, CT rows with a finite B column, shift, lag, previous minimiser)
    if use_hidden:
        r = pad + ms[ms - 1 >= 1]
        kinds.append((HIDDEN, r, 1, 0, np.full(len(r), 2, dtype=np.int64)))
    if alpha is not None:
        r = pad + ms[ms - alpha >= 1]
        kinds.append((INTERNAL, r, alpha, 1, np.full(len(r), 2, dtype=np.int64)))
    for t in range(1, t_max + 1):
        # Candidates are tried in a fixed order and replaced only when strictly better: hidden before
        # internal at y = 1, then y = 2, 3, ..., and the working step (y = t) last, so that ties go to
        # the earlier push (the paper's Algorithm 1 keeps the first minimum, e.g. D(t, m >= t) = 1).
        # Working step (y = t): t forwards, then the left t - 1 steps with all memory (eq. (4) at y = t).
        work = t + CT[cols, t - 1]
        best = np.full(m_max, INF, dtype=np.int64)
        bd = np.zeros(m_max, dtype=np.int64)
        bh = np.zeros(m_max, dtype=np.int8)
        cands = []  # the y = 1 choices
        if t > 1 and use_hidden:
            cands.append((1 + CT[pad + 1 : pad + m_max + 1, 1] + CT[pad : pad + m_max, t - 1], HIDDEN))
        if t > 1 and alpha is not None:
            cands.append((1 + CT[pad + 1 - beta : pad + m_max + 1 - beta, t - 1], INTERNAL))
        for val, kind in cands:
            better = val < best
            best = np.where(better, val, best)
            bd = np.where(better, 1, bd)
            bh = np.where(better, kind, bh)
        if t >= 3:
            if walk and all(convex[rows].all() and convex[rows - shift].all() for _, rows, shift, _, _ in kinds):
                for kind, rows, shift, lag, prev in kinds:
                    y, f = _walk(flat, width, rows, shift, lag, t, np.minimum(prev, t - 1))
                    prev[:] = y
                    i = rows - pad - 1
                    better = f < best[i]
                    best[i] = np.where(better, f, best[i])
                    bd[i] = np.where(better, y, bd[i])
                    bh[i] = np.where(better, kind, bh[i])
            else:
                _scan(CT, t, pad, use_hidden, alpha, work, best, bd, bh)
                for _, _, _, _, prev in kinds:
                    prev[:] = 2  # the walk's start must be at or below the minimiser: restart low
        better = work < best
        best = np.where(better, work, best)
        bd = np.where(better, t, bd)
        bh = np.where(better, INTERNAL, bh)
        CT[cols, t], DT[1:, t], HT[1:, t] = np.minimum(best, INF), bd, bh
        if t >= 3:
            convex[cols] &= CT[cols, t] - 2 * CT[cols, t - 1] + CT[cols, t - 2] >= 0
    return CT[pad:, :].T.copy(), DT.T.copy(), HT.T.copy()


#: Sequence length from which the hull method solves MSM faster than the scan (measured on a 2-core CPU,
#: alpha = 5, beta = 4: CPU seconds hull/scan 0.25/0.22 at t = 1000, 0.39/0.50 at 1500, m = 100).
_HULL_FROM = 1200


def _solve_dp(t_max: int, m_max: int, use_hidden: bool, alpha: int | None, beta: int | None,
              method: str = "auto"):
    """Tables C, D, H (as ``C[t, m]``) of the recurrence in the module docstring, by ``method``:

    ``"walk"`` (:func:`_solve_walk`: the convexity walk where the columns are convex, else the scan),
    ``"hull"`` (:func:`fxplan.bptt.hull_dp.solve_tables`: windows certified by the columns' hulls, for
    t <= ``hull_dp.T_LIMIT``) or ``"scan"`` (every position; the reference). All three give identical
    tables. ``"auto"``: the walk for HSM and ISM (whose columns are convex, appendix B); for MSM the hull
    method from ``_HULL_FROM`` steps up to its limit, the walk's scan below (faster there).
    """
    if method == "auto":
        msm = use_hidden and alpha is not None
        method = "hull" if msm and _HULL_FROM <= t_max <= T_LIMIT else "walk"
    if method == "hull":
        return solve_tables(t_max, m_max, use_hidden, alpha, beta)
    if method in ("walk", "scan"):
        return _solve_walk(t_max, m_max, use_hidden, alpha, beta, walk=method == "walk")
    raise FxplanError(f"unknown BPTT solver method {method!r}; choose 'auto', 'walk', 'hull' or 'scan'")


@functools.lru_cache(maxsize=32)
def _solve_cached(policy: str, t: int, m: int, alpha: int | None, beta: int | None) -> Policy:
    if policy == "hsm":
        C, D, H = _solve_dp(t, m, True, None, None)
    elif policy == "ism":
        C, D, H = _solve_dp(t, m, False, 1, 1)
    else:
        C, D, H = _solve_dp(t, m, True, alpha, beta)
    for arr in (C, D, H):
        arr.setflags(write=False)
    return Policy(policy, t, m, alpha, beta, C, D, H)


def solve(policy: str, t: int, m: int | None = None, *, alpha: int | None = None,
          beta: int | None = None, segment: int | None = None) -> Policy:
    """Solve ``policy`` for every length up to ``t`` and memory up to ``m``; return its tables.

    ``policy`` is ``"hsm"`` (3.1, ``m`` hidden states), ``"ism"`` (3.2, ``m`` internal states),
    ``"msm"`` (3.3, ``m`` hidden-state units, an internal state costing ``alpha`` units; with ``beta`` the
    3.4 refinement: ``beta`` units when the input hidden state is already stored), or one of Chen et al.'s
    baselines ``"chen_sqrt"`` (segments of ``segment`` steps, default ceil(sqrt(t)); needs ``alpha``) and
    ``"chen_recursive"`` (bisection, log2(t) hidden states). For the baselines ``m`` may be omitted;
    if given, a :class:`~fxplan.errors.BudgetError` says when the baseline does not fit in it.
    """
    if policy not in POLICIES:
        raise FxplanError(f"unknown BPTT policy {policy!r}; choose one of {', '.join(POLICIES)}")
    alpha, beta = _alpha_beta(policy, alpha, beta)
    if policy.startswith("chen"):
        _check_tm(t, 1 if m is None else m)
        pol = _chen(policy, int(t), alpha, beta, segment)
        need = simulate(pol, t).peak_units
        pol = Policy(pol.name, pol.t, need, alpha, beta, pol.C, pol.D, pol.H)
        if m is not None and need > m:
            raise BudgetError(
                f"{policy} needs {need} memory units for t={t} (alpha={alpha}, beta={beta}) but only "
                f"m={m} were given; give at least {need} or use policy 'msm', which fits any m >= 1",
                None,
            )
        return pol
    if m is None:
        raise FxplanError(f"policy {policy!r} needs the memory size m (number of slots)")
    _check_tm(t, m)
    return _solve_cached(policy, int(t), int(m), alpha, beta)


def optimal_cost(policy: str, t: int, m: int, *, alpha: int | None = None, beta: int | None = None) -> int:
    """Total forward operations of ``policy`` for ``t`` steps and memory ``m`` (see :func:`solve`).

    Plain BPTT costs ``t``; e.g. ``optimal_cost("ism", 1000, 50) == 1950`` (section 3.2's 95% less
    memory for 33% more time, counting a backward step as two forward steps).
    """
    return solve(policy, t, m, alpha=alpha, beta=beta).cost(t, m)


def _chen(policy: str, t: int, alpha: int | None, beta: int | None, segment: int | None) -> Policy:
    """Chen et al.'s schedules written as (suboptimal) policies D, H of the same recurrences (4.1).

    ``chen_sqrt``: store the hidden state at every segment boundary in one pass, then back-propagate
    each segment keeping all of its internal states. ``chen_recursive``: store the middle hidden state,
    solve the right half, then the left half, recursively (Chen's k = 1 case, log2(t) hidden states).
    """
    C = np.zeros(t + 1, dtype=np.int64)
    D = np.zeros(t + 1, dtype=np.int64)
    H = np.zeros(t + 1, dtype=np.int8)
    if policy == "chen_sqrt":
        k = int(segment) if segment is not None else math.ceil(math.sqrt(t))
        if k < 1:
            raise FxplanError(f"segment must be >= 1, got {segment!r}")
        for n in range(1, t + 1):
            if n > k:  # Q1 with y = k: the next segment boundary
                H[n], D[n], C[n] = HIDDEN, k, k + C[n - k] + C[k]
            else:  # Q2 with y = 1: keep every internal state of the last segment
                H[n], D[n], C[n] = INTERNAL, 1, 1 + C[n - 1]
    else:
        for n in range(1, t + 1):
            if n == 1:
                H[n], D[n], C[n] = INTERNAL, 1, 1
            else:
                y = n // 2
                H[n], D[n], C[n] = HIDDEN, y, y + C[n - y] + C[y]
    for arr in (C, D, H):
        arr.setflags(write=False)
    return Policy(policy, t, 0, alpha, beta, C, D, H)
