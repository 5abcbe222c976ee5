"""Tracing a model into a :class:`~fxplan.solvers.costgraph.CostGraph`.

:func:`fxplan.capture.capturers.capture` gives the graph: ``torch.fx.symbolic_trace`` at module granularity where
it works (leaf modules are torch.nn's, which matches the node counts of Kusumoto et al.'s Chainer
graphs), an ATen graph from ``torch.export`` otherwise. The example inputs are then propagated
through a private fake-tensor copy of the model, one node at a time, to record per node:

* ``M``: bytes of the node's output tensors (as if written out of place);
* ``T``: the node's forward cost. ``cost_model="roofline"`` (default) and ``"measured"``: microseconds on
  the model's device (:mod:`fxplan.costs.timecost`; a roofline of FLOPs, bytes moved and ops against the
  device's measured speed, or the node timed on real tensors of its shapes); ``"fused"``: microseconds of the
  node's FLOPs alone at the device's speed, with the fixed cost of one op as a floor, as a step compiled with
  inductor runs it (pointwise ops and norms are fused into the kernels that read their outputs, so recomputing
  them adds no pass over memory: the price torch.compile's own partitioner gives them); ``"flops"``: FLOPs from
  ``torch.utils.flop_counter`` with a floor of one per output element; ``"paper"``: the paper's rule
  (10 for a convolution, 1 otherwise);
* what autograd saves for the node's backward, seen through ``saved_tensors_hooks``: whether it keeps
  the node's own output (``saves_output``), which predecessors' outputs it keeps (``saved_inputs``),
  and the bytes of anything else it keeps (``saved``: BatchNorm statistics, pooling indices, masks);
  ``saves_resident``: whether it also keeps a parameter, buffer or model input (no bytes of its own, but
  where a recomputation that checkpoint stops early ends);
* ``flops``: the FLOPs ``torch.utils.flop_counter`` counts for the node (matrix products, convolutions,
  attention; 0 for pointwise ops and norms, which :mod:`fxplan.capture.recomputed_inputs` takes for cheap);
* ``alias_of``: the predecessor whose storage the output shares (views and in-place ops), else None;
* ``mutates``: the buffers the node writes in place, seen from the schemas of the ops it runs;
* ``forward_rise`` and ``backward_rise``: the most bytes of new storages the node's forward and its
  backward hold at once (its outputs and gradients, and the temporaries between the ops it runs: an
  attention decomposed into matmuls, a softmax and a dropout; and what their kernels hold inside
  themselves, :mod:`fxplan.measure.scratch`), for the replay (``backward_rise`` where not 0).

The same propagation records what the replay of a plan's backward (:mod:`fxplan.planner.replay`) needs from
autograd: which inputs of each node its backward gives a gradient, which nodes have no backward of
their own (``cg.graph["gradients"]``), and the model's output (``cg.graph["example_output"]``, fake
tensors), so that no second pass over the graph is needed for them. The fake copy it ran on is kept
with its fake mode (``cg.graph["fake"]``) for the budget search to measure candidates on.

Besides data edges, the graph holds ``order_only`` edges (see :func:`fxplan.capture.effects.ordering_edges`):
random ops keep their program order, and readers after an in-place write stay after it, so every
plan over the graph is one the rewriter can run exactly. Solvers treat them like data edges, which
can only overestimate memory.

Propagation runs on fake tensors, so it allocates nothing, works at any batch size and leaves the
user's model (parameters, BatchNorm statistics) untouched.

This module runs the stages in turn: the propagation (:mod:`fxplan.costs.propagation`), the nodes built from its
records (:mod:`fxplan.costs.node_costs`) and the facts of the units' savers (:mod:`fxplan.costs.unit_savers`).
"""

from __future__ import annotations

import logging
from typing import Any

import networkx as nx
import torch
from torch.utils._pytree import tree_map

from fxplan.capture.capturers import Captured, ExampleCall, as_call, capture, export_after
from fxplan.capture.fakes import (
    DATA_DEPENDENT,
    caches_kept_real,
    data_dependent_error,
    fake_copy,
    fake_mode_of,
    to_fake,
)
from fxplan.costs.node_costs import build_cost_graph, time_costs
from fxplan.costs.propagation import CostPropagator
from fxplan.costs.timecost import TIME_MODELS
from fxplan.costs.unit_savers import unit_savers
from fxplan.errors import FxplanError, TraceError
from fxplan.measure.meter import fresh_autocast_cache
from fxplan.solvers.costgraph import CostGraph

