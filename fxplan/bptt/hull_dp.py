"""The BPTT dynamic program, compiled, with hull-certified positions (Gruslys et al. 2016, 3.1-3.4, appendix A).

:func:`solve_tables` fills the tables C, D, H of the recurrence in :mod:`fxplan.bptt.solvers` exactly as
an exhaustive scan of every position would, ties included; it evaluates a few positions per entry in
practice instead of t (O(t^2 m) remains the worst case, where the hulls bound nothing).

Appendix A says the O(t^2 m) evaluation (Algorithm 1) can be made O(t m) "by exploiting convexity in t".
That holds for HSM and ISM, whose columns ``C(., m)`` are convex (appendix B), but not for MSM: 96 of
100 MSM columns at t = 1000, alpha = 5, beta = 4 have a negative second difference. So nothing here
assumes convexity. For a push of one kind at row t and memory m the cost of position y is::

    Q(y) = y + A(y - lag) + B(t - y),   2 <= y <= t - 1,

with A = C(., m) and B = C(., m - 1) for a hidden push (lag 0, eq. (1)/(6)), and B = C(., m - alpha) for an
internal one (lag 1, eq. (7)/(10)). With hA, hB the lower convex hulls of those columns over the rows
filled so far, ``LB(y) = y + hA(y - lag) + hB(t - y)`` is convex in y and at most Q(y). The kernel finds
LB's smallest minimiser y* (walking from the previous row's), evaluates Q there, and then evaluates Q at
the positions left and right of y* only while LB does not exceed the best cost found: since LB is
monotone on either side of y*, every position beyond is provably worse (ties: a smaller position wins,
so on the left equal LB still has to be checked). Where the columns are convex, LB = Q and this is the
appendix's walk; MSM columns stay close to their hulls, so a few positions usually suffice. Where they
do not, it is slower, never wrong.

A position matters only if it can win: if its cost is below the earlier candidates', at most the working
step's, and at most C(t, m - 1). The last holds because more memory never costs more: by induction on
t, every candidate for (t, m - 1) is one for (t, m) too, built from entries C(t', m') with t' < t that
are no larger at m' + 1 (and C(0, .) = 0). So LB's minimum above that cap skips the lane, and the scan
stops at the first position whose cost reaches LB's minimum rounded up, since none can cost less.

All comparisons are exact integer arithmetic: a hull value is kept as floor plus remainder over the
segment's width, so no product exceeds about t^3 (hence :data:`T_LIMIT`). Memory: the hulls and the
tables take about 50 bytes per table entry (100 MB at t = 10,000, m = 200).

The kernel is compiled by numba on first use and cached on disk (``cache=True``: in ``__pycache__``
beside this file, or numba's per-user cache directory where that is not writable; ``NUMBA_CACHE_DIR``
overrides both).
"""

from __future__ import annotations

import numpy as np
from numba import njit

from fxplan.bptt.policy import HIDDEN, INF, INTERNAL
from fxplan.errors import FxplanError

__all__ = ["T_LIMIT", "kernel_signatures", "solve_tables"]

#: Largest sequence length whose exact int64 arithmetic cannot overflow (products reach about t^3 / 2).
T_LIMIT = 1_000_000
#: The positions probed to bound a lane's scan are this far from LB's minimiser, then this factor further
#: each time: a probe costs about as much as scanning a few positions.
_REACH = 8


@njit(cache=True, error_model="numpy", inline="always")
def _find(hx, n, col, x, k):
    """Index of the hull segment [hx[col, k], hx[col, k + 1]] of column ``col`` that contains the unit
    interval [x, x + 1] (for x at the last vertex, the last segment), walking from the guess ``k``: a
    lane's positions move little between the look-ups, so the walk is short."""
    last = n[col] - 2
    k = min(k, last)
    while k > 0 and hx[col, k] > x:
        k -= 1
    while k < last and hx[col, k + 1] <= x:
        k += 1
    return k


@njit(cache=True, error_model="numpy", inline="always")
def _lb(hx, hy, n, a, b, lag, t, y, ka, kb):
    """LB(y) = y + hA(y - lag) + hB(t - y) as ``s + num / den`` with integers, 0 <= num / den < 2, and the
    segments found (the next look-ups' guesses). Each hull value is its floor plus remainder / width."""
    ka = _find(hx, n, a, y - lag, ka)
    kb = _find(hx, n, b, t - y, kb)
    da, db = hx[a, ka + 1] - hx[a, ka], hx[b, kb + 1] - hx[b, kb]
    na = (hy[a, ka + 1] - hy[a, ka]) * (y - lag - hx[a, ka])
    nb = (hy[b, kb + 1] - hy[b, kb]) * (t - y - hx[b, kb])
    fa, fb = na // da, nb // db  # floor division, also on a decreasing segment
    s = y + hy[a, ka] + fa + hy[b, kb] + fb
    return s, (na - fa * da) * db + (nb - fb * db) * da, da * db, ka, kb


