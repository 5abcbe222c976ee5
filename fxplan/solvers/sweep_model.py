"""The sweep memory model: one segment's backward followed node by node, in the DP's (F, G, H) form.

The autograd model (:class:`fxplan.solvers.memory_model.AutogradModel`) charges a segment with everything it
saves *plus* its largest per-node gradient transient, as if both happened at once. In a real backward
they do not: the saved values of the nodes already differentiated are gone by the time the large
early-layer gradients are formed. On the zoo that model over-predicts measured peaks by 5-30%, and not
uniformly, so the plan it calls cheapest at a budget is often not the one that measures best.

This model follows autograd's order inside the segment ``V' = L' \\ L``: backward visits the members of
``V'`` in decreasing topological position, and while it processes node ``v`` the live bytes are

* the values saved by members still to be processed: ``u`` stays alive while a member at position
  ``≤ v`` that saves it (a *saver* in ``L'``) is unprocessed, and extra saved bytes ``saved(w)`` while
  ``w`` is;
* the gradients in flight: the gradient of ``u ∈ V'`` exists from the moment its last reader inside
  ``L'`` is processed until ``u`` itself is; for members of ``∂(L')`` (read by later segments) and for
  sinks (the model's outputs) it exists from the start of the segment's backward;
* the gradients ``v``'s backward allocates for its inputs (none for inputs whose gradient is the
  incoming one: an add of equal shapes, a concatenation, a view);

plus, for the whole segment, the gradients of ``∂(L)`` (the cached inputs of later segments and of
this one, produced or being produced for earlier segments), minus the cached values of ``L`` that
``V'`` does not read: the DP's cache ``m`` still counts them, but they are read beyond ``L'`` (those
readers' backward is over, so they are freed) or, as this model assumes, inside their own segment
(which recomputes them) rather than by a segment between theirs and ``V'``. U-Net's skip connections
are the case that needs this. ``F`` is the largest such total over ``v ∈ V'``; ``G`` and ``H`` are the
autograd model's (cache ``M(∂(L') \\ L)``; ``T(V')``, except for the last segment, which is not
recomputed). Every term depends on ``L`` and ``L'`` only, so the DP is unchanged.

:func:`fxplan.planner.replay.replay` follows the whole step the same way (and more: cache values freed once
their last reader is done, the model outputs held by the training loop, parameter gradients); this
model is what a DP can afford. The family engine evaluates it for many pairs of sets at once, each in
time linear in its segment's node range by a compiled sweep (:meth:`_BoundSweep.pair_costs`,
:mod:`fxplan.solvers.sweep_kernel`); the exact DP's search engine (lattices too large for the family engine)
evaluates each move from scratch with :meth:`transition`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from fxplan.solvers.lowersets import GraphIndex, iter_bits
from fxplan.solvers.memory_model import BoundModel, recompute_costs, saved_sets

#: Node kinds whose backward hands an input the incoming gradient itself (``"same"``: when the input has
#: the output's size) or a slice of it (``"slice"``); views share their operand's gradient likewise.
GRADIENT_SHARING = {"add": "same", "iadd": "same", "add_": "same", "clone": "same", "contiguous": "same",
                    "cat": "slice", "concat": "slice", "concatenate": "slice", "flatten": "slice",
                    "view": "slice", "reshape": "slice", "getitem": "slice", "squeeze": "slice",
                    "unsqueeze": "slice", "transpose": "slice", "permute": "slice", "identity": "slice"}


@dataclass(frozen=True)
class SweepModel:
    """The sweep model (module docstring)."""

    name: str = "sweep"

    def bind(self, ix: GraphIndex) -> BoundModel:
        return _BoundSweep(ix)


# Which sets an event's node must belong to for the event to count in segment V' = L' \ L.
_IN_SEGMENT, _IN_L, _ON_BOUNDARY = 0, 1, 2


class _BoundSweep(BoundModel):
    name = "sweep"

    def __init__(self, ix: GraphIndex):
        super().__init__(ix)
        n, M = ix.n, ix.M
        self.so, si, self.sx = saved_sets(ix)
        self.savers = [(1 << u) if self.so >> u & 1 else 0 for u in range(n)]  # nodes whose backward keeps u
        for w in range(n):
            for u in iter_bits(si[w]):
                self.savers[u] |= 1 << w
        # bytes v's backward allocates for its inputs' gradients
        self.alloc = [0] * n
        for v in range(n):
            kind = GRADIENT_SHARING.get(str(ix.cg.nodes[ix.names[v]].get("kind")))
            for p in iter_bits(ix.dpred[v]):
                if not (kind == "slice" or (kind == "same" and M[p] == M[v])):
                    self.alloc[v] += M[p]
        self.sinks = sum(1 << u for u in range(n) if not ix.dsucc[u])
        self._arrays: dict[str, np.ndarray] | None = None  # what the compiled kernel reads (_kernel_arrays)

    def _node_events(self, u: int, Lp: int, ends: int, out: list) -> None:
        """Append the events of member ``u`` of L' to ``out`` (:meth:`_events`; ``ends``: ∂(L') and sinks)."""
        M = self.ix.M
        s = self.savers[u] & Lp
        if s:
            out.append(((s & -s).bit_length() - 1, M[u], u, _IN_SEGMENT))  # kept until its first saver is done
        if self.sx[u]:
            out.append((u, self.sx[u], u, _IN_SEGMENT))
        readers = self.ix.dsucc[u] & Lp
        if ends >> u & 1:
            out.append((u, M[u], u, _IN_SEGMENT))
            out.append((0, M[u], u, _IN_L))
        elif readers:  # the gradient is made when the last reader is done, and lives until u is
            last = readers.bit_length() - 1
            out += [(u, M[u], u, _IN_SEGMENT), (last, -M[u], u, _IN_SEGMENT),
                    (0, M[u], u, _ON_BOUNDARY), (last, -M[u], u, _ON_BOUNDARY)]

    def _events(self, Lp: int) -> list[tuple[int, int, int, int]]:
        """(position, bytes, node u, gate) for target set L': the bytes count at that position and above
        (backward runs from high positions to low) in every segment V' = L' \\ L where u is in V'
        (gate ``_IN_SEGMENT``), in L (``_IN_L``) or in ∂(L) (``_ON_BOUNDARY``)."""
        ends = self.ix.boundary(Lp) | self.sinks  # gradients that exist before the segment's backward starts
        out: list[tuple[int, int, int, int]] = []
        for u in iter_bits(Lp):
            self._node_events(u, Lp, ends, out)
        return out

    def _kernel_arrays(self) -> dict[str, np.ndarray]:
        """Per graph, what :func:`fxplan.solvers.sweep_kernel.segment_peaks` reads: every node's segment and
        boundary events as a member of V (where only the model's outputs end; a member of L' off ∂(L') has
        all its readers and savers in L', so these are its events in L' too), each node's savers, its
        saved and allocated bytes."""
        if self._arrays is None:
            ix = self.ix
            per_node: list[list[tuple[int, int, int, int]]] = [[] for _ in range(ix.n)]
            for u in range(ix.n):
                self._node_events(u, ix.full, self.sinks, per_node[u])
            arrays = {"M": ix.M_np.astype(np.float64), "sx": np.array(self.sx, dtype=np.float64),
                      "alloc": np.array(self.alloc, dtype=np.float64),
                      "sinks": np.array([0 if ix.dsucc[u] else ix.M[u] for u in range(ix.n)], dtype=np.float64)}
            for name, gate in (("seg", _IN_SEGMENT), ("ob", _ON_BOUNDARY)):
                ptr, pos, w = _csr([[(p, w) for p, w, _, g in ev if g == gate] for ev in per_node], 2)
                arrays.update({f"{name}_ptr": ptr, f"{name}_pos": pos, f"{name}_w": w.astype(np.float64)})
            arrays["sv_ptr"], arrays["sv_node"] = _csr([[(w,) for w in iter_bits(s)] for s in self.savers], 1)
            self._arrays = arrays
        return self._arrays

    def _freed(self, L: int, Lp: int) -> int:
        """Cached values of L that V' does not read: taken to be read only beyond L' (whose backward is
        over, so they are gone) or inside their own segment (which recomputes them)."""
        Vp = Lp & ~L
        return sum(1 << u for u in iter_bits(self.ix.boundary(L)) if not self.ix.dsucc[u] & Vp)

    def transition(self, L: int, Lp: int, bd: int | None = None) -> tuple[int, int, float]:
        ix = self.ix
        Vp = Lp & ~L
        gates = {_IN_SEGMENT: Vp, _IN_L: L, _ON_BOUNDARY: ix.boundary(L)}
        delta = [0] * ix.n
        for pos, nbytes, u, gate in self._events(Lp):
            if gates[gate] >> u & 1:
                delta[pos] += nbytes
        live, F = 0, None
        for v in range(ix.n):
            live += delta[v]
            if Vp >> v & 1:
                total = live + self.alloc[v]
                F = total if F is None or total > F else F
        F -= ix.msum(self._freed(L, Lp))
        G = ix.msum(ix.boundary(Lp) & ~L)
        H = 0.0 if Lp == ix.full else ix.tsum(Vp)
        return F, G, H

    def pair_costs(self, fam, pi, pj):
        """Vectorised :meth:`transition`: the peaks by the compiled sweep of :mod:`fxplan.solvers.sweep_kernel`,
        the rest with the family's boundary arrays."""
        from fxplan.solvers.sweep_kernel import segment_peaks  # numba: imported when first needed

        ix, a = self.ix, self._kernel_arrays()
        M = ix.M_np
        key = ("sweep_sinks", id(self))
        if key not in fam.cache:
            fam.cache[key] = (self, fam.sums(a["sinks"]))
        F = segment_peaks(pi.astype(np.int64), pj.astype(np.int64), fam.bits, fam.first_out, fam.last_in,
                          fam.bd_ptr, fam.bd_node, a["seg_ptr"], a["seg_pos"], a["seg_w"], a["ob_ptr"],
                          a["ob_pos"], a["ob_w"], a["sv_ptr"], a["sv_node"], a["M"], a["sx"], a["alloc"],
                          fam.cache[key][1])
        # the values of ∂(L) that V' does not read (:meth:`_freed`), and G, H as the autograd model's
        pair, u, stays, read, _ = fam.boundary_runs(pi, pj)
        P = len(pi)
        MB, TA = fam.boundary_sums(M), fam.sums(ix.T_np)
        F -= MB[pi] - np.bincount(pair, weights=M[u] * read, minlength=P)
        G = MB[pj] - np.bincount(pair, weights=M[u] * stays, minlength=P)
        return F, G, recompute_costs(fam, TA, pi, pj)

    def h_weights(self):
        return self.ix.T_np.copy()

    def lb_weights(self):
        """Σ over V' of what is alive when backward processes the segment's last member v_max (module
        docstring): every ``sx[u]``, and ``M[u]`` for every member u that is saved or is a sink. A member
        u that saves itself is held from v_max on; a reader that saves u is in V' (no reader of u is in
        the lower set L), and then u is held from v_max on, or outside L', and then u ∈ ∂(L') and its
        gradient exists from the segment's start; so does a sink's. The other
        terms at v_max are non-negative: the ∂(L) gradients (+M until their last reader in L'), the cached
        L ∩ ∂(L') (which pay for ``_freed``: a member of ∂(L) that V' does not read is read beyond L'),
        and ``alloc[v_max]``. So the sum is at most F(L, L') for every move.
        """
        ix = self.ix
        add = [float(self.sx[u] + (ix.M[u] if self.savers[u] or not ix.dsucc[u] else 0)) for u in range(ix.n)]
        return add, [0.0] * ix.n


def _csr(lists: list[list[tuple[int, ...]]], width: int) -> tuple[np.ndarray, ...]:
    """CSR offsets over the lists, then one int64 column per field of their entries (tuples of ``width``)."""
    ptr = np.zeros(len(lists) + 1, dtype=np.int64)
    ptr[1:] = np.cumsum([len(x) for x in lists])
    cols = np.array([e for x in lists for e in x], dtype=np.int64).reshape(-1, width)
    return (ptr, *cols.T)
