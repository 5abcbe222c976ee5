"""The sweep memory model: one segment's backward followed node by node, in the DP's (F, G, H) form.

The autograd model (:class:`fxplan.memory_model.AutogradModel`) charges a segment with everything it
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

:func:`fxplan.replay.replay` follows the whole step the same way (and more: cache values freed once
their last reader is done, the model outputs held by the training loop, parameter gradients); this
model is what a DP can afford. The family engine evaluates it for many pairs of sets at once, one
cumulative sum per block of source sets of a target set (:meth:`_BoundSweep.pair_costs`); the exact DP's search engine
(lattices too large for the family engine) evaluates each move from scratch with :meth:`transition`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from fxplan.family import expand
from fxplan.lowersets import GraphIndex, iter_bits
from fxplan.memory_model import BoundModel, recompute_costs, saved_sets

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


#: Events (4 numbers each) of targets' boundary members the sweep model keeps per bound graph (~160 MB at most).
EVENTS_HELD = 5_000_000

#: Sources of one target priced together by the sweep model's ``pair_costs``.
SOURCE_BLOCK = 64

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
        self._sink_nodes = np.array([u for u in range(n) if not ix.dsucc[u]], dtype=np.int64)
        self._held_events: dict[int, tuple[np.ndarray, ...]] = {}
        self._held_count = 0
        self._interior: tuple[np.ndarray, ...] | None = None  # events of every node as a member of V

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

    def _interior_events(self) -> tuple[np.ndarray, ...]:
        """The events of every node as a member of V (where only the model's outputs end), grouped by
        node: (ptr, position, bytes, node, gate), ``ptr`` the CSR offsets by node."""
        if self._interior is None:
            per_node: list[list[tuple[int, int, int, int]]] = []
            for u in range(self.ix.n):
                per_node.append([])
                self._node_events(u, self.ix.full, self.sinks, per_node[-1])
            ptr = np.zeros(self.ix.n + 1, dtype=np.int64)
            ptr[1:] = np.cumsum([len(x) for x in per_node])
            flat = [e for x in per_node for e in x]
            cols = [np.array(c, dtype=np.int64) for c in zip(*flat)] if flat else [np.zeros(0, dtype=np.int64)] * 4
            self._interior = (ptr, *cols)
        return self._interior

    def _target_events(self, fam, j: int) -> tuple[tuple[np.ndarray, ...], np.ndarray, np.ndarray]:
        """What pricing moves into the family's set ``j`` needs beyond the interior events: the events of
        the members of ∂(L') (evaluated for L' itself: their readers outside L' end them), as arrays
        (position, bytes, node, gate); ∂(L'); and the nodes whose gradient exists before the segment's
        backward starts (∂(L') and the model's outputs in L'; their ``_IN_L`` events, all at position 0).

        A member u of L' off its boundary has all its readers and savers (u itself, or readers of u) in
        L', so its events are those it has as a member of V (:meth:`_interior_events`). Kept for later
        calls (the budget search prices moves into the same targets solve after solve) up to
        ``EVENTS_HELD`` events."""
        Lp = fam.sets[j]
        held = self._held_events.get(Lp)
        if held is None:
            bd = fam.bd_node[fam.bd_ptr[j]:fam.bd_ptr[j + 1]]
            own: list[tuple[int, int, int, int]] = []
            ends = sum(1 << u for u in bd.tolist()) | self.sinks
            for u in bd.tolist():
                self._node_events(u, Lp, ends, own)
            cols = [np.array(c, dtype=np.int64) for c in zip(*own)] if own else [np.zeros(0, dtype=np.int64)] * 4
            sinks = self._sink_nodes[fam.member(np.full(len(self._sink_nodes), j), self._sink_nodes)]
            held = (tuple(cols), bd, np.concatenate([bd, sinks]))
            self._held_count += len(cols[0]) + len(held[2])
            if self._held_count > EVENTS_HELD:
                self._held_events.clear()
                self._held_count = len(cols[0]) + len(held[2])
            self._held_events[Lp] = held
        return held

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

    def _block_peaks(self, fam, j: int, rows: np.ndarray, lp: np.ndarray, alloc: np.ndarray) -> np.ndarray:
        """max over v ∈ V' of (live bytes + alloc[v]) for the sources ``rows`` of one target L' (the
        family's set ``j``, member mask ``lp``), before the ``_freed`` correction.

        Nodes that every source holds (``common``) are in L for all of them, never in V': their
        ``_IN_SEGMENT`` events never count and their ``_IN_L`` events (all at position 0) always do, a
        constant. Only the events of the other members of L' (the window, which holds every V') and the
        ``_ON_BOUNDARY`` events of nodes on some source's boundary vary by source, so a block costs
        O(rows × |window|), not O(|L'|): no array here spans the whole graph's events."""
        n, M = self.ix.n, self.ix.M_np
        ptr, ipos, iw, inode, igate = self._interior_events()
        (opos, ow, onode, ogate), bd_target, ends = self._target_events(fam, j)
        common = np.unpackbits(np.bitwise_and.reduce(fam.bits[rows], axis=0), bitorder="little",
                               count=n).astype(bool)
        rep, flat = expand(fam.bd_ptr, rows)
        bn = fam.bd_node[flat]
        some_bd = np.zeros(n, dtype=bool)
        some_bd[bn] = True
        window = np.flatnonzero(lp & ~common)  # every V' = L' \ L lies here
        on_own = np.zeros(n, dtype=bool)
        on_own[bd_target] = True  # members of ∂(L'): their events are the target's own
        nodes = np.union1d(window, np.flatnonzero(some_bd & common))
        inner = nodes[~on_own[nodes]]
        _, at_int = expand(ptr, inner)
        pick = on_own[onode] & (~common[onode] | some_bd[onode])
        pos, w, node, gate = (np.concatenate([a[at_int], b[pick]]) for a, b in
                              ((ipos, opos), (iw, ow), (inode, onode), (igate, ogate)))
        var = np.where(gate == _ON_BOUNDARY, some_bd[node], ~common[node])
        order = np.flatnonzero(var)
        order = order[np.argsort(pos[order], kind="stable")]
        pos, w, vn, vg = pos[order], w[order].astype(np.float64), node[order], gate[order]
        const = float(M[ends[common[ends]]].sum())  # the _IN_L events of nodes every source holds
        in_L = fam.member(np.repeat(rows, len(vn)), np.tile(vn, len(rows))).reshape(len(rows), len(vn))
        cols = np.unique(vn)  # on_bd[source, k]: cols[k] ∈ ∂(L) of that source
        on_bd = np.zeros((len(rows), len(cols)), dtype=bool)
        hit = np.isin(bn, cols)
        on_bd[rep[hit], np.searchsorted(cols, bn[hit])] = True
        counts = np.where(vg == _IN_SEGMENT, ~in_L, np.where(vg == _IN_L, in_L, on_bd[:, np.searchsorted(cols, vn)]))
        live = np.cumsum(counts * w, axis=1)  # [source, variable event]
        last = np.searchsorted(pos, window, side="right") - 1  # the last variable event at a position ≤ v
        at = live[:, np.maximum(last, 0)] if len(vn) else np.zeros((len(rows), len(window)))
        if len(vn):
            at[:, last < 0] = 0.0
        at += const + alloc[window]
        in_L = fam.member(np.repeat(rows, len(window)), np.tile(window, len(rows))).reshape(len(rows), len(window))
        at[in_L] = -np.inf
        return at.max(axis=1)  # only v ∈ V' = L' \ L counts

    def pair_costs(self, fam, pi, pj):
        """Vectorised :meth:`transition`: per target set, a cumulative sum of the events that vary among
        its source sets, for all of them together.

        The sources of a target go in blocks of ``SOURCE_BLOCK`` consecutive family indices. Events of
        nodes that every source of a block holds count alike for all of them (a node of L is never in V',
        always in L), so they are summed once; only the other nodes' events, and the events of members
        of some source's boundary, are summed per source. On a chain of sets the sources of a block differ
        in a short window, so a move costs about O(|V'|) rather than O(|L'|).
        """
        ix = self.ix
        n, M = ix.n, ix.M_np
        F = np.empty(len(pi))
        order = np.lexsort((pi, pj))  # by target, then source
        targets, starts = np.unique(pj[order], return_index=True)
        ends = np.r_[starts[1:], len(pi)]
        alloc = np.array(self.alloc, dtype=np.float64)
        for j, a, b in zip(targets.tolist(), starts.tolist(), ends.tolist()):
            lp = np.unpackbits(fam.bits[j], bitorder="little", count=n).astype(bool)
            for c in range(a, b, SOURCE_BLOCK):  # a block: consecutive sources, alike sets
                sel = order[c:min(b, c + SOURCE_BLOCK)]
                F[sel] = self._block_peaks(fam, j, pi[sel], lp, alloc)
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
