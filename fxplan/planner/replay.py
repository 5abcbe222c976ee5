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

Which inputs receive gradients is recorded by the trace's propagation (:mod:`fxplan.costs.trace`); what the
loss holds, its peak and how large its gradients of the outputs are, by running it on fake outputs
(:func:`probe_loss`). The peak is the largest total, resident bytes (parameters, buffers, inputs,
existing gradients) included. What it does not see: a recomputation that checkpoint stops in the middle
of a node that PyTorch runs as several ops (GPT-2's attention in plans nested three deep: up to 4.4%), and
the guard's copies swapped in for a recomputation, which a recomputed BatchNorm keeps for its backward
(ResNet-18 and DenseNet-121 nested plans: up to 0.007% and 0.07% under).
docs/rewrite.md and docs/planner.md give its residual error.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._pytree import tree_leaves, tree_map

from fxplan.capture import effects
from fxplan.capture.capturers import as_call
from fxplan.capture.fakes import FakeMode
from fxplan.capture.graph_module import resolve_attr
from fxplan.capture.recomputed_inputs import call_recomputing, saver_operands
from fxplan.measure import scratch
from fxplan.measure.meter import default_loss, device_of, resident_bytes, track_memory
from fxplan.measure.scratch import charged_bytes, storage_bytes
from fxplan.rewriter.recompute import STATEFUL_NORMS, host_rng_state_bytes
from fxplan.solvers import subplans
from fxplan.solvers.costgraph import CostGraph
from fxplan.solvers.subplans import Block


@dataclass
class GraphFacts:
    """What a replay reads of the cost graph, per node, kept as plain dicts (:func:`graph_facts`): data-edge
    ``preds`` and ``succs``, output bytes ``M``, the forward and backward temporaries, ``kind``, what
    autograd keeps for its backward (``keeps``: the node itself and its inputs, ``saved``: extra bytes)
    and where checkpoint's early stop ends (``save``), and the nodes in program order."""

    preds: dict[str, list[str]]
    succs: dict[str, list[str]]
    M: dict[str, int]
    forward_rise: dict[str, int]
    backward_rise: dict[str, int]
    kind: dict[str, str | None]
    keeps: dict[str, list[str]]
    saved: dict[str, int]
    save: subplans.SaveFacts
    program: list[str]
    position: dict[str, int] = field(default_factory=dict)  # node -> its index in ``program``


def graph_facts(cg: CostGraph) -> GraphFacts:
    """The :class:`GraphFacts` of ``cg``."""
    program = list(cg.nodes)
    preds: dict[str, list[str]] = {v: [] for v in program}
    succs: dict[str, list[str]] = {v: [] for v in program}
    for u, w, only in cg.edges(data="order_only"):
        if not only:
            preds[w].append(u)
            succs[u].append(w)
    nodes = cg.nodes
    return GraphFacts(
        preds, succs, {v: int(nodes[v]["M"]) for v in program},
        {v: nodes[v].get("forward_rise", 0) for v in program}, {v: nodes[v].get("backward_rise", 0) for v in program},
        {v: nodes[v].get("kind") for v in program},
        {v: ([v] if nodes[v].get("saves_output", False) else []) + list(nodes[v].get("saved_inputs", preds[v]))
         for v in program},
        {v: int(nodes[v].get("saved", 0) or 0) for v in program}, subplans.SaveFacts.of(nodes), program,
        {v: i for i, v in enumerate(program)})


@dataclass(frozen=True)
class StepModel:
    """What :func:`replay` needs besides the plan, computed once per cost graph (:func:`step_model`).

    ``resident``: bytes held for the whole step (parameters, buffers, inputs, existing gradients);
    ``grads_exist``: the model already holds ``.grad`` tensors, so backward adds into them;
    ``param_grads``: per node, ``(key, bytes)`` of the parameters whose gradients its backward makes;
    ``outputs``: the nodes whose values the model returns; ``output_grad``: bytes of the gradient the
    loss gives an output, per byte of output; ``views``: node -> the node it returns a view of (no
    storage of its own); ``inplace``: node -> the node whose value it overwrites; ``grad_inputs``:
    node -> the inputs its backward gives a gradient; ``passes``: nodes without a backward of their
    own (their inputs get the incoming gradient itself). The last two come from the trace
    (``cg.graph["gradients"]``). ``random_inplace``: the in-place nodes that draw random numbers.
    ``loss_held`` and ``loss_peak``: :class:`LossCost`'s ``held`` and ``peak``; ``facts``: the graph's
    :class:`GraphFacts` (made once here: a search replays hundreds of plans of one graph).
    ``rng_state_bytes``: the CPU generator state each checkpoint keeps, as the meter counts it (a model on
    the CPU; 0 elsewhere: it lives in host memory, which a device's meter does not count), where a block
    holds one of ``random_nodes`` (:func:`fxplan.capture.effects.may_draw_random`; other blocks keep no state).
    ``guarded``: per node that updates buffers in place, ``(key, bytes)`` of them, which the buffer guard of a
    checkpointed block holding it copies before the block's forward (:class:`fxplan.rewriter.recompute.BufferGuard`).
    ``sharing``: per node an in-place op overwrites, the nodes whose values live in its storage (through views and
    in-place ops).
    """

    resident: int
    grads_exist: bool
    param_grads: dict[str, tuple[tuple[int, int], ...]]
    outputs: tuple[str, ...]
    output_grad: float
    views: dict[str, str]
    inplace: dict[str, str]
    grad_inputs: dict[str, frozenset[str]]
    passes: frozenset[str]
    random_inplace: frozenset[str] = frozenset()
    loss_held: int = 0
    loss_peak: int = 0
    facts: GraphFacts | None = field(default=None, compare=False, repr=False)
    rng_state_bytes: int = 0
    random_nodes: frozenset[str] = frozenset()
    guarded: dict[str, tuple[tuple[int, int], ...]] = field(default_factory=dict)
    sharing: dict[str, list[str]] = field(default_factory=dict)


def step_model(cg: CostGraph, model: torch.nn.Module, example_inputs: Sequence[Any],
               loss_fn: Callable[[Any], torch.Tensor] | None = None) -> StepModel:
    """The :class:`StepModel` of ``cg``, traced from ``model`` with ``example_inputs`` (real or fake)."""
    gm: fx.GraphModule = cg.graph["gm"]
    grad_inputs, passes = cg.graph["gradients"]
    loss = probe_loss(cg, loss_fn)
    param_grads: dict[str, tuple[tuple[int, int], ...]] = {}
    guarded: dict[str, tuple[tuple[int, int], ...]] = {}
    views: dict[str, str] = {}
    inplace: dict[str, str] = {}
    random_inplace: set[str] = set()
    for node in gm.graph.nodes:
        if node.name not in cg:
            continue
        params: list[torch.nn.Parameter] = []
        if node.op == "call_module":
            params += gm.get_submodule(str(node.target)).parameters()
        # a unit's saver: the parameters its operator reads, not those of the recipe it keeps (their gradients come
        # in their own nodes' backward)
        operands = saver_operands(node) if node.target is call_recomputing else node.all_input_nodes
        for u in operands:
            if u.op == "get_attr":  # a parameter, or a module handed to a function (its parameters)
                value = resolve_attr(gm, str(u.target))
                if isinstance(value, torch.nn.Parameter):
                    params.append(value)
                elif isinstance(value, torch.nn.Module):
                    params += value.parameters()
        param_grads[node.name] = tuple((id(p), charged_bytes(p.numel() * p.element_size(), p.device))
                                       for p in params if p.requires_grad)
        buffers = _guarded_buffers(gm, node)
        if buffers:
            guarded[node.name] = buffers
        mutated = effects.mutated_arg(node, gm)
        source = effects.view_source(node, gm)
        if mutated is not None:
            inplace[node.name] = mutated.name
            if effects.is_random(node, gm):
                random_inplace.add(node.name)
        elif source is not None:
            views[node.name] = source.name
    output = next(n for n in gm.graph.nodes if n.op == "output")
    outputs = tuple(u.name for u in output.all_input_nodes if u.name in cg)
    grads_exist = any(p.grad is not None for p in model.parameters())
    call = as_call(example_inputs)
    resident = resident_bytes(model, (call.args, call.kwargs))
    on_cpu = device_of(model, (call.args, call.kwargs)).type == "cpu"
    rng_state = host_rng_state_bytes() if on_cpu and scratch.counted() else 0
    random_nodes = frozenset(n.name for n in gm.graph.nodes if n.name in cg and effects.may_draw_random(n, gm))
    return StepModel(resident, grads_exist, param_grads, outputs, loss.output_grad, views, inplace, grad_inputs,
                     passes, frozenset(random_inplace), loss.held, loss.peak, graph_facts(cg), rng_state,
                     random_nodes, guarded, _sharing(views, inplace, list(cg.nodes)))


def _sharing(views: dict[str, str], inplace: dict[str, str], program: list[str]) -> dict[str, list[str]]:
    """Node -> the nodes whose values share its storage (itself included), for the nodes in-place ops overwrite."""
    root: dict[str, str] = {}
    for v in program:
        src = inplace.get(v) or views.get(v)
        root[v] = root.get(src, src) if src is not None else v
    members: dict[str, list[str]] = {}
    for v in program:
        members.setdefault(root[v], []).append(v)
    return {a: members[root[a]] for a in inplace.values() if a in root}


def _guarded_buffers(gm: fx.GraphModule, node: fx.Node) -> tuple[tuple[int, int], ...]:
    """``(key, bytes)`` of the buffers a checkpointed block's guard copies for ``node``: those it updates in place
    (the trace's ``mutates``), and every buffer of a norm layer it calls in training
    (:meth:`fxplan.rewriter.recompute.Segment._known_mutating`)."""
    buffers = [resolve_attr(gm, key) for key in node.meta.get("fxplan_mutates", ())]
    if node.op == "call_module":
        module = gm.get_submodule(str(node.target))
        if isinstance(module, STATEFUL_NORMS) and module.training:
            buffers += module.buffers()
    found = {id(b): storage_bytes(b) for b in buffers if isinstance(b, torch.Tensor)}
    return tuple(found.items())


@dataclass(frozen=True)
class LossCost:
    """What the loss function costs beyond the model's outputs, in one step.

    ``output_grad``: bytes of the gradient it hands the outputs, per byte of floating-point output (0 for
    a sum, which hands each output an expanded scalar; 1 for cross-entropy); ``held``: bytes it keeps
    from its forward until its backward (a cross-entropy's log-softmax, a shifted copy of the logits:
    the size of the logits, gigabytes for a language model's vocabulary); ``peak``: the most bytes it
    holds at once over its forward and backward, the output gradients it ends with included.
    """

    output_grad: float
    held: int
    peak: int


def probe_loss(cg: CostGraph, loss_fn: Callable[[Any], torch.Tensor] | None = None) -> LossCost:
    """:class:`LossCost` of ``loss_fn``: it and its backward run, and their storages counted, on fake outputs
    of the traced shapes (``cg.graph["example_output"]``)."""
    loss_fn = loss_fn or default_loss
    example = cg.graph["example_output"]
    fakes = [t for t in tree_leaves(example) if isinstance(t, FakeTensor)]
    fake_mode = fakes[0].fake_mode if fakes else FakeMode(allow_non_fake_inputs=True)
    with fake_mode, torch.enable_grad():
        out = tree_map(lambda t: t.detach().requires_grad_() if _is_float(t) else t, example)
        leaves = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor) and t.requires_grad]
        grads: dict[int, int] = {}  # the gradients as the loss hands them over (before .grad copies them)

        def seen(g: torch.Tensor) -> None:
            grads[g.untyped_storage()._cdata] = storage_bytes(g)

        for t in leaves:
            t.register_hook(seen)
        with track_memory(*[t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]) as tracker:
            before = tracker.current_bytes
            loss = loss_fn(out)
            held = tracker.current_bytes - before
            loss.backward()
            peak = tracker.peak_bytes - before
    total = sum(storage_bytes(t) for t in leaves)
    return LossCost(sum(grads.values()) / total if total else 0.0, held, peak)


