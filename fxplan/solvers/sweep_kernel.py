"""The sweep memory model's per-move peak, compiled (numba): the planner's hot loop on large graphs.

:meth:`fxplan.solvers.sweep_model._BoundSweep.pair_costs` hands over many moves L → L' at once; for each, this
follows the backward of ``V' = L' \\ L`` node by node, as :meth:`~fxplan.solvers.sweep_model._BoundSweep.transition`
defines it, in O(range + events) where the range is the node positions [first_out(L), last_in(L')] that
hold V'. The events that can count in V' are the segment events of its members (as members of V, or, for
members of ∂(L'), as ends of L': their gradient exists from the segment's start and a value is kept until
its first saver inside L' is done) and the boundary events of the members of ∂(L) off ∂(L'); the
gradients that exist before the backward starts of members of L that end L' (∂(L') and the model's
outputs) are a constant. Events below the range count everywhere in it, events above it nowhere.

Compiled on first use and cached on disk like :mod:`fxplan.bptt.hull_dp` (numba takes a while to import,
so :mod:`fxplan.solvers.sweep_model` imports this module only when it prices moves).
"""

from __future__ import annotations

import numpy as np
from numba import njit


@njit(cache=True, error_model="numpy", inline="always")
def bit_member(bits: np.ndarray, s: int, v: int) -> bool:
    return (bits[s, v >> 3] >> (v & 7)) & 1 == 1


@njit(cache=True, error_model="numpy")
def segment_peaks(pi, pj, bits, first_out, last_in, bd_ptr, bd_node, seg_ptr, seg_pos, seg_w, ob_ptr, ob_pos,
                  ob_w, sv_ptr, sv_node, M, sx, alloc, sinks_in):
    """max over v ∈ V' of (live bytes + alloc[v]) for every move ``pi[k] → pj[k]`` (family indices), before
    the sweep model's correction for cached values V' does not read. ``seg_*`` / ``ob_*``: the segment and
    boundary events (position, bytes) of every node as a member of V, CSR by node; ``sv_*``: each node's
    savers, increasing; ``sinks_in``: the model outputs' bytes in each set."""
    n = len(M)
    out = np.empty(len(pi))
    delta = np.zeros(n + 1)
    end_of = np.zeros(n, dtype=np.int64)  # == k + 1: the node is on ∂(L') of move k
    for k in range(len(pi)):
        i, j = pi[k], pj[k]
        lo, hi = first_out[i], last_in[j]
        delta[:hi - lo + 1] = 0.0
        below = 0.0  # events before the range: they count at every member of V'
        const = sinks_in[i]
        for t in range(bd_ptr[j], bd_ptr[j + 1]):
            u = bd_node[t]
            end_of[u] = k + 1
            if bit_member(bits, i, u):
                const += M[u]
        for v in range(lo, hi + 1):
            if not bit_member(bits, j, v) or bit_member(bits, i, v):
                continue
            if end_of[v] == k + 1:  # an end of L': kept until its first saver inside L', gradient from the start
                for s in range(sv_ptr[v], sv_ptr[v + 1]):
                    w = sv_node[s]
                    if bit_member(bits, j, w):
                        delta[w - lo] += M[v]
                        break
                delta[v - lo] += sx[v] + M[v]
            else:
                for e in range(seg_ptr[v], seg_ptr[v + 1]):
                    p = seg_pos[e]
                    if p <= hi:
                        delta[p - lo] += seg_w[e]
        for t in range(bd_ptr[i], bd_ptr[i + 1]):
            u = bd_node[t]
            if end_of[u] == k + 1:
                continue
            for e in range(ob_ptr[u], ob_ptr[u + 1]):
                p = ob_pos[e]
                if p < lo:
                    below += ob_w[e]
                elif p <= hi:
                    delta[p - lo] += ob_w[e]
        live, best = below, -np.inf
        for v in range(lo, hi + 1):
            live += delta[v - lo]
            if bit_member(bits, j, v) and not bit_member(bits, i, v):
                best = max(best, live + const + alloc[v])
        out[k] = best
    return out