logger = logging.getLogger("fxplan")

#: What ``trace`` accepts as ``cost_model``.
COST_MODELS = ("roofline", "measured", "fused", "flops", "paper")


@caches_kept_real()
def trace(model: torch.nn.Module, example_inputs: Any, *, cost_model: str = "roofline",
          captured: Captured | None = None, probe_units: bool = False) -> CostGraph:
    """Capture ``model`` and propagate ``example_inputs`` (real or fake) into a cost graph.

    ``example_inputs`` is a tuple of positional arguments, a dict of keyword arguments or one tensor.
    ``cost_model`` (module docstring) is ``"roofline"`` (default: works on fake tensors, costs little
    more than counting FLOPs, and gives the same plan on every run), ``"measured"`` (each distinct node timed on real
    tensors: closer to the machine, slower, and varies with load), ``"fused"`` (a step compiled with inductor),
    ``"flops"`` or ``"paper"`` (Kusumoto et
    al. section 3: 10 for a convolution, 1 otherwise). ``cg.graph["T_seconds"]`` is the seconds of one
    unit of T (1e-6 for the time models; None for FLOPs and the paper's units, which are not time).
    A model whose device cannot be timed here (meta tensors, fake CUDA tensors without a GPU) falls back
    from the time models to FLOPs, with a warning. The captured GraphModule (sharing the user's modules) is kept in
    ``cg.graph["gm"]`` and the :class:`~fxplan.capture.capturers.Captured` record in ``cg.graph["captured"]``.
    Nodes that update buffers in place (BatchNorm statistics of any class, counters) list them in
    ``mutates``, also recorded in the graph node's ``meta["fxplan_mutates"]`` for the rewriter.
    ``probe_units``: also run the savers of the graph's units of recomputed inputs as the graphs with them run
    them (``cg.graph["unit_savers"]``), from which the search derives those graphs (:func:`unit_savers`).
    """
    if cost_model not in COST_MODELS:
        raise FxplanError(f"cost_model must be one of {', '.join(COST_MODELS)}, got {cost_model!r}")
    call = as_call(example_inputs)
    captured = captured or capture(model, call)
    try:
        with fresh_autocast_cache():
            propagator = _propagate(model, captured, call)
    except TraceError as error:
        if captured.method != "symbolic_trace":
            raise
        # symbolic_trace can give a graph that does not run (a shape frozen into an assertion): try export.
        logger.info("fxplan: capturing %s with torch.export (the graph symbolic_trace made does not run)",
                    type(model).__name__)
        logger.debug("fxplan: the symbolic_trace graph of %s failed: %s", type(model).__name__, error)
        captured = export_after(model, call, error)
        with fresh_autocast_cache():
            propagator = _propagate(model, captured, call)
    gm = captured.gm
    _refuse_own_checkpoints_updating_buffers(model, captured, propagator)
    for node in gm.graph.nodes:
        if node.name in propagator.records:
            node.meta["fxplan_mutates"] = propagator.records[node.name].mutates
    for graph in (gm.graph, propagator.module.graph):  # the search generates code over both
        for node in graph.nodes:
            if node.name in propagator.records:
                node.meta["fxplan_fresh_output"] = propagator.records[node.name].alias_storage is None
    cg = build_cost_graph(gm, propagator, cost_model, type(model).__name__)
    cg.graph["captured"] = captured
    cg.graph["gradients"] = propagator.gradients()
    nx.set_node_attributes(cg, propagator.backward_rises(), "backward_rise")
    if probe_units:
        try:
            cg.graph["unit_savers"] = unit_savers(cg, propagator)
        except Exception as error:  # noqa: BLE001 (optional facts: the graphs with units are traced instead)
            logger.info("fxplan: the savers of recomputed inputs were not probed (%s: %s)", type(error).__name__,
                        str(error).splitlines()[0][:200] if str(error) else "")
    # the fake copy propagated (its parameters without .grad: no backward ran) and its fake mode, on which
    # the budget search measures its candidates (fxplan.planner.search) without copying the model again
    cg.graph["fake"] = (propagator.module, propagator.fake_mode)
    cg.graph["example_output"] = tree_map(lambda t: t.detach() if isinstance(t, torch.Tensor) else t,
                                          captured.interface.output(propagator.result))
    if cost_model in TIME_MODELS:
        time_costs(cg, gm, propagator, cost_model)
    propagator.release()
    return cg


