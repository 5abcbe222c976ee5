"""The planning allowance against the plans: fake steps, ATen calls and seconds of ``fxplan.rewrite`` (no budget),
and the smallest peak, with the allowance and, where it stopped a search, without it, side by side.

Every fake step a planning call measures counts its ATen calls against
:data:`fxplan.planner.plan_meter.PLANNING_OPS`; once spent, the searches for a lower peak stop. A model whose
searches stay below it plans as without it (the search is deterministic), so it is planned once; one that reaches it
is planned again with no bound, to show what the bound costs in peak and saves in seconds. Run:

    python scripts/planning_allowance.py [MODEL ...]

MODEL: a zoo name with an optional batch (``resnet50:8``), a held-out model of ``scripts/heldout_exact.py``
(``hf:llama``), or ``mamba`` (a 2-layer Hugging Face Mamba, width 64, batch 4 x 64, its reference scan). One thread.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import sys
import time

import torch

import fxplan
from fxplan.planner import plan_meter

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))

DEFAULT = ["resnet50:8", "densenet121:8", "vit_b_16:2", "gpt2_small:1", "hf:gpt2", "hf:llama", "hf:t5", "hf:bart",
           "hf:mixtral", "mamba"]


def build(spec: str):
    """(model, example inputs, loss_fn) of ``spec``."""
    if spec == "mamba":
        from planning_time import MODELS as TIMED

        return TIMED["mamba"]()[:3]
    from heldout_exact import MODELS

    if spec in MODELS:
        model, inputs = MODELS[spec]()
        return model, inputs, (lambda output: output.loss) if isinstance(inputs, dict) else None
    import models_zoo

    name, _, batch = spec.partition(":")
    entry = models_zoo.resolve(name)
    torch.manual_seed(0)
    return entry.build(), entry.example_inputs(batch_size=int(batch or 8)), entry.loss


class _Lines(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def planned(model, inputs, loss_fn, lines: _Lines) -> tuple[float, int, int, int]:
    """Seconds, fake steps, ATen calls of those steps, and measured peak of ``fxplan.rewrite(model, None)``."""
    lines.lines.clear()
    start = time.perf_counter()
    module = fxplan.rewrite(model, None, example_inputs=inputs, loss_fn=loss_fn)
    seconds = time.perf_counter() - start
    text = "\n".join(lines.lines)
    steps = int(re.findall(r"(\d+) measured on fake tensors\)", text)[-1])
    calls = int(re.findall(r"dispatched (\d+) ATen calls", text)[-1])
    return seconds, steps, calls, module.fxplan_measured_peak_bytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("models", nargs="*", default=DEFAULT)
    args = parser.parse_args()
    torch.set_num_threads(1)
    lines = _Lines()
    logger = logging.getLogger("fxplan")
    logger.addHandler(lines)
    logger.setLevel(logging.DEBUG)
    bound = plan_meter.PLANNING_OPS
    print(f"torch {torch.__version__}, one thread; allowance {bound:,} ATen calls")
    print(f"{'model':<16}{'seconds':>9}{'steps':>7}{'ATen calls':>12}{'peak bytes':>14}   without the allowance")
    for spec in args.models:
        model, inputs, loss_fn = build(spec)
        seconds, steps, calls, peak = planned(model, inputs, loss_fn, lines)
        unbounded = "the same (not reached)"
        if calls >= bound:
            plan_meter.PLANNING_OPS = 10**15
            try:
                s, n, c, p = planned(model, inputs, loss_fn, lines)
            finally:
                plan_meter.PLANNING_OPS = bound
            unbounded = f"{s:.1f} s, {n} steps, {c:,} calls, peak {p:,} ({p / peak - 1:+.2%})"
        print(f"{spec:<16}{seconds:>9.1f}{steps:>7}{calls:>12,}{peak:>14,}   {unbounded}", flush=True)


if __name__ == "__main__":
    main()
