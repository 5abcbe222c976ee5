"""A GraphModule that owns all of a model's state, and what a graph node's dotted target names.

Every graph fxplan captures, splices or rewrites owns the model's own module, parameter and buffer objects under
their original names, so that ``state_dict`` keys, parameter sharing and non-persistent buffers are the model's
and training the graph trains the model. :func:`owning_graph_module` makes such a GraphModule (for the capturers
of :mod:`fxplan.capture.capturers`, the graphs with recomputed regions, the spliced graphs and the rewritten
module); :func:`resolve_attr` looks up the attribute a ``get_attr`` or ``call_module`` target names.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx


def resolve_attr(root: torch.nn.Module, target: str) -> Any:
    """The attribute a dotted get_attr/call_module target names, looked up from ``root``."""
    value: Any = root
    for atom in target.split("."):
        value = getattr(value, atom)
    return value


def owning_graph_module(model: torch.nn.Module, graph: fx.Graph, constants: dict[str, Any] | None = None,
                        class_name: str | None = None) -> fx.GraphModule:
    """A GraphModule running ``graph`` that owns all of ``model``'s state, the very same objects.

    ``constants`` (tensors and submodules the capture made up) become non-persistent buffers and plain
    attributes, so ``state_dict`` keys are exactly the model's. The buffers among them are named in
    ``_fxplan_constants`` (those of ``model`` kept too): the rewritten module holds them as plain attributes
    instead (:func:`fxplan.rewriter.codegen.segment_module`), so that its ``named_buffers()`` are the model's.
    """
    constants = dict(constants or {})
    holder = torch.nn.Module()
    holder.__dict__.update(constants)
    holder.__dict__["_modules"] = model._modules
    holder.__dict__["_parameters"] = model._parameters
    holder.__dict__["_buffers"] = model._buffers
    gm = fx.GraphModule(holder, graph, class_name or type(model).__name__)
    gm.training = model.training
    gm.__dict__["_modules"] = dict(model._modules)
    gm.__dict__["_parameters"] = dict(model._parameters)
    gm.__dict__["_buffers"] = dict(model._buffers)
    gm.__dict__["_non_persistent_buffers_set"] = set(model._non_persistent_buffers_set)
    made = {name for name in model.__dict__.get("_fxplan_constants", ()) if name in gm._buffers}
    for name, value in constants.items():
        gm.__dict__.pop(name, None)
        if isinstance(value, torch.Tensor) and not isinstance(value, torch.nn.Parameter):
            gm.register_buffer(name, value, persistent=False)
            made.add(name)
        else:  # a plain attribute; a module here is a stateless graph body (a no_grad region), not a submodule
            gm.__dict__[name] = value
    gm.__dict__["_fxplan_constants"] = made
    return gm
