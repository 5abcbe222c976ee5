"""The BPTT dynamic program with hull-certified windows (Gruslys et al. 2016, sections 3.3-3.4, appendix A).

:func:`solve_tables` fills the same tables C, D, H as the exhaustive scan of
:func:`fxplan.bptt.solvers._solve_walk` (``walk=False``), ties included, in about O(t m) instead of
O(t^2 m) numpy work: the speed-up appendix A mentions, which there rests on the columns ``C(., m)`` being
convex in t. That holds for HSM and ISM but not for MSM, whose columns have small dents (96 of 100 at
t = 1000, alpha = 5, beta = 4 have a negative second difference; in the tables measured, t <= 3000 and
m <= 200, each column stays within one operation of its lower convex hull). So this module does not
assume convexity: it evaluates a few positions exactly and proves with the columns' hulls that no other
position does better; where the hulls are far from the columns it is slower, never wrong. Memory: the
hulls take 32 bytes per table entry, on top of the tables' 17.
"""

from __future__ import annotations

import numpy as np

from fxplan.bptt.policy import HIDDEN, INF, INTERNAL
from fxplan.errors import FxplanError

__all__ = ["T_LIMIT", "cost_table", "solve_tables"]


class _Hulls:
    """Lower convex hulls of the columns ``t' -> C(t', m)``, m = 1 .. m_max, of the rows pushed so far.

    A column's hull is a convex function below every entry of the column, which bounds the costs Q1 and Q2
    from below (see :func:`solve_tables`). The vertices of column ``j`` (0-based) are kept at flat indices
    ``j * cap ..`` of ``x`` and ``y``; ``key = j * cap + x`` (``j * cap + cap - 1`` past the last vertex) is
    sorted over all columns, so one ``searchsorted`` finds the segments of many columns at once.
    """

    def __init__(self, m_max: int, t_max: int) -> None:
        self.cap = cap = t_max + 2
        self.base = np.arange(m_max, dtype=np.int64) * cap
        self.x = np.zeros(m_max * cap, dtype=np.int64)
        self.y = np.zeros(m_max * cap, dtype=np.int64)
        self.key = np.repeat(self.base + cap - 1, cap)
        self.n = np.zeros(m_max, dtype=np.int64)
        # seg[j * cap + p]: flat index of the vertex starting the segment that contained p when last
        # looked up (or p's own vertex when pushed); checked on use, so stale entries only cost a search
        self.seg = np.zeros(m_max * cap, dtype=np.int64)

    def push(self, t: int, c: np.ndarray) -> None:
        """Append the point ``(t, c[j])`` to every column ``j`` (Andrew's monotone chain, collinear popped)."""
        act = np.flatnonzero(self.n >= 2)
        while act.size:
            i1 = self.base[act] + self.n[act] - 1
            x2, y2 = self.x[i1 - 1], self.y[i1 - 1]
            pop = (self.x[i1] - x2) * (c[act] - y2) <= (self.y[i1] - y2) * (t - x2)
            act, i1 = act[pop], i1[pop]
            self.n[act] -= 1
            self.key[i1] = self.base[act] + self.cap - 1
            act = act[self.n[act] >= 2]
        i = self.base + self.n
        self.x[i], self.y[i], self.key[i], self.seg[self.base + t] = t, c, self.base + t, i
        self.n += 1

    def segments(self, col: np.ndarray, p: np.ndarray) -> tuple[np.ndarray, ...]:
        """``(x0, y0, dx, dy)`` of the hull segment of column ``col`` that contains position ``p`` (the
        last segment for a position at or past the last vertex): the hull there is
        ``y0 + dy * (p - x0) / dx``, and ``dy / dx`` is one of its subgradients."""
        q = self.base[col] + p
        k = self.seg[q]
        last = self.base[col] + self.n[col] - 2  # the last segment's start
        bad = np.flatnonzero((k > last) | (k < self.base[col]) | (self.x[k] > p)
                             | (self.x[np.minimum(k + 1, last + 1)] <= p))
        if bad.size:
            kb = np.searchsorted(self.key, q[bad], side="right") - 1
            k[bad] = self.seg[q[bad]] = np.minimum(kb, last[bad])
        x0, y0 = self.x[k], self.y[k]
        return x0, y0, self.x[k + 1] - x0, self.y[k + 1] - y0