def _is_float(t: object) -> bool:
    return isinstance(t, torch.Tensor) and t.is_floating_point()


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
    recomputed again for its own backward (:meth:`_Replayer.backward_block`). ``cap``: stop as soon as the
    peak is seen to exceed it, and return :class:`AboveCap` instead (a search that only needs to know whether a
    plan beats a bar need not replay the rest of its step).
    """
    return replay_blocks(cg, sm, subplans.tree(segments, children), cap)


def replay_blocks(cg: CostGraph, sm: StepModel, blocks: list[Block], cap: int | None = None) -> Replay | AboveCap:
    """:func:`replay` of a plan given as its tree of blocks (:mod:`fxplan.solvers.subplans`)."""
    replayer = _Replayer(cg, sm, blocks, sys.maxsize if cap is None else cap)
    try:
        return replayer.run()
    except _OverCap:
        return AboveCap(replayer.peak)


@dataclass
class _Recorded:
    """A replay's state before each top-level block's forward and backward, and the peak while each block's forward
    runs (:meth:`_Replayer.forward`); for :class:`NearReplays`, the tree replayed, its replay, the rewriter's copies
    of in-place ops and the forward's frees (:meth:`_Replayer._frees`) with it."""

    blocks: list[Block]
    replay: Replay | None = None
    copies: set[str] = field(default_factory=set)
    frees: dict[int, list[str]] = field(default_factory=dict)
    forward_states: dict[int, tuple] = field(default_factory=dict)
    forward_peaks: dict[int, int] = field(default_factory=dict)
    loss_peak: int = 0  # the peak while the loss runs, after the forward
    backward_states: dict[int, tuple] = field(default_factory=dict)