@njit(cache=True, error_model="numpy", inline="always")
def _lb_above(hx, hy, n, a, b, lag, t, y, bound, ka, kb):
    """Whether LB(y) > ``bound`` (exactly), and the segments found."""
    s, num, den, ka, kb = _lb(hx, hy, n, a, b, lag, t, y, ka, kb)
    d = s - bound
    return d >= 1 or (d >= -1 and d * den + num > 0), ka, kb


@njit(cache=True, error_model="numpy", inline="always")
def _lb_rises(hx, n, hy, a, b, lag, t, y, ka, kb):
    """Whether LB(y + 1) >= LB(y): 1 + (slope of hA on [y - lag, y + 1 - lag]) - (slope of hB on
    [t - y - 1, t - y]) >= 0, exactly; and the segments found."""
    ka = _find(hx, n, a, y - lag, ka)
    kb = _find(hx, n, b, t - y - 1, kb)
    dxa, dya = hx[a, ka + 1] - hx[a, ka], hy[a, ka + 1] - hy[a, ka]
    dxb, dyb = hx[b, kb + 1] - hx[b, kb], hy[b, kb + 1] - hy[b, kb]
    return dxa * dxb + dya * dxb - dyb * dxa >= 0, ka, kb


@njit(cache=True, error_model="numpy")
def _lane(CT, hx, hy, n, a, b, lag, t, y, ka, kb, cap):
    """Min over y = 2 .. t - 1 of Q(y) = y + C(y - lag, a) + C(t - y, b) and its smallest minimiser among
    the positions with Q(y) <= ``cap`` (position -1 where there is none: the caller's earlier candidates
    are cheaper); also LB's smallest minimiser and its segments, the next row's guesses ``y, ka, kb``.
    See the module docstring."""
    lo, hi = 2, t - 1
    y = min(max(y, lo), hi)
    # LB's slopes do not decrease (convex), so its smallest minimiser is the first y whose slope is >= 0.
    rises, ka, kb = _lb_rises(hx, n, hy, a, b, lag, t, y, ka, kb) if y < hi else (True, ka, kb)
    if not rises:
        y += 1
        while y < hi:
            rises, ka, kb = _lb_rises(hx, n, hy, a, b, lag, t, y, ka, kb)
            if rises:
                break
            y += 1
    else:
        while y > lo:
            rises, ka, kb = _lb_rises(hx, n, hy, a, b, lag, t, y - 1, ka, kb)
            if not rises:
                break
            y -= 1
    s, num, den, ka, kb = _lb(hx, hy, n, a, b, lag, t, y, ka, kb)
    floor = s + (0 if num == 0 else (1 if num <= den else 2))  # ceil(LB(y)): no position costs less
    if floor > cap:
        return cap + 1, -1, y, ka, kb
    q0 = y + CT[a, y - lag] + CT[b, t - y]
    # LB does not increase from lo up to y and does not decrease from y up to hi. Positions left of y can
    # win with a cost <= q0 (a tie at a smaller position wins), right of it only with a smaller one.
    # Galloping outwards finds positions beyond which LB exceeds those bounds, so Q does too.
    left, right = min(q0, cap), min(q0 - 1, cap)
    d, first, ja, jb = _REACH, y - _REACH, ka, kb
    while first >= lo:
        above, ja, jb = _lb_above(hx, hy, n, a, b, lag, t, first, left, ja, jb)
        if above:
            break
        d *= _REACH
        first = y - d
    d, last, ja, jb = _REACH, y + _REACH, ka, kb
    while last <= hi and right >= floor:
        above, ja, jb = _lb_above(hx, hy, n, a, b, lag, t, last, right, ja, jb)
        if above:
            break
        d *= _REACH
        last = y + d
    first, last = max(first, lo - 1), min(last, hi + 1)
    # Scan what is left from the left: the first smallest cost wins; none can be below ``floor``.
    best, by = cap + 1, -1
    for z in range(first + 1, last):
        q = z + CT[a, z - lag] + CT[b, t - z]
        if q < best:
            best, by = q, z
            if q == floor:
                break
    return best, by, y, ka, kb


@njit(cache=True, error_model="numpy")
def _push(hx, hy, n, col, x, c):
    """Append the point (x, c) to column ``col``'s lower hull (Andrew's monotone chain; collinear popped)."""
    k = n[col]
    while k >= 2 and (hx[col, k - 1] - hx[col, k - 2]) * (c - hy[col, k - 2]) <= \
            (hy[col, k - 1] - hy[col, k - 2]) * (x - hx[col, k - 2]):
        k -= 1
    hx[col, k], hy[col, k] = x, c
    n[col] = k + 1