#: Costs and positions are packed as ``cost << _YBITS | y``, so that one ``min`` finds the smallest cost at
#: its smallest position (y < 2 ** _YBITS; costs stay below 2 ** 40 for t <= T_LIMIT).
_YBITS = 16


def _window_min(flat, width: int, arow, brow, lag, t, lo, hi, w: int):
    """Per lane: min over y in [lo, hi] (at most ``w`` positions) of y + CT[arow, y - lag] + CT[brow, t - y],
    and its smallest minimiser."""
    ys = np.minimum(lo[:, None] + np.arange(w), hi[:, None])  # repeats of hi: no smaller position
    q = ys + flat[(arow * width - lag)[:, None] + ys] + flat[(brow * width + t)[:, None] - ys]
    key = ((q << _YBITS) | ys).min(axis=1)
    return key >> _YBITS, key & ((1 << _YBITS) - 1)


def _certified(hulls: _Hulls, acol, bcol, lag, t, lo, hi, v, cap, ylb, dom_lo, dom_hi):
    """Whether no position outside [lo, hi] changes the row's answer, per lane.

    Needed: every y in [dom_lo, lo) costs more than min(v, cap) and every y in (hi, dom_hi] at least
    min(v, cap + 1), where ``v`` is the window's minimum and ``cap`` the largest value with which the lane
    can still win: so either the window's smallest minimiser is the domain's, or the lane loses anyway.
    With hA, hB the hulls of the columns of A and B (lower bounds over the domain),
    LB(y) = y + hA(y - lag) + hB(t - y) <= Q(y) is convex and piecewise linear in y. A side is proven by
    LB's value and slope at the position next to the window (LB > threshold there and not decreasing away
    from the window), or by LB's minimum, at ``ylb`` when its left and right slopes there have opposite
    signs (:func:`_lb_minimiser` walks ``ylb`` there). Exact integer arithmetic.
    """
    n = len(lo)
    ylb = np.clip(ylb, dom_lo, dom_hi)
    # positions y: left edge, right edge, ylb twice (for its left and right slopes)
    ys = np.concatenate([lo - 1, hi + 1, ylb, ylb])
    lag4 = np.tile(lag, 4)
    pa, pb = ys - lag4, np.tile(t, 4) - ys  # where A and B are evaluated
    # Subgradients: for y decreasing (left edge, ylb's left slope) A's segment ending at pa and B's
    # starting at pb; for y increasing the opposite.
    back = np.repeat([1, 0, 1, 0], n)
    xa, ya, dxa, dya = hulls.segments(np.tile(acol, 4), np.maximum(pa - back, 0))
    xb, yb, dxb, dyb = hulls.segments(np.tile(bcol, 4), np.maximum(pb - 1 + back, 0))
    thr = np.tile(np.concatenate([np.minimum(v, cap), np.minimum(v - 1, cap)]), 2)
    # LB(y) > thr, both sides multiplied by dxa * dxb > 0
    above = ((ys + ya + yb - thr) * dxa * dxb + dya * (pa - xa) * dxb + dyb * (pb - xb) * dxa) > 0
    # the slope of LB, 1 + dya/dxa - dyb/dxb, times dxa * dxb
    slope = (dxa + dya) * dxb - dyb * dxa
    left, right, at_min_l, at_min_r = (slice(k * n, (k + 1) * n) for k in range(4))
    is_min = (slope[at_min_l] <= 0) & (slope[at_min_r] >= 0)
    ok_left = (lo <= dom_lo) | (above[left] & (slope[left] <= 0)) | (is_min & above[at_min_l])
    ok_right = (hi >= dom_hi) | (above[right] & (slope[right] >= 0)) | (is_min & above[at_min_r])
    return ok_left, ok_right


