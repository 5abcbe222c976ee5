"""The container types of a model's output that a torch.fx graph loses, and the output rebuilt with them.

torch.fx records every dict as a plain dict, so a model returning an ``OrderedDict`` (torchvision's segmentation
models) would get a plain dict back from its captured graph. The symbolic_trace capturer's tracer
(:mod:`fxplan.capture.capturers`) notes the types of the dicts the output holds (:func:`container_types`), and the
call interface rebuilds them from what the graph returns (:func:`retyped`).
"""

from __future__ import annotations

from typing import Any


def container_types(value: Any, dicts: dict[int, tuple[dict, type]]) -> Any:
    """Where the traced output holds dicts of other types than ``dict`` (``OrderedDict``: torchvision's
    segmentation models), a template :func:`retyped` rebuilds them from; None where it holds none."""
    if isinstance(value, dict):
        inner = {k: container_types(v, dicts) for k, v in value.items()}
        made, kind = dicts.get(id(value), (None, None))
        kind = kind if made is value else None
        if kind is None and all(v is None for v in inner.values()):
            return None
        return ("dict", kind, inner)
    if isinstance(value, (list, tuple)):
        items = [container_types(v, dicts) for v in value]
        return None if all(v is None for v in items) else ("sequence", None, items)
    return None


def retyped(value: Any, template: Any) -> Any:
    """``value`` (what a graph returned) with its dicts rebuilt as the types ``template`` (of
    :func:`container_types`) names; a type that cannot be built from a dict of the items stays a dict."""
    if template is None:
        return value
    _, kind, inner = template
    if isinstance(value, dict) and isinstance(inner, dict):
        items = {k: retyped(v, inner.get(k)) for k, v in value.items()}
        if kind is None:
            return items
        try:
            return kind(items)
        except Exception:  # a dict subclass whose constructor takes something else
            return items
    if isinstance(value, (list, tuple)) and isinstance(inner, list) and len(inner) == len(value):
        items = [retyped(v, t) for v, t in zip(value, inner)]
        return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)
    return value
