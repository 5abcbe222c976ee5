"""How far the search trusts its replay of a plan's step, and the tolerances it plans within, in one place.

A candidate's replayed peak (:func:`fxplan.planner.replay.replay`) costs a fraction of a measurement (a fake step of
its rewritten module); the budget search (:mod:`fxplan.planner.search`), its candidates
(:mod:`fxplan.planner.candidates`) and the nested search (:mod:`fxplan.planner.nested`) let the replay stand in for a
measurement as far as the bounds here allow, and what they return is measured. ``MARGIN``: how much more than on the
plans measured the replay may over-predict one plan, for ruling a candidate out unmeasured; ``TRUST``: how close the
replay must have been on every plan measured before it ranks plans alone (:func:`replayed_within_trust`); then
``NESTED_SLACK`` and ``NESTED_MISSES`` say when a nested plan chosen by replay that measured otherwise sends the
search back to measuring. ``TOLERANCE`` and ``RELATIVE_TOLERANCE`` bound the nested search's moves worth measuring.
Two tolerances are of the choice, not of the replay: ``NEGLIGIBLE``, a saving too small to pay for recomputation
(:func:`negligibly_above`), and ``FLOOR_SLACK``, how near the step's physical floor a plan ends the search for a
lower one (:class:`StepFloor`).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from typing import Any

import torch

from fxplan.capture.guards import host_generators_kept
from fxplan.errors import FxplanError
from fxplan.measure.floor import physical_floor

logger = logging.getLogger("fxplan")

#: Assumed bound on how much the replay over-predicts one plan's measured peak beyond what it does on the plans measured
#: so far (it over-predicted by at most 0.5% on the zoo: docs/rewrite.md).
MARGIN = 0.01

#: Once every candidate measured so far replayed within this fraction of its measured peak, the search ranks by replay
#: instead of measuring (each measurement is a fake step of a rewritten module): the smallest candidate is the least
#: replayed one, a budget rules out candidates replayed this much above it, and the nested search measures none of its
#: moves (:meth:`fxplan.planner.search.Search.lowest`). What is returned is measured; a nested plan measuring above its
#: replay by more than this fraction (or above the budget) sends the nested search back to measuring every move. On the
#: zoo and the transformers the replay is within 0.01% of flat plans and 0.4% of nested ones (docs/planner.md).
TRUST = 0.001

def replayed_within_trust(measured: list[Any]) -> bool:
    """True if every one of ``measured`` (candidates, one at least) replayed within ``TRUST`` of its measured peak."""
    return bool(measured) and all(abs(c.replayed - c.measured) <= TRUST * c.measured for c in measured)


#: The lowest nested plan found by replay (:meth:`fxplan.planner.search.Search.lowest`) that measures above its replay
#: by more than ``TRUST`` but at most this fraction, and below every canonical plan, is kept at its measured peak
#: instead of the nested search being made again measuring every move: at no budget and 2% above the smallest peak,
#: GPT-2 with 4 layers (0.14% over its replay) and DenseNet-121 at batch 8 (1.2%) spent 16 fake steps each (20 s of 42
#: and about 60 of 108 s) for a search that ended at the same plan. A replay off by more than this is not trusted.
NESTED_SLACK = 0.02

#: A nested plan chosen by its replay (the lowest plan's cheaper variants,
#: :meth:`fxplan.planner.nested.NestedSearch.cheapen`) that measures above what it must fit is set aside for the next
#: cheapest this many times less one; then the replay is no longer trusted
#: (:meth:`fxplan.planner.search.Search._confirmed`). DenseNet-161 at batch 4, 224²: a cheapened plan replayed 0.13%
#: below its measured peak, and searching again by measurement took 56 s of a 94 s rewrite.
NESTED_MISSES = 4

#: A move is measured only if its replayed peak (:func:`fxplan.planner.replay.replay`, nested plans included) is at most
#: this fraction above the measured peak it must beat. On random nested plans the replay is within 0.03% of the
#: measurement on ResNet-50, DenseNet-121, GoogLeNet, EfficientNet-B0, ConvNeXt-atto and VGG-11; on a 4-layer GPT-2 it
#: errs by up to 4.4% on plans nested three deep (docs/planner.md). Each measurement is a fake step; a replay, a
#: fraction of one.
TOLERANCE = 0.03

#: A move is measured only if its replayed peak is below the replayed peak of the plan it must beat (the replay predicts
#: a gain), and a tree that must keep a peak (:meth:`fxplan.planner.nested.NestedSearch.cheapen`) only if its replayed
#: peak is at most this fraction above that plan's. Where the replay errs, it errs alike on a plan and the moves made
#: from it (the same segments around the peak), so a move it predicts lowers nothing, measured, lowers nothing: most of
#: the search's measurements were such moves (no-budget ResNet-50 at batch 8: 44 fake steps before, 19 after, the same
#: plan; docs/planner.md).
RELATIVE_TOLERANCE = 0.005


#: Without a budget, savings below this fraction of the smallest peak do not justify recomputation.
NEGLIGIBLE = 0.001


def negligibly_above(peak: int) -> int:
    """The most bytes a peak may take and still count as ``peak``: within ``NEGLIGIBLE`` of it."""
    return math.floor(peak * (1 + NEGLIGIBLE))


#: Without a budget, the search stops once a plan measures within this fraction of the step's physical floor
#: (:func:`fxplan.measure.floor.physical_floor`, what no plan of the same ops can peak below): every plan it could still
#: find is lower by less than this share of the peak, and finding one costs fake steps of rewritten modules, dozens on a
#: nested search. Models whose parameters and gradients dwarf their activations meet it at once: a timm RegNetY-200MF at
#: batch 2, 64², measured its canonical plans down to 1.4% above the floor and then spent 40 of 64 s planning on a
#: nested search that lowered the peak by 0.4% more.
FLOOR_SLACK = 0.02


class StepFloor:
    """The physical floor of one model's step (:func:`fxplan.measure.floor.physical_floor`), found once, when first
    asked for, and shared by the searches of the model's graphs (a recomputed region runs the same ops)."""

    def __init__(self, model: torch.nn.Module, example_inputs: Any, loss_fn: Callable[[Any], torch.Tensor] | None):
        self._args = model, example_inputs, loss_fn
        self._bytes: int | None = None

    def reached(self, measured: int) -> bool:
        """Whether a plan measuring ``measured`` bytes is within ``FLOOR_SLACK`` of the floor."""
        if self._bytes is None:
            model, inputs, loss_fn = self._args
            try:
                with host_generators_kept():  # the model's own forward runs: it may draw (a LayerDrop)
                    self._bytes = physical_floor(model, inputs, loss_fn=loss_fn).bytes
                logger.debug("the physical floor of the step: %d bytes", self._bytes)
            except (FxplanError, RuntimeError) as error:  # the search goes on as without a floor
                logger.debug("no physical floor of the step (%s)", str(error).splitlines()[0][:200])
                self._bytes = 0
        return measured <= self._bytes * (1 + FLOOR_SLACK)