#: Trees of fewer top-level blocks are replayed whole by :class:`NearReplays`: recording the base's states costs
#: two copies of the replay's state per block, and a move's replay from them saves less the fewer blocks there are.
#: Every nested-search replay of a no-budget rewrite, both ways (throwaway script, 2-core CPU): HF Electra (2 to 9
#: blocks) 0.74 s from records against 0.72 s whole; GPT-2 with 23 layers (23 blocks and more) 2.3 s against 5.3 s.
NEAR_MIN_BLOCKS = 8

#: Holders that name a block by its id (its checkpoint's inputs, the generator state forked for it, its guard).
_BLOCK_HOLDERS = ("ckpt", "fork", "fguard")


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
        self._base: _Recorded | None = None  # the last base tree's replay, recorded

    def replay(self, blocks: list[Block], cap: int | None = None, base: list[Block] | None = None) -> Replay | AboveCap:
        """:func:`replay_blocks` of ``blocks``, from ``base``'s recorded replay where ``blocks`` is one move from
        it (class docstring)."""
        near = base is not None and len(base) >= NEAR_MIN_BLOCKS and not self.sm.guarded
        i = self._moved_block(base, blocks) if near else None
        if i is None:
            return replay_blocks(self.cg, self.sm, blocks, cap)
        record = self._recorded(base)
        done = record.replay
        replayer = _Replayer(self.cg, self.sm, blocks, sys.maxsize if cap is None else cap)
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
        except _OverCap:
            return AboveCap(replayer.peak)
        except KeyError:  # a state that names blocks no longer there
            return replay_blocks(self.cg, self.sm, blocks, cap)
        seg_peaks[i + 1:] = later
        return Replay(max(known, *seg_peaks[:i + 1]), seg_peaks, forward_peak)

    @staticmethod
    def _frees_in(replayer: _Replayer, block: Block, base_frees: dict[int, list[str]]) -> dict[int, list[str]]:
        """The forward's frees (:meth:`_Replayer._frees`) at the nodes of ``block``, a top-level block of
        ``replayer``'s tree where it differs from the base (whose frees are ``base_frees``): where the block's own
        values are freed depends on how it is split, where the others' are (at the end of the block, or outside it)
        does not."""
        names = subplans.nodes_of(block)
        inside, first, last = set(names), replayer.pos[names[0]], replayer.pos[names[-1]]
        frees = {p: [v for v in values if v not in inside] for p, values in base_frees.items() if first <= p <= last}
        for p, values in replayer._frees(replayer.order, names).items():
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

    def _recorded(self, base: list[Block]) -> _Recorded:
        """``base``'s replay with its states recorded (made once per base tree, the last one kept)."""
        if self._base is None or self._base.blocks is not base:
            replayer, record = _Replayer(self.cg, self.sm, base), _Recorded(base)
            record.replay = replayer.run(record)
            record.copies, record.frees = replayer.copies, replayer._frees(replayer.order)
            self._base = record
        return self._base


