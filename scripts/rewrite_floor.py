"""The least time a rewrite (capture, plan, rewrite, budget fit) can take, against one bare fake step of the model.

Usage: python scripts/rewrite_floor.py [--models gpt2:23,gpt2:4,synthetic:3000] [--repeats 3]

The goal is ``fxplan.rewrite`` (capture, plan, rewrite, budget fit) in at most 3x one fake-tensor step,
and keeps a fake-tensor step of the rewritten module as the final check. Two parts of that time do not depend
on how fxplan plans, and this script times them alone, interleaved with the bare step (forward and backward of
a fake copy under its fake mode, no meter: ``rewrite_scale.bare_step``):

* ``capture``: the capturer fxplan picks for the model called by itself, nothing of fxplan's around it:
  ``torch.fx.symbolic_trace(model)``, or non-strict ``torch.export.export`` on a fake copy made beforehand
  (the capturer for models symbolic_trace cannot trace: every Hugging Face transformer);
* ``rewritten step``: the bare step of the module ``fxplan.rewrite`` returns (no budget; the middle budget,
  halfway between its measured peak and the plain step's), which the final check must run: it recomputes.

``floor`` = (capture + rewritten step) / bare step: a rewrite that also propagates costs over the graph,
plans and measures on a meter takes longer. ``rewrite`` is fxplan's own, in the same run. Medians over
``--repeats``. Models as in ``scripts/rewrite_scale.py``.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from pathlib import Path

import torch

import fxplan
from fxplan.capture.capturers import as_call, capture
from fxplan.capture.fakes import fake_copy, fake_mode_of, to_fake
from fxplan.capture.guards import replaced

sys.path.insert(0, str(Path(__file__).resolve().parent))
from rewrite_scale import bare_step, build  # noqa: E402


def capture_alone(net, inputs, method: str) -> float:
    """Seconds of the bare capturer ``method`` (module docstring) on ``net``."""
    if method == "symbolic_trace":
        return timed(lambda: torch.fx.symbolic_trace(net))
    call = as_call(inputs)
    mode = fake_mode_of(net, inputs)
    model = fake_copy(net, mode)
    args, kwargs = to_fake((call.args, call.kwargs), mode)
    with replaced(torch.fx.config, "do_not_emit_stack_traces", True):  # as fxplan exports
        return timed(lambda: torch.export.export(model, args, kwargs, strict=False))


def timed(fn) -> float:
    """Seconds of ``fn()``, after a full garbage collection (the rewritten modules this script keeps would
    otherwise make a collection inside whichever call is timed next take a second or more)."""
    gc.collect()
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def run(name: str, repeats: int) -> str:
    net, inputs, loss = build(name, 8)
    method = capture(net, inputs).method
    plain = fxplan.measure_step(net, inputs, fake=True, loss_fn=loss).peak_bytes
    smallest = fxplan.rewrite(net, example_inputs=inputs, loss_fn=loss)
    middle_budget = (smallest.fxplan_measured_peak_bytes + plain) // 2
    middle = fxplan.rewrite(net, example_inputs=inputs, loss_fn=loss, budget_bytes=middle_budget)
    capture_alone(net, inputs, method)  # warm-up
    bare_step(net, inputs, loss)
    got: dict[str, list[float]] = {k: [] for k in ("bare", "capture", "step none", "step middle",
                                                   "rewrite none", "rewrite middle")}
    for _ in range(repeats):
        gc.collect()
        got["bare"].append(bare_step(net, inputs, loss))
        got["capture"].append(capture_alone(net, inputs, method))
        gc.collect()
        got["step none"].append(bare_step(smallest, inputs, loss))
        gc.collect()
        got["step middle"].append(bare_step(middle, inputs, loss))
        got["rewrite none"].append(timed(lambda: fxplan.rewrite(net, example_inputs=inputs, loss_fn=loss)))
        got["rewrite middle"].append(timed(lambda: fxplan.rewrite(net, example_inputs=inputs, loss_fn=loss,
                                                                  budget_bytes=middle_budget)))
    m = {k: statistics.median(v) for k, v in got.items()}
    bare = m["bare"]

    def x(seconds: float) -> str:
        return f"{seconds:.2f} ({seconds / bare:.1f}x)"

    floor_none, floor_middle = ((m["capture"] + m[step]) / bare for step in ("step none", "step middle"))
    return (f"| {name} | {method} | {bare:.2f} [{min(got['bare']):.2f}-{max(got['bare']):.2f}] | "
            f"{x(m['capture'])} | {x(m['step none'])} / {x(m['step middle'])} | "
            f"**{floor_none:.1f}x** / **{floor_middle:.1f}x** | "
            f"{x(m['rewrite none'])} / {x(m['rewrite middle'])} |")


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="gpt2:23,gpt2:4,synthetic:3000")
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args(argv)
    print("| model | capturer | bare step s | capture alone s (x bare) | rewritten step s: no budget / middle "
          "| floor: no budget / middle | rewrite s: no budget / middle |")
    print("|---|---|---|---|---|---|---|", flush=True)
    for name in args.models.split(","):
        print(run(name, args.repeats), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