def _propagate(model: torch.nn.Module, captured: Captured, call: ExampleCall) -> CostPropagator:
    gm = captured.gm
    args, kwargs = captured.interface.graph_inputs(call.args, call.kwargs)
    values = placeholder_values(gm, args, kwargs, type(model).__name__)
    fake_mode = fake_mode_of(model, (call.args, call.kwargs))
    propagator = CostPropagator(fake_copy(gm, fake_mode), fake_mode)
    try:
        with fake_mode, torch.enable_grad():
            propagator.result = propagator.run(*to_fake(values, fake_mode))
    except DATA_DEPENDENT as exc:
        raise data_dependent_error(_eager_failure(model, call) or exc, f"the captured graph of "
                                   f"{type(model).__name__} (at node '{propagator.current}')", TraceError) from exc
    except FxplanError:  # fxplan's own refusal: its message says what to do, whole
        raise
    except Exception as exc:  # anything the model's own code raises on these inputs
        node = propagator.current
        raise TraceError(f"running the captured graph on the example inputs failed at node '{node}' "
                         f"({type(exc).__name__}: {str(exc).strip().splitlines()[0][:300]}); check the example "
                         "inputs' shapes and dtypes against what the model expects") from exc
    return propagator


def _eager_failure(model: torch.nn.Module, call: ExampleCall) -> Exception | None:
    """The data-dependent op the model's own forward stops at on a fake copy, whose traceback names the model's
    line (a captured graph's code has none); None if it runs through or fails otherwise."""
    fake_mode = fake_mode_of(model, (call.args, call.kwargs))
    try:
        args, kwargs = to_fake((call.args, call.kwargs), fake_mode)
        with fake_mode, fresh_autocast_cache():
            fake_copy(model, fake_mode)(*args, **kwargs)
    except DATA_DEPENDENT as exc:
        return exc
    except Exception:  # noqa: BLE001 (only the line is looked for: the graph's failure is the error)
        return None
    return None


def _refuse_own_checkpoints_updating_buffers(model: torch.nn.Module, captured: Captured,
                                             propagator: CostPropagator) -> None:
    """A model that checkpoints parts of itself re-runs them in backward, buffer updates included (its
    BatchNorm statistics move twice per step); the captured graph runs them once, as a step without its
    checkpoints does, so a rewrite could not keep its buffers: refused."""
    if not captured.checkpoints_itself:
        return
    updated = sorted({key for record in propagator.records.values() for key in record.mutates})
    if updated:
        raise FxplanError(
            f"{type(model).__name__} checkpoints parts of its own forward (torch.utils.checkpoint) and its step "
            f"updates buffers ({', '.join(map(str, updated[:3]))}{', ...' if len(updated) > 3 else ''}); its "
            "checkpoints re-run those updates when they recompute in backward, which fxplan's rewrite, planning the "
            "recomputation itself, would not do, so its buffers would differ from the model's. Turn the model's own "
            "checkpointing off (timm: model.set_grad_checkpointing(False); torchvision DenseNet: "
            "memory_efficient=False; Hugging Face: model.gradient_checkpointing_disable()) and let fxplan plan it")


def placeholder_values(gm: torch.fx.GraphModule, args: tuple, kwargs: dict[str, Any], name: str) -> list[Any]:
    """One value per placeholder of ``gm``: positional first, then by name, then the placeholder's default."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if len(args) > len(placeholders):
        raise TraceError(f"{name}.forward takes {len(placeholders)} inputs, got {len(args)} example inputs")
    values = list(args)
    for node in placeholders[len(args):]:
        if node.target in kwargs:
            values.append(kwargs[node.target])
        elif node.args:  # a placeholder's args hold its default value
            values.append(node.args[0])
        else:
            names = ", ".join(str(n.target) for n in placeholders)
            raise TraceError(f"{name}.forward({names}) needs a value for '{node.target}' in the example inputs")
    return values