@dataclass(frozen=True)
class AboveCap:
    """A replay stopped where its peak passed the cap: ``peak_bytes`` is a lower bound of the step's peak, above
    the cap (the peak so far; the rest of the step can only add to it)."""

    peak_bytes: int


class _OverCap(Exception):
    """Raised inside a replay once its peak exceeds the cap."""


class _Replayer:
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
        self.copies = _inplace_copies(sm, self.seg, self.succs, self.k)
        self.copies -= _inplace_openers(sm, self.segments, self.seg, self.preds, self.succs, facts)
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

    def _frees(self, run: Sequence[str], values: Sequence[str] | None = None) -> dict[int, list[str]]:
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
    def run(self, record: _Recorded | None = None) -> Replay:
        forward_peak = self.forward(record)
        seg_peaks = self.backward(record)
        return Replay(max(forward_peak, *seg_peaks), seg_peaks, forward_peak)

    def forward(self, record: _Recorded | None = None) -> int:
        """The forward pass and the loss; ``record``: the state before each top-level block and the peak while it
        runs (:class:`NearReplays`)."""
        frees, outputs = self._frees(self.order), set(self.sm.outputs)
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
            raise _OverCap
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
                raise _OverCap

    def backward(self, record: _Recorded | None = None) -> list[int]:
        sm = self.sm
        self.release(self.loss, "loss")  # the loss's backward ran (its peak was counted by forward())
        for o in sm.outputs:
            self.grad[o] = self.new(int(sm.output_grad * self.facts.M[o]), ("grad", o))
        return self.backward_from(len(self.blocks) - 1, record)

    def backward_from(self, first: int, record: _Recorded | None = None) -> list[int]:
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
                raise _OverCap

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
        self.forward_blocks([b] if b.sub is None else b.sub, self._frees(run), ("rval",), set(run), unrun)
        if keeps:
            self.release(forked, ("fork", id(b)))


