"""The DPs of the autograd memory model over a whole family that keep one state per set, compiled (numba).

Under a model that recomputes every segment whole but the last (``H(L, L') = T(L' \\ L)``, 0 into V; the
autograd and sweep models), a plan ∅ ⊊ L_1 ⊊ … ⊊ L_{k-1} ⊊ V has overhead T(L_{k-1}): the sum telescopes.
So every state the DP of Kusumoto et al. (Algorithm 1, section 4.2) holds at a set L has the same
objective a = T(L), and the state of least cache m dominates the others (any move that fits after one
fits after it, and caches no more). The DP reduces to one number per set,

    m*(∅) = 0,  m*(L') = min { m*(L) + G(L, L') : L ⊊ L' in the family, m*(L) + F(L, L') ≤ B },

and the plan is the last set L of least (T(L), m*(L) + G(L, V)) with m*(L) + F(L, V) ≤ B: the same optimum
as :func:`fxplan.solvers.family_dp._family_dp` (ties between plans of equal overhead and final cache aside).

What made that DP slow on large graphs at a middle budget is listing and pricing its moves: every set
reaches thousands of others (10,000 nodes at 30% of the single-segment peak: 8 s, 1.9 GB of move arrays).
Here each move is priced where it is examined, in O(|edges leaving L| + |maximal members of L|) plus a
range maximum, as :meth:`fxplan.solvers.memory_model._BoundAutograd.pair_costs` prices it, and nothing is stored
per move. A source L is examined for L' only if its additive lower bound fits (``lb_weights``, the window
:meth:`fxplan.solvers.family.Family.moves` lists), it was reached, and it is a subset of L'.

The same single-label DP decides whether any plan fits B (the least cache dominates for that too), which
gives the smallest budget (:func:`least_peak_chain`), and with T(L_{k-1}) maximised instead, the
memory-centric plan of section 4.4 (:func:`most_overhead_chain`).
"""

from __future__ import annotations

import time

import numpy as np
from numba import njit

from fxplan.errors import FxplanError
from fxplan.solvers.family import Family
from fxplan.solvers.sweep_kernel import bit_member

CHUNK = 4096
"""Sets planned per compiled call; the time limit is checked between calls."""

LAST_SETS_TRIED = 32
"""Candidate last sets :func:`most_overhead_chain` tries before it plans every set."""


@njit(cache=True, error_model="numpy", inline="always")
def _move(i, j, bits, size, first_out, last_in, oe_ptr, oe_u, oe_w, oe_saver, into, out_of, M, table, log2,
          bytes_max, out_grad, in_grad, transient):
    """(F, bytes of ∂(L_i) still on ∂(L_j)) of the move L_i → L_j (a strict superset), as ``pair_costs``."""
    n = len(M)
    # the edges leaving L_i, grouped by boundary member u: u stays on ∂(L_j), is read by V', is saved by V'
    kept, rest, t, end = 0.0, 0.0, oe_ptr[i], oe_ptr[i + 1]
    while t < end:
        u = oe_u[t]
        stays, read, saved = False, False, False
        while t < end and oe_u[t] == u:
            if bit_member(bits, j, oe_w[t]):
                read = True
                saved = saved or oe_saver[t]
            else:
                stays = True
            t += 1
        if stays:
            kept += M[u]
        rest += M[u] * ((in_grad if read else 0.0) - (1.0 if saved else 0.0))
    lo, hi = first_out[i], last_in[j]
    if size[j] - size[i] == hi - lo + 1:  # V' fills its node range: a sparse-table maximum
        k = log2[hi - lo + 1]
        trans = max(table[k * n + lo], table[k * n + hi - (1 << k) + 1])
    else:
        trans = -np.inf
        for b in range(lo >> 3, (hi >> 3) + 1):
            trans = max(trans, bytes_max[b, bits[j, b] & ~bits[i, b]])
    return into[j] - out_of[i] - out_grad * kept + rest + transient * trans, kept


