"""Blocks of a (possibly nested) plan -> calls of :class:`~fxplan.rewriter.recompute.Segment` modules in an FX graph.

The code generation half of :func:`fxplan.rewriter.codegen.segment_module`: after the rewriter has settled copies
for in-place ops on the innermost segments, each block becomes one function whose inputs are the values
it reads from outside and whose outputs are the values read outside it; a block with a sub-plan
(:mod:`fxplan.solvers.subplans`) becomes a function that calls its sub-segments in turn.
"""

from __future__ import annotations

import operator
from collections.abc import Iterator

import torch
import torch.fx as fx

from fxplan.errors import FxplanError
from fxplan.rewriter import offload
from fxplan.rewriter.recompute import Segment
from fxplan.solvers import subplans


def _segment_name(gm: torch.nn.Module, base: str, i: int) -> str:
    for prefix in (base, f"fxplan_{base}", f"_fxplan_{base}"):
        if not hasattr(gm, f"{prefix}{i}"):
            return f"{prefix}{i}"
    raise FxplanError(f"cannot find a free attribute name for segment {base}{i}")


def _copy_nodes(g: fx.Graph, env: dict[fx.Node, fx.Node], block: list[fx.Node],
                offloaded: frozenset[str] = frozenset()) -> None:
    """Copy ``block``'s nodes into ``g`` in order, with the attributes they read (``env`` maps inputs); a node in
    ``offloaded`` is followed by the call that marks its value offloaded (:func:`fxplan.rewriter.offload.mark`)."""
    for v in block:
        for u in v.all_input_nodes:
            if u.op == "get_attr" and u not in env:
                env[u] = g.node_copy(u)
        env[v] = g.node_copy(v, env.__getitem__)
        if v.name in offloaded:
            g.call_function(offload.mark, (env[v], v.name))


class Emitter:
    """Emits blocks (and, recursively, their sub-blocks) as :class:`Segment` calls into a graph."""

    def __init__(self, gm: fx.GraphModule, pos: dict[fx.Node, int], blocks: list[subplans.Block],
                 leaf_nodes: Iterator[list[fx.Node]], plain: set[int] | None = None,
                 offloaded: frozenset[str] = frozenset()):
        self.gm, self.pos = gm, pos
        self.offloaded = offloaded  # node names whose values are offloaded (:mod:`fxplan.rewriter.offload`)
        self.plain = plain or set()  # ids of one-op blocks emitted inline in their parent (not checkpointed)
        self.nodes: dict[int, list[fx.Node]] = {}  # id(block) -> its nodes (after in-place copies)
        self._assign(blocks, leaf_nodes)
        self.made: list[Segment] = []

    def _assign(self, blocks: list[subplans.Block], leaf_nodes: Iterator[list[fx.Node]]) -> list[fx.Node]:
        out: list[fx.Node] = []
        for b in blocks:
            self.nodes[id(b)] = next(leaf_nodes) if b.sub is None else self._assign(b.sub, leaf_nodes)
            out += self.nodes[id(b)]
        return sorted(out, key=self.pos.__getitem__)

    def emit(self, g: fx.Graph, env: dict[fx.Node, fx.Node], blocks: list[subplans.Block],
             prefix: str) -> dict[str, Segment]:
        """Add one call per block to ``g`` (``env``: original node -> node of ``g``); return the segments
        by attribute name. Every block but the last is checkpointed; the last one of a sub-plan is
        recomputed as part of its parent segment only (its backward comes first, right after). A block in
        ``plain`` (an in-place op split off by the rewriter) is emitted inline, with no segment of its own."""
        made: dict[str, Segment] = {}
        i = -1
        for b in blocks:
            block = self.nodes[id(b)]
            if id(b) in self.plain:  # runs inline, never checkpointed on its own
                _copy_nodes(g, env, block, self.offloaded)
                continue
            i += 1
            members = set(block)
            inputs = sorted(
                {u for v in block for u in v.all_input_nodes if u not in members and u.op != "get_attr"},
                key=self.pos.__getitem__,
            )
            outputs = [v for v in block if any(u not in members for u in v.users)]
            sg = fx.Graph()
            senv: dict[fx.Node, fx.Node] = {u: sg.placeholder(u.name) for u in inputs}
            targets: list[str] = []
            attr_targets: list[str] = []
            for v in block:
                for u in v.all_input_nodes:
                    if u.op == "get_attr" and str(u.target) not in attr_targets:
                        attr_targets.append(str(u.target))
                if v.op == "call_module" and str(v.target) not in targets:
                    targets.append(str(v.target))
            name = _segment_name(self.gm, f"{prefix}_", i)
            recompute = b is not blocks[-1]
            inner: dict[str, Segment] = {}
            if b.sub is None:
                _copy_nodes(sg, senv, block, self.offloaded)
            else:
                inner = self.emit(sg, senv, b.sub, name)
            if len(outputs) == 1:
                sg.output(senv[outputs[0]])
            else:
                sg.output(tuple(senv[o] for o in outputs))
            seg = Segment(self.gm, sg, "Segment" + name.rsplit("segment_", 1)[-1], recompute=recompute, targets=targets,
                          attr_targets=attr_targets, children=inner)
            made[name] = seg
            self.made.append(seg)
            args = tuple(env[u] for u in inputs)
            if len(outputs) == 1:
                env[outputs[0]] = g.create_node("call_module", name, args, {}, name=outputs[0].name)
            else:
                call = g.create_node("call_module", name, args, {}, name=name)
                for j, o in enumerate(outputs):
                    env[o] = g.create_node("call_function", operator.getitem, (call, j), {}, name=o.name)
        return made
