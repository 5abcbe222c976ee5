"""fxplan.bptt solvers and schedules against Gruslys et al. (2016) sections 3.1-3.4 and appendix A."""

from __future__ import annotations

import functools
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fxplan.bptt import HIDDEN, INTERNAL, optimal_cost, simulate, solve
from fxplan.errors import BudgetError, FxplanError

INF = float("inf")


# ---------------------------------------------------------------- brute force, straight from the equations


def brute(policy: str, alpha: int | None = None, beta: int | None = None):
    """Memoised recursion of eqs. (1)-(3) (HSM), (4)-(5) (ISM), (6)-(10) (MSM) with the stated boundaries."""

    @functools.lru_cache(maxsize=None)
    def C(t: int, m: int) -> float:
        if t == 0:
            return 0
        if m <= 0:
            return INF
        if policy == "hsm":
            if m == 1:
                return t * (t + 1) // 2
            if m >= t:
                return 2 * t - 1
            return min(y + C(t - y, m - 1) + C(y, m) for y in range(1, t))
        if policy == "ism":
            if m >= t:
                return t
            return min(y + C(y - 1, m) + C(t - y, m - 1) for y in range(1, t + 1))
        # MSM: m = 1 is the minimal-memory boundary; memory never below zero; C(0, .) = 0.
        if m == 1:
            return t * (t + 1) // 2
        q1 = [y + C(y, m) + C(t - y, m - 1) for y in range(1, t)]
        q2 = [y + C(y - 1, m) + C(t - y, m - (beta if y == 1 else alpha)) for y in range(1, t)]
        q2.append(t + C(t - 1, m))  # y = t: the pushed internal state is the one being back-propagated
        return min(q1 + q2)

    return C


# ---------------------------------------------------------------- headline numbers


def test_headline_ism_1000_steps_50_slots():
    # Section 3.2: 95% less memory (50 of 1000 internal states) for 33% more time, a backward = 2 forwards.
    cost = optimal_cost("ism", 1000, 50)
    assert cost == 1950
    assert 1 - 50 / 1000 == pytest.approx(0.95)
    assert (cost + 2 * 1000) / (1000 + 2 * 1000) == pytest.approx(4 / 3, abs=0.02)


def test_figure_3_examples():
    # Figure 3: m = 4 hidden states, t = 4 costs 2t - 1 = 7; t = 10 costs less than 3 per step.
    assert optimal_cost("hsm", 4, 4) == 7
    assert optimal_cost("hsm", 10, 4) < 30
    p = solve("hsm", 4, 4)
    assert (p.H[4, 4], p.D[4, 4]) == (HIDDEN, 1)


# ---------------------------------------------------------------- boundary conditions


@pytest.mark.parametrize("policy", ["hsm", "ism", "msm"])
def test_boundary_conditions(policy):
    T, M, alpha = 40, 30, 3
    kw = {"alpha": alpha} if policy == "msm" else {}
    p = solve(policy, T, M, **kw)
    for t in range(1, T + 1):
        assert p.C[t, 1] == t * (t + 1) // 2
        assert p.C[0, 1] == 0
        for m in range(1, M + 1):
            assert p.C[0, m] == 0
            if policy == "hsm" and m >= t:
                assert p.C[t, m] == 2 * t - 1
                if t >= 2:
                    assert p.D[t, m] == 1  # Algorithm 1, line 7
            if policy == "ism" and m >= t:
                assert p.C[t, m] == t
            if policy == "msm" and m >= alpha * t:
                assert p.C[t, m] == t
            assert 1 <= p.D[t, m] <= t
            if p.H[t, m] == HIDDEN:
                assert p.D[t, m] < t  # a hidden push at y = t is meaningless (eq. (3) vs (5))
    if policy == "ism":
        assert (p.H[1:, 1:] == INTERNAL).all()


def test_beta_boundary():
    p = solve("msm", 30, 100, alpha=4, beta=3)
    for t in range(1, 31):
        assert p.C[t, 1] == t * (t + 1) // 2
        # 3.4: a chain of internal states needs beta per state after the first hidden one.
        assert p.C[t, min(100, 1 + 3 * (t - 1))] == t


