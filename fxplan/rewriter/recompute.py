"""The runtime of a recomputed segment: checkpointing, buffer guard, random state.

One :class:`Segment` runs one block ``V_i = L_i \\ L_{i-1}`` of the canonical strategy (Kusumoto et al.,
section 3): in training with grad enabled, every segment but the last runs under non-reentrant
``torch.utils.checkpoint.checkpoint``: its forward keeps only the segment's inputs (the cache of
``∂(L_{i-1})``), and backward re-runs the segment to recover the values it needs ("recover the required
forward values for the nodes V_i based on the cache of ∂(L_{i-1})"). In ``eval()`` mode or under
``torch.no_grad()`` a segment is a plain function call: no checkpoint machinery at all.

Exactness, and how it is kept:

* **Random ops** draw the same numbers in the forward and in the recomputation: checkpoint saves the
  CPU (and device) generator state before the forward of the segment and restores it, forked, for the
  recomputation, so the global generator continues exactly as in an un-checkpointed step. A segment
  whose ops certainly draw nothing (:func:`fxplan.capture.effects.may_draw_random`: no dropout of non-zero
  probability, no user code the tracer left whole) skips this.
  (:mod:`fxplan.rewriter.codegen` makes sure random ops keep their program order, so the draws also equal
  those of the original model.) The CPU generator's state that checkpoint keeps (5,056 bytes, made
  outside the dispatcher, where fxplan's meter cannot see it) is counted by that meter all the same
  (:class:`MeteredRngStates`), so budgets hold on a meter that sees every allocation.
* **Buffers** are never mutated by a recomputation (:class:`BufferGuard`). BatchNorm in training
  mode updates ``running_mean``, ``running_var`` and ``num_batches_tracked`` in its forward; re-running
  it would update them twice. During a recomputation each buffer that the segment's forward mutates
  is swapped for a private copy of the value it had *before* that forward, so the recomputation
  replays the forward exactly (same outputs bitwise: a training-mode BatchNorm normalises with batch
  statistics) and its updates land in the copy, which is then dropped.
* **Generators of the model's own** (``torch.rand(..., generator=g)``), which checkpoint does not keep:
  their states when the forward starts are set for the recomputation and put back after it
  (:class:`GeneratorStates`), as for the default generators. Their states (5 KB each on a CPU) are not metered.
* **Autocast** state is recorded by checkpoint and re-applied in the recomputation.

Segments hold no parameters, buffers or submodules of their own: attribute look-ups the generated
code makes (``self.layer1``) are forwarded to the owning module, which holds the original module tree
under its original names, so ``state_dict`` keys do not change.
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.fx as fx
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack
from torch.utils._pytree import tree_leaves
from torch.utils.checkpoint import checkpoint

from fxplan.capture import effects
from fxplan.capture.graph_module import resolve_attr
from fxplan.measure import scratch
from fxplan.rewriter import offload

#: Modules whose training-mode forward is known to update their own buffers.
STATEFUL_NORMS = (torch.nn.modules.batchnorm._NormBase,)


class BufferGuard:
    """Keeps one checkpointed forward's buffer mutations out of its recomputation.

    Created just before the segment's forward. ``slots`` are ``(key, module, name)`` for every buffer
    the segment can reach; ``known`` are the keys of buffers expected to be mutated (BatchNorm
    buffers, and buffers seen mutated in earlier steps): their values are copied before the forward.
    :meth:`finish` (after the forward) records which buffers the forward really mutated. The
    recomputation context (second element of :meth:`contexts`) swaps each of them for a fresh copy of
    its pre-forward value and puts the real buffer back afterwards, so the real buffers are untouched,
    not even their version counters.

    Version counters alone cannot find every mutation: the native batch norm kernel updates
    ``running_mean``/``running_var`` without bumping their versions (torch 2.14.1), which is why
    norm-layer buffers are known up front. A buffer that only a native kernel mutates, in a module
    that is not a norm layer, would go unnoticed. The swap is visible to other threads that use the
    same modules during the recomputation (e.g. the original model, which shares them).
    """

    def __init__(self, slots: list[tuple[str, torch.nn.Module, str]], known: set[str]):
        self.slots = slots
        self.before = [_version(mod._buffers[name]) for _, mod, name in slots]
        self.snapshot: dict[int, torch.Tensor] = {}
        self.known: list[int] = []
        for i, (key, mod, name) in enumerate(slots):
            if key in known:
                self.known.append(i)
                buf = mod._buffers[name]
                self.snapshot[id(buf)] = buf.detach().clone()
        self.mutated: list[int] = []
        self._recomputations: list[tuple[list, list]] = []  # per recomputation running: (others, swapped)

    def finish(self) -> list[str]:
        """Record the buffers the forward mutated; return the keys of those not known beforehand.

        Known buffers count as mutated whatever their version counters say: the native batch norm
        kernel updates ``running_mean``/``running_var`` without bumping their versions. Other
        buffers are found by their version counters (any Python-level in-place op bumps them).
        """
        known = set(self.known)
        found = [
            i
            for i, (_, mod, name) in enumerate(self.slots)
            if i not in known and _version(mod._buffers[name]) != self.before[i]
        ]
        self.mutated = sorted(known | set(found))
        return [self.slots[i][0] for i in found]

    def contexts(self) -> tuple[contextlib.AbstractContextManager, contextlib.AbstractContextManager]:
        """``context_fn`` for checkpoint: nothing around the forward, the guard around recomputation (entered
        once per backward that needs the segment: twice for a double backward)."""
        return contextlib.nullcontext(), self

    def __enter__(self) -> None:
        mutated = set(self.mutated)
        others = [
            (key, mod._buffers[name], _version(mod._buffers[name]))
            for i, (key, mod, name) in enumerate(self.slots)
            if i not in mutated
        ]
        swapped: list[tuple[torch.nn.Module, str, torch.Tensor]] = []
        copies: dict[int, torch.Tensor] = {}  # one copy per tensor, even if registered twice
        for i in self.mutated:
            _, mod, name = self.slots[i]
            real = mod._buffers[name]
            if id(real) not in copies:
                source = self.snapshot.get(id(real), real)
                copies[id(real)] = source.detach().clone()
            mod._buffers[name] = copies[id(real)]
            swapped.append((mod, name, real))
        self._recomputations.append((others, swapped))

    def __exit__(self, *exc_info: Any) -> None:
        others, swapped = self._recomputations.pop()
        for mod, name, real in reversed(swapped):
            mod._buffers[name] = real
        for key, buf, version in others:
            if _version(buf) != version:
                warnings.warn(
                    f"fxplan: buffer {key!r} was mutated while recomputing a segment but not "
                    "in its forward; recomputation may have changed model state",
                    RuntimeWarning,
                    stacklevel=2,
                )


def _version(t: torch.Tensor) -> int:
    try:
        return t._version
    except RuntimeError:  # inference tensors have no version counter
        return -1


class Segment(fx.GraphModule):
    """One segment of a recomputation plan, called as ``self.segment_i(...)`` by its owner.

    Its ``code`` is the segment's part of the original forward, with the original names. It owns
    no state: the generated code's ``self.<name>`` look-ups fall through to the owner module.
    ``recompute=False`` marks the last segment, which always runs plainly (its activations are kept
    for backward, as in the canonical strategy).
    """

    def __init__(
        self,
        root: torch.nn.Module,
        graph: fx.Graph,
        class_name: str,
        *,
        recompute: bool,
        targets: list[str],
        attr_targets: list[str],
        children: dict[str, Segment] | None = None,
    ):
        children = dict(children or {})
        # a nested segment's graph calls its sub-segments, and the in-place ops it runs inline between them
        # (fxplan.rewriter.planned_graph.split_off): GraphModule checks that a dict root names each of them
        inline = {
            str(n.target): resolve_attr(root, str(n.target))
            for n in graph.nodes
            if n.op in ("call_module", "get_attr") and str(n.target) not in children
        }
        super().__init__({**inline, **children} if children else root, graph, class_name)
        # Drop what GraphModule copied in: look-ups go to the owner (see __getattr__). Sub-segments of a
        # nested plan (fxplan.solvers.subplans) are the only modules a segment holds.
        self._modules.clear()
        self._parameters.clear()
        self._buffers.clear()
        self._modules.update(children)
        self.__dict__["fxplan_children"] = children
        self.__dict__["_fxplan_owner"] = None
        self.fxplan_recompute = recompute
        self._fxplan_targets = list(targets)
        self._fxplan_attr_targets = list(attr_targets)
        self._fxplan_learned: set[str] = set()

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            owner = self.__dict__.get("_fxplan_owner")
            if owner is None:
                raise
            return getattr(owner, name)

    def _set_owner(self, owner: torch.nn.Module) -> None:
        self.__dict__["_fxplan_owner"] = owner

    def __deepcopy__(self, memo: dict[int, Any]) -> Segment:
        raise TypeError(
            "a fxplan Segment cannot be copied on its own; deep-copy the module returned by "
            "fxplan.rewriter.codegen.segment_module instead"
        )

    def buffer_slots(self) -> list[tuple[str, torch.nn.Module, str]]:
        """``(key, module, name)`` for every buffer this segment's modules and attributes can reach: those
        of the modules it calls and of the modules its ``get_attr`` nodes fetch (a function handed a module,
        as ``symbolic_trace`` records one, can run it and update its buffers), and the buffers fetched."""
        owner = self.__dict__["_fxplan_owner"]
        slots: list[tuple[str, torch.nn.Module, str]] = []
        seen: set[tuple[int, str]] = set()
        fetched = [t for t in self._fxplan_attr_targets if isinstance(resolve_attr(owner, t), torch.nn.Module)]
        for target in self._fxplan_targets + fetched:
            for path, mod in owner.get_submodule(target).named_modules(prefix=target):
                for name, buf in mod._buffers.items():
                    if buf is not None and (id(mod), name) not in seen:
                        seen.add((id(mod), name))
                        slots.append((f"{path}.{name}", mod, name))
        for target in self._fxplan_attr_targets:
            parent_path, _, name = target.rpartition(".")
            mod = owner.get_submodule(parent_path) if parent_path else owner
            if name in mod._buffers and mod._buffers[name] is not None and (id(mod), name) not in seen:
                seen.add((id(mod), name))
                slots.append((target, mod, name))
        return slots

    def known_mutating(self, slots: list[tuple[str, torch.nn.Module, str]]) -> set[str]:
        """Buffers the forward will mutate: seen by :func:`fxplan.costs.trace.trace` in what the graph's ops
        write, learned in earlier steps, and (for graphs not traced by fxplan) training norm layers."""
        known = set(self._fxplan_learned)
        for node in self._all_nodes():
            known.update(node.meta.get("fxplan_mutates", ()))
        for key, mod, _ in slots:
            if isinstance(mod, STATEFUL_NORMS) and mod.training:
                known.add(key)
        return known

    def may_draw_random(self) -> bool:
        """Whether this segment's forward (its sub-segments' included) may draw random numbers, so that its
        recomputation must start from the generators' state of the forward
        (:func:`fxplan.capture.effects.may_draw_random`; asked at every call: a dropout's probability can change)."""
        owner = self.__dict__["_fxplan_owner"]
        children = self.fxplan_children
        return any(child.may_draw_random() for child in children.values()) or any(
            effects.may_draw_random(n, owner) for n in self.graph.nodes
            if not (n.op == "call_module" and str(n.target) in children) and n.target is not offload.mark)

    def own_generators(self) -> list[torch.Generator]:
        """The ``torch.Generator`` objects this segment's ops (its sub-segments' included) draw from by argument
        (``torch.rand(..., generator=g)``), each once: checkpoint keeps only the default generators' states."""
        owner = self.__dict__["_fxplan_owner"] or self
        if "_fxplan_generator_sources" not in self.__dict__:  # the nodes do not change; the attributes may
            self.__dict__["_fxplan_generator_sources"] = [
                source for node in self._all_nodes()
                for source in ([str(node.target)] if node.op == "get_attr" else
                               [v for v in tree_leaves((node.args, node.kwargs)) if isinstance(v, torch.Generator)])
                if isinstance(resolve_attr(owner, source) if isinstance(source, str) else source, torch.Generator)]
        found: dict[int, torch.Generator] = {}
        for source in self.__dict__["_fxplan_generator_sources"]:
            value = resolve_attr(owner, source) if isinstance(source, str) else source
            if isinstance(value, torch.Generator):
                found.setdefault(id(value), value)
        return list(found.values())

    def _all_nodes(self) -> Iterator[fx.Node]:
        """The nodes this segment runs: its own and, for a nested plan, its sub-segments'."""
        yield from self.graph.nodes
        for child in self.fxplan_children.values():
            yield from child._all_nodes()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        plain = functools.partial(_replaying_views, torch.nn.Module.__call__, self)  # recomputed as it ran
        owner = self.__dict__["_fxplan_owner"]
        training = owner.training if owner is not None else self.training
        if not (self.fxplan_recompute and training and torch.is_grad_enabled()):
            return plain(*args, **kwargs)
        slots = self.buffer_slots()
        out, new = checkpointed(plain, args, kwargs, slots=slots, known=self.known_mutating(slots),
                                random=self.may_draw_random(), generators=self.own_generators())
        if new:
            self._fxplan_learned.update(new)
            surprising = [k for k in new if not k.endswith(("running_mean", "running_var",
                                                            "num_batches_tracked"))]
            if surprising:
                warnings.warn(
                    f"fxplan: segment {self._get_name()} mutated buffers {surprising} in its "
                    "forward; this step recomputes from their updated values, later steps from "
                    "the values before the forward",
                    RuntimeWarning,
                    stacklevel=2,
                )
        return out


def checkpointed(plain: Callable[..., Any], args: tuple, kwargs: dict[str, Any], *,
                 slots: list[tuple[str, torch.nn.Module, str]], known: set[str], random: bool,
                 generators: list[torch.Generator]) -> tuple[Any, list[str]]:
    """``plain(*args, **kwargs)`` checkpointed: recomputed in backward with the buffers at ``slots`` guarded
    (:class:`BufferGuard`, ``known``: those expected to be mutated), from the random state of the forward where
    ``random``, and from the states of ``generators``. Returns the output and the keys of the buffers the forward
    mutated that were not known."""
    guard = BufferGuard(slots, known)
    context_fn = guard.contexts
    if random and _metering_host_memory(args, kwargs):
        context_fn = functools.partial(MeteredRngStates.contexts, guard.contexts)
    if generators:
        context_fn = functools.partial(GeneratorStates.contexts, generators, context_fn)
    out = checkpoint(plain, *args, use_reentrant=False, preserve_rng_state=random, context_fn=context_fn, **kwargs)
    return out, guard.finish()


def views_replayed() -> contextlib.AbstractContextManager:
    """Autograd records each view a planned step makes by replaying the view op (as it does for fake tensors, and
    for real ones under AOTAutograd), not as an ``as_strided`` of its base. The two differ in the memory of the
    backward of an in-place op on a view (an in-place ReLU after InstanceNorm, which normalizes a view): on real
    tensors ``AsStridedBackward`` makes a zeroed copy of the base's size where the view's gradient is passed on as a
    view, so a real step held a base-sized buffer more than the fake step fxplan measured (RAFT's smallest plan,
    1.057x its measured peak). With views replayed the real step runs what was measured; the gradients are equal."""
    return torch.autograd._force_original_view_tracking(True)


def _replaying_views(call: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``call(*args, **kwargs)`` with views replayed (:func:`views_replayed`): a recomputation in backward too."""
    with views_replayed():
        return call(*args, **kwargs)


def _metering_host_memory(args: tuple, kwargs: dict) -> bool:
    """Whether fxplan's meter (:class:`fxplan.measure.meter.StorageTracker`) is counting this step and the segment
    runs on the CPU, where the generator states checkpoint keeps are allocated too."""
    from fxplan.measure.tracker import StorageTracker

    if not scratch.counted() or not any(isinstance(m, StorageTracker) for m in _get_current_dispatch_mode_stack()):
        return False
    first = next((t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)), None)
    return first is not None and first.device.type == "cpu"


class GeneratorStates:
    """A checkpoint's contexts that also keep the states of generators the segment's ops draw from by argument
    (:meth:`Segment.own_generators`), as checkpoint keeps the default ones': their states when the forward
    starts are set for each recomputation, which then draws the forward's numbers, and the states it found are
    put back after it, so the generators go on as in a step without recomputation. The object is the
    recomputation context, entered once per backward that needs the segment (as :class:`BufferGuard`)."""

    def __init__(self, generators: list[torch.Generator], forward: Any, recompute: Any) -> None:
        self.generators, self._forward, self._recompute = generators, forward, recompute
        self.states: list[torch.Tensor] = []
        self._found: list[list[torch.Tensor]] = []  # per recomputation running: the states it found

    @classmethod
    def contexts(cls, generators: list[torch.Generator], inner: Callable[[], tuple[Any, Any]]) -> tuple[Any, Any]:
        """``context_fn`` for checkpoint: ``inner()``'s contexts, with the generators' states kept around them."""
        keeper = cls(generators, *inner())
        return keeper._forwarding(), keeper

    @contextlib.contextmanager
    def _forwarding(self) -> Iterator[None]:
        self.states = [g.get_state() for g in self.generators]
        with self._forward:
            yield

    def __enter__(self) -> Any:
        self._found.append([g.get_state() for g in self.generators])
        for g, state in zip(self.generators, self.states):
            g.set_state(state)
        return self._recompute.__enter__()

    def __exit__(self, *exc_info: Any) -> Any:
        try:
            return self._recompute.__exit__(*exc_info)
        finally:
            for g, state in zip(self.generators, self._found.pop()):
                g.set_state(state)


class MeteredRngStates:
    """A checkpoint's recomputation context that also holds, where fxplan's meter sees them, stand-ins for
    the CPU generator states checkpoint allocates outside the dispatcher.

    With ``preserve_rng_state`` checkpoint keeps ``torch.get_rng_state()`` from the forward for as long as
    it keeps this context (both belong to its recomputation), and ``torch.random.fork_rng`` takes another
    copy around the recomputation. Those bytes are real on the CPU (torch.profiler counts them) but no op
    makes them, so the meter is handed stand-ins of the same size with the same lifetimes: one made with
    the context, one while the recomputation runs. Only used while the meter runs.
    """

    def __init__(self, recompute: contextlib.AbstractContextManager) -> None:
        self._recompute = recompute
        self._kept = torch.empty(host_rng_state_bytes(), dtype=torch.uint8)
        self._forked: torch.Tensor | None = None

    @classmethod
    def contexts(cls, inner: Callable[[], tuple[Any, Any]]) -> tuple[Any, MeteredRngStates]:
        """``context_fn`` for checkpoint: ``inner()``'s contexts, its recomputation one wrapped."""
        forward, recompute = inner()
        return forward, cls(recompute)

    def __enter__(self) -> Any:
        self._forked = torch.empty_like(self._kept)
        return self._recompute.__enter__()

    def __exit__(self, *exc_info: Any) -> Any:
        self._forked = None
        return self._recompute.__exit__(*exc_info)


@functools.cache
def host_rng_state_bytes() -> int:
    """Bytes of the CPU generator's state (``torch.get_rng_state()``), which checkpoint keeps per segment."""
    return torch.get_rng_state().nbytes