@njit(cache=True, error_model="numpy")
def _time_dp(budget, eps, tol, W, by_w, rank_w, size, bits, first_out, last_in, mx_ptr, mx_node, oe_ptr, oe_u, oe_w,
             oe_saver, into, out_of, MB, TA, M, table, log2, bytes_max, out_grad, in_grad, transient, last_free,
             maximise, target, inside, j_lo, j_hi, m, par, bound, reached, reached_in_block):
    """Parents of the least-cache plans (module docstring), -1 where a set is unreachable; the last set's
    parent is the plan's last recomputed set. ``by_w``: the sets sorted by ``W``, ``rank_w`` each set's place
    there; ``target``: the last set (V, or a set the plan must pass through), only sets with ``inside`` set
    (its subsets) are planned; ``last_free``: the move into it is not recomputed. Sources are scanned ∅ first, then
    by ``W``; the first of least (overhead, cache) is kept, or with ``maximise`` (the memory-centric plan) of
    greatest overhead, then least cache. A set that ∅ reaches in one move caches M(∂(L)), the least any plan
    can, so no other source is scanned for it; nor, when minimising, for the last set once ∅ reaches it (no
    overhead at all). When minimising, sets of more overhead than one known to end a plan (``bound[0]``) are
    skipped: overheads grow along a plan. ``reached`` (by rank) marks the sets reached so far and
    ``reached_in_block`` counts them per 64 ranks, so that a scan skips unreached sources 64 at a time (near
    the smallest budget few sets are reachable). Fills ``m`` (least cache) and ``par`` for the sets ``j_lo``
    .. ``j_hi`` - 1, so that a caller can stop between calls."""
    w_sorted = W[by_w]
    for j in range(j_lo, min(j_hi, target + 1)):
        if not inside[j]:
            continue
        last = last_free and j == target
        if not last and TA[j] > bound[0] + eps:
            continue
        best_a, best_m, best_i = np.inf, np.inf, -1
        F, kept = _move(0, j, bits, size, first_out, last_in, oe_ptr, oe_u, oe_w, oe_saver, into, out_of, M,
                        table, log2, bytes_max, out_grad, in_grad, transient)
        if F <= budget + eps:
            best_a, best_m, best_i = (0.0 if last else TA[j]), MB[j], 0
        if best_i < 0 or (last and maximise):
            lo_q = np.searchsorted(w_sorted, W[j] - budget - tol)
            hi_q = np.searchsorted(w_sorted, W[j] + tol, side="right")
            for blk in range(lo_q >> 6, ((hi_q - 1) >> 6) + 1):
                if reached_in_block[blk] == 0:
                    continue
                for q in range(max(lo_q, blk << 6), min(hi_q, (blk + 1) << 6)):
                    if not reached[q]:
                        continue
                    i = by_w[q]
                    if size[i] >= size[j] or m[i] + (W[j] - W[i]) > budget + eps + tol:
                        continue
                    a = (-TA[i] if maximise else TA[i]) if last else TA[j]
                    # what this move can cache at least (∂(L_i) staying on ∂(L_j) is at most M(∂(L_i)))
                    if a > best_a + eps or (a >= best_a - eps and m[i] - MB[i] + MB[j] >= best_m - eps):
                        continue
                    subset = True
                    for t in range(mx_ptr[i], mx_ptr[i + 1]):
                        if not bit_member(bits, j, mx_node[t]):
                            subset = False
                            break
                    if not subset:
                        continue
                    F, kept = _move(i, j, bits, size, first_out, last_in, oe_ptr, oe_u, oe_w, oe_saver, into,
                                    out_of, M, table, log2, bytes_max, out_grad, in_grad, transient)
                    if m[i] + F > budget + eps:
                        continue
                    cache = m[i] + MB[j] - kept
                    if a < best_a - eps or cache < best_m - eps:
                        best_a, best_m, best_i = a, cache, i
        if best_i >= 0:
            m[j], par[j] = best_m, best_i
            rank = rank_w[j]
            reached[rank] = True
            reached_in_block[rank >> 6] += 1
            if last_free and not last and not maximise and TA[j] < bound[0]:
                F, _ = _move(j, target, bits, size, first_out, last_in, oe_ptr, oe_u, oe_w, oe_saver, into, out_of,
                             M, table, log2, bytes_max, out_grad, in_grad, transient)
                if best_m + F <= budget + eps:
                    bound[0] = TA[j]


