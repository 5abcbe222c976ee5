"""``torch.export`` run as :func:`fxplan.capture.capturers.export_module` needs it.

:func:`export_program` runs non-strict ``torch.export`` with Hugging Face's attention-mask helpers as they run in
eager mode (:func:`masks_as_in_eager`: the graph then computes what the eager step computes, gradients summed in
the same order), and turns what export cannot capture into a :class:`~fxplan.errors.TraceError` that says what to
do; an output holding an object a graph cannot return (a key/value cache) is :class:`UnsupportedOutput`, and
:func:`without_objects` leaves such objects out. :func:`drop_checks` removes the guards and shape assertions
export adds, which the rewritten module's call interface replaces.
"""

from __future__ import annotations

import contextlib
import inspect
import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.fx as fx
from torch.utils import _pytree as pytree

from fxplan.capture.functions import functions_as_ops
from fxplan.capture.guards import replaced
from fxplan.errors import TraceError, first_line, user_frame

#: ATen ops that only check what export assumed; the rewritten module checks its inputs itself.
_ASSERTIONS = {"_assert_tensor_metadata", "_assert_scalar", "sym_constrain_range_for_size", "_assert_async"}


def without_objects(value: Any) -> Any:
    """``value`` with every leaf that is neither a tensor nor a plain constant left out (mappings such as
    Hugging Face's ModelOutput drop the key; sequences hold None in its place)."""
    if isinstance(value, torch.Tensor) or isinstance(value, (int, float, bool, str, type(None))):
        return value
    if type(value) not in pytree.SUPPORTED_NODES:
        return None
    if isinstance(value, dict):
        kept = {k: without_objects(v) for k, v in value.items()}
        return type(value)(**{k: v for k, v in kept.items() if v is not None or value[k] is None})
    if isinstance(value, (tuple, list)) and not hasattr(value, "_fields"):
        return type(value)(without_objects(v) for v in value)
    return value


class UnsupportedOutput(Exception):
    def __init__(self, type_name: str):
        super().__init__(type_name)
        self.type_name = type_name


@contextlib.contextmanager
def masks_as_in_eager(model: torch.nn.Module, args: tuple, kwargs: dict[str, Any]) -> Iterator[None]:
    """Hugging Face's attention-mask helpers as they run in eager mode, while exporting.

    Eager, ``transformers.masking_utils`` skips a causal mask that its shapes alone make redundant, and the
    attention then calls ``scaled_dot_product_attention`` with ``is_causal=True`` and, for grouped-query
    attention, ``enable_gqa=True``; under ``torch.export`` it never skips, and the graph holds an explicit mask
    and key/value heads repeated before the call: the same values forward, but gradients summed in another
    order, which differ in the last bits on some CPUs (an AMD EPYC here; not on the Intel Xeon of earlier
    runs). The skip stays off wherever a padding mask is given (its values are not known while tracing:
    ``is_tracing(mask)`` sees to that), so the decision depends only on shapes, on which the graph specialises
    anyway. Older transformers (5.17) ask ``is_tracing(padding_mask)`` alone, True for a missing mask too while
    exporting: there it answers for the mask given, and False for none. On CUDA the explicit mask also costs
    time: GPT-2 small's efficient-attention kernels took 1.8x as long with it (H100).

    The same holds for the search for packed sequences (several sequences in one row, told apart by
    ``position_ids`` that restart): eager, it finds none when the positions run on, and skips the mask; under
    export it cannot look at the values and always builds the mask. Where the caller gives no
    ``position_ids``, the model makes them itself as a running count (so it does, for instance, with gradient
    checkpointing on, which turns its cache off), so the search is skipped as eager skips it; positions the
    caller gives keep the search and its mask, right for any values. Nothing changes if transformers is not
    loaded.
    """
    masking = sys.modules.get("transformers.masking_utils")
    if masking is None:
        yield
        return
    held = {name: getattr(masking, name) for name in ("is_torchdynamo_exporting", "is_tracing",
                                                      "find_packed_sequence_indices") if hasattr(masking, name)}
    eager: dict[str, Callable] = {}
    if "is_torchdynamo_exporting" in held:  # newer transformers: exporting vetoes the skip
        eager["is_torchdynamo_exporting"] = lambda: False
    if "is_tracing" in held:  # older ones (5.17): is_tracing(mask) is True while exporting, whatever the mask
        traced = held["is_tracing"]
        eager["is_tracing"] = lambda tensor=None: tensor is not None and traced(tensor)
    if "find_packed_sequence_indices" in held and not _gives_position_ids(model, args, kwargs):
        eager["find_packed_sequence_indices"] = lambda position_ids: None
    for name, value in eager.items():
        setattr(masking, name, value)
    try:
        yield
    finally:
        for name, value in held.items():
            setattr(masking, name, value)


def _gives_position_ids(model: torch.nn.Module, args: tuple, kwargs: dict[str, Any]) -> bool:
    """Whether the call hands the model ``position_ids`` (by name, or in that parameter's place)."""
    try:
        bound = inspect.signature(model.forward).bind_partial(*args, **kwargs).arguments
    except TypeError:
        return True  # a call its signature does not describe: assume it may
    return bound.get("position_ids") is not None


def export_program(model: torch.nn.Module, args: tuple, kwargs: dict[str, Any]) -> torch.export.ExportedProgram:
    try:
        # no node's stack trace (fxplan reads none; recording them is about a sixth of the capture)
        with masks_as_in_eager(model, args, kwargs), replaced(fx.config, "do_not_emit_stack_traces", True), \
                functions_as_ops():
            return torch.export.export(model, args, kwargs, strict=False)
    except Exception as exc:  # export raises many types; all mean "not capturable"
        message = str(exc)
        if "in output, which is not a known type" in message:
            type_name = message.split("<class '")[1].split("'>")[0].rsplit(".", 1)[-1] if "<class '" in message \
                else "object"
            raise UnsupportedOutput(type_name) from exc
        raise TraceError(
            f"{type(exc).__name__}: {first_line(exc)}{user_frame(exc, model)}. If this is data-dependent control "
            "flow, write it with torch.cond or on values known before the call; if it is an op torch.export "
            "does not know, wrap it as a custom op (torch.library.custom_op)"
        ) from exc


def drop_checks(graph: fx.Graph) -> None:
    """Remove export's guard module call and shape assertions: the interface checks calls itself."""
    for node in list(graph.nodes):
        name = getattr(node.target, "__name__", str(node.target))
        is_guard = node.op == "call_module" and str(node.target) == "_guards_fn"
        is_assert = node.op == "call_function" and name.split(".")[0] in _ASSERTIONS
        if (is_guard or is_assert) and not node.users:
            graph.erase_node(node)
