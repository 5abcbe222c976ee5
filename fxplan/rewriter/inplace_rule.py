"""The rule for in-place ops under a plan, stated once for the rewriter and for the replay.

A recomputed segment keeps its inputs and runs again in backward, so no in-place op may overwrite a value a
recomputation reads. The rewriter applies the rule to the fx graph it rewrites
(:class:`fxplan.rewriter.planned_graph.Rewrite`); the replay reads it off the step model to count the storages the
rewritten module holds (:mod:`fxplan.planner.replay`). Both ask these two functions, each on its own nodes (fx nodes,
node names):

* :func:`inplace_openers`: the in-place ops that open a recomputed segment on a value from an earlier segment and can
  run alone, between the two segments, on the value itself;
* :func:`read_by_recompute`: whether a value that shares the storage an in-place op overwrites is read, as an input,
  by a recomputed segment that runs no later than the op; such an op (unless it opens its segment as above) runs on
  a private copy of its operand. The rewriter also copies where a plan moves the op across a reader of the old
  value (:meth:`fxplan.rewriter.planned_graph.Rewrite.fix_inplace`), which the replay does not model.

Segments are numbered in execution order; the last one (``k - 1``) is not recomputed. A node of no segment (a
placeholder, an attribute) has a segment number below every segment's, the graph's output one above.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Collection, Hashable, Iterable, Mapping
from typing import TypeVar

N = TypeVar("N", bound=Hashable)


def inplace_openers(overwrites: Iterable[tuple[N, N]], sources: Mapping[N, N], seg_of: Callable[[N], int], k: int,
                    first: Callable[[int], N], position: Mapping[N, int], inputs: Callable[[N], Iterable[N]],
                    readers: Callable[[N], Iterable[N]]) -> list[tuple[N, int, int]]:
    """The in-place ops of ``overwrites`` that run by themselves between two segments, as ``(op, j, s)``: the op
    opens segment ``s`` on a value of segment ``j``.

    ``overwrites``: ``(op, a)`` in program order for the in-place ops that may run so, ``a`` the value the op
    overwrites, both in the plan's segments (random ops may not: their order is fixed); ``sources``: node -> the node
    whose storage its value shares (in-place ops and views); ``seg_of``: a node's segment; ``first(s)``: the first
    node of segment ``s`` in program order; ``position``: each node's place in program order; ``inputs`` and
    ``readers``: the nodes a node reads, and those that read its value.

    A ``relu_(a)`` that is the first node of segment ``s`` while ``a`` comes from segment ``j < s`` would need a
    private copy of ``a``: the recomputed segment keeps ``a`` as its input and must not overwrite it. Where ``a`` is
    no alias and has no other alias, the op's other inputs come from segments ``<= j``, and the other readers of
    ``a`` that come before the op in program order run in segments ``<= j`` too (ResNet's ``out += identity; out =
    relu(out)`` at a block boundary), the op runs by itself, not recomputed, between the two: the same program, the
    op overwrites ``a`` as the model does, its autograd node saves what it saves in the model (for ReLU: its result,
    the very tensor segment ``s`` keeps as input), and nothing is copied.
    """
    shared = Counter(sources.values())
    found = []
    for n, a in overwrites:
        j, s = seg_of(a), seg_of(n)
        if not (j < s < k - 1 and first(s) == n):
            continue
        if shared[a] > 1 or a in sources:
            continue  # a is an alias, or has a view or another in-place op: it gets the copy
        if any(seg_of(u) > j for u in inputs(n) if u != a):
            continue
        if any(seg_of(r) > j for r in readers(a) if r != n and position[r] < position[n]):
            continue  # a reader of the old value would run after the op
        found.append((n, j, s))
    return found


def read_by_recompute(members: Iterable[N], s: int, seg_of: Callable[[N], int], readers: Callable[[N], Iterable[N]],
                      k: int, plain: Collection[int] = ()) -> bool:
    """True if a value of ``members`` (those sharing the storage that an in-place op of segment ``s`` overwrites) is
    read by a recomputed segment that runs no later than the op, as that segment's input: a segment ``<= s`` other
    than the value's own, neither the last (``k - 1``) nor one of ``plain`` (segments that are not checkpointed: the
    in-place ops :func:`inplace_openers` finds, each split off into a segment of its own)."""
    for m in members:
        for r in readers(m):
            t = seg_of(r)
            if t <= s and t < k - 1 and t not in plain and t != seg_of(m):
                return True
    return False