# ---------------------------------------------------------------- optimality against brute force


@pytest.mark.parametrize(
    "policy,alpha,beta",
    [("hsm", None, None), ("ism", None, None), ("msm", 2, 2), ("msm", 3, 3), ("msm", 3, 2), ("msm", 5, 4)],
)
def test_matches_brute_force(policy, alpha, beta):
    T, M = 24, 14
    p = solve(policy, T, M, alpha=alpha, beta=beta)
    C = brute(policy, alpha, beta)
    got = p.C[: T + 1, : M + 1]
    want = np.array([[C(t, m) if m else (0 if t == 0 else INF) for m in range(M + 1)] for t in range(T + 1)])
    finite = np.isfinite(want)
    assert (finite[:, 1:]).all()
    np.testing.assert_array_equal(got[:, 1:], want[:, 1:].astype(np.int64))
    for t in (1, 7, 24):
        for m in (1, 3, 14):
            assert optimal_cost(policy, t, m, alpha=alpha, beta=beta) == C(t, m)
    # the plain scan, the reference of test_solver_gives_the_plain_scans_tables, agrees with the recursion
    use_hidden, a, b = {"hsm": (True, None, None), "ism": (False, 1, 1)}.get(policy, (True, alpha, beta or alpha))
    np.testing.assert_array_equal(plain_scan(T, M, use_hidden, a, b)[0][:, 1:], want[:, 1:].astype(np.int64))


def plain_scan(T: int, M: int, use_hidden: bool, alpha: int | None, beta: int | None):
    """C, D, H by scanning every position of eqs. (1), (4), (6)-(10) with no bound, vectorised over m and y.

    Ties go to the first candidate in the order hidden y = 1, internal y = 1, hidden y = 2 .. t - 1,
    internal y = 2 .. t - 1, working step y = t (the paper's Algorithm 1 keeps the first minimum).
    """
    big = 1 << 60
    C = np.full((T + 1, M + 1), big, dtype=np.int64)  # C[t, m], m = 0 infeasible
    C[0, :] = 0
    D = np.zeros((T + 1, M + 1), dtype=np.int64)
    H = np.zeros((T + 1, M + 1), dtype=np.int8)
    m = np.arange(1, M + 1)
    for t in range(1, T + 1):
        vals, ys, kinds = [], [], []
        y = np.arange(2, t)  # positions 2 .. t - 1
        if use_hidden and t > 1:
            vals.append(1 + C[1, m] + np.where(m - 1 >= 1, C[t - 1, np.maximum(m - 1, 0)], big))
            ys.append(np.ones(M, dtype=np.int64)), kinds.append(HIDDEN)
        if alpha is not None and t > 1:
            vals.append(1 + np.where(m - beta >= 1, C[t - 1, np.maximum(m - beta, 0)], big))
            ys.append(np.ones(M, dtype=np.int64)), kinds.append(INTERNAL)
        for kind, shift, lag, on in ((HIDDEN, 1, 0, use_hidden), (INTERNAL, alpha, 1, alpha is not None)):
            if on and len(y):
                mb = m[:, None] - shift
                q = y + C[y - lag][:, m].T + np.where(mb >= 1, C[t - y][:, np.maximum(m - shift, 0)].T, big)
                j = np.argmin(q, axis=1)
                vals.append(q[np.arange(M), j]), ys.append(y[j]), kinds.append(kind)
        vals.append(t + C[t - 1, m]), ys.append(np.full(M, t)), kinds.append(INTERNAL)
        k = np.argmin(np.array(vals), axis=0)
        C[t, m] = np.minimum(np.array(vals)[k, np.arange(M)], big)
        D[t, m] = np.array(ys)[k, np.arange(M)]
        H[t, m] = np.array(kinds)[k]
    return C, D, H