@njit(cache=True, error_model="numpy")
def _fill(CT, DT, HT, use_hidden, alpha, beta, big, hidden, internal):
    """Fill CT[m, t], DT, HT (memory-major) row by row for t = 1 .. t_max, m = 1 .. m_max.

    Candidates per entry, in the order that wins ties (a later one replaces only a strictly smaller
    cost; the paper's Algorithm 1 keeps the first minimum): hidden push at y = 1, internal push at
    y = 1 (costing ``beta``, 3.4), hidden pushes at y = 2 .. t - 1, internal pushes at y = 2 .. t - 1,
    and the working step y = t (eq. (4) at y = t). ``alpha == 0``: no internal pushes but the working step.
    """
    m_max, t_max = CT.shape[0] - 1, CT.shape[1] - 1
    hx = np.zeros((m_max + 1, t_max + 1), dtype=np.int64)
    hy = np.zeros((m_max + 1, t_max + 1), dtype=np.int64)
    n = np.zeros(m_max + 1, dtype=np.int64)
    # per kind (hidden, internal) and m: LB's last minimiser and its segments in the A and B columns
    start = np.full((2, m_max + 1), 2, dtype=np.int64)
    seg_a = np.zeros((2, m_max + 1), dtype=np.int64)
    seg_b = np.zeros((2, m_max + 1), dtype=np.int64)
    for m in range(1, m_max + 1):
        CT[m, 0] = 0
        _push(hx, hy, n, m, 0, 0)
    for t in range(1, t_max + 1):
        for m in range(1, m_max + 1):
            best, bd, bh = big, 0, internal
            if t > 1 and use_hidden and m >= 2:
                best, bd, bh = 1 + CT[m, 1] + CT[m - 1, t - 1], 1, hidden
            if t > 1 and alpha > 0 and m - beta >= 1:
                v = 1 + CT[m - beta, t - 1]
                if v < best:
                    best, bd, bh = v, 1, internal
            work = t + CT[m, t - 1]
            # A lane position matters only below the earlier candidates, at most the working step, and at
            # most C(t, m - 1): more memory never costs more (module docstring), so C(t, m) <= C(t, m - 1).
            cap = min(work, CT[m - 1, t])
            if t >= 3 and use_hidden and m >= 2:
                v, y, start[0, m], seg_a[0, m], seg_b[0, m] = _lane(
                    CT, hx, hy, n, m, m - 1, 0, t, start[0, m], seg_a[0, m], seg_b[0, m], min(best - 1, cap))
                if y > 0:
                    best, bd, bh = v, y, hidden
            if t >= 3 and alpha > 0 and m - alpha >= 1:
                v, y, start[1, m], seg_a[1, m], seg_b[1, m] = _lane(
                    CT, hx, hy, n, m, m - alpha, 1, t, start[1, m], seg_a[1, m], seg_b[1, m], min(best - 1, cap))
                if y > 0:
                    best, bd, bh = v, y, internal
            if work < best:
                best, bd, bh = work, t, internal
            CT[m, t], DT[m, t], HT[m, t] = best, bd, bh
        for m in range(1, m_max + 1):  # after the row: row t's lanes read the hulls of rows < t only
            _push(hx, hy, n, m, t, CT[m, t])


def solve_tables(t_max: int, m_max: int, use_hidden: bool, alpha: int | None, beta: int | None):
    """Tables C, D, H (indexed ``C[t, m]``) of the recurrence in :mod:`fxplan.bptt.solvers` for t <= t_max
    (at most :data:`T_LIMIT`), m <= m_max; ``alpha is None``: no internal pushes but the working step
    (HSM). ``C[t, 0]`` is INF for t >= 1 (no memory), ``C[0, m] = 0``."""
    if t_max > T_LIMIT:
        raise FxplanError(f"the BPTT solver supports sequence lengths t <= {T_LIMIT:,} (exact int64 "
                          f"arithmetic), got {t_max:,}; split the sequence into chunks of at most that length")
    CT = np.full((m_max + 1, t_max + 1), INF, dtype=np.int64)
    CT[0, 0] = 0
    DT = np.zeros((m_max + 1, t_max + 1), dtype=np.int64)
    HT = np.zeros((m_max + 1, t_max + 1), dtype=np.int8)
    _fill(CT, DT, HT, bool(use_hidden), int(alpha or 0), int(beta or 0), INF, HIDDEN, INTERNAL)
    return CT.T.copy(), DT.T.copy(), HT.T.copy()


def kernel_signatures() -> list:
    """The signatures the kernel has been compiled (or loaded from numba's disk cache) for in this process."""
    return _fill.signatures
