"""Predict the measured peak of a plan by replaying its training step on the cost graph.

The solvers' memory models (:mod:`fxplan.solvers.memory_model`) reduce a segment to three numbers so the DP
can compare every pair of lower sets; that forces them to assume the worst moment of every segment
at once (every value the segment saves still alive while its largest gradient is computed), and the
default one over-predicts measured peaks on the zoo by 3–54%. To choose between plans, and to show users a number they
can trust, :func:`replay` instead runs the step the rewritten module runs (the canonical strategy of
Kusumoto et al., section 3, as :mod:`fxplan.rewriter.codegen` generates it), one node at a time, and counts the
bytes of live storages as :func:`fxplan.measure_step` does:

* forward: each segment in order; a value lives until its last reader has run (FX frees values after
  their last use); a recomputed segment keeps only its inputs (non-reentrant checkpoint holds them
  until the segment's backward is over); the last segment keeps what autograd saves (the cost
  graph's ``saves_output``, ``saved_inputs`` and ``saved``); views and in-place ops share their
  operand's storage, except where the rewriter gives an in-place op a private copy;
* the training loop holds the model's outputs for the whole step (``out = model(x)``; ``loss =
  loss_fn(out)``; ``loss.backward()``); the loss holds what its backward needs (a cross-entropy's
  log-softmax of the logits) until backward starts, which ends its own backward with a gradient for
  every output;
* backward: segments in reverse order, nodes in reverse order inside each; a recomputed segment first
  re-runs its forward to recover what it saves; processing a node allocates the gradients of its
  inputs (a view's input gradient is a view of its own; the outputs of a node that returns several
  keep one gradient each) and of its parameters (kept when the model starts without ``.grad``, added
  into the existing ones otherwise), then frees its own gradient and the values it saved once no
  other node needs them, and only then sums a gradient into one already there;
* a node's own temporaries: the most bytes its forward and its backward hold at once, measured by the
  trace (``forward_rise``, ``backward_rise``: an attention that PyTorch runs as matmuls, a softmax and
  a dropout holds several tensors of the attention matrix's size), count at the moment it runs;
* nested plans: a checkpoint made while its enclosing block is recomputed lets go of its inputs once it
  has been recomputed itself;
* the buffer guard (:class:`fxplan.rewriter.recompute.BufferGuard`): before each checkpointed block's forward, at
  every level, a copy of each buffer the block updates (a BatchNorm's running statistics), kept as long as
  the block's inputs, or, for a block checkpointed inside one whose forward runs under checkpoint, until
  its own backward.

What it knows of the step besides the plan (which inputs receive gradients, what the loss holds, which
in-place ops get a private copy) is the step model's (:mod:`fxplan.planner.step_model`). The peak is the
largest total, resident bytes (parameters, buffers, inputs, existing gradients) included. What it does not
see: a recomputation that checkpoint stops in the middle of a node that PyTorch runs as several ops (GPT-2's
attention in plans nested three deep: up to 4.4%), and the guard's copies swapped in for a recomputation, which a
recomputed BatchNorm keeps for its backward (ResNet-18 and DenseNet-121 nested plans: up to 0.007% and 0.07% under).
docs/rewrite.md and docs/planner.md give its residual error.

Replays of trees one move from a recorded replay are :mod:`fxplan.planner.near_replay`'s.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from fxplan.planner.step_model import StepModel, graph_facts, inplace_copies, inplace_openers
from fxplan.solvers import subplans
from fxplan.solvers.costgraph import CostGraph
from fxplan.solvers.subplans import Block


@dataclass
class Replay:
    """The replayed step: whole-step ``peak_bytes``; ``segment_peak_bytes[i]``, the peak while segment i's
    backward (recomputation included) runs; ``forward_peak_bytes``, the peak of the forward pass and of
    the loss (its forward and backward)."""

    peak_bytes: int
    segment_peak_bytes: list[int]
    forward_peak_bytes: int


def replay(cg: CostGraph, sm: StepModel, segments: Sequence[Sequence[str]],
           children: Mapping[str, Any] | None = None, cap: int | None = None) -> Replay | AboveCap:
    """Replay one training step of the plan ``segments`` (module docstring) and return its peaks.

    ``children`` nests plans as the rewriter does (:mod:`fxplan.solvers.subplans`): a split segment's backward
    recomputes it as its sub-segments, keeping the inputs of all but the last, and each of those is
    recomputed again for its own backward (:meth:`Replayer.backward_block`). ``cap``: stop as soon as the
    peak is seen to exceed it, and return :class:`AboveCap` instead (a search that only needs to know whether a
    plan beats a bar need not replay the rest of its step).
    """
    return replay_blocks(cg, sm, subplans.tree(segments, children), cap)


def replay_blocks(cg: CostGraph, sm: StepModel, blocks: list[Block], cap: int | None = None) -> Replay | AboveCap:
    """:func:`replay` of a plan given as its tree of blocks (:mod:`fxplan.solvers.subplans`)."""
    replayer = Replayer(cg, sm, blocks, sys.maxsize if cap is None else cap)
    try:
        return replayer.run()
    except OverCap:
        return AboveCap(replayer.peak)


@dataclass
class Recorded:
    """A replay's state before each top-level block's forward and backward, and the peak while each block's forward
    runs (:meth:`Replayer.forward`); for :class:`fxplan.planner.near_replay.NearReplays`, the tree replayed, its
    replay, the rewriter's copies of in-place ops and the forward's frees (:meth:`Replayer.frees`) with it."""

    blocks: list[Block]
    replay: Replay | None = None
    copies: set[str] = field(default_factory=set)
    frees: dict[int, list[str]] = field(default_factory=dict)
    forward_states: dict[int, tuple] = field(default_factory=dict)
    forward_peaks: dict[int, int] = field(default_factory=dict)
    loss_peak: int = 0  # the peak while the loss runs, after the forward
    backward_states: dict[int, tuple] = field(default_factory=dict)


#: Holders that name a block by its id (its checkpoint's inputs, the generator state forked for it, its guard).
_BLOCK_HOLDERS = ("ckpt", "fork", "fguard")


@dataclass(frozen=True)
class AboveCap:
    """A replay stopped where its peak passed the cap: ``peak_bytes`` is a lower bound of the step's peak, above
    the cap (the peak so far; the rest of the step can only add to it)."""

    peak_bytes: int


class OverCap(Exception):
    """Raised inside a replay once its peak exceeds the cap."""


class Replayer:
    """One replay: live storages with their holders; a storage is freed when its last holder lets go."""

    def __init__(self, cg: CostGraph, sm: StepModel, blocks: list[Block], cap: int = sys.maxsize):
        self.sm, self.blocks, self.cap = sm, blocks, cap
        self.facts = facts = sm.facts or graph_facts(cg)
        self.segments = subplans.leaves(blocks)  # the innermost segments, in execution order
        self.k = len(self.segments)
        self.seg = {v: i for i, names in enumerate(self.segments) for v in names}
        self.order = [v for names in self.segments for v in names]
        self.pos = {v: i for i, v in enumerate(self.order)}
        # per leaf: the position of the last node of its ancestor at each depth (the leaf itself last)
        self.ends: list[list[int]] = []
        self._walk(blocks, [])
        self.preds, self.succs = facts.preds, facts.succs
        self.copies = inplace_copies(sm, self.seg, self.succs, self.k)
        self.copies -= inplace_openers(sm, self.segments, self.seg, self.preds, self.succs, facts)
        # node -> the node whose storage its value shares (a view, or an in-place op the rewriter gives no copy)
        self.source = {v: src for v, src in sm.views.items() if v in self.pos}
        self.source.update((v, src) for v, src in sm.inplace.items() if v in self.pos and v not in self.copies)
        self.bytes: dict[int, int] = {}
        self.holders: dict[int, set] = {}
        self.current = self.peak = sm.resident
        self.sid: dict[str, int] = {}  # node -> the storage of its value
        self.saved: dict[str, list[int]] = {}  # node -> the storages its backward keeps
        self.inputs: dict[int, list[int]] = {}  # id of a checkpointed block -> the storages checkpoint keeps
        self.loss = -1  # the storage of what the loss holds for its backward
        self.grad: dict[str, int] = {}  # node -> the storage of its gradient, while backward needs it
        self.slots: dict[str, list[int]] = {}  # node -> its other outputs' gradients (besides grad[node])
        self.seen_params: set[int] = set()
        self.forward_guards: dict[int, int] = {}  # id of a block checkpointed inside another -> its guard's copies
        self._next = 0

    def _walk(self, blocks: list[Block], ends: list[int]) -> None:
        for b in blocks:
            end = self.pos[subplans.leaf_blocks([b])[-1].names[-1]]
            if b.sub is None:
                self.ends.append([*ends, end])
            else:
                self._walk(b.sub, [*ends, end])

    def frees(self, run: Sequence[str], values: Sequence[str] | None = None) -> dict[int, list[str]]:
        """Position -> the values of ``run`` (of ``values`` among them, if given) to free after the node there: FX
        frees a value after its last reader in the function that made it, and a call of a block holds its
        arguments until it returns, so a reader in another block counts as the end of the outermost block that
        holds it. A reader beyond ``run`` (a recomputation stopped early) holds the value to the end of the run."""
        within, pos, seg, stop = set(run), self.pos, self.seg, self.pos[run[-1]] if run else 0
        frees: dict[int, list[str]] = {}
        for v in run if values is None else values:
            readers = self.succs[v]
            if not readers:
                last = pos[v]
            else:
                last, sv = -1, seg[v]
                for w in readers:
                    if w not in within:
                        end = stop
                    else:
                        sw = seg[w]
                        end = pos[w] if sw == sv else self._end(sv, sw)
                        end = end if end < stop else stop
                    last = end if end > last else last
            if last in frees:
                frees[last].append(v)
            else:
                frees[last] = [v]
        return frees

    def _end(self, sv: int, sw: int) -> int:
        """Where a reader in leaf ``sw`` of a value made in another leaf ``sv`` ends holding it."""
        a, b = self.ends[sv], self.ends[sw]
        d = 0
        while d < len(a) - 1 and d < len(b) - 1 and a[d] == b[d]:
            d += 1  # blocks end at distinct positions: equal ends are the same ancestor
        return b[d]

    # ---------------------------------------------------------------------------- storages
    def new(self, nbytes: int, holder) -> int:
        sid = self._next
        self._next = sid + 1
        self.bytes[sid] = nbytes
        self.holders[sid] = {holder}
        self.current = current = self.current + nbytes
        if current > self.peak:
            self.peak = current
        return sid

    def hold(self, sid: int, holder) -> None:
        held = self.holders.get(sid)
        if held is not None:
            held.add(holder)

    def release(self, sid: int, holder) -> None:
        held = self.holders.get(sid)
        if held is None:
            return
        held.discard(holder)
        if not held:
            del self.holders[sid]
            self.current -= self.bytes.pop(sid)

    # ---------------------------------------------------------------------------- values
    def save(self, w: str) -> None:
        """What autograd keeps for w's backward, held until w's backward has run."""
        held = self.saved.setdefault(w, [])
        sids, holders, holder = self.sid, self.holders, ("saved", w)
        for u in self.facts.keeps[w]:
            sid = sids.get(u)
            holding = holders.get(sid) if sid is not None else None
            if holding is not None:
                holding.add(holder)
                held.append(sid)
        extra = self.facts.saved[w]
        if extra:
            held.append(self.new(extra, ("saved", w)))

    def unsave(self, w: str) -> None:
        for s in self.saved.pop(w, ()):
            self.release(s, ("saved", w))

    # ---------------------------------------------------------------------------- the step
    def run(self, record: Recorded | None = None) -> Replay:
        forward_peak = self.forward(record)
        seg_peaks = self.backward(record)
        return Replay(max(forward_peak, *seg_peaks), seg_peaks, forward_peak)

    def forward(self, record: Recorded | None = None) -> int:
        """The forward pass and the loss; ``record``: the state before each top-level block and the peak while it
        runs (:class:`fxplan.planner.near_replay.NearReplays`)."""
        frees, outputs = self.frees(self.order), set(self.sm.outputs)
        for i in range(len(self.blocks)):
            if record is not None:  # the peak while this block runs, kept apart from the running one
                record.forward_states[i], before, self.peak = self.state(), self.peak, self.current
            self.forward_block(self.blocks, i, frees, ("val",), None, None, outputs)
            if record is not None:
                record.forward_peaks[i], self.peak = self.peak, max(before, self.peak)
        if record is not None:
            record.loss_peak = self.current + self.sm.loss_peak
        self.peak = max(self.peak, self.current + self.sm.loss_peak)
        self.loss = self.new(self.sm.loss_held, "loss")
        if self.peak > self.cap:
            raise OverCap
        return self.peak

    def forward_blocks(self, blocks: list[Block], frees: dict[int, list[str]], tag: tuple,
                       run: set[str] | None, unrun: str | None = None) -> None:
        """Run ``blocks`` forward as the rewriter does: each but the last under checkpoint (its inputs kept,
        nothing saved), the last split again in the same way or, a leaf, saving what autograd saves.
        ``run``: the nodes to run (a recomputation stops early), None for all, and ``unrun`` the last of them
        if it only saves its inputs, without running (:meth:`recompute`); ``tag``: the values' holder."""
        outputs = set(self.sm.outputs) if tag == ("val",) else set()
        for i in range(len(blocks)):
            if not self.forward_block(blocks, i, frees, tag, run, unrun, outputs):
                return

    def forward_block(self, blocks: list[Block], i: int, frees: dict[int, list[str]], tag: tuple,
                      run: set[str] | None, unrun: str | None, outputs: set[str]) -> bool:
        """Block ``blocks[i]``'s forward (:meth:`forward_blocks`); False where a recomputation stops before it."""
        b = blocks[i]
        if i < len(blocks) - 1:
            names = subplans.nodes_of(b)
            if run is not None and names[0] not in run:
                return False
            inside = set(names)
            self.inputs[id(b)] = sorted({self.sid[u] for v in names for u in self.preds[v] if u not in inside})
            for sid in self.inputs[id(b)]:
                self.hold(sid, ("ckpt", id(b)))
            if self._keeps_rng_state(names):  # the generator state checkpoint keeps with them
                self.inputs[id(b)].append(self.new(self.sm.rng_state_bytes, ("ckpt", id(b))))
            guard = self._guard_bytes(names)
            if guard:  # the buffer guard's copies of the buffers the block updates
                self.inputs[id(b)].append(self.new(guard, ("ckpt", id(b))))
            if b.sub is not None and tag == ("val",):
                self._inner_guards(b.sub)
            self._run(names, frees, tag, run, None, saving=False, outputs=outputs)
        elif b.sub is not None:
            self.forward_blocks(b.sub, frees, tag, run, unrun)
        else:
            self._run(b.names, frees, tag, run, unrun, saving=True, outputs=outputs)
        return True

    def _run(self, names: list[str], frees: dict[int, list[str]], tag: tuple, run: set[str] | None,
             unrun: str | None, saving: bool, outputs: set[str]) -> None:
        pos, sids, holders, cap = self.pos, self.sid, self.holders, self.cap
        rises, M, source = self.facts.forward_rise, self.facts.M, self.source
        for v in names:
            if run is not None and v not in run:
                return
            if v != unrun:
                # v runs: after the temporaries its forward holds on the way (``forward_rise``), its value
                # shares its operand's storage (a view, an in-place op) or gets a new one
                rise = self.current + rises[v]
                if rise > self.peak:
                    self.peak = rise
                src = source.get(v)
                shared = sids.get(src) if src is not None else None
                held = holders.get(shared) if shared is not None else None
                if held is not None:
                    sids[v] = shared
                    held.add((*tag, v))
                else:
                    sids[v] = self.new(M[v], (*tag, v))
            if v in outputs:
                self.hold(sids[v], "out")
            if saving:
                self.save(v)
            for u in frees.get(pos[v], ()):
                sid = sids.get(u)
                if sid is not None:
                    self.release(sid, (*tag, u))
            if self.peak > cap:
                raise OverCap

    def backward(self, record: Recorded | None = None) -> list[int]:
        sm = self.sm
        self.release(self.loss, "loss")  # the loss's backward ran (its peak was counted by forward())
        for o in sm.outputs:
            self.grad[o] = self.new(int(sm.output_grad * self.facts.M[o]), ("grad", o))
        return self.backward_from(len(self.blocks) - 1, record)

    def backward_from(self, first: int, record: Recorded | None = None) -> list[int]:
        """The backward of the top-level blocks ``first``, ``first - 1``, ..., 0, and the peak during each (0 for
        those after ``first``); ``record``: the state before each."""
        seg_peaks = [0] * len(self.blocks)
        for i in range(first, -1, -1):
            if record is not None:
                record.backward_states[i] = self.state()
            self.peak = self.current
            self.backward_block(self.blocks, i)
            seg_peaks[i] = self.peak
        return seg_peaks

    # ---------------------------------------------------------------------------- states (NearReplays)
    def state(self) -> tuple:
        """A copy of everything the replay changes as it goes."""
        return (dict(self.bytes), {sid: set(h) for sid, h in self.holders.items()}, dict(self.sid),
                {w: list(s) for w, s in self.saved.items()}, {k: list(s) for k, s in self.inputs.items()},
                dict(self.grad), {k: list(s) for k, s in self.slots.items()}, set(self.seen_params),
                dict(self.forward_guards), self.current, self._next, self.loss)

    def restore(self, state: tuple, blocks: dict[int, int]) -> None:
        """Take up ``state`` (:meth:`state`) of another tree's replay, its top-level blocks' ids mapped to this
        tree's (``blocks``); KeyError where a holder names any other block (a state this replay cannot take up)."""
        (nbytes, holders, sid, saved, inputs, grad, slots, seen, guards, self.current, self._next, self.loss) = state
        if guards:
            raise KeyError("buffer guards")

        def mapped(h):
            return (h[0], blocks[h[1]]) if isinstance(h, tuple) and h[0] in _BLOCK_HOLDERS else h

        self.bytes, self.sid, self.grad, self.seen_params = dict(nbytes), dict(sid), dict(grad), set(seen)
        self.holders = {s: {mapped(h) for h in held} for s, held in holders.items()}
        self.saved = {w: list(s) for w, s in saved.items()}
        self.inputs = {blocks[k]: list(s) for k, s in inputs.items()}
        self.slots = {k: list(s) for k, s in slots.items()}

    def backward_block(self, level: list[Block], i: int, in_recompute: bool = False) -> None:
        """The backward of block ``level[i]``: recomputed first if checkpointed (every block of a level but
        the last), then its sub-blocks' backward in reverse, or its nodes' if it is a leaf.
        ``in_recompute``: the block's checkpoint was made while an enclosing block was recomputed; such a
        checkpoint lets go of its inputs once its own recomputation has run."""
        b = level[i]
        checkpointed = i < len(level) - 1
        if checkpointed:
            self.recompute(b)
            if in_recompute:
                self._release_inputs(b)
        if b.sub is None:
            self.backward_nodes(b.names)
        else:
            for j in range(len(b.sub) - 1, -1, -1):
                self.backward_block(b.sub, j, in_recompute or checkpointed)
        self._release_inputs(b)
        if id(b) in self.forward_guards:
            self.release(self.forward_guards.pop(id(b)), ("fguard", id(b)))

    def _guard_bytes(self, names: list[str]) -> int:
        """Bytes of the buffer guard's copies for a checkpointed block of ``names``."""
        if not self.sm.guarded:  # a model without buffers it updates: no walk over the block in every replay
            return 0
        return sum(dict(item for v in names for item in self.sm.guarded.get(v, ())).values())

    def _inner_guards(self, level: list[Block]) -> None:
        """The guards of the checkpointed blocks inside one whose forward runs (under checkpoint): each made as
        its block runs, kept by the forward's graph until that block's backward."""
        for i, c in enumerate(level):
            names = subplans.nodes_of(c)
            guard = self._guard_bytes(names) if i < len(level) - 1 else 0
            if guard:
                self.forward_guards[id(c)] = self.new(guard, ("fguard", id(c)))
            if c.sub is not None:
                self._inner_guards(c.sub)

    def _keeps_rng_state(self, names: list[str]) -> bool:
        return bool(self.sm.rng_state_bytes) and not self.sm.random_nodes.isdisjoint(names)

    def _release_inputs(self, b: Block) -> None:
        for sid in self.inputs.pop(id(b), ()):
            self.release(sid, ("ckpt", id(b)))

    def backward_nodes(self, names: list[str]) -> None:
        sm, grad, M, kind, preds, rises = self.sm, self.grad, self.facts.M, self.facts.kind, self.preds, \
            self.facts.backward_rise
        views, passing, grad_inputs, param_grads = sm.views, sm.passes, sm.grad_inputs, sm.param_grads
        for v in reversed(names):
            if v not in grad:  # nothing downstream needs a gradient through v
                self.unsave(v)
                continue
            sums, accumulated, replaced, before = 0, 0, [], self.current
            passes = PASS_THROUGH.get(kind[v])
            given = grad_inputs.get(v, ())
            for u in preds[v]:
                if u not in given:
                    continue  # v's backward gives u no gradient (a shape, an index, a detached value)
                size = M[u]
                shared = (v in views or v in passing or passes == "slice"
                          or (passes == "same" and size == M[v]))
                if shared and u not in grad:
                    grad[u] = grad[v]
                    self.hold(grad[u], ("grad", u))
                elif u in grad and v in passing and kind[v] == "getitem":
                    # one output of a node that returns several (split, unbind): autograd keeps each
                    # output's gradient in its own slot of the node's backward, and sums nothing
                    self.hold(grad[v], ("grad", u))
                    self.slots.setdefault(u, []).append(grad[v])
                elif u in grad:
                    # a contribution, summed with the existing gradient into a new tensor (the meter
                    # sees autograd sum out of place; on a real CPU step it may add in place instead)
                    sums += size
                    replaced.append((grad[u], u))
                    grad[u] = self.new(size, ("grad", u))
                else:
                    grad[u] = self.new(size, ("grad", u))
            for key, nbytes in param_grads.get(v, ()):
                if sm.grads_exist or key in self.seen_params:
                    accumulated += nbytes
                else:
                    self.seen_params.add(key)
                    self.new(nbytes, ("param", key))
            self.peak = max(self.peak, self.current + accumulated, before + rises[v])
            # the engine lets go of the node's incoming gradient and saved tensors before it sums the
            # gradients the node returned into those already there
            self.release(grad.pop(v), ("grad", v))
            if self.slots:
                for sid in self.slots.pop(v, ()):
                    self.release(sid, ("grad", v))
            if v in self.saved:
                self.unsave(v)
            if replaced:
                self.peak = max(self.peak, self.current + sums)
                for old, u in replaced:
                    self.release(old, ("grad", u))
            if self.peak > self.cap:
                raise OverCap

    def recompute(self, b: Block) -> None:
        """Re-run a checkpointed block's forward for its backward, as far as checkpoint's early stop lets it
        (:func:`fxplan.solvers.subplans.recomputation`). Values nobody saved are freed after their last reader inside
        the run; a value read after it lives until the recomputation stops, as early stop abandons the
        block's function there."""
        run, unrun = subplans.recomputation(b, self.facts.save)
        if not run:
            return
        names = subplans.nodes_of(b)
        keeps = self._keeps_rng_state(names)
        if keeps:  # fork_rng's copy of the state while the block recomputes
            forked = self.new(self.sm.rng_state_bytes, ("fork", id(b)))
        self.forward_blocks([b] if b.sub is None else b.sub, self.frees(run), ("rval",), set(run), unrun)
        if keeps:
            self.release(forked, ("fork", id(b)))


#: Ops whose backward hands the incoming gradient (or slices of it) to an input of the same size or
#: smaller: an add gives both operands the output's gradient, a concatenation gives each input a slice.
PASS_THROUGH = {"add": "same", "add_": "same", "iadd": "same", "cat": "slice", "concat": "slice",
                "concatenate": "slice", "clone": "same", "contiguous": "same"}
