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
on bitsets, for one move, and :meth:`BoundModel.pair_costs`, vectorised with numpy over a list of moves
between sets of a :class:`~fxplan.solvers.family.Family` (the family engine's path). ``pair_costs`` never touches
the members of a segment: sums are differences of per-set sums, the terms that depend on both sets involve
only ∂(L) and the edges leaving L, and max τ is a range maximum (:meth:`Family.max_new`).

Per-node inputs of the autograd model (from :func:`fxplan.costs.trace.trace`): ``saves_output`` (bool),
``saved_inputs`` (names of predecessor compute nodes whose outputs the node's backward keeps), ``saved``
(extra bytes). A node without those attributes (e.g. from :meth:`CostGraph.from_edges`) is taken to save
all its compute-node inputs and not its output, with ``saved`` 0 when absent.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from fxplan.errors import FxplanError
from fxplan.solvers.family import Family
from fxplan.solvers.lowersets import GraphIndex, iter_bits, weighted_sum


class BoundModel:
    """A memory model bound to one :class:`GraphIndex`; see the module docstring."""

    name: str = "?"

    def __init__(self, ix: GraphIndex):
        self.ix = ix

    def transition(self, L: int, Lp: int, bd: int | None = None) -> tuple[int, int, float]:
        """(F, G, H) of the move L → L' on bitsets (``L ⊊ L'`` lower sets); ``bd``: ∂(L') if known."""
        raise NotImplementedError

    def pair_costs(self, fam: Family, pi: np.ndarray, pj: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(F, G, H) of the moves ``fam.sets[pi[k]] → fam.sets[pj[k]]`` (each a strict subset), as arrays.

        Must equal :meth:`transition`; this default calls it pair by pair, the built-in models vectorise.
        """
        sets = fam.sets
        out = np.array([self.transition(sets[i], sets[j]) for i, j in zip(pi.tolist(), pj.tolist())],
                       dtype=np.float64).reshape(-1, 3)
        return out[:, 0], out[:, 1], out[:, 2]

    def h_weights(self) -> np.ndarray:
        """Per-node h ≥ 0 with Σ_{v∈V'} h[v] ≤ H(L, L') for every move with L' ≠ V (default: zeros)."""
        return np.zeros(self.ix.n)

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


def recompute_costs(fam: Family, TA: np.ndarray, pi: np.ndarray, pj: np.ndarray) -> np.ndarray:
    """H = T(V') of the moves ``fam.sets[pi] → fam.sets[pj]`` (``TA``: T summed per set), except 0 for moves
    to V: the last segment is not recomputed."""
    H = TA[pj] - TA[pi]
    if fam.sets[-1] == fam.ix.full:
        H[pj == fam.S - 1] = 0.0
    return H


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

    def transition(self, L: int, Lp: int, bd: int | None = None) -> tuple[int, int, float]:
        ix = self.ix
        Vp = Lp & ~L
        bd = ix.boundary(Lp) if bd is None else bd
        dplus = ix.delta_plus(bd) & ~Lp
        dmd = ix.delta_minus(dplus) & ~Lp
        F = 2 * ix.msum(Vp) + ix.msum(dplus) + ix.msum(dmd)
        G = ix.msum(bd & ~L)
        H = ix.tsum(Vp & ~bd)
        return F, G, H

    def pair_costs(self, fam, pi, pj):
        ix = self.ix
        key = ("paper", id(self))
        if key not in fam.cache:
            # per set X: M(X), T(X), M(∂X), T(∂X) and M(δ⁺(X) \ X) + M(δ⁻(δ⁺(X)) \ X)
            P = np.zeros(fam.S)
            ptr, node = fam.bd_ptr.tolist(), fam.bd_node.tolist()
            for k, X in enumerate(fam.sets):
                dplus = 0  # δ⁺(X) \ X: consumers of boundary members outside X
                for u in node[ptr[k]:ptr[k + 1]]:
                    dplus |= ix.dsucc[u]
                dplus &= ~X
                P[k] = ix.msum(dplus) + ix.msum(ix.delta_minus(dplus) & ~X)
            fam.cache[key] = (fam.sums(ix.M_np), fam.sums(ix.T_np), fam.boundary_sums(ix.M_np),
                              fam.boundary_sums(ix.T_np), P)
        MA, TA, MB, TB, P = fam.cache[key]
        kept_M, kept_T = _kept_boundary(fam, pi, pj, ix.M_np, ix.T_np)
        F = 2.0 * (MA[pj] - MA[pi]) + P[pj]
        G = MB[pj] - kept_M
        H = (TA[pj] - TA[pi]) - (TB[pj] - kept_T)
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
        for name in ("out_grad", "in_grad", "transient"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                raise FxplanError(f"AutogradModel.{name} must be a finite number >= 0, got {value!r}")
        return _BoundAutograd(ix, self)


class _BoundAutograd(BoundModel):
    name = "autograd"

    def __init__(self, ix: GraphIndex, cfg: AutogradModel):
        super().__init__(ix)
        self.cfg = cfg
        self.so, self.si, self.sx = saved_sets(ix)  # own output, inputs kept, extra bytes
        self.tau = [ix.M[i] + ix.msum(ix.dpred[i]) for i in range(ix.n)]

    def _saved_members(self, Vp: int) -> int:
        r = self.so & Vp
        for w in iter_bits(Vp):
            r |= self.si[w] & Vp
        return r

    def transition(self, L: int, Lp: int, bd: int | None = None) -> tuple[int, int, float]:
        ix, c = self.ix, self.cfg
        Vp = Lp & ~L
        R = self._saved_members(Vp)
        out_g = ix.msum((ix.boundary(Lp) if bd is None else bd) & ~L)
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

    def _family_terms(self, fam):
        """Per-set sums the move costs are differences of, and per edge u → w leaving a set X whether w saves
        u while u ∉ R*(X) (R*(X): members of X saved by a member of X or saving their own output).

        For L ⊊ L', R(V') = R*(L') \\ L, and R*(L') ∩ L is R*(L) plus the members of ∂(L) that a member of
        V' saves: M(R) = M(R*(L')) - M(R*(L)) - (those members' bytes)."""
        key = ("autograd", id(self))
        if key in fam.cache:
            return fam.cache[key]
        ix = self.ix
        M = ix.M
        rstar: list[int] = []
        MR = np.zeros(fam.S)
        in_rstar = np.zeros(len(fam.bd_node), dtype=bool)
        ex_ptr, ex_node, bd_ptr = fam.ex_ptr.tolist(), fam.ex_node.tolist(), fam.bd_ptr.tolist()
        bd_node = fam.bd_node.tolist()
        for k, b in enumerate(fam.base.tolist()):
            R, total = (rstar[b], MR[b]) if b >= 0 else (0, 0.0)
            new = 0
            for w in ex_node[ex_ptr[k]:ex_ptr[k + 1]]:
                new |= self.si[w] | (self.so & (1 << w))
            new &= ~R
            R |= new
            MR[k] = total + weighted_sum(new, M)
            rstar.append(R)
            for e in range(bd_ptr[k], bd_ptr[k + 1]):
                in_rstar[e] = R >> bd_node[e] & 1
        n = ix.n
        saver_pairs = np.array(sorted(u * n + w for w in range(n) for u in iter_bits(self.si[w])), dtype=np.int64)
        sx = np.array(self.sx, dtype=np.float64)
        terms = (fam.sums(ix.M_np), fam.sums(ix.T_np), fam.sums(sx), fam.boundary_sums(ix.M_np), MR,
                 (saver_pairs, in_rstar), np.array(self.tau, dtype=np.float64))
        fam.cache[key] = terms
        return terms

    def time_terms(self, fam) -> dict:
        """What :func:`fxplan.solvers.time_kernel.least_overhead_chain` prices moves with, as :meth:`pair_costs`
        does."""
        _, TA, _, MB, _, savers, tau = self._family_terms(fam)
        into, out_of = self._per_set_F(fam)
        return {"TA": TA, "MB": MB, "savers": savers, "tau": tau, "into": into, "out_of": out_of}

    def _per_set_F(self, fam) -> tuple[np.ndarray, np.ndarray]:
        """The parts of F that depend on one set: (into L', out of L)."""
        key = ("per-set F", id(self))
        if key not in fam.cache:
            c = self.cfg
            _, _, SXA, MB, MRA, _, _ = self._family_terms(fam)
            fam.cache[key] = (MRA + SXA + c.out_grad * MB, MRA + SXA)
        return fam.cache[key]

    def pair_costs(self, fam, pi, pj):
        ix, c = self.ix, self.cfg
        _, TA, _, MB, _, savers, tau = self._family_terms(fam)
        P = len(pi)
        # u ∈ ∂(L) stays on ∂(L') if a consumer is outside L'; V' reads it if a consumer is inside L';
        # it joins R if a member of V' saves it. F = M(R) + S(V') + out·out_g + in·in_g + tr·max τ with
        # M(R) = MR*(L') - MR*(L) - (saved members of ∂(L)), out_g = M(∂L') - (members of ∂L staying)
        into, out_of = self._per_set_F(fam)
        pair, u, stays, read, saved = fam.boundary_runs(pi, pj, *savers)
        Mu = ix.M_np[u]
        kept = np.bincount(pair, weights=Mu * stays, minlength=P)
        rest = np.bincount(pair, weights=Mu * (c.in_grad * read - saved), minlength=P)
        trans = fam.max_new(tau, pi, pj)
        F = into[pj] - out_of[pi] - c.out_grad * kept + rest + c.transient * trans
        return F, MB[pj] - kept, recompute_costs(fam, TA, pi, pj)

    def h_weights(self):
        return self.ix.T_np.copy()

    def lb_weights(self):
        # Every input u a member w of V' saves is in R (u ∈ V') or in δ⁻(V') ∩ L (u ∈ L), and so is every
        # member saving its own output. Splitting M(u) evenly among the k(u) nodes that save it charges
        # each such u at most once: Σ_{w∈V'} add[w] ≤ M(R) + min(1, in_grad) M(δ⁻(V') ∩ L) + S(V').
        ix = self.ix
        n = ix.n
        savers = [1 if self.so >> u & 1 else 0 for u in range(n)]
        for w in range(n):
            for u in iter_bits(self.si[w]):
                savers[u] += 1
        share = min(1.0, self.cfg.in_grad)
        add = []
        for w in range(n):
            kept = sum(ix.M[u] / savers[u] for u in iter_bits(self.si[w]))
            if self.so >> w & 1:
                kept += ix.M[w] / savers[w]
            add.append(float(self.sx[w]) + share * kept)
        return add, [self.cfg.transient * t for t in self.tau]


MODELS = {"paper": PaperModel, "autograd": AutogradModel}


def _kept_boundary(fam, pi: np.ndarray, pj: np.ndarray, *weights: np.ndarray) -> list[np.ndarray]:
    """Σ w[u] over ∂(L') ∩ L = the members u of ∂(L) with a consumer outside L', per pair, per weight."""
    pair, u, stays, _, _ = fam.boundary_runs(pi, pj)
    return [np.bincount(pair, weights=w[u] * stays, minlength=len(pi)) for w in weights]


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
    m, peak, over, seg_peaks, prev, bd = 0, 0, 0.0, [], 0, 0
    for Lp in chain:
        bd = bm.ix.next_boundary(bd, Lp, Lp & ~prev)
        F, G, H = bm.transition(prev, Lp, bd)
        seg_peaks.append(int(round(m + F)))
        peak = max(peak, seg_peaks[-1])
        over += H
        m += G
        prev = Lp
    return peak, over, seg_peaks, int(m)
