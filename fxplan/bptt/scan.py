"""The BPTT dynamic program by a scan of every position, in NumPy (Gruslys et al. 2016, 3.1-3.4, Algorithm 1).

:func:`scan_tables` fills the tables C, D, H of the recurrence in :mod:`fxplan.bptt.solvers` row by row: for row
``t`` every memory ``m`` and every position ``y`` at once, as arrays. It does O(t^2 m) work, as the paper's
Algorithm 1 does, but needs no compilation, so on problems up to :data:`SCAN_WORK` positions it answers before
the compiled kernel of :mod:`fxplan.bptt.hull_dp` would have compiled (numba took 16 s the first time on the
project's 2-core CPU). Ties go to the first candidate in the order hidden y = 1, internal y = 1, hidden y = 2 .. t - 1,
internal y = 2 .. t - 1, working step y = t: the kernel's order, so both give the same tables.
"""

from __future__ import annotations

import numpy as np

from fxplan.bptt.policy import HIDDEN, INF, INTERNAL

__all__ = ["SCAN_WORK", "scan_tables", "scan_work"]

#: Problems with at most this many (t, m, y) positions, about t^2 m / 2, are scanned (t = 1000, m = 100 at most;
#: ISM at t = 1000, m = 50, 25 million positions, took 0.2 to 0.5 s on one core of the project's 2-core CPU).
SCAN_WORK = 50_000_000


def scan_work(t_max: int, m_max: int) -> int:
    """How many positions :func:`scan_tables` evaluates for these sizes."""
    return t_max * t_max * m_max // 2


def scan_tables(t_max: int, m_max: int, use_hidden: bool, alpha: int | None, beta: int | None):
    """Tables C, D, H (indexed ``C[t, m]``), as :func:`fxplan.bptt.hull_dp.solve_tables` gives them."""
    C = np.full((t_max + 1, m_max + 1), INF, dtype=np.int64)
    C[0, :] = 0
    D = np.zeros((t_max + 1, m_max + 1), dtype=np.int64)
    H = np.zeros((t_max + 1, m_max + 1), dtype=np.int8)
    m = np.arange(1, m_max + 1)
    for t in range(1, t_max + 1):
        costs, positions, kinds = zip(*_candidates(C, t, m, use_hidden, alpha, beta))
        stacked = np.minimum(np.stack(costs), INF)
        first = np.argmin(stacked, axis=0)  # the first minimum: ties go to the earlier candidate
        cost = stacked[first, np.arange(m_max)]
        feasible = cost < INF  # where none is, the kernel records position 0, an internal kind
        C[t, m] = cost
        at = np.stack([np.broadcast_to(p, m.shape) for p in positions])[first, np.arange(m_max)]
        D[t, m] = np.where(feasible, at, 0)
        H[t, m] = np.where(feasible, np.array(kinds, dtype=np.int8)[first], INTERNAL)
    return C, D, H


def _candidates(C: np.ndarray, t: int, m: np.ndarray, use_hidden: bool, alpha: int | None, beta: int | None):
    """Row ``t``'s candidates in the order that wins ties, each (cost per m, position per m or one, kind)."""
    if t > 1 and use_hidden:  # eq. (1) at y = 1: C(1, m) + C(t - 1, m - 1)
        yield 1 + C[1, m] + _column(C, t - 1, m - 1), 1, HIDDEN
    if t > 1 and alpha is not None:  # eq. (7) at y = 1, costing beta (3.4)
        yield 1 + _column(C, t - 1, m - beta), 1, INTERNAL
    if t > 2:
        y = np.arange(2, t)
        for on, lag, shift, kind in ((use_hidden, 0, 1, HIDDEN), (alpha is not None, 1, alpha, INTERNAL)):
            if on:  # eqs. (1)/(6) and (7)/(10) at y = 2 .. t - 1, every m at once
                q = y[None, :] + C[y - lag][:, m].T + _column(C, t - y, m[:, None] - shift)
                best = np.argmin(q, axis=1)
                yield q[np.arange(len(m)), best], y[best], kind
    yield t + C[t - 1, m], t, INTERNAL  # the working step, y = t


def _column(C: np.ndarray, rows, ms) -> np.ndarray:
    """``C[rows, ms]`` broadcast, INF where ``ms < 1`` (no memory left)."""
    rows, ms = np.broadcast_arrays(rows, ms)
    return np.where(ms >= 1, C[rows, np.maximum(ms, 0)], INF)
