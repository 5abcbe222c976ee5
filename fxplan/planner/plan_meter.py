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
from fxplan.common import heartbeat
from fxplan.common.console import format_count
from fxplan.errors import FxplanError
from fxplan.measure.meter import StepStats, measure_fake
from fxplan.rewriter import offload
from fxplan.rewriter.codegen import SegmentedModule, segment_module
from fxplan.solvers.costgraph import CostGraph

logger = logging.getLogger("fxplan")

#: The most ATen calls the fake steps of one planning call dispatch together before the searches for a lower peak
#: stop at the lowest plan measured (a plan for a budget is still measured until one fits). A fake step's time is
#: its dispatch overhead, about 100 microseconds a call on the 2-core CPU of docs/planner.md, so this bounds the
#: seconds spent measuring on any model, in a count that is the same on every machine. Nine zoo and held-out models
#: checked dispatch at most 73,151 (a 2-layer Mixtral, 31 steps: ``scripts/planning_allowance.py``); a 2-layer Hugging
#: Face Mamba, whose rewritten steps replay its scan, reaches it after 19 steps and plans in 58 s where it took 174 s
#: for a peak 11.9% lower.
PLANNING_OPS = 300_000


class MeasuredWork:
    """The fake steps the searches of one planning call measured, and the ATen calls they dispatched, against
    ``PLANNING_OPS``."""

    def __init__(self, allowance: int | None = None):
        self.steps, self.ops = 0, 0
        self.allowance = PLANNING_OPS if allowance is None else allowance

    @property
    def spent(self) -> bool:
        return self.ops >= self.allowance

    def add(self, stats: StepStats) -> None:
        was_spent = self.spent
        self.steps, self.ops = self.steps + 1, self.ops + stats.ops
        if self.spent and not was_spent:
            logger.info("fxplan: %s measured on fake tensors dispatched %s ATen calls, the planning allowance: the "
                        "search for a lower peak stops at the lowest plan measured", format_count(self.steps, "plan"),
                        f"{self.ops:,}")


class PlanMeter:
    """Measured peaks of plans (segments and sub-plans) of one traced model, inputs and loss."""

    def __init__(self, cg: CostGraph, inputs: Any, loss_fn: Callable[[Any], torch.Tensor] | None,
                 work: MeasuredWork | None = None):
        self.cg, self.inputs, self.loss_fn = cg, inputs, loss_fn
        self._fake: tuple[fx.GraphModule, tuple[tuple, dict], FakeTensorMode] | None = None
        self.steps = 0  # fake-tensor steps measured
        self.work = work or MeasuredWork()  # shared by the searches of one planning call

    def measure(self, segments: list[list[str]], children: dict) -> tuple[int, str] | None:
        """The measured peak of one step of the plan's module and the module's code; None if the
        rewriter rejects the plan."""
        step = self._step(segments, children, ())
        return None if step is None else (step[0].peak_bytes, step[2])

    def accepts(self, segments: list[list[str]], children: dict) -> bool:
        """Whether the rewriter generates the plan's module (as :meth:`measure` would before its step), for a plan
        judged by its replay alone."""
        try:
            segment_module(self._fake_graph()[0], segments, children, ())
        except FxplanError as exc:
            logger.debug("plan of %s rejected by the rewriter: %s", format_count(len(segments), "segment"), exc)
            return False
        return True

    def measure_offloaded(self, segments: list[list[str]], children: dict,
                          offloaded: Sequence[str]) -> tuple[StepStats, list[tuple[str, int]], str] | None:
        """One step of the plan's module with the values of ``offloaded`` kept in host memory
        (:mod:`fxplan.rewriter.offload`): the step's figures, the values the step really offloaded (node name and
        host bytes, in the order the forward saved them: :func:`fxplan.rewriter.offload.recording`) and the module's
        code; None if the rewriter rejects the plan."""
        return self._step(segments, children, offloaded)

    def _step(self, segments: list[list[str]], children: dict,
              offloaded: Sequence[str]) -> tuple[StepStats, list[tuple[str, int]], str] | None:
        gm, inputs, fake_mode = self._fake_graph()
        try:
            twin = segment_module(gm, segments, children, offloaded)
        except FxplanError as exc:
            logger.debug("plan of %s rejected by the rewriter: %s", format_count(len(segments), "segment"), exc)
            return None
        with offload.recording() as records:
            stats = measure_fake(twin, inputs, fake_mode, self.loss_fn)
        self.steps += 1
        self.work.add(stats)
        heartbeat.measured()
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
