"""A family of lower sets with what the DP needs to enumerate and price its moves sparsely.

The DP of Kusumoto et al. (sections 4.2-4.3) moves from a lower set ``L`` of a family to a larger one
``L'``. Pricing every pair of the family costs #family² time and memory (10,000 sets: 10⁸ pairs), yet at
a budget only pairs whose new segment ``V' = L' \\ L`` is small can be taken. :class:`Family` therefore
keeps, per set, what lets it

* list only the pairs ``L ⊊ L'`` whose segment can fit a cap (:meth:`Family.moves`), from a lower bound
  that is additive over the segment (the sets sorted by it, each source's candidates are one range), and
* evaluate set functions of the segment without touching its members (:meth:`Family.sums`,
  :meth:`Family.max_new`, :meth:`Family.out_edges`): sums over ``V'`` are differences of per-set sums,
  and every term that depends on both sets involves only the boundary ``∂(L)`` of the smaller one and
  the successors of its members, because a member of ``L`` that is not on ``∂(L)`` has all its consumers
  in ``L``.

Per-set data is built incrementally: each set is written as an earlier, smaller set of the family plus a
few extra nodes (the set without its highest node for the full lattice; the largest ancestor closure of a
predecessor for ``L_v``), so building costs about the total size of those differences.
"""

from __future__ import annotations

import numpy as np

from fxplan.errors import FxplanError
from fxplan.solvers.lowersets import GraphIndex, iter_bits

#: Pairs expanded at once when listing candidate moves (bounds the temporary arrays).
CHUNK = 1 << 21

#: Largest #sets × #nodes for which per-set consumer counts are kept as dense matrices (see
#: :meth:`Family.boundary_runs`).
DENSE_COUNTS = 1 << 22