#: Ops whose backward hands the incoming gradient (or slices of it) to an input of the same size or
#: smaller: an add gives both operands the output's gradient, a concatenation gives each input a slice.
PASS_THROUGH = {"add": "same", "add_": "same", "iadd": "same", "cat": "slice", "concat": "slice",
                "concatenate": "slice", "clone": "same", "contiguous": "same"}


def _inplace_copies(sm: StepModel, seg: dict[str, int], succs, k: int) -> set[str]:
    """In-place nodes whose operand needs a private copy by :mod:`fxplan.rewriter.planned_graph`'s rule (a value sharing
    the overwritten storage is read, as a segment input, by a recomputed segment that runs no later than
    the op), before :func:`_inplace_openers` takes out those the rewriter runs between segments instead."""
    copies = set()
    for v, operand in sm.inplace.items():
        if v not in seg or operand not in seg:
            continue
        s = seg[v]
        for m in sm.sharing[operand]:
            if any(seg[r] <= s and seg[r] < k - 1 and seg[r] != seg[m] for r in succs[m]):
                copies.add(v)
                break
    return copies


def _inplace_openers(sm: StepModel, segments: Sequence[Sequence[str]], seg: dict[str, int], preds, succs,
                     facts: GraphFacts) -> set[str]:
    """In-place nodes the rewriter runs by themselves between two segments, on no copy: the conditions of
    :meth:`fxplan.rewriter.planned_graph.Rewrite.inplace_openers`, read off the step model. tests/test_replay.py
    checks that the two agree on the cuts of a ResNet and of a model with a read before an in-place op."""
    if not sm.inplace:
        return set()
    k = len(segments)
    position = facts.position
    aliased: dict[str, int] = {}
    for a in [*sm.inplace.values(), *sm.views.values()]:
        aliased[a] = aliased.get(a, 0) + 1
    found = set()
    for v, a in sm.inplace.items():
        if v not in seg or a not in seg or v in sm.random_inplace:
            continue
        j, s = seg[a], seg[v]
        if not (j < s < k - 1 and min(segments[s], key=position.__getitem__) == v):
            continue
        if aliased[a] > 1 or a in sm.inplace or a in sm.views:
            continue  # a is an alias, or has a view or another in-place op: it gets the copy
        if any(seg[u] > j for u in preds[v] if u != a):
            continue
        if any(seg[r] > j for r in succs[a] if r != v and position[r] < position[v]):
            continue
        found.add(v)
    return found
