"""The plan applied to a private copy of the captured graph, checked and made safe to run segment by segment.

:func:`validate` checks that a plan is one the rewriter can run: its segments name every compute node once, in
execution order. :class:`Rewrite` gives each node of a copy of the graph its segment and deals with what the data
graph does not say (:mod:`fxplan.capture.effects`): an in-place op that opens a recomputed segment on a value from an
earlier one, and can run alone, runs between the segments (:meth:`Rewrite.inplace_openers`; :func:`split_off` gives it
a block of its own); any other in-place op whose overwritten value a recomputation reads, or that the plan moves
across a reader of the old value, runs on a private copy of its operand (:meth:`Rewrite.fix_inplace`); a plan that
reorders random ops is refused (:meth:`Rewrite.check_random_order`). :func:`fxplan.rewriter.codegen.segment_module`
generates the module from the graph so rewritten. The in-place rule itself is :mod:`fxplan.rewriter.inplace_rule`'s,
which the replay of a plan's step follows too.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch.fx as fx

from fxplan.capture import effects
from fxplan.common.console import format_count
from fxplan.errors import FxplanError
from fxplan.rewriter.inplace_rule import inplace_openers, read_by_recompute
from fxplan.solvers import subplans

logger = logging.getLogger("fxplan")
_WARNED_INPUTS: set[tuple[str, str]] = set()

_LAST = 1 << 30  # segment index of the output node


def validate(gm: fx.GraphModule, segments: Sequence[Sequence[str]]) -> list[list[str]]:
    """``segments`` as lists of node names, checked as the module docstring says (an FxplanError says what is
    wrong)."""
    if not isinstance(gm, fx.GraphModule):
        raise FxplanError(
            f"segment_module needs a torch.fx.GraphModule, got {type(gm).__name__}; "
            "trace the model first (torch.fx.symbolic_trace(model))"
        )
    if isinstance(segments, (str, bytes)) or not isinstance(segments, Sequence):
        raise FxplanError("segments must be a list of lists of node names")
    plan = []
    for i, seg in enumerate(segments):
        if isinstance(seg, (str, bytes)) or not isinstance(seg, Sequence):
            raise FxplanError(f"segment {i} must be a list of node names, got {seg!r}")
        if len(seg) == 0:
            raise FxplanError(f"segment {i} is empty; drop it from the plan")
        plan.append([str(v) for v in seg])
    if not plan:
        raise FxplanError("the plan has no segments; pass at least one (all compute nodes)")
    compute = [n.name for n in gm.graph.nodes if effects.is_compute(n)]
    names = {n.name: n for n in gm.graph.nodes}
    seen: dict[str, int] = {}
    for i, seg in enumerate(plan):
        for v in seg:
            if v not in names:
                raise FxplanError(f"segment {i} names {v!r}, which is not a node of the graph")
            if not effects.is_compute(names[v]):
                raise FxplanError(
                    f"segment {i} names {v!r}, a {names[v].op} node; segments list only compute "
                    "nodes (call_module, call_function, call_method)"
                )
            if v in seen:
                raise FxplanError(f"node {v!r} appears in segments {seen[v]} and {i}; list it once")
            seen[v] = i
    missing = [v for v in compute if v not in seen]
    if missing:
        raise FxplanError(
            f"the plan leaves out {format_count(len(missing), 'compute node')}, e.g. {missing[:5]}; "
            "every compute node must be in exactly one segment"
        )
    for n in gm.graph.nodes:
        if n.name in seen:
            for u in n.all_input_nodes:
                if u.name in seen and seen[u.name] > seen[n.name]:
                    raise FxplanError(
                        f"node {n.name!r} in segment {seen[n.name]} uses {u.name!r} from later "
                        f"segment {seen[u.name]}; segments must be in execution order "
                        "(each union of the first i segments a lower set)"
                    )
    return plan


class Rewrite:
    """The plan applied to a private copy of the graph: segment of each node, copies, redirects."""

    def __init__(self, gm: fx.GraphModule, plan: list[list[str]], plain: frozenset[int] = frozenset()):
        self.gm = gm
        self.plain = plain  # leaves that are not checkpointed (in-place ops split off by split_off)
        self.graph = copy.deepcopy(gm.graph)
        by_name = {n.name: n for n in self.graph.nodes}
        self.seg: dict[fx.Node, int] = {}
        for i, names in enumerate(plan):
            for v in names:
                self.seg[by_name[v]] = i
        self.k = len(plan)
        # Classify once: rewriting only swaps argument nodes, never what a node is.
        self.mpos = {n: effects.mutated_position(n, gm) for n in self.graph.nodes if effects.is_compute(n)}
        self.is_view = {
            n: self.mpos[n] is None and effects.view_source(n, gm) is not None for n in self.mpos
        }

    def _source(self, n: fx.Node) -> fx.Node | None:
        where = self.mpos.get(n)
        if where is not None:
            kind, key = where
            value = n.args[key] if kind == "arg" else n.kwargs.get(key)  # type: ignore[index]
            return value if isinstance(value, fx.Node) else None
        if self.is_view.get(n):
            first = n.args[0]
            return first if isinstance(first, fx.Node) else None
        return None

    def roots(self) -> dict[fx.Node, fx.Node]:
        root: dict[fx.Node, fx.Node] = {}
        for n in self.graph.nodes:
            src = self._source(n)
            root[n] = root.get(src, src) if src is not None else n
        return root

    def seg_of(self, node: fx.Node) -> int:
        if node.op == "output":
            return _LAST
        return self.seg.get(node, -1)  # placeholders and attributes: available everywhere

    def inplace_openers(self) -> list[tuple[str, int, int]]:
        """In-place ops that would open a recomputed leaf on a value from an earlier leaf, and can run alone, as
        ``(op name, j, s)`` (:func:`fxplan.rewriter.inplace_rule.inplace_openers` on this graph's leaves):
        :func:`fxplan.rewriter.codegen.segment_module` runs each by itself, not recomputed, between leaves ``j`` and
        ``s``, where :meth:`fix_inplace` would copy its operand. Random ops are never split off (their order is
        fixed)."""
        pos = {v: i for i, v in enumerate(self.graph.nodes)}
        first: dict[int, fx.Node] = {}
        for v in self.graph.nodes:
            if v in self.seg:
                first.setdefault(self.seg[v], v)
        sources = {n: a for n in self.graph.nodes if (a := self._source(n)) is not None}
        overwrites = [(n, a) for n, a in sources.items()
                      if self.mpos.get(n) is not None and a in self.seg and not effects.is_random(n, self.gm)]
        found = inplace_openers(overwrites, sources, self.seg_of, self.k, first.__getitem__, pos,
                                lambda n: n.all_input_nodes, lambda a: a.users)
        return [(n.name, j, s) for n, j, s in found]

    def fix_inplace(self, copy_function: Callable[[Any], Any]) -> None:
        """Copy the operand of each in-place op that recomputation or the plan's order would break; ``copy_function``
        makes the copy of an operand of an in-place operator function (:func:`fxplan.rewriter.codegen.copy_for_inplace`,
        which generated code and saved modules name there)."""
        for n in list(self.graph.nodes):
            if not effects.is_compute(n):
                continue
            where = self.mpos.get(n)
            a = self._source(n) if where is not None else None
            if where is None or a is None:
                continue
            pos = {v: i for i, v in enumerate(self.graph.nodes)}
            roots = self.roots()
            members = [m for m in self.graph.nodes if roots[m] is roots[a]]
            s = self.seg_of(n)
            if roots[a].op == "get_attr":
                # A module attribute (a buffer) updated in place: the buffer guard's business, unless a
                # recomputed segment takes a value of it from another segment. Checkpoint holds that value
                # for the recomputation, and state cannot be given a private copy.
                computed = [m for m in members if m.op != "get_attr"]
                if self._read_by_recompute(computed, s):
                    raise FxplanError(
                        f"in-place op {n.name!r} (segment {s}) updates {roots[a].target!r}, a module attribute "
                        "that a recomputed segment takes from another segment; keep the attribute's in-place "
                        "updates in one segment with the ops that read them"
                    )
                continue
            if not (self._read_by_recompute(members, s) or self._reordered(members, n, pos)):
                continue
            if roots[a].op == "placeholder" and (n.name, roots[a].target) not in _WARNED_INPUTS:
                _WARNED_INPUTS.add((n.name, roots[a].target))  # once: the search generates many candidates
                logger.warning("fxplan: in-place op %r overwrites model input %r, whose old value a recomputed "
                               "segment needs: the rewritten module runs it on a private copy in training, so the "
                               "caller's tensor keeps its value where the model's forward changes it",
                               n.name, roots[a].target)
            self._copy_operand(n, a, where, members, pos, copy_function)

    def _read_by_recompute(self, members: list[fx.Node], s: int) -> bool:
        """:func:`fxplan.rewriter.inplace_rule.read_by_recompute` on this graph's leaves."""
        return read_by_recompute(members, s, self.seg_of, lambda m: m.users, self.k, self.plain)

    def _reordered(self, members: list[fx.Node], n: fx.Node, pos: dict[fx.Node, int]) -> bool:
        s = self.seg_of(n)
        for m in members:
            for r in m.users:
                if r is n:
                    continue
                if pos[r] < pos[n] and self.seg_of(r) > s:
                    return True
                if pos[r] > pos[n] and self.seg_of(r) < s:
                    return True
        return False

    def _copy_operand(self, n, a, where, members, pos, copy_function) -> None:
        later = [r for m in members for r in m.users if r is not n and pos[r] > pos[n]]
        for r in later:
            for u in r.all_input_nodes:
                if u in members and u is not a and pos[u] < pos[n]:
                    raise FxplanError(
                        f"{r.name!r} reads {u.name!r}, an alias of {a.name!r}, after in-place op "
                        f"{n.name!r} overwrote it, and the plan needs {n.name!r} made "
                        "out-of-place; keep these nodes in one segment or write the model "
                        "without the in-place op"
                    )
        s = self.seg_of(n)
        for r in later:
            if a in r.all_input_nodes:
                if self.seg_of(r) < s:
                    raise FxplanError(
                        f"{r.name!r} (segment {self.seg_of(r)}) reads {a.name!r} after in-place op "
                        f"{n.name!r} (segment {s}) overwrote it; the plan must not put "
                        f"{r.name!r} in an earlier segment (see fxplan.capture.effects.ordering_edges)"
                    )
                r.replace_input_with(a, n)
        with self.graph.inserting_before(n):
            if n.op == "call_function" and n.target in effects.INPLACE_OPERATORS:
                op, target = "call_function", copy_function
            else:
                op, target = "call_method", "clone"
            c = self.graph.create_node(op, target, (a,), {}, name=f"{a.name}_copy")
        self.seg[c] = s
        kind, key = where
        if kind == "arg":
            n.update_arg(key, c)
        else:
            n.update_kwarg(key, c)

    def check_random_order(self) -> None:
        last: fx.Node | None = None
        for n in self.graph.nodes:
            if effects.is_compute(n) and effects.is_random(n, self.gm):
                if last is not None and self.seg_of(n) < self.seg_of(last):
                    raise FxplanError(
                        f"the plan runs random op {n.name!r} (segment {self.seg_of(n)}) before "
                        f"{last.name!r} (segment {self.seg_of(last)}), which precedes it in the "
                        "model; they would draw different random numbers. Keep random ops in "
                        "program order (see fxplan.capture.effects.ordering_edges)"
                    )
                last = n


def split_off(
    blocks: list[subplans.Block], openers: list[tuple[str, int, int]]
) -> tuple[list[subplans.Block], set[int]]:
    """A copy of ``blocks`` in which each in-place op of :meth:`Rewrite.inplace_openers` is a block of its
    own that is not checkpointed, and the ids of those blocks.

    The op ``n`` opens leaf ``s``; its operand comes from leaf ``j``. The new block goes right before the
    ancestor of leaf ``s`` that is a sibling of an ancestor of leaf ``j`` (in their closest common
    parent), so the operand is made inside that parent or outside it and never a recomputed segment's
    input. Only done when leaf ``s`` is the first leaf of that ancestor (nothing else moves); a leaf that is
    ``n`` alone is not split but marked. Elsewhere :meth:`Rewrite.fix_inplace` copies the operand.
    """
    blocks = copy.deepcopy(blocks)
    paths: list[list[int]] = []

    def walk(bs: list[subplans.Block], prefix: list[int]) -> None:
        for i, b in enumerate(bs):
            if b.sub is None:
                paths.append([*prefix, i])
            else:
                walk(b.sub, [*prefix, i])

    walk(blocks, [])
    leaves = subplans.leaf_blocks(blocks)
    plain: set[int] = set()
    moves = []
    for name, j, s in openers:
        pj, ps = paths[j], paths[s]
        d = next(i for i in range(min(len(pj), len(ps))) if pj[i] != ps[i])
        if len(leaves[s].names) == 1 and len(ps) == d + 1:
            plain.add(id(leaves[s]))  # the op is a whole segment of its own: just do not checkpoint it
        elif len(leaves[s].names) > 1 and not any(x != 0 for x in ps[d + 1:]):
            moves.append((ps, name, s, d))
    for ps, name, s, d in sorted(moves, reverse=True):  # later positions first: earlier ones stay valid
        parent_path, at = ps[:d], ps[d]
        leaves[s].names.remove(name)
        siblings = blocks
        for i in parent_path:
            siblings = siblings[i].sub  # type: ignore[assignment]
        new = subplans.Block([name])
        siblings.insert(at, new)
        plain.add(id(new))
    return blocks, plain