def _lb_minimiser(hulls: _Hulls, acol, bcol, lag, t, y, lo, hi, steps: int = 8):
    """Walk ``y`` towards LB's minimiser in [lo, hi] (see :func:`_certified`) over LB's breakpoints, the
    ends of A's and B's hull segments, at most ``steps`` of them: LB's minimiser moves little from one
    row to the next, so the previous one plus a few steps usually reaches it."""
    act = np.arange(len(y))
    for _ in range(steps):
        yy, n = y[act], len(act)
        pa, pb = np.tile(yy - lag[act], 2), np.tile(t[act] - yy, 2)
        back = np.repeat([1, 0], n)
        xa, _, dxa, dya = hulls.segments(np.tile(acol[act], 2), np.maximum(pa - back, 0))
        xb, _, dxb, dyb = hulls.segments(np.tile(bcol[act], 2), np.maximum(pb - 1 + back, 0))
        slope = (dxa + dya) * dxb - dyb * dxa
        up = np.minimum(xa[n:] + dxa[n:] + lag[act], t[act] - xb[n:])
        down = np.maximum(xa[:n] + lag[act], t[act] - xb[:n] - dxb[:n])
        ny = np.clip(np.where(slope[n:] < 0, up, np.where(slope[:n] > 0, down, yy)), lo[act], hi[act])
        moved = ny != yy
        y[act] = ny
        act = act[moved]
        if not act.size:
            break
    return y


#: Positions evaluated exactly per (t, m) and kind before the bounds are checked, and rows per block
#: (measured best of 8 .. 64 on a 2-core CPU at t = 1000, m = 100 and t = 3000, m = 200).
_WINDOW = 16
_BLOCK = 16
#: Largest t for which the exact int64 arithmetic of :func:`_certified` cannot overflow (it reaches
#: about 3 t^4).
T_LIMIT = 30_000


def solve_tables(t_max: int, m_max: int, use_hidden: bool, alpha: int | None, beta: int | None):
    """Tables C, D, H (as ``C[t, m]``) of the recurrence in :mod:`fxplan.bptt.solvers` for t <= t_max
    (at most :data:`T_LIMIT`), m <= m_max; ``alpha is None``: no internal pushes but the working step (HSM).

    The first push at y = 1 and the working step y = t are evaluated directly. Positions y = 2 .. t - 1:
    Q1(y) = y + A(y) + B(t - y) with A = C(., m), B = C(., m - 1)
    (Q2: A(y) = C(y - 1, m), B = C(., m - alpha)); one "lane" per kind and m. Appendix A's O(t m) speed-up
    rests on the columns being convex in t, which holds for HSM and ISM but not for MSM (96 of 100
    columns at t = 1000, alpha = 5, beta = 4 have a negative second difference). So instead of assuming
    convexity, each lane evaluates a window of positions around its previous minimiser exactly and proves
    with the columns' lower convex hulls hA, hB (:class:`_Hulls`) that no position outside it does
    better: LB(y) = y + hA(y - lag) + hB(t - y) <= Q(y) is convex in y (:func:`_certified`). Where the
    proof fails the window grows on that side until it holds, so the tables are exactly the scan's, ties
    included. MSM columns stay within 1 of their hulls, so a few positions usually suffice.

    Rows are taken in blocks of ``_BLOCK`` from t0: the positions of rows t0 .. t0 + _BLOCK - 1 that only
    read rows before t0 (A(y - lag), B(t - y) with y - lag, t - y < t0) are solved for the whole block at
    once with the hulls of rows 0 .. t0 - 1 (:func:`_block_middle`); the few others, next to y = 2 and
    y = t - 1, are evaluated exactly row by row.
    """
    if t_max > T_LIMIT:
        raise FxplanError(f"the hull-certified BPTT solver supports t <= {T_LIMIT}, got {t_max}; use "
                          "method='walk' (exact, slower)")
    CT, pad = cost_table(t_max, m_max, alpha, beta)
    flat, width = CT.reshape(-1), t_max + 1
    DT = np.zeros((m_max + 1, t_max + 1), dtype=np.int64)
    HT = np.zeros((m_max + 1, t_max + 1), dtype=np.int8)
    cols = slice(pad + 1, pad + m_max + 1)  # m = 1 .. m_max
    ms = np.arange(1, m_max + 1)
    # Lanes: one per (kind, m) whose B column exists; hidden lanes first.
    kinds = []
    if use_hidden:
        kinds.append((ms[ms - 1 >= 1], 1, 0))
    if alpha is not None:
        kinds.append((ms[ms - alpha >= 1], alpha, 1))
    lanes = _Lanes(
        m=np.concatenate([k[0] for k in kinds]).astype(np.int64),
        arow=np.concatenate([pad + k[0] for k in kinds]).astype(np.int64),
        brow=np.concatenate([pad + k[0] - k[1] for k in kinds]).astype(np.int64),
        lag=np.concatenate([np.full(len(k[0]), k[2]) for k in kinds]).astype(np.int64),
        pad=pad,
        width=width,
    )
    # Candidates per m, in the order that wins ties (the scan's order: a later candidate replaces only a
    # strictly larger cost): hidden at y = 1, internal at y = 1, the hidden lane, the internal lane, and
    # the working step y = t. argmin over them keeps the first minimum.
    cand_v = np.full((5, m_max), INF, dtype=np.int64)
    cand_y = np.ones((5, m_max), dtype=np.int64)
    cand_h = np.array([HIDDEN, INTERNAL, HIDDEN, INTERNAL, INTERNAL], dtype=np.int8)
    lane_slot = 2 + lanes.lag  # hidden lanes have lag 0, internal lanes lag 1
    ar = np.arange(m_max)
    hulls = _Hulls(m_max, t_max)
    hulls.push(0, CT[cols, 0])
    for t in range(1, t_max + 1):
        if t > 1 and use_hidden:
            cand_v[0] = 1 + CT[pad + 1 : pad + m_max + 1, 1] + CT[pad : pad + m_max, t - 1]
        if t > 1 and alpha is not None:
            cand_v[1] = 1 + CT[pad + 1 - beta : pad + m_max + 1 - beta, t - 1]
        if (t - 1) % _BLOCK == 0:
            t0 = t
            mid = _block_middle(flat, width, hulls, lanes, t0, min(t0 + _BLOCK, t_max + 1))
        if t >= 3 and len(lanes.m):
            v, y = _row_lanes(flat, lanes, t, t0, mid[0][t - t0], mid[1][t - t0])
            cand_v[lane_slot, lanes.m - 1], cand_y[lane_slot, lanes.m - 1] = v, y
        cand_v[4], cand_y[4] = t + CT[cols, t - 1], t  # eq. (4) at y = t: all memory for the left t - 1
        k = np.argmin(cand_v, axis=0)
        CT[cols, t], DT[1:, t], HT[1:, t] = np.minimum(cand_v[k, ar], INF), cand_y[k, ar], cand_h[k]
        hulls.push(t, CT[cols, t])
    return CT[pad:, :].T.copy(), DT.T.copy(), HT.T.copy()


