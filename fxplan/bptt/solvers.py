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

Small problems are scanned position by position in NumPy (:mod:`fxplan.bptt.scan`, no compiling) until a
process has the compiled kernel; larger ones, and every one after, are filled by that kernel
(:mod:`fxplan.bptt.hull_dp`, numba), which evaluates only the positions ``2 <= y < t`` that the lower convex
hulls of the columns ``C(., m)`` cannot rule out: appendix A's convexity speed-up made exact for MSM, whose
columns are not convex. Both give the tables of a scan of every position, ties included (the first minimum in
the order hidden y = 1, internal y = 1, hidden y = 2 .. t - 1, internal y = 2 .. t - 1, y = t;
``tests/test_bptt_solvers.py``).
"""

from __future__ import annotations

import functools
import math
import sys

import numpy as np

from fxplan.bptt.policy import HIDDEN, INF, INTERNAL, POLICIES, Policy
from fxplan.bptt.scan import SCAN_WORK, scan_tables, scan_work
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


def _solve_dp(t_max: int, m_max: int, use_hidden: bool, alpha: int | None, beta: int | None):
    """Tables C, D, H (as ``C[t, m]``) of the recurrence in the module docstring, by the compiled kernel of
    :mod:`fxplan.bptt.hull_dp` once this process has it, and until then, up to ``SCAN_WORK`` positions, by the
    NumPy scan of :mod:`fxplan.bptt.scan`: loading numba and the kernel costs a process more than such a scan
    (0.7 s and 0.5 s where numba's disk cache has the kernel), and compiling it, on a machine's first use,
    seconds. Both give the same tables."""
    if scan_work(t_max, m_max) <= SCAN_WORK and not _kernel_loaded():
        return scan_tables(t_max, m_max, use_hidden, alpha, beta)
    from fxplan.bptt.hull_dp import solve_tables

    return solve_tables(t_max, m_max, use_hidden, alpha, beta)


def _kernel_loaded() -> bool:
    """Whether this process has compiled or loaded the hull kernel already."""
    hull_dp = sys.modules.get("fxplan.bptt.hull_dp")
    return hull_dp is not None and bool(hull_dp.kernel_signatures())


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