def _cases():
    """(T, M, use_hidden, alpha, beta): HSM, ISM and MSM, including beta < alpha and alpha = 1."""
    fixed = [(260, 60, True, None, None), (200, 45, False, 1, 1), (300, 70, True, 5, 4), (257, 90, True, 3, 2),
             (150, 150, True, 2, 1), (240, 30, True, 7, 7), (120, 200, True, 1, 1), (33, 17, True, 5, 4),
             (3, 5, True, 2, 2), (18, 1, True, 3, 3), (1, 4, True, 2, 1), (2, 3, False, 1, 1), (400, 12, True, 9, 3)]
    rng = np.random.default_rng(2016)
    rand = []
    for i in range(40):
        if i % 8 == 0:  # HSM
            rand.append((int(rng.integers(3, 320)), int(rng.integers(1, 130)), True, None, None))
        elif i % 8 == 1:  # ISM
            rand.append((int(rng.integers(3, 320)), int(rng.integers(1, 130)), False, 1, 1))
        else:
            alpha = int(rng.integers(1, 12))
            beta = int(rng.integers(1, alpha + 1))
            rand.append((int(rng.integers(3, 320)), int(rng.integers(1, 130)), True, alpha, beta))
    return fixed + rand


def _engines():
    from fxplan.bptt.hull_dp import solve_tables
    from fxplan.bptt.scan import scan_tables

    return {"hull": solve_tables, "scan": scan_tables}


@pytest.mark.parametrize("engine", ["hull", "scan"])
@pytest.mark.parametrize("case", _cases(), ids=lambda c: "T{}-M{}-{}-{}-{}".format(*c))
def test_solver_gives_the_plain_scans_tables(case, engine):
    """The compiled hull-certified kernel and the NumPy scan give the plain scan's C, D and H, ties included, also
    where the columns are not convex (MSM)."""
    for name, a, b in zip("CDH", _engines()[engine](*case), plain_scan(*case)):  # m = 0 included: infeasible
        np.testing.assert_array_equal(a, b, err_msg=name)


@settings(max_examples=150, deadline=None)
@given(t=st.integers(1, 70), m=st.integers(1, 50), kind=st.sampled_from(["hsm", "ism", "msm"]),
       alpha=st.integers(1, 10), beta_frac=st.floats(0, 1))
def test_solver_gives_the_plain_scans_tables_random(t, m, kind, alpha, beta_frac):
    case = {"hsm": (t, m, True, None, None), "ism": (t, m, False, 1, 1)}.get(
        kind, (t, m, True, alpha, 1 + round(beta_frac * (alpha - 1))))
    want = plain_scan(*case)
    for engine in _engines().values():
        for name, a, b in zip("CDH", engine(*case), want):
            np.testing.assert_array_equal(a, b, err_msg=name)


def test_msm_columns_are_not_convex():
    """Why MSM needs more than appendix A's convexity walk: its columns have negative second differences
    (so the hull bound, not convexity, is what makes the solver exact there)."""
    C = solve("msm", 1000, 100, alpha=5, beta=4).C.astype(np.int64)
    second = C[2:, 1:] - 2 * C[1:-1, 1:] + C[:-2, 1:]
    assert ((second < 0).any(axis=0)).sum() >= 90
    hsm = solve("hsm", 400, 40).C.astype(np.int64)
    assert (hsm[2:, 1:] - 2 * hsm[1:-1, 1:] + hsm[:-2, 1:] >= 0).all()


def test_large_msm_matches_scan():
    """Long sequences, where most positions are proven away rather than evaluated, and many positions tie."""
    from fxplan.bptt.solvers import _solve_dp

    for a, b in zip(_solve_dp(1500, 60, True, 5, 4), plain_scan(1500, 60, True, 5, 4)):
        np.testing.assert_array_equal(a, b)


def test_solver_limit_error():
    from fxplan.bptt.hull_dp import T_LIMIT, solve_tables

    with pytest.raises(FxplanError, match="chunks"):
        solve_tables(T_LIMIT + 1, 3, True, 2, 2)


def test_upper_bound_appendix_b():
    # Proposition 1: C(t, m) <= m t^(1 + 1/m) for BPTT-HSM.
    p = solve("hsm", 300, 12)
    for t in range(1, 301):
        for m in range(1, 13):
            assert p.C[t, m] <= m * t ** (1 + 1 / m) + 1e-9


# ---------------------------------------------------------------- comparisons between the policies


