"""Replays of trees one move from a base tree, from the base's recorded replay (:class:`NearReplays`).

The nested search (:mod:`fxplan.planner.nested`) replays many trees that differ from its best tree inside one
top-level block. Replaying only what such a move changes, from the states a replay of the base recorded, gives the
peaks a whole replay (:func:`fxplan.planner.replay.replay_blocks`) gives, in less time on models of many blocks
(``NEAR_MIN_BLOCKS``).
"""

from __future__ import annotations

import sys

from fxplan.planner.replay import AboveCap, OverCap, Recorded, Replay, Replayer, replay_blocks
from fxplan.planner.step_model import StepModel
from fxplan.solvers import subplans
from fxplan.solvers.costgraph import CostGraph
from fxplan.solvers.subplans import Block

#: Trees of fewer top-level blocks are replayed whole by :class:`NearReplays`: recording the base's states costs
#: two copies of the replay's state per block, and a move's replay from them saves less the fewer blocks there are.
#: Every nested-search replay of a no-budget rewrite, both ways (throwaway script, 2-core CPU): HF Electra (2 to 9
#: blocks) 0.74 s from records against 0.72 s whole; GPT-2 with 23 layers (23 blocks and more) 2.3 s against 5.3 s.
NEAR_MIN_BLOCKS = 8


class NearReplays:
    """:func:`replay_blocks` of trees one move from a base tree (the nested search's moves from its best tree:
    :mod:`fxplan.planner.nested`), replaying only what the move changes.

    A tree that differs from the base only inside one top-level block that runs under checkpoint (not the last)
    runs the same step before that block's forward and between its forward and its backward: the rest of the
    forward cannot see how the block is split (it runs flat; its values are freed by the end of the block at the
    latest), and the later blocks' backward neither. So the base is replayed once with its state recorded before
    each top-level block's forward and backward, and such a tree replays that block's forward from the recorded
    state, then the backward from that block down to the first: the same peaks as :func:`replay_blocks`, which
    every other tree gets (and every tree of a model whose buffers the guard copies: the guards' copies are made
    inside the forward of a split block)."""

    def __init__(self, cg: CostGraph, sm: StepModel):
        self.cg, self.sm = cg, sm
        self._base: Recorded | None = None  # the last base tree's replay, recorded

    def replay(self, blocks: list[Block], cap: int | None = None, base: list[Block] | None = None) -> Replay | AboveCap:
        """:func:`replay_blocks` of ``blocks``, from ``base``'s recorded replay where ``blocks`` is one move from
        it (class docstring)."""
        near = base is not None and len(base) >= NEAR_MIN_BLOCKS and not self.sm.guarded
        i = self._moved_block(base, blocks) if near else None
        if i is None:
            return replay_blocks(self.cg, self.sm, blocks, cap)
        record = self._recorded(base)
        done = record.replay
        replayer = Replayer(self.cg, self.sm, blocks, sys.maxsize if cap is None else cap)
        if replayer.copies != record.copies:  # the rewriter's copies of in-place ops moved with the split
            return replay_blocks(self.cg, self.sm, blocks, cap)
        ids = {id(a): id(b) for a, b in zip(base, blocks)}
        try:
            replayer.restore(record.forward_states[i], ids)
            replayer.peak = replayer.current
            replayer.forward_block(blocks, i, self._frees_in(replayer, blocks[i], record.frees), ("val",), None, None,
                                   set(self.sm.outputs))
            forward_peak = max(replayer.peak, record.loss_peak,
                               *(p for k, p in record.forward_peaks.items() if k != i))
            later = done.segment_peak_bytes[i + 1:]
            known = max(forward_peak, *later) if later else forward_peak
            if known > replayer.cap:
                return AboveCap(known)
            replayer.restore(record.backward_states[i], ids)
            seg_peaks = replayer.backward_from(i)
        except OverCap:
            return AboveCap(replayer.peak)
        except KeyError:  # a state that names blocks no longer there
            return replay_blocks(self.cg, self.sm, blocks, cap)
        seg_peaks[i + 1:] = later
        return Replay(max(known, *seg_peaks[:i + 1]), seg_peaks, forward_peak)

    @staticmethod
    def _frees_in(replayer: Replayer, block: Block, base_frees: dict[int, list[str]]) -> dict[int, list[str]]:
        """The forward's frees (:meth:`Replayer.frees`) at the nodes of ``block``, a top-level block of
        ``replayer``'s tree where it differs from the base (whose frees are ``base_frees``): where the block's own
        values are freed depends on how it is split, where the others' are (at the end of the block, or outside it)
        does not."""
        names = subplans.nodes_of(block)
        inside, first, last = set(names), replayer.pos[names[0]], replayer.pos[names[-1]]
        frees = {p: [v for v in values if v not in inside] for p, values in base_frees.items() if first <= p <= last}
        for p, values in replayer.frees(replayer.order, names).items():
            frees.setdefault(p, []).extend(values)
        return frees

    @staticmethod
    def _moved_block(base: list[Block], blocks: list[Block]) -> int | None:
        """The one top-level block, run under checkpoint, of the same nodes, in which ``blocks`` differs from
        ``base``; None if there is no such block."""
        if len(blocks) != len(base):
            return None
        moved = [k for k, (a, b) in enumerate(zip(base, blocks)) if a is not b and a != b]
        if len(moved) != 1 or moved[0] == len(blocks) - 1 or base[moved[0]].names != blocks[moved[0]].names:
            return None
        return moved[0]

    def _recorded(self, base: list[Block]) -> Recorded:
        """``base``'s replay with its states recorded (made once per base tree, the last one kept)."""
        if self._base is None or self._base.blocks is not base:
            replayer, record = Replayer(self.cg, self.sm, base), Recorded(base)
            record.replay = replayer.run(record)
            record.copies, record.frees = replayer.copies, replayer.frees(replayer.order)
            self._base = record
        return self._base
