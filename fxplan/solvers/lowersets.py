"""Lower sets of a cost graph as bitsets (Kusumoto et al. 2019, sections 2, 4.2 and 4.3).

A lower set ``L`` is a set of nodes with no edge entering it from outside (δ⁻(L) ⊆ L). Every plan the
planner considers is an increasing sequence of lower sets ``L1 ≺ … ≺ Lk = V``.

Representation: nodes are numbered by a topological order (program order where it is one) and a set is a
Python ``int`` whose bit ``i`` says whether node ``i`` belongs to it. Python ints are arbitrary-precision, so
this works for any graph size, and union / intersection / subset tests are single machine-level operations
on a few words.

Enumeration (:func:`enumerate_lower_sets`) relies on one fact: if ``L`` is a lower set and its members are
listed by increasing topological index, every prefix of that list is a lower set too (a node's
predecessors come before it). So a depth-first search that grows a set by one *addable* node (all its
predecessors already in) at a time, and only ever adds nodes of higher index than the last one added,
reaches every lower set exactly once. The addable nodes are kept as a bitmask and updated from the added
node's successors, so the cost per lower set is about the degree of one node: googlenet's ~327,000 lower
sets take a second or two.

The pruned family of section 4.3 (:func:`pruned_lower_sets`) is ``{L_v}``: ``L_v`` = ``v`` and all its
ancestors.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np

from fxplan.errors import FxplanError
from fxplan.solvers.costgraph import CostGraph

#: Masks with more set bits than this are read through numpy: each step of the bit loop costs O(words of
#: the mask), so a lower set of a 10,000-node graph took milliseconds the loop's way.
DENSE_BITS = 64


def _bit_list(mask: int) -> list[int]:
    raw = np.frombuffer(mask.to_bytes((mask.bit_length() + 7) // 8, "little"), dtype=np.uint8)
    return np.flatnonzero(np.unpackbits(raw, bitorder="little")).tolist()


def iter_bits(mask: int) -> Iterator[int]:
    """Indices of the set bits of ``mask``, lowest first."""
    if mask.bit_count() > DENSE_BITS:
        yield from _bit_list(mask)
        return
    while mask:
        low = mask & -mask
        yield low.bit_length() - 1
        mask ^= low


def weighted_sum(mask: int, weights: list[int] | list[float]) -> int | float:
    """Σ weights[i] over the set bits i of ``mask`` (M(S) or T(S) of a bitset S), added lowest bit first."""
    total = 0
    for i in iter_bits(mask):
        total += weights[i]
    return total


@dataclass
class GraphIndex:
    """A cost graph numbered by topological order, with the per-node bitmasks the planner needs.

    ``pred[i]`` / ``succ[i]``: bitmasks of the predecessors / successors of node ``i`` over all edges, which
    define the lower sets; ``dpred`` / ``dsucc``: the same over *data* edges only (edges without
    ``order_only=True``; the tracer adds order-only edges to keep random ops and in-place readers in
    program order). Boundaries and every memory term use data edges: an order-only edge carries no value;
    ``anc[i]``: the ancestor closure ``L_v`` of node ``i`` (``i`` included), section 4.3.
    ``M`` / ``T``: output bytes and forward cost per node, as Python lists (fast scalar access) and as numpy
    arrays (``M_np``, ``T_np``).
    """

    cg: CostGraph
    names: list[str]
    pos: dict[str, int]
    pred: list[int]
    succ: list[int]
    anc: list[int]
    dpred: list[int]
    dsucc: list[int]
    M: list[int]
    T: list[float]
    M_np: np.ndarray = field(repr=False)
    T_np: np.ndarray = field(repr=False)

    @property
    def n(self) -> int:
        return len(self.names)

    @property
    def full(self) -> int:
        """The bitset of V."""
        return (1 << self.n) - 1

    @classmethod
    def build(cls, cg: CostGraph) -> GraphIndex:
        """Number ``cg`` topologically and precompute predecessor, successor and ancestor bitmasks."""
        if cg.number_of_nodes() == 0:
            raise FxplanError("the cost graph is empty: there is nothing to plan")
        names = cg.topo_order()
        pos = {v: i for i, v in enumerate(names)}
        n = len(names)
        pred = [0] * n
        succ = [0] * n
        dpred = [0] * n
        dsucc = [0] * n
        for v, w, order_only in cg.edges(data="order_only", default=False):
            pred[pos[w]] |= 1 << pos[v]
            succ[pos[v]] |= 1 << pos[w]
            if not order_only:
                dpred[pos[w]] |= 1 << pos[v]
                dsucc[pos[v]] |= 1 << pos[w]
        anc = [0] * n
        for i in range(n):  # topological order: ancestors of the predecessors are final already
            a = 1 << i
            for j in iter_bits(pred[i]):
                a |= anc[j]
            anc[i] = a
        M = [int(cg.nodes[v]["M"]) for v in names]
        T = [float(cg.nodes[v]["T"]) for v in names]
        return cls(cg, names, pos, pred, succ, anc, dpred, dsucc, M, T, np.array(M, dtype=np.float64),
                   np.array(T))

    # -- conversions -------------------------------------------------------------------------------------
    def mask(self, nodes: Iterable[str]) -> int:
        """Bitset of a collection of node names."""
        m = 0
        for v in nodes:
            m |= 1 << self.pos[v]
        return m

    def names_of(self, mask: int) -> list[str]:
        """Node names of a bitset, in topological order."""
        return self._names_array[self.indices(mask)].tolist()

    @cached_property
    def _names_array(self) -> np.ndarray:
        return np.array(self.names, dtype=object)

    def indices(self, mask: int) -> np.ndarray:
        """Node indices of a bitset, increasing."""
        raw = np.frombuffer(mask.to_bytes((self.n + 7) // 8, "little"), dtype=np.uint8)
        return np.flatnonzero(np.unpackbits(raw, bitorder="little"))

    # -- set functions of section 2 ----------------------------------------------------------------------
    def is_lower(self, mask: int) -> bool:
        """True if no edge enters ``mask`` from outside (δ⁻(L) ⊆ L)."""
        for i in iter_bits(mask):
            if self.pred[i] & ~mask:
                return False
        return True

    def boundary(self, mask: int) -> int:
        """∂(L) = δ⁻(V \\ L) ∩ L: members of L whose value a node outside L reads (data edges)."""
        out = 0
        for i in iter_bits(mask):
            if self.dsucc[i] & ~mask:
                out |= 1 << i
        return out

    def next_boundary(self, bd: int, Lp: int, Vp: int) -> int:
        """∂(L') from ∂(L), for lower sets L ⊊ L' with V' = L' \\ L: only ∂(L) ∪ V' can be on ∂(L')."""
        out = 0
        outside = ~Lp
        for i in iter_bits(bd | Vp):
            if self.dsucc[i] & outside:
                out |= 1 << i
        return out

    def delta_plus(self, mask: int) -> int:
        """δ⁺(S): nodes reading a value of S (data edges)."""
        out = 0
        for i in iter_bits(mask):
            out |= self.dsucc[i]
        return out

    def delta_minus(self, mask: int) -> int:
        """δ⁻(S): nodes whose values S reads (data edges)."""
        out = 0
        for i in iter_bits(mask):
            out |= self.dpred[i]
        return out

    def msum(self, mask: int) -> int:
        """M(S) in bytes."""
        return int(weighted_sum(mask, self.M))

    def tsum(self, mask: int) -> float:
        """T(S)."""
        return float(weighted_sum(mask, self.T))


def _supersets(ix: GraphIndex, base: int, limit: int | None) -> Iterator[int]:
    """All lower sets L' ⊋ ``base`` (``base`` must be a lower set), each once, depth first."""
    full = ix.full
    pred, succ = ix.pred, ix.succ
    addable = 0
    for i in iter_bits(full & ~base):
        if not pred[i] & ~base:
            addable |= 1 << i
    # stack entries: (current set, addable set, lowest index allowed for the next node)
    stack = [(base, addable, 0)]
    count = 0
    while stack:
        cur, add, lo = stack.pop()
        cand = add >> lo << lo
        while cand:
            low = cand & -cand
            cand ^= low
            i = low.bit_length() - 1
            nxt = cur | low
            nadd = add ^ low
            for j in iter_bits(succ[i]):
                if not pred[j] & ~nxt:
                    nadd |= 1 << j
            yield nxt
            count += 1
            if limit is not None and count >= limit:
                return
            stack.append((nxt, nadd, i + 1))


