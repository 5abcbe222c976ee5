"""What a replay knows of a model's step besides the plan (:class:`StepModel`), made once per cost graph.

:func:`fxplan.planner.replay.replay` predicts a plan's peak from the cost graph and these facts of the step: the
bytes held for the whole step (parameters, buffers, inputs, existing gradients), which nodes return views of their
operands or overwrite them in place, the gradients each node's backward makes (its parameters' included), the
buffers a checkpointed block's guard copies, the generator state a checkpoint keeps, and what the loss function
holds and hands the outputs (:func:`probe_loss`, run on fake outputs). Which inputs receive gradients is recorded
by the trace's propagation (:mod:`fxplan.costs.propagation`). A search replays hundreds of plans of one graph, so
:func:`step_model` makes these facts once, with the graph's as plain dicts (:class:`GraphFacts`). Per plan, which
in-place ops run on a private copy of their operand follows from them by the rewriter's rule (:func:`inplace_copies`,
:func:`inplace_openers`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
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
from fxplan.measure.meter import default_loss, device_of, resident_bytes
from fxplan.measure.scratch import charged_bytes, storage_bytes
from fxplan.measure.tracker import track_memory
from fxplan.rewriter import inplace_rule
from fxplan.rewriter.recompute import STATEFUL_NORMS, host_rng_state_bytes
from fxplan.solvers import subplans
from fxplan.solvers.costgraph import CostGraph


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
    (:meth:`fxplan.rewriter.recompute.Segment.known_mutating`)."""
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


def inplace_copies(sm: StepModel, seg: dict[str, int], succs, k: int) -> set[str]:
    """In-place nodes whose operand needs a private copy by the rewriter's rule
    (:func:`fxplan.rewriter.inplace_rule.read_by_recompute`: a value sharing the overwritten storage is read, as a
    segment input, by a recomputed segment that runs no later than the op), before :func:`inplace_openers` takes out
    those the rewriter runs between segments instead."""
    return {v for v, operand in sm.inplace.items() if v in seg and operand in seg
            and inplace_rule.read_by_recompute(sm.sharing[operand], seg[v], seg.__getitem__, succs.__getitem__, k)}


def inplace_openers(sm: StepModel, segments: Sequence[Sequence[str]], seg: dict[str, int], preds, succs,
                    facts: GraphFacts) -> set[str]:
    """In-place nodes the rewriter runs by themselves between two segments, on no copy
    (:func:`fxplan.rewriter.inplace_rule.inplace_openers`, read off the step model). tests/test_replay.py checks that
    the replay's copies are the rewriter's on the cuts of a ResNet and of a model with a read before an in-place op."""
    if not sm.inplace:
        return set()
    position = facts.position
    overwrites = [(v, a) for v, a in sm.inplace.items() if v in seg and a in seg and v not in sm.random_inplace]
    found = inplace_rule.inplace_openers(overwrites, {**sm.views, **sm.inplace}, seg.__getitem__, len(segments),
                                         lambda s: min(segments[s], key=position.__getitem__), position,
                                         preds.__getitem__, succs.__getitem__)
    return {v for v, _, _ in found}