def expand(ptr: np.ndarray, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For CSR offsets ``ptr`` and row ids ``rows``: (position in ``rows``, flat index) of every entry."""
    starts = ptr[rows]
    lens = ptr[rows + 1] - starts
    total = int(lens.sum())
    rep = np.repeat(np.arange(len(rows)), lens)
    offs = np.arange(total) - np.repeat(np.cumsum(lens) - lens, lens)
    return rep, starts[rep] + offs


def _csr(lists: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    ptr = np.zeros(len(lists) + 1, dtype=np.int64)
    ptr[1:] = np.cumsum([len(x) for x in lists])
    flat = np.fromiter((v for x in lists for v in x), dtype=np.int64, count=int(ptr[-1]))
    return ptr, flat


class Family:
    """Lower sets ``sets`` (sorted by size, then value; ∅ first, V last) of ``ix``; see the module docstring.

    Arrays indexed by set: ``size``, ``first_out`` (lowest node not in the set; n for V), ``last_in``
    (highest node in the set; -1 for ∅), ``bits`` (the sets as packed little-endian bit rows). CSR lists
    indexed by set: ``ex_ptr``/``ex_node`` (the set minus its ``base`` set), ``bd_ptr``/``bd_node`` (the
    data boundary ∂(L)), ``mx_ptr``/``mx_node`` (maximal members, for subset tests).
    ``cache`` holds what memory models derive from the family.
    """

    def __init__(self, ix: GraphIndex, sets: list[int], bases: list[int] | None = None):
        """``bases[k]``: index of a subset of ``sets[k]`` earlier in ``sets`` (-1: none); by default the set
        minus its highest node where that is in ``sets`` (all lower sets), else none."""
        self.ix = ix
        self.sets = sets
        self.S = S = len(sets)
        self.cache: dict = {}
        n = ix.n
        nb = (n + 7) // 8
        rows = [s.to_bytes(nb, "little") for s in sets]
        self.bits = np.frombuffer(b"".join(rows), dtype=np.uint8).reshape(S, nb)
        self._flat = self.bits.reshape(-1)
        self.size = np.array([s.bit_count() for s in sets], dtype=np.int64)
        self.last_in = np.array([s.bit_length() - 1 for s in sets], dtype=np.int64)
        self.first_out = np.array([(~s & (s + 1)).bit_length() - 1 for s in sets], dtype=np.int64)
        index = {s: k for k, s in enumerate(sets)} if bases is None else {}
        dsucc, succ, full = ix.dsucc, ix.succ, ix.full
        base = np.full(S, -1, dtype=np.int64)
        extras: list[list[int]] = []
        bds: list[list[int]] = []
        mxs: list[list[int]] = []
        for k, X in enumerate(sets):
            if bases is not None:
                b = bases[k]
            else:  # the set without its highest node (always there in the full lattice), else none
                b = index.get(X ^ (1 << (X.bit_length() - 1)), -1) if X else -1
            base[k] = b
            B = sets[b] if b >= 0 else 0
            extra = list(iter_bits(X & ~B))
            extras.append(extra)
            cand = bds[b] + extra if b >= 0 else extra  # disjoint: ∂(B) ⊆ B
            outside = full & ~X
            bds.append([u for u in cand if dsucc[u] & outside])
            cand = (mxs[b] + extra) if b >= 0 else extra
            mxs.append([u for u in cand if not succ[u] & X])
        self.base = base
        self.ex_ptr, self.ex_node = _csr(extras)
        self.bd_ptr, self.bd_node = _csr(bds)
        self.mx_ptr, self.mx_node = _csr(mxs)
        self.dense_counts = S * n <= DENSE_COUNTS

    def leaving_edges(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """CSR over sets of the data edges u → w leaving the set (u ∈ ∂(L), w ∉ L): (ptr, u, w, boundary
        entry of u), grouped by boundary member in boundary order."""
        if "edges" not in self.cache:
            ix = self.ix
            dptr, dnode = _csr([list(iter_bits(m)) for m in ix.dsucc])
            entries = np.arange(len(self.bd_node))
            rep, flat = expand(dptr, self.bd_node)
            owner = np.repeat(np.arange(self.S), np.diff(self.bd_ptr))[rep]
            w = dnode[flat]
            out = ~self.member(owner, w)
            cnt = np.bincount(owner[out], minlength=self.S)
            ptr = np.r_[0, np.cumsum(cnt)]
            self.cache["edges"] = (ptr, self.bd_node[rep][out], w[out], entries[rep][out])
        return self.cache["edges"]

    @classmethod
    def pruned(cls, ix: GraphIndex) -> Family:
        """The pruned family {L_v} ∪ {∅, V} of section 4.3, ordered as
        :func:`~fxplan.solvers.lowersets.pruned_lower_sets`."""
        anc, pred, succ = ix.anc, ix.pred, ix.succ
        size = [a.bit_count() for a in anc]
        nodes = sorted(range(ix.n), key=lambda v: (size[v], anc[v]))
        at = {v: k + 1 for k, v in enumerate(nodes)}
        sets = [0] + [anc[v] for v in nodes]
        # L_v = v plus the closures of its predecessors; the largest of them is the base
        bases = [-1] + [at[max(iter_bits(pred[v]), key=size.__getitem__)] if pred[v] else 0 for v in nodes]
        if sets[-1] != ix.full:  # several sinks: V is the union of their closures
            sinks = [u for u in range(ix.n) if not succ[u]]
            sets.append(ix.full)
            bases.append(at[max(sinks, key=size.__getitem__)])
        return cls(ix, sets, bases)

    # -- set functions ---------------------------------------------------------------------------------------
    def sums(self, w: np.ndarray) -> np.ndarray:
        """Σ_{u ∈ L} w[u] for every set L (exact for integer-valued weights)."""
        grp = np.repeat(np.arange(self.S), np.diff(self.ex_ptr))
        extra = np.bincount(grp, weights=w[self.ex_node], minlength=self.S)
        out = extra.tolist()
        for k, b in enumerate(self.base.tolist()):
            if b >= 0:
                out[k] += out[b]
        return np.array(out, dtype=np.float64)

    def boundary_sums(self, w: np.ndarray) -> np.ndarray:
        """Σ_{u ∈ ∂(L)} w[u] for every set L."""
        grp = np.repeat(np.arange(self.S), np.diff(self.bd_ptr))
        return np.bincount(grp, weights=w[self.bd_node], minlength=self.S)

    def member(self, rows: np.ndarray, nodes: np.ndarray) -> np.ndarray:
        """``nodes[k] ∈ sets[rows[k]]``, elementwise."""
        return ((self._flat[rows * self.bits.shape[1] + (nodes >> 3)] >> (nodes & 7).astype(np.uint8)) & 1).astype(bool)

    def max_new(self, vals: np.ndarray, pi: np.ndarray, pj: np.ndarray) -> np.ndarray:
        """max_{u ∈ L_j \\ L_i} vals[u] for pairs L_i ⊊ L_j (``vals`` ≥ 0, indexed by node).

        The new segment lies within the node range [first_out(L_i), last_in(L_j)]; where it fills that
        range a sparse-table range maximum answers at once, elsewhere the packed rows are scanned byte by
        byte through a table of the maximum over each byte pattern.
        """
        table, log2, bytes_max = self.range_max_tables(vals)
        n = len(vals)
        lo, hi = self.first_out[pi], self.last_in[pj]
        out = np.empty(len(pi))
        full = (self.size[pj] - self.size[pi]) == hi - lo + 1
        f = np.flatnonzero(full)
        if f.size:
            lf, hf = lo[f], hi[f]
            k = log2[hf - lf + 1]
            out[f] = np.maximum(table[k * n + lf], table[k * n + hf - (1 << k) + 1])
        r = np.flatnonzero(~full)
        if r.size:
            blo, bhi = lo[r] >> 3, hi[r] >> 3
            ptr = np.zeros(r.size + 1, dtype=np.int64)
            ptr[1:] = np.cumsum(bhi - blo + 1)
            rep, flat = expand(ptr, np.arange(r.size))
            byte = blo[rep] + (flat - ptr[rep])
            pat = self.bits[pj[r][rep], byte] & ~self.bits[pi[r][rep], byte]
            out[r] = np.maximum.reduceat(bytes_max[byte, pat], ptr[:-1])
        return out

    def range_max_tables(self, vals: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """What :meth:`max_new` answers with, kept per ``vals`` array: its sparse table (flattened, level-major),
        ⌊log2⌋ of every range length, and the maximum over each byte pattern of each byte of nodes."""
        key = ("max", id(vals))
        if key not in self.cache:
            self.cache[key] = (vals, _sparse_table(vals).reshape(-1), _byte_table(vals))
        if "log2" not in self.cache:
            self.cache["log2"] = np.r_[0, np.floor(np.log2(np.arange(1, len(vals) + 1))).astype(np.int64)]
        _, table, bytes_max = self.cache[key]
        return table, self.cache["log2"], bytes_max

    # -- moves -------------------------------------------------------------------------------------------------
    def subset(self, pi: np.ndarray, pj: np.ndarray) -> np.ndarray:
        """L_i ⊆ L_j for pairs with |L_i| < |L_j|: every maximal member of L_i is in L_j."""
        lens = self.mx_ptr[pi + 1] - self.mx_ptr[pi]
        if not len(pi) or lens.max() <= 1:  # ∅, or one maximal member (every L_v): one lookup
            node = self.mx_node[np.minimum(self.mx_ptr[pi], len(self.mx_node) - 1)]
            return (lens == 0) | self.member(pj, node)
        rep, flat = expand(self.mx_ptr, pi)
        miss = ~self.member(pj[rep], self.mx_node[flat])
        return np.bincount(rep[miss], minlength=len(pi)) == 0

    def moves(self, weight: np.ndarray, cap: float, sources: np.ndarray, targets: np.ndarray | None = None,
              limit: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """All pairs (i, j), i in ``sources``, j in ``targets`` (default: all), with L_i ⊊ L_j and
        weight[j] - weight[i] ≤ cap, sorted by j then i. ``weight`` must grow with the set.

        Raises :class:`FxplanError` if more than ``limit`` candidate pairs would be examined.
        """
        sources = np.asarray(sources, dtype=np.int64)
        order, lo, hi = self._windows(weight, cap, sources, targets)
        lens = hi - lo
        ends = np.cumsum(lens)
        if limit is not None and len(ends) and ends[-1] > limit:
            raise FxplanError(
                f"the DP would examine {int(ends[-1]):,} moves between {self.S:,} lower sets, more than the "
                f"{limit:,} allowed (memory); use the approximate DP (solver='approx', exact=False), or a smaller "
                "budget, or raise dp.solve's max_states"
            )
        out_i, out_j = [], []
        start = 0
        while start < len(sources):
            stop = int(np.searchsorted(ends, (ends[start - 1] if start else 0) + CHUNK, side="right"))
            stop = max(stop, start + 1)
            src = sources[start:stop]
            ptr = np.zeros(len(src) + 1, dtype=np.int64)
            ptr[1:] = np.cumsum(lens[start:stop])
            rep, flat = expand(ptr, np.arange(len(src)))
            pi = src[rep]
            pj = order[lo[start:stop][rep] + flat - ptr[rep]]
            keep = self.size[pj] > self.size[pi]
            pi, pj = pi[keep], pj[keep]
            keep = self.subset(pi, pj)
            out_i.append(pi[keep])
            out_j.append(pj[keep])
            start = stop
        pi = np.concatenate(out_i) if out_i else np.zeros(0, dtype=np.int64)
        pj = np.concatenate(out_j) if out_j else np.zeros(0, dtype=np.int64)
        order = np.lexsort((pi, pj))
        return pi[order], pj[order]

    def candidate_count(self, weight: np.ndarray, cap: float, sources: np.ndarray, targets: np.ndarray) -> int:
        """How many pairs :meth:`moves` would examine (before its subset tests), without listing them."""
        _, lo, hi = self._windows(weight, cap, np.asarray(sources, dtype=np.int64), targets)
        return int((hi - lo).sum())

    def _windows(self, weight: np.ndarray, cap: float, sources: np.ndarray, targets: np.ndarray | None
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The targets sorted by weight, and per source the range of them within ``cap`` of its weight."""
        tol = 1e-9 * (float(np.abs(weight).max()) + 1.0)
        tgt = np.arange(self.S) if targets is None else np.asarray(targets, dtype=np.int64)
        order = tgt[np.argsort(weight[tgt], kind="stable")]
        ws = weight[order]
        lo = np.searchsorted(ws, weight[sources] - tol, side="left")
        hi = np.searchsorted(ws, weight[sources] + cap + tol, side="right") if np.isfinite(cap) else \
            np.full(len(sources), len(ws), dtype=np.int64)
        return order, lo, hi

    def boundary_runs(self, pi: np.ndarray, pj: np.ndarray, saver_pairs: np.ndarray | None = None,
                      in_rstar: np.ndarray | None = None
                      ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray | None]:
        """For every pair (L_i ⊊ L_j) and boundary member u ∈ ∂(L_i): (pair, u, stays, read, saved).

        ``stays``: u has a consumer outside L_j (u ∈ ∂(L_j)); ``read``: a consumer in L_j \\ L_i;
        ``saved`` (when ``saver_pairs``, sorted keys u·n + w of "w saves u", and ``in_rstar``, per boundary
        entry whether u is already saved inside its set, are given): not ``in_rstar`` and a node of
        L_j \\ L_i saves u. Consumers are looked up edge by edge, or, where the boundary members have
        many consumers and the family is small (``dense_counts``), from per-set consumer counts.
        """
        n = self.ix.n
        if self.dense_counts:
            if "counts" not in self.cache:
                self.cache["counts"] = self._counts(self.ix.dsucc)
            counts = self.cache["counts"]
            rep, flat = expand(self.bd_ptr, pi)
            u = self.bd_node[flat]
            ci, cj = counts[pi[rep], u], counts[pj[rep], u]
            stays = cj < self.outdeg[u]
            read = cj > ci
            saved = None
            if saver_pairs is not None:
                key = ("savers", id(saver_pairs))
                if key not in self.cache:
                    sv = [0] * n
                    for k in saver_pairs.tolist():
                        sv[k // n] |= 1 << (k % n)
                    self.cache[key] = (saver_pairs, self._counts(sv))
                saved = ~in_rstar[flat] & (self.cache[key][1][pj[rep], u] > 0)
            return rep, u, stays, read, saved
        oe_ptr, oe_u, oe_w, oe_bd = self.leaving_edges()
        rep, flat = expand(oe_ptr, pi)
        w = oe_w[flat]
        inside = self.member(pj[rep], w)
        u = oe_u[flat]
        starts = np.flatnonzero(np.r_[True, (rep[1:] != rep[:-1]) | (u[1:] != u[:-1])]) if len(rep) else rep
        if not len(rep):
            return rep, u, rep.astype(bool), rep.astype(bool), None if saver_pairs is None else rep.astype(bool)
        stays = np.logical_or.reduceat(~inside, starts)
        read = np.logical_or.reduceat(inside, starts)
        saved = None
        if saver_pairs is not None:
            saved = np.logical_or.reduceat(inside & self.leaving_edges_saved(saver_pairs, in_rstar)[flat], starts)
        return rep[starts], u[starts], stays, read, saved

    def leaving_edges_saved(self, saver_pairs: np.ndarray, in_rstar: np.ndarray) -> np.ndarray:
        """Per leaving edge u → w (:meth:`leaving_edges`): w saves u (``saver_pairs``: sorted keys u·n + w)
        and u is not saved inside its set yet (``in_rstar``, per boundary entry); kept per ``saver_pairs``."""
        key = ("saver_edges", id(saver_pairs))
        if key not in self.cache:
            _, oe_u, oe_w, oe_bd = self.leaving_edges()
            self.cache[key] = (saver_pairs, np.isin(oe_u * self.ix.n + oe_w, saver_pairs) & ~in_rstar[oe_bd])
        return self.cache[key][1]

    @property
    def outdeg(self) -> np.ndarray:
        if "outdeg" not in self.cache:
            self.cache["outdeg"] = np.array([m.bit_count() for m in self.ix.dsucc], dtype=np.int32)
        return self.cache["outdeg"]

    def _counts(self, adj: list[int]) -> np.ndarray:
        """C[k, u] = |adj[u] ∩ sets[k]| (adj: bitsets), built along the base decomposition."""
        n = self.ix.n
        rev: list[list[int]] = [[] for _ in range(n)]
        for u, m in enumerate(adj):
            for w in iter_bits(m):
                rev[w].append(u)
        C = np.zeros((self.S, n), dtype=np.int32)
        ex_ptr, ex_node = self.ex_ptr.tolist(), self.ex_node.tolist()
        for k, b in enumerate(self.base.tolist()):
            if b >= 0:
                C[k] = C[b]
            hit = [u for w in ex_node[ex_ptr[k]:ex_ptr[k + 1]] for u in rev[w]]
            if hit:
                np.add.at(C[k], hit, 1)
        return C


def _sparse_table(vals: np.ndarray) -> np.ndarray:
    n = len(vals)
    levels = max(1, int(n).bit_length())
    table = np.zeros((levels, n))
    table[0] = vals
    for k in range(1, levels):
        h = 1 << (k - 1)
        table[k, : n - h] = np.maximum(table[k - 1, : n - h], table[k - 1, h:])
        table[k, n - h:] = table[k - 1, n - h:]
    return table


def _byte_table(vals: np.ndarray) -> np.ndarray:
    n = len(vals)
    nb = (n + 7) // 8
    padded = np.full(nb * 8, -np.inf)
    padded[:n] = vals
    per = padded.reshape(nb, 8)
    pats = np.arange(256)
    out = np.full((nb, 256), -np.inf)
    for k in range(8):
        has = (pats >> k) & 1 == 1
        out[:, has] = np.maximum(out[:, has], per[:, k : k + 1])
    return out
