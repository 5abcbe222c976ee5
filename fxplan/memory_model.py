"""Cost of one step of the canonical strategy (Kusumoto et al. 2019, section 3), as pluggable models.

The DP (Algorithm 1) moves from a lower set ``L`` to a larger one ``L'`` (new segment ``V' = L' \\ L``)
carrying ``m = M(U)``, the bytes of boundary values cached so far. Every model here reduces one move to
three numbers, so the DP never needs to know which model it runs:

``F(L, L')``  peak-memory excess of the move: the peak while segment ``V'`` runs is ``m + F``;
``G(L, L')``  bytes newly cached by the move: ``m' = m + G`` (both models: ``M(∂(L') \\ L)``);
``H(L, L')``  time overhead of the move; the plan's overhead is the sum of ``H``.

Two models:

* :class:`PaperModel` (``"paper"``) is equation (1) and (2) exactly:
  ``F = 2M(V') + M(δ⁺(L') \\ L') + M(δ⁻(δ⁺(L')) \\ L')``, ``H = T(V' \\ ∂(L'))``.
* :class:`AutogradModel` (``"autograd"``, the default) models what PyTorch autograd keeps when segment
  ``V'`` is run under non-reentrant checkpointing and differentiated (see docs/planner.md):
  ``F = M(R) + S(V') + M(∂(L') \\ L) + M(δ⁻(V') ∩ L) + max_{v∈V'} τ(v)`` where ``R`` are the members of
  ``V'`` whose outputs some backward of ``V'`` saves (or that save their own output), ``S`` the extra bytes
  nodes save (BatchNorm statistics, pooling indices, masks), ``M(∂(L') \\ L)`` the gradients arriving from
  later segments, ``M(δ⁻(V') ∩ L)`` the gradients this segment produces for its inputs, and ``τ(v) = M(v)
  + M(δ⁻(v))`` the transient gradients while one node is differentiated.  ``H = T(V')`` (a checkpointed
  segment re-runs whole), except for the last segment, which is not recomputed: ``H = 0``.

Each model exists in two evaluations that must agree (a test checks it): :meth:`BoundModel.transition`
on bitsets, for one move, and :meth:`BoundModel.pair_matrices`, vectorised with numpy for every pair of
a family of lower sets at once (the approximate DP's fast path).

Per-node inputs of the autograd model (from :func:`fxplan.trace.trace`): ``saves_output`` (bool),
``saved_inputs`` (names of predecessor compute nodes whose outputs the node's backward keeps), ``saved``
(extra bytes). A node without those attributes (e.g. from :meth:`CostGraph.from_edges`) is taken to save
all its compute-node inputs and not its output, with ``saved`` 0 when absent.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from fxplan.errors import FxplanError
from fxplan.lowersets import GraphIndex, iter_bits, weighted_sum


class BoundModel:
    """A memory model bound to one :class:`GraphIndex`; see the module docstring."""

    name: str = "?"

    def __init__(self, ix: GraphIndex):
        self.ix = ix

    def transition(self, L: int, Lp: int) -> tuple[int, int, float]:
        """(F, G, H) of the move L → L' on bitsets (``L ⊊ L'`` lower sets)."""
        raise NotImplementedError

    def pair_matrices(self, sets: list[int], A: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(F, G, H) as ``len(sets)²`` arrays, entry [i, j] for the move sets[i] → sets[j].

        Entries where ``sets[i] ⊄ sets[j]`` are meaningless; the caller masks them.
        """
        raise NotImplementedError

    def lb_weights(self) -> tuple[list[float], list[float]]:
        """(add, mx) with ``Σ_{v∈V'} add[v] + max_{v∈V'} mx[v] ≤ F(L, L ∪ V')`` for every move.

        The bound grows with ``V'``, so a search that grows segments can stop once it exceeds the budget.
        """
        raise NotImplementedError

    # -- incremental evaluation for the exact DP's search engine ------------------------------------------
    # The search grows a segment V' one node at a time (in topological order) from a lower set L. A model
    # may carry a state along so that each move costs O(degree) instead of O(|V'|). The defaults carry only
    # the lower bound of :meth:`lb_weights` and evaluate moves from scratch.

    def inc_start(self, L: int) -> tuple:
        """Search state for the empty segment above L."""
        if not hasattr(self, "_lbw"):
            self._lbw = self.lb_weights()
        return (0.0, 0.0)

    def inc_add(self, st: tuple, L: int, nxt: int, i: int) -> tuple:
        """State after adding node i (``nxt`` = L ∪ V' with i in it)."""
        add, mx = self._lbw
        return (st[0] + add[i], mx[i] if mx[i] > st[1] else st[1])

    def inc_lb(self, st: tuple) -> float:
        """Lower bound on F for this segment and every larger one (monotone along the search)."""
        return st[0] + st[1]

    def inc_eval(self, st: tuple, L: int, nxt: int) -> tuple[int, int, float]:
        """(F, G, H) of the move L → ``nxt``; must equal :meth:`transition`."""
        return self.transition(L, nxt)

    def _common(self, A: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Boundary indicator matrix of every set in A and its per-set bytes."""
        ix = self.ix
        succ_adj = _adjacency(ix)  # E[u, w] = 1 for an edge u → w
        # a member u of X is on ∂(X) iff it has a successor outside X: outdeg(u) > |succ(u) ∩ X|
        inside = A.astype(np.float32) @ succ_adj.T.astype(np.float32)  # exact counts
        outdeg = succ_adj.sum(axis=1)
        Bd = A & (inside < outdeg[None, :])
        return Bd, inside


def cache_and_recompute(ix: GraphIndex, sets: list[int], Af: np.ndarray, Bf: np.ndarray,
                        ) -> tuple[np.ndarray, np.ndarray]:
    """(G, H) of the autograd-style models for every pair of a family: G = M(∂(L') \\ L), the newly
    cached boundary, and H = T(V'), except 0 for moves to V (the last segment is not recomputed).

    ``Af``: the family's indicator matrix as floats; ``Bf``: the indicators of the sets' boundaries.
    """
    M = ix.M_np
    G = (Bf @ M)[None, :] - (Af * M) @ Bf.T
    TA = Af @ ix.T_np
    H = TA[None, :] - TA[:, None]
    H[:, [j for j, s in enumerate(sets) if s == ix.full]] = 0.0
    return G, H


def self_saved_bytes(ix: GraphIndex, so: int, sx: list[int]) -> list[float]:
    """Per node, what its backward keeps of its own: its output if it saves it (``so``), and ``sx``."""
    return [float(sx[i] + (ix.M[i] if so >> i & 1 else 0)) for i in range(ix.n)]


def input_gradient_bytes(Bd: np.ndarray, inside: np.ndarray, sub: np.ndarray, M: np.ndarray) -> np.ndarray:
    """M(δ⁻(V') ∩ L) for every pair (L, L') of a family with L ⊊ L' (``sub``), V' = L' \\ L.

    The inputs of V' taken from L are the members u of ∂(L) (``Bd``) with more successors in L' than in
    L (``inside``: successor counts per set, from :meth:`BoundModel._common`). Entries with L ⊄ L' are 0.
    """
    S = len(Bd)
    out = np.zeros((S, S))
    for i in range(S):
        cols = np.flatnonzero(Bd[i])
        rows_i = np.flatnonzero(sub[i])
        if cols.size and rows_i.size:
            out[i, rows_i] = (inside[np.ix_(rows_i, cols)] > inside[i, cols][None, :]) @ M[cols]
    return out


def _adjacency(ix: GraphIndex) -> np.ndarray:
    E = np.zeros((ix.n, ix.n))
    for u in range(ix.n):
        for w in iter_bits(ix.dsucc[u]):
            E[u, w] = 1.0
    return E


def saved_sets(ix: GraphIndex) -> tuple[int, list[int], list[int]]:
    """What each node's backward keeps, from the tracer's attributes (module docstring).

    Returns ``(so, si, sx)``: the bitset of nodes that keep their own output, per node the bitset of
    predecessors whose outputs it keeps, and per node the extra bytes it keeps.
    """
    so, si, sx = 0, [0] * ix.n, [0] * ix.n
    for i, v in enumerate(ix.names):
        attrs = ix.cg.nodes[v]
        if attrs.get("saves_output", False):
            so |= 1 << i
        if "saved_inputs" in attrs:
            si[i] = ix.mask(u for u in attrs["saved_inputs"] if u in ix.pos) & ix.dpred[i]
        else:
            si[i] = ix.dpred[i]
        sx[i] = int(attrs.get("saved", 0) or 0)
    return so, si, sx


class _BoundPaper(BoundModel):
    name = "paper"

    def transition(self, L: int, Lp: int) -> tuple[int, int, float]:
        ix = self.ix
        Vp = Lp & ~L
        bd = ix.boundary(Lp)
        dplus = ix.delta_plus(Lp) & ~Lp
        dmd = ix.delta_minus(dplus) & ~Lp
        F = 2 * ix.msum(Vp) + ix.msum(dplus) + ix.msum(dmd)
        G = ix.msum(bd & ~L)
        H = ix.tsum(Vp & ~bd)
        return F, G, H

    def pair_matrices(self, sets, A):
        ix = self.ix
        M, T = ix.M_np, ix.T_np
        Af = A.astype(np.float64)
        Bd, inside = self._common(A)
        E = _adjacency(ix)
        dplus = ((Af @ E) > 0) & ~A  # δ⁺(X) \ X
        dmd = ((dplus.astype(np.float64) @ E.T) > 0) & ~A  # δ⁻(δ⁺(X)) \ X
        MA, TA = Af @ M, Af @ T
        P = dplus @ M + dmd @ M
        Bf = Bd.astype(np.float64)
        F = 2.0 * (MA[None, :] - MA[:, None]) + P[None, :]
        G = (Bf @ M)[None, :] - (Af * M) @ Bf.T
        H = (TA[None, :] - TA[:, None]) - ((Bf @ T)[None, :] - (Af * T) @ Bf.T)
        return F, G, H

    def lb_weights(self):
        return [2.0 * m for m in self.ix.M], [0.0] * self.ix.n


@dataclass(frozen=True)
class PaperModel:
    """Equations (1) and (2) of Kusumoto et al. exactly as the paper states them."""

    name: str = "paper"

    def bind(self, ix: GraphIndex) -> BoundModel:
        return _BoundPaper(ix)


@dataclass(frozen=True)
class AutogradModel:
    """What PyTorch autograd keeps under non-reentrant checkpointing (module docstring, docs/planner.md).

    The coefficients scale the three gradient terms so the model can be recalibrated against measured
    peaks without touching the planner: ``out_grad`` (gradients arriving from later segments), ``in_grad``
    (gradients produced for the segment's inputs) and ``transient`` (max over nodes of τ).
    """

    out_grad: float = 1.0
    in_grad: float = 1.0
    transient: float = 1.0
    name: str = "autograd"

    def bind(self, ix: GraphIndex) -> BoundModel:
        return _BoundAutograd(ix, self)


class _BoundAutograd(BoundModel):
    name = "autograd"

    def __init__(self, ix: GraphIndex, cfg: AutogradModel):
        super().__init__(ix)
        self.cfg = cfg
        self.so, self.si, self.sx = saved_sets(ix)
        self.tau = [ix.M[i] + ix.msum(ix.dpred[i]) for i in range(ix.n)]

    def _saved_members(self, Vp: int) -> int:
        r = self.so & Vp
        for w in iter_bits(Vp):
            r |= self.si[w] & Vp
        return r

    def transition(self, L: int, Lp: int) -> tuple[int, int, float]:
        ix, c = self.ix, self.cfg
        Vp = Lp & ~L
        R = self._saved_members(Vp)
        out_g = ix.msum(ix.boundary(Lp) & ~L)
        in_g = ix.msum(ix.delta_minus(Vp) & L)
        trans = max(self.tau[i] for i in iter_bits(Vp))
        F = ix.msum(R) + int(weighted_sum(Vp, self.sx)) + c.out_grad * out_g + c.in_grad * in_g
        F += c.transient * trans
        H = 0.0 if Lp == ix.full else ix.tsum(Vp)
        return F, out_g, H

    # state: (R, M(R), S, I, M(I), B, M(B), max τ, T(V')) with R the saved members of V', I = δ⁻(V') ∩ L
    # (inputs whose gradients the segment produces) and B = ∂(L') ∩ V' (outputs whose gradients arrive)
    def inc_start(self, L: int) -> tuple:
        self._full = self.ix.full
        return (0, 0, 0, 0, 0, 0, 0, 0, 0.0)

    def inc_add(self, st: tuple, L: int, nxt: int, i: int) -> tuple:
        ix = self.ix
        R, MR, S, I, MI, B, MB, mx, TV = st  # noqa: E741 (I: the inputs set of the paper's notation)
        M = ix.M
        Vp = nxt & ~L
        new = ((self.si[i] & Vp) | (self.so & (1 << i))) & ~R
        while new:
            low = new & -new
            MR += M[low.bit_length() - 1]
            R |= low
            new ^= low
        new = ix.dpred[i] & L & ~I
        while new:
            low = new & -new
            MI += M[low.bit_length() - 1]
            I |= low  # noqa: E741
            new ^= low
        done = ix.dpred[i] & B
        while done:
            low = done & -done
            u = low.bit_length() - 1
            if not ix.dsucc[u] & ~nxt:  # u's last consumer just joined: no longer leaves the segment
                B ^= low
                MB -= M[u]
            done ^= low
        if ix.dsucc[i]:
            B |= 1 << i
            MB += M[i]
        t = self.tau[i]
        return (R, MR, S + self.sx[i], I, MI, B, MB, t if t > mx else mx, TV + ix.T[i])

    def inc_lb(self, st: tuple) -> float:
        c = self.cfg
        return st[1] + st[2] + c.in_grad * st[4] + c.transient * st[7]

    def inc_eval(self, st: tuple, L: int, nxt: int) -> tuple[int, int, float]:
        c = self.cfg
        F = st[1] + st[2] + c.out_grad * st[6] + c.in_grad * st[4] + c.transient * st[7]
        return F, st[6], 0.0 if nxt == self._full else st[8]

    def pair_matrices(self, sets, A):
        ix, c = self.ix, self.cfg
        M = ix.M_np
        n, S = ix.n, len(sets)
        Af = A.astype(np.float64)
        Bd, inside = self._common(A)
        Bf = Bd.astype(np.float64)
        # R*(X): members of X saved by some member of X, or saving their own output
        SI = np.zeros((n, n))
        for w in range(n):
            for u in iter_bits(self.si[w]):
                SI[w, u] = 1.0
        so = np.zeros(n, dtype=bool)
        so[list(iter_bits(self.so))] = True
        Rs = A & (so[None, :] | ((A.astype(np.float32) @ SI.astype(np.float32)) > 0))
        Rf = Rs.astype(np.float64)
        AM = Af * M
        MR = (Rf @ M)[None, :] - AM @ Rf.T
        out_g, H = cache_and_recompute(ix, sets, Af, Bf)
        sxa = Af @ np.array(self.sx, dtype=np.float64)
        SX = sxa[None, :] - sxa[:, None]
        # only pairs L ⊊ L' matter: compute the two non-bilinear terms on those alone
        A32 = A.astype(np.float32)
        sizes = A32.sum(axis=1)
        sub = ((A32 @ A32.T) == sizes[:, None]) & (sizes[None, :] > sizes[:, None])
        in_g = input_gradient_bytes(Bd, inside, sub, M)
        # max τ over V': the largest level θ_q with more nodes of τ ≥ θ_q in L' than in L. The excess
        # |V' ∩ {τ ≥ θ_q}| shrinks as q grows, so a binary search over levels finds q for all pairs at once.
        tau = np.array(self.tau, dtype=np.float64)
        levels = np.unique(tau)
        k = len(levels)
        # C[X, q] = #{v ∈ X: τ_v ≥ θ_q}, flattened for gathers
        C = (A32 @ (tau[:, None] >= levels[None, :]).astype(np.float32)).ravel()
        pi, pj = np.nonzero(sub)
        lo = np.zeros(pi.size, dtype=np.int64)
        hi = np.full(pi.size, k - 1, dtype=np.int64)
        while True:
            open_ = np.flatnonzero(lo < hi)
            if not open_.size:
                break
            mid = (lo[open_] + hi[open_] + 1) // 2
            up = C[pj[open_] * k + mid] > C[pi[open_] * k + mid]
            lo[open_[up]] = mid[up]
            hi[open_[~up]] = mid[~up] - 1
        trans = np.zeros((S, S))
        trans[pi, pj] = levels[lo]
        F = MR + SX + c.out_grad * out_g + c.in_grad * in_g + c.transient * trans
        return F, out_g, H

    def lb_weights(self):
        return self_saved_bytes(self.ix, self.so, self.sx), [self.cfg.transient * t for t in self.tau]


class Memoized:
    """A memory model whose pair matrices are computed once per family of lower sets.

    The approximate DP evaluates every move between the sets of its family with
    :meth:`BoundModel.pair_matrices`, which dominates the time of one solve. A search that solves the
    same cost graph at many budgets (``fxplan.search``) passes one ``Memoized`` object to every solve, so
    the matrices are computed once. Use one object per cost graph only.
    """

    def __init__(self, base: PaperModel | AutogradModel | str | None = None):
        self.base = get_model(base)
        self.name = self.base.name
        self._pairs: dict[tuple[int, ...], tuple[np.ndarray, np.ndarray, np.ndarray]] = {}

    def bind(self, ix: GraphIndex) -> BoundModel:
        bound = self.base.bind(ix)
        compute = bound.pair_matrices

        def pair_matrices(sets, A):
            key = tuple(sets)
            if key not in self._pairs:
                self._pairs[key] = compute(sets, A)
            return self._pairs[key]

        bound.pair_matrices = pair_matrices
        return bound


MODELS = {"paper": PaperModel, "autograd": AutogradModel}


def get_model(model: str | PaperModel | AutogradModel | None) -> PaperModel | AutogradModel:
    """A memory model from its name (``"paper"``, ``"autograd"``) or a model object (passed through)."""
    if model is None:
        return AutogradModel()
    if isinstance(model, str):
        if model not in MODELS:
            raise FxplanError(f"unknown memory_model {model!r}; choose one of {sorted(MODELS)}")
        return MODELS[model]()
    if hasattr(model, "bind"):
        return model
    raise FxplanError(f"memory_model must be a name or a model object with .bind(), not {model!r}")


def evaluate_chain(bm: BoundModel, chain: list[int]) -> tuple[int, float, list[int], int]:
    """Evaluate a plan L1 ≺ … ≺ Lk = V (bitsets, ∅ excluded) under a bound model.

    Returns (predicted peak, overhead, peak of each segment, bytes cached at the end M(U_k)).
    """
    m, peak, over, seg_peaks, prev = 0, 0, 0.0, [], 0
    for Lp in chain:
        F, G, H = bm.transition(prev, Lp)
        seg_peaks.append(int(round(m + F)))
        peak = max(peak, seg_peaks[-1])
        over += H
        m += G
        prev = Lp
    return peak, over, seg_peaks, int(m)