def enumerate_lower_sets(cg_or_ix: CostGraph | GraphIndex, *, limit: int | None = None) -> list[int]:
    """All lower sets of the graph (∅ and V included) as bitsets, sorted by size, then by value.

    ``limit`` caps the number enumerated (an :class:`FxplanError` is raised beyond it) so a caller can
    refuse graphs whose lattice is too large instead of running out of memory.
    """
    ix = cg_or_ix if isinstance(cg_or_ix, GraphIndex) else GraphIndex.build(cg_or_ix)
    out = [0]
    for s in _supersets(ix, 0, None if limit is None else limit + 1):
        out.append(s)
        if limit is not None and len(out) > limit:
            raise _more_than(limit)
    out.sort(key=lambda m: (m.bit_count(), m))
    return out


def count_lower_sets(cg_or_ix: CostGraph | GraphIndex, *, limit: int | None = None) -> int:
    """#L_G, the number of lower sets (∅ and V included), without keeping them; ``limit`` as for
    :func:`enumerate_lower_sets` (an :class:`FxplanError` beyond it, found without counting further)."""
    ix = cg_or_ix if isinstance(cg_or_ix, GraphIndex) else GraphIndex.build(cg_or_ix)
    count = 1 + sum(1 for _ in _supersets(ix, 0, None if limit is None else limit + 1))
    if limit is not None and count > limit:
        raise _more_than(limit)
    return count


def _more_than(limit: int) -> FxplanError:
    return FxplanError(f"the graph has more than {limit} lower sets; use the approximate DP (exact=False)")


def pruned_lower_sets(cg_or_ix: CostGraph | GraphIndex) -> list[int]:
    """The pruned family of section 4.3: {L_v | v ∈ V} plus ∅ and V, sorted by size.

    ``L_v`` is ``v`` with all its ancestors. ∅ is the DP's start; V is added because it is an ``L_v`` only
    when the graph has a single sink.
    """
    ix = cg_or_ix if isinstance(cg_or_ix, GraphIndex) else GraphIndex.build(cg_or_ix)
    fam = set(ix.anc) | {0, ix.full}
    return sorted(fam, key=lambda m: (m.bit_count(), m))


def supersets_of(ix: GraphIndex, base: int) -> Iterator[int]:
    """All lower sets strictly containing the lower set ``base``, each once."""
    return _supersets(ix, base, None)
