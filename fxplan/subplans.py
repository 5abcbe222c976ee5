"""Nested plans as the rewriter reads them: segments, each optionally split again by a sub-plan.

A plan's ``children`` (:class:`fxplan.plans.Plan`) map a segment's index (as a string) to a plan of that
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


def as_children(blocks: list[Block]) -> dict[str, dict[str, Any]]:
    """``children`` in plain form (lists and dicts) for the blocks: what pickling stores."""
    return {str(i): {"segments": [s.names for s in b.sub], "children": as_children(b.sub)}
            for i, b in enumerate(blocks) if b.sub is not None}


def depth(blocks: list[Block]) -> int:
    """Levels of checkpoints: 1 for a flat plan."""
    return 1 + max((depth(b.sub) for b in blocks if b.sub is not None), default=0)