def cost_table(t_max: int, m_max: int, alpha: int | None, beta: int | None) -> tuple[np.ndarray, int]:
    """CT[pad + m, t] (memory-major, so that reductions over y run along contiguous rows), with ``pad``
    rows of INF standing for negative memory and C(0, m) = 0."""
    pad = max(alpha or 1, beta or 1)
    CT = np.full((pad + m_max + 1, t_max + 1), INF, dtype=np.int64)
    CT[:, 0] = 0
    return CT, pad


class _Lanes:
    """The lanes of :func:`solve_tables`: CT rows of A and B, lag, and the state carried between rows."""

    def __init__(self, m, arow, brow, lag, pad: int, width: int) -> None:
        self.m, self.arow, self.brow, self.lag = m, arow, brow, lag
        self.a_at, self.b_at = (arow * width - lag)[:, None], (brow * width)[:, None]  # + y, + t - y: flat
        self.acol, self.bcol = arow - pad - 1, brow - pad - 1  # hull columns
        self.y = np.full(len(m), 2, dtype=np.int64)  # the last row's minimiser
        # the lane of the other kind with the same m (-1: none)
        other = {(int(mm), int(g)): i for i, (mm, g) in enumerate(zip(m, lag))}
        self.other = np.array([other.get((int(mm), 1 - int(g)), -1) for mm, g in zip(m, lag)], dtype=np.int64)
        self.ylb = np.full(len(m), 2, dtype=np.int64)  # LB's minimiser, tracked (see _certified)