def test_msm_never_worse_than_hsm_or_ism():
    T, alpha = 400, 5
    hsm = solve("hsm", T, 60)
    ism = solve("ism", T, 12)
    msm = solve("msm", T, 60, alpha=alpha)
    msm_b = solve("msm", T, 60, alpha=alpha, beta=alpha - 1)
    t = np.arange(1, T + 1)
    # Equal memory in hidden-state units (Figure 6): m hidden states, or m / alpha internal states.
    assert (msm.C[1:, 1:] <= hsm.C[1:, 1:]).all()
    for k in range(1, 13):
        assert (msm.C[t, alpha * k] <= ism.C[t, k]).all()
        # The same with the executor's byte model: ISM's k internal states and h0 equal MSM's
        # (k - 1) * alpha + 1 units plus the working step.
        assert (msm.C[t, (k - 1) * alpha + 1] <= ism.C[t, k]).all()
    assert (msm_b.C <= msm.C).all()  # 3.4 only removes duplicated hidden states
    # For long sequences hidden states win, for short ones internal states win (section 3.6).
    assert hsm.C[400, 50] < ism.C[400, 10]
    assert ism.C[100, 10] < hsm.C[100, 50]


def test_cost_monotone_in_memory_and_length():
    for pol, kw in (("hsm", {}), ("ism", {}), ("msm", {"alpha": 3, "beta": 2})):
        p = solve(pol, 80, 40, **kw)
        C = p.C[1:, 1:]
        assert (np.diff(C, axis=1) <= 0).all()
        assert (np.diff(C, axis=0) > 0).all()


def test_chen_baselines_and_optimality():
    # Section 4.1: Chen's schedules are policies of the same recurrences, so MSM is at least as good.
    alpha, beta = 6, 5
    for t in (10, 64, 100, 250):
        sq = solve("chen_sqrt", t, alpha=alpha, beta=beta)
        k = math.ceil(math.sqrt(t))
        last = t - k * ((t - 1) // k)
        assert sq.cost() == 2 * t - last  # one forward pass to the last segment, then every step once
        assert optimal_cost("msm", t, sq.m, alpha=alpha, beta=beta) <= sq.cost()
        rec = solve("chen_recursive", t)
        assert rec.m <= math.ceil(math.log2(t)) + 1
        assert optimal_cost("hsm", t, rec.m) <= rec.cost()
    with pytest.raises(BudgetError, match="needs"):
        solve("chen_sqrt", 100, 3, alpha=2)


# ---------------------------------------------------------------- schedules


@pytest.mark.parametrize("policy,kw", [("hsm", {}), ("ism", {}), ("msm", {"alpha": 3}),
                                        ("msm", {"alpha": 4, "beta": 3})])
def test_schedule_cost_and_memory(policy, kw):
    p = solve(policy, 30, 12, **kw)
    for t in range(1, 31):
        for m in range(1, 13):
            s = simulate(p, t, m)
            assert s.forward_ops == p.C[t, m]
            assert s.peak_units <= m


def test_schedule_large_is_fast_enough_and_valid():
    p = solve("msm", 1000, 100, alpha=5, beta=4)
    s = simulate(p, 1000, 100)
    assert s.forward_ops == p.C[1000, 100] and s.peak_units <= 100


# ---------------------------------------------------------------- errors


def test_bad_arguments():
    with pytest.raises(FxplanError, match="unknown BPTT policy"):
        solve("revolve", 10, 3)
    with pytest.raises(FxplanError, match="positive integer"):
        optimal_cost("hsm", 10, 0)
    with pytest.raises(FxplanError, match="positive integer"):
        optimal_cost("hsm", 0, 3)
    with pytest.raises(FxplanError, match="needs alpha"):
        optimal_cost("msm", 10, 3)
    with pytest.raises(FxplanError, match="beta"):
        optimal_cost("msm", 10, 3, alpha=2, beta=3)


def test_a_problem_of_the_usual_size_is_solved_without_compiling():
    """The paper's headline problem is scanned in NumPy: numba, which compiles the hull kernel on a machine's first
    use (seconds), is not even loaded."""
    import subprocess
    import sys

    code = ("import sys, fxplan.bptt as b; print(b.optimal_cost('ism', 1000, 50)); "
            "print('numba' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == [str(optimal_cost("ism", 1000, 50)), "False"]
