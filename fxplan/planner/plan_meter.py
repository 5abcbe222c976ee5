"""Measuring candidate plans on the trace's fake copy of the captured graph.

The budget search (:mod:`fxplan.planner.search`) and the nested search (:mod:`fxplan.planner.nested`) measure many
plans of one model. Each measurement generates the plan's module over one fake copy of the captured graph, made
once per trace (:mod:`fxplan.costs.trace`, by the rule of :func:`fxplan.measure_step`), and runs its step on
that copy (:func:`fxplan.measure.meter.measure_fake`): the step :func:`fxplan.measure_step` takes on a copy of
the module generated over the model, without copying (and so generating) every candidate twice. The
module of the plan finally chosen is generated over the model, and its code compared with the code
measured (:meth:`PlanMeter.module`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensorMode

from fxplan.capture.capturers import as_call
from fxplan.capture.fakes import to_fake
from fxplan.common.console import format_count
from fxplan.errors import FxplanError
from fxplan.measure.meter import StepStats, measure_fake
from fxplan.rewriter import offload
from fxplan.rewriter.codegen import SegmentedModule, segment_module
from fxplan.solvers.costgraph import CostGraph

logger = logging.getLogger("fxplan")


class PlanMeter:
    """Measured peaks of plans (segments and sub-plans) of one traced model, inputs and loss."""

    def __init__(self, cg: CostGraph, inputs: Any, loss_fn: Callable[[Any], torch.Tensor] | None):
        self.cg, self.inputs, self.loss_fn = cg, inputs, loss_fn
        self._fake: tuple[fx.GraphModule, tuple[tuple, dict], FakeTensorMode] | None = None
        self.steps = 0  # fake-tensor steps measured

    def measure(self, segments: list[list[str]], children: dict) -> tuple[int, str] | None:
        """The measured peak of one step of the plan's module and the module's code; None if the
        rewriter rejects the plan."""
        gm, inputs, fake_mode = self._fake_graph()
        try:
            twin = segment_module(gm, segments, children)
        except FxplanError as exc:
            logger.debug("plan of %s rejected by the rewriter: %s", format_count(len(segments), "segment"), exc)
            return None
        self.steps += 1
        return measure_fake(twin, inputs, fake_mode, self.loss_fn).peak_bytes, code_of(twin)

    def measure_offloaded(self, segments: list[list[str]], children: dict,
                          offloaded: Sequence[str]) -> tuple[StepStats, list[tuple[str, int]], str] | None:
        """One step of the plan's module with the values of ``offloaded`` kept in host memory
        (:mod:`fxplan.rewriter.offload`): the step's figures, the values the step really offloaded (node name and
        host bytes, in the order the forward saved them: :func:`fxplan.rewriter.offload.recording`) and the module's
        code; None if the rewriter rejects the plan."""
        gm, inputs, fake_mode = self._fake_graph()
        try:
            twin = segment_module(gm, segments, children, offloaded)
        except FxplanError as exc:
            logger.debug("offloading plan rejected by the rewriter: %s", exc)
            return None
        self.steps += 1
        with offload.recording() as records:
            stats = measure_fake(twin, inputs, fake_mode, self.loss_fn)
        return stats, records, code_of(twin)

    def module(self, segments: list[list[str]], children: dict, code: str | None,
               offloaded: Sequence[str] = ()) -> SegmentedModule:
        """The plan's module over the model; it must run the code measured (``code``)."""
        module = segment_module(self.cg.graph["gm"], segments, children, offloaded)
        if code_of(module) != code:
            raise FxplanError("internal error: the module generated for the chosen plan differs from the "
                              "one measured; please report it with the model (measure_step it to check)")
        return module

    def _fake_graph(self) -> tuple[fx.GraphModule, tuple[tuple, dict], FakeTensorMode]:
        """The trace's fake copy of the captured graph, its fake mode and the inputs as fake ``(args, kwargs)``."""
        if self._fake is None:
            gm, fake_mode = self.cg.graph["fake"]
            call = as_call(self.inputs)
            self._fake = (gm, to_fake((call.args, call.kwargs), fake_mode), fake_mode)
        return self._fake


def code_of(module: SegmentedModule) -> str:
    """The generated code of a rewritten module and all its segments (not its class name)."""
    return module.readable().split("\n", 1)[1]