class _Arrays:
    """The family's and the autograd model's arrays the kernel takes, from what the planning context and the
    family keep (the lower-bound sums moves are listed by, range-maximum tables, saver flags)."""

    def __init__(self, ctx, fam: Family):
        bm = ctx.bm
        ix, cfg = bm.ix, bm.cfg
        terms = bm.time_terms(fam)
        self.W = ctx.lb_sums(fam)
        self.tol = 1e-9 * (float(np.abs(self.W).max()) + 1.0)
        oe_ptr, oe_u, oe_w, _ = fam.leaving_edges()
        table, log2, bytes_max = fam.range_max_tables(terms["tau"])
        by_w = np.argsort(self.W, kind="stable")
        rank_w = np.empty_like(by_w)
        rank_w[by_w] = np.arange(len(by_w))
        saver = fam.leaving_edges_saved(*terms["savers"])
        self.family = (self.W, by_w, rank_w, fam.size, fam.bits, fam.first_out, fam.last_in,
                       fam.mx_ptr, fam.mx_node, oe_ptr, oe_u, oe_w, saver, terms["into"], terms["out_of"], terms["MB"])
        self.move_args = (fam.bits, fam.size, fam.first_out, fam.last_in, oe_ptr, oe_u, oe_w, saver, terms["into"],
                          terms["out_of"])  # what _move takes after (i, j), before the model's arrays
        self.MB = terms["MB"]
        self.TA = terms["TA"]
        self.model = (ix.M_np.astype(np.float64), table, log2, bytes_max, float(cfg.out_grad), float(cfg.in_grad),
                      float(cfg.transient))
        self.last_free = fam.sets[-1] == ix.full


def _arrays(ctx, fam: Family) -> _Arrays:
    if "time_kernel" not in fam.cache:
        fam.cache["time_kernel"] = _Arrays(ctx, fam)
    return fam.cache["time_kernel"]


@njit(cache=True, error_model="numpy")
def _moves_into(target, bits, size, first_out, last_in, oe_ptr, oe_u, oe_w, oe_saver, into, out_of, M, table, log2,
                bytes_max, out_grad, in_grad, transient):
    """F of every set's move to ``target`` (a superset of them all: V)."""
    F = np.empty(target)
    for i in range(target):
        F[i] = _move(i, target, bits, size, first_out, last_in, oe_ptr, oe_u, oe_w, oe_saver, into, out_of, M, table,
                     log2, bytes_max, out_grad, in_grad, transient)[0]
    return F


