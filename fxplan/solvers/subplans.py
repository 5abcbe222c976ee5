"""Nested plans as the rewriter reads them: segments, each optionally split again by a sub-plan.

A plan's ``children`` (:class:`fxplan.solvers.plans.Plan`) map a segment's index (as a string) to a plan of that
segment's own nodes. The rewriter runs such a segment as a sequence of sub-segments, every one but
the last checkpointed again inside it: when backward recomputes the segment, its sub-segments keep only
their inputs, and each is recomputed once more when its own backward runs. A value can so be computed
up to depth + 1 times and be dropped inside a backward; this is the recursive plan of Chen et al.
(section 4.4), with any sequence of lower sets of the segment's subgraph as the sub-plan.

This module turns ``segments`` + ``children`` (plans or their ``to_dict`` form) into a checked tree of
:class:`Block` and back into the plain form that pickles; it knows nothing of graphs.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from fxplan.errors import FxplanError


@dataclass
class Block:
    """One segment: its node names and, if it is split again, its sub-segments (None: not split)."""

    names: list[str]
    sub: list[Block] | None = None


def _parts(child: Any) -> tuple[Sequence[Sequence[str]], Mapping[str, Any]]:
    if isinstance(child, Mapping):
        return child.get("segments", ()), child.get("children") or {}
    segments = getattr(child, "segments", None)
    if segments is None:
        raise FxplanError(f"a sub-plan must be a Plan or a dict with 'segments', got {type(child).__name__}")
    return segments, getattr(child, "children", None) or {}


def tree(segments: Sequence[Sequence[str]], children: Mapping[str, Any] | None,
         where: str = "the plan") -> list[Block]:
    """The blocks of ``segments`` with their sub-plans from ``children``, checked.

    A sub-plan must list exactly its segment's nodes; a one-segment sub-plan without children of its own
    splits nothing and is dropped. Order within segments is checked by the rewriter on the leaves.
    """
    children = dict(children or {})
    for key in children:
        if not (isinstance(key, str) and key.isdigit() and int(key) < len(segments)):
            raise FxplanError(f"{where} has a sub-plan for segment {key!r}, but only segments 0..{len(segments) - 1}; "
                              "key sub-plans by the segment's index as a string")
    blocks = []
    for i, seg in enumerate(segments):
        if isinstance(seg, (str, bytes)) or not isinstance(seg, Sequence):
            raise FxplanError(f"segment {i} of {where} must be a list of node names, got {seg!r}")
        names = [str(v) for v in seg]
        child = children.get(str(i))
        if child is None:
            blocks.append(Block(names))
            continue
        sub_segments, sub_children = _parts(child)
        inner = f"segment {i} of {where}"
        listed = [str(v) for s in sub_segments for v in s]
        if sorted(listed) != sorted(names):
            raise FxplanError(f"the sub-plan of {inner} must list exactly that segment's nodes, each once")
        if len(sub_segments) == 1 and not sub_children:
            blocks.append(Block(names))
        else:
            blocks.append(Block(names, tree(sub_segments, sub_children, inner)))
    return blocks


def leaf_blocks(blocks: list[Block]) -> list[Block]:
    """The innermost blocks in execution order."""
    return [leaf for b in blocks for leaf in ([b] if b.sub is None else leaf_blocks(b.sub))]


def leaves(blocks: list[Block]) -> list[list[str]]:
    """The innermost segments in execution order: the flat plan the nested one refines."""
    return [b.names for b in leaf_blocks(blocks)]


def nodes_of(b: Block) -> list[str]:
    """Every node ``b`` runs, its leaves' in execution order."""
    return [v for leaf in leaves([b]) for v in leaf]


def as_children(blocks: list[Block]) -> dict[str, dict[str, Any]]:
    """``children`` in plain form (lists and dicts) for the blocks: what pickling stores."""
    return {str(i): {"segments": [s.names for s in b.sub], "children": as_children(b.sub)}
            for i, b in enumerate(blocks) if b.sub is not None}


def depth(blocks: list[Block]) -> int:
    """Levels of checkpoints: 1 for a flat plan."""
    return 1 + max((depth(b.sub) for b in blocks if b.sub is not None), default=0)


@dataclass(frozen=True)
class SaveFacts:
    """Per node, what checkpoint's early stop reads (from the trace's node attributes: :meth:`of`): whether its
    backward keeps any tensor (``saves``), and whether it keeps one the op itself makes (``saves_made``: its
    output, or extra tensors such as BatchNorm's statistics), so that the op must run to save it."""

    saves: Mapping[str, bool]
    saves_made: Mapping[str, bool]

    @classmethod
    def of(cls, nodes: Mapping[str, Mapping[str, Any]]) -> SaveFacts:
        """From node attributes; a node the trace did not classify counts as saving its inputs."""
        return cls({v: saves_any(a) for v, a in nodes.items()},
                   {v: bool(a.get("saves_output") or a.get("saved")) for v, a in nodes.items()})


def saves_any(attrs: Mapping[str, Any]) -> bool:
    """Whether a node's backward keeps any tensor: checkpoint's early stop ends at the last such node."""
    return bool(attrs.get("saves_output") or attrs.get("saved_inputs", True) or attrs.get("saved")
                or attrs.get("saves_resident"))


def recomputation(b: Block, facts: SaveFacts) -> tuple[list[str], str | None]:
    """What the recomputation of checkpointed block ``b`` runs: (the nodes, in order, up to where it stops; the
    last of them if it stops before running it, else None).

    Non-reentrant checkpoint with early stop (torch's default) re-runs the block's forward only until the last
    tensor it saved is saved again; for a split block only its last leaf saves (its other sub-blocks keep their
    inputs). Autograd saves an op's inputs before the op runs and its outputs after, so a last saver that keeps
    only inputs (a convolution) does not run. A flat block that saves nothing is not recomputed at all.
    """
    names = nodes_of(b)
    last = leaf_blocks([b])[-1]
    saving = [v for v in last.names if facts.saves[v]]
    if not saving:
        return ([], None) if b.sub is None else (names[:names.index(last.names[0])], None)
    run = names[:names.index(saving[-1]) + 1]
    return run, None if facts.saves_made[run[-1]] else run[-1]


def early_stop_cost(blocks: list[Block], facts: SaveFacts, T: Mapping[str, float]) -> float:
    """Forward cost that checkpointed blocks hold but never re-run: for each checkpointed block at every level
    (the last block of each level is not checkpointed by itself: :mod:`fxplan.rewriter.codegen`), its nodes that its
    recomputation does not run (:func:`recomputation`)."""
    cost = 0.0
    for i, b in enumerate(blocks):
        if i < len(blocks) - 1:
            run, unrun = recomputation(b, facts)
            ran = set(run) - {unrun}
            cost += sum(T[v] for v in nodes_of(b) if v not in ran)
        if b.sub is not None:
            cost += early_stop_cost(b.sub, facts, T)
    return cost