def _block_middle(flat, width: int, hulls: _Hulls, lanes: _Lanes, t0: int, t1: int):
    """For rows t0 .. t1 - 1 and every lane: min and smallest minimiser of Q over the positions that read
    rows before t0 only, y in [max(2, t - t0 + 1), min(t - 1, t0 - 1 + lag)] (INF where empty). All
    rows and lanes at once: a window around the lane's last minimiser, grown until :func:`_certified`."""
    n_lanes, n_rows = len(lanes.m), t1 - t0
    v_out = np.full((n_rows, n_lanes), INF, dtype=np.int64)
    y_out = np.zeros((n_rows, n_lanes), dtype=np.int64)
    r = np.tile(np.arange(n_rows), n_lanes)  # lane-major: the hull look-ups of one column are adjacent
    ln = np.repeat(np.arange(n_lanes), n_rows)
    t = t0 + r
    dom_lo = np.maximum(2, t - t0 + 1)
    dom_hi = np.minimum(t - 1, t0 - 1 + lanes.lag[ln])
    keep = np.flatnonzero(dom_lo <= dom_hi)
    if not keep.size:
        return v_out, y_out
    r, ln, t, dom_lo, dom_hi = r[keep], ln[keep], t[keep], dom_lo[keep], dom_hi[keep]
    arow, brow, lag = lanes.arow[ln], lanes.brow[ln], lanes.lag[ln]
    acol, bcol = lanes.acol[ln], lanes.bcol[ln]
    w = _WINDOW
    lo = np.minimum(np.maximum(lanes.y[ln] - w // 4, dom_lo), np.maximum(dom_lo, dom_hi - w + 1))
    hi = np.minimum(lo + w - 1, dom_hi)
    v, y = _window_min(flat, width, arow, brow, lag, t, lo, hi, w)
    # The lane matters only with a value <= cap: at most the other kind's window minimum (an achievable
    # cost), strictly below it for internal lanes since ties go to the hidden push.
    v_win = np.full((n_rows, n_lanes + 1), INF, dtype=np.int64)  # column -1: no other lane
    v_win[r, ln] = v
    cap = v_win[r, lanes.other[ln]] - lag
    ylb = _lb_minimiser(hulls, acol, bcol, lag, t, np.clip(lanes.ylb[ln], dom_lo, dom_hi), dom_lo, dom_hi)
    act = np.flatnonzero((lo > dom_lo) | (hi < dom_hi))
    while act.size:
        ok_l, ok_r = _certified(hulls, acol[act], bcol[act], lag[act], t[act], lo[act], hi[act],
                                          v[act], cap[act], ylb[act], dom_lo[act], dom_hi[act])
        w *= 2
        i = act[~ok_l]
        if i.size:  # grow left; a tie there is a smaller minimiser
            nlo = np.maximum(dom_lo[i], lo[i] - w)
            vv, yy = _window_min(flat, width, arow[i], brow[i], lag[i], t[i], nlo, lo[i] - 1, w)
            take = vv <= v[i]
            v[i], y[i], lo[i] = np.where(take, vv, v[i]), np.where(take, yy, y[i]), nlo
        j = act[~ok_r]
        if j.size:  # grow right; only a strictly smaller value replaces
            nhi = np.minimum(dom_hi[j], hi[j] + w)
            vv, yy = _window_min(flat, width, arow[j], brow[j], lag[j], t[j], hi[j] + 1, nhi, w)
            take = vv < v[j]
            v[j], y[j], hi[j] = np.where(take, vv, v[j]), np.where(take, yy, y[j]), nhi
        act = act[~(ok_l & ok_r)]
    v_out[r, ln], y_out[r, ln] = v, y
    lanes.ylb[ln] = ylb  # the last row's wins
    return v_out, y_out


def _row_lanes(flat, lanes: _Lanes, t: int, t0: int, v_mid, y_mid):
    """Every lane's min over y = 2 .. t - 1 and smallest minimiser at row t: the block's middle
    (``v_mid``, ``y_mid``) with the positions next to both ends evaluated exactly, y in [2, t - t0] and
    [max(t0 + lag, t - t0 + 1), t - 1]."""
    e1 = max(0, min(t - t0, t - 1) - 1)  # y = 2 .. e1 + 1
    lo2 = [max(t0 + lag, t - t0 + 1, 2) for lag in (0, 1)]
    e2 = max(0, t - lo2[0])
    if e1 + e2 == 0:
        lanes.y = y_mid
        return v_mid, y_mid
    ys = np.array([np.concatenate([np.arange(2, 2 + e1), np.minimum(np.arange(lo, lo + e2), t - 1)])
                   for lo in lo2])[lanes.lag]
    q = ys + flat[lanes.a_at + ys] + flat[lanes.b_at + (t - ys)]
    key = np.minimum(((q << _YBITS) | ys).min(axis=1), (np.minimum(v_mid, 1 << 40) << _YBITS) | y_mid)
    v, lanes.y = key >> _YBITS, key & ((1 << _YBITS) - 1)
    return v, lanes.y