def _plan(ctx, fam: Family, budget: float, eps: float, time_limit: float | None, maximise: bool = False,
          target: int | None = None, started: float | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(least cache, parent) of every set, of plans ending at ``target`` (default: the last set). The time
    limit counts from ``started`` (default: now)."""
    t0 = time.perf_counter() if started is None else started
    a = _arrays(ctx, fam)
    target = fam.S - 1 if target is None else target
    inside = ~(fam.bits & ~fam.bits[target]).any(axis=1)
    m = np.full(fam.S, np.inf)
    m[0] = 0.0
    par = np.full(fam.S, -1, dtype=np.int64)
    bound = np.full(1, np.inf)  # the least T(L) of a set L reached so far whose move to the target fits
    reached = np.zeros(fam.S, dtype=np.bool_)
    reached_in_block = np.zeros((fam.S >> 6) + 1, dtype=np.int64)
    for j_lo in range(1, target + 1, CHUNK):
        if time_limit is not None and time.perf_counter() - t0 > time_limit:
            raise FxplanError(f"exact DP stopped after {time_limit:.0f} s ({j_lo:,} of {fam.S:,} lower sets done); "
                              "use the approximate DP (exact=False) or a larger time_limit")
        _time_dp(float(budget), eps, a.tol, *a.family, a.TA, *a.model, a.last_free, maximise, target, inside, j_lo,
                 j_lo + CHUNK, m, par, bound, reached, reached_in_block)
    return m, par


def _chain_to(par: np.ndarray, k: int) -> list[int]:
    chain = [k]
    while par[k] > 0:
        k = int(par[k])
        chain.append(k)
    return chain[::-1]


def least_overhead_chain(ctx, fam: Family, budget: float, eps: float, time_limit: float | None = None,
                         maximise: bool = False, started: float | None = None) -> list[int] | None:
    """The time-centric plan of least overhead within ``budget`` over ``fam`` under the planning context
    ``ctx``'s autograd model (family indices of L_1..L_k, V last), or None if no plan fits; with ``maximise``,
    the plan of greatest overhead within it (the memory-centric plan, section 4.4), of least cache at the end.
    Stops with an :class:`FxplanError` ``time_limit`` seconds after ``started`` (default: now; None: never)."""
    par = _plan(ctx, fam, budget, eps, time_limit, maximise, started=started)[1]
    return None if par[-1] < 0 else _chain_to(par, fam.S - 1)


def most_overhead_chain(ctx, fam: Family, budget: float, eps: float, time_limit: float | None = None
                        ) -> list[int] | None:
    """The memory-centric plan (section 4.4): the greatest overhead within ``budget`` (the smallest budget), as
    :func:`least_overhead_chain` with ``maximise``, usually without planning every set.

    Its overhead is T(L) of its last recomputed set L, and a set can be that set only if its boundary and the
    last move fit: M(∂(L)) + F(L, V) ≤ budget. Those sets are tried by decreasing T(L), each through the
    least-overhead plan to it (the kernel with that set as its target, as fast as a time-centric solve): a
    set no plan reaches cannot end one and is passed over; the first whose plan leaves room at L for the last
    move is optimal. Where a set is reached but that plan leaves no room (or after ``LAST_SETS_TRIED`` sets),
    the answer is undecided and all sets are planned, which at the smallest budget takes minutes on
    GoogLeNet's lattice (and then the plan has the least cache at the end among those of greatest overhead;
    the first route need not)."""
    t0 = time.perf_counter()
    a = _arrays(ctx, fam)
    V = fam.S - 1
    to_v = _moves_into(V, *a.move_args, *a.model)
    possible = np.flatnonzero(a.MB[:V] + to_v <= budget + eps)
    for last in possible[np.argsort(-a.TA[possible], kind="stable")][:LAST_SETS_TRIED].tolist():
        if last == 0:  # no recomputation at all: the only plan left
            return [V]
        m, par = _plan(ctx, fam, budget, eps, time_limit, target=last, started=t0)
        if par[last] < 0:  # no plan reaches it: it cannot end one
            continue
        if m[last] + to_v[last] <= budget + eps:
            return _chain_to(par, last) + [V]
        break  # reached, but not with room for the last move: undecided
    return least_overhead_chain(ctx, fam, budget, eps, time_limit, maximise=True, started=t0)


def least_peak_chain(ctx, fam: Family, start: list[int], eps: float, time_limit: float | None = None
                     ) -> list[int]:
    """The plan of least peak over ``fam`` (the smallest budget, ψ(∅)), from a known plan ``start`` (family
    indices, e.g. the approximate DP's smallest-budget plan, which is often already the least).

    No plan exists within a budget B exactly when the kernel at B finds none, and any plan it finds peaks at
    most B, so the least peak (in whole bytes, as the family engine reports it) is found by testing B one
    byte under the best peak so far: first at growing distances below it, then, once a budget is known to
    fail, by bisection. Each test near the smallest budget is fast: few sets are reachable there."""
    t0 = time.perf_counter()

    def whole_bytes(chain: list[int]) -> int:
        return int(np.ceil(ctx.chain_costs(fam, chain)[0] - eps))

    best, high = start, whole_bytes(start)
    low, gap = -1, 1  # every budget up to ``low`` is known to fail
    while low + 1 < high:
        test = high - gap if low < 0 else (low + high) // 2
        test = max(test, low + 1)
        found = least_overhead_chain(ctx, fam, test, eps, time_limit, started=t0)
        if found is None:
            low = test
        else:  # the kernel's plan fits ``test`` (min: should the float sums round up a byte)
            best, high = found, min(whole_bytes(found), test)
            gap *= 2
    return best
