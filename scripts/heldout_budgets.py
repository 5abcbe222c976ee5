"""Budget fidelity on models outside the zoo: the checks tests/test_budget.py makes on ResNet-18.

Usage: python scripts/heldout_budgets.py NAME... [--batch-size N] [--input-size H] [--points K]

For each model name (a torchvision builder, timm:NAME or hf:NAME, as the CLI takes them), on fake
inputs at the given batch (default: the name's default batch and input size):

- the smallest measured peak, from the ``BudgetError`` of a 1-byte budget, and that minimum accepted
  as a budget in GiB (``min_feasible_bytes / 2**30``, what the error tells the user to do);
- a sweep of K budgets from the minimum to 2% above the vanilla peak: every measured peak at most its
  budget and equal to a fresh ``measure_step`` of the returned module, and no budget paying for a plan
  that a smaller budget's plan beats (every smaller budget's plan fits it, so its recomputation must be
  lower, or equal with a peak no higher);
- on real tensors at batch 2 and the quick input size, outputs and parameter gradients of one step of
  the rewrite at the middle of its budget range, bitwise equal to the original's (same seed).
"""

from __future__ import annotations

import argparse
import copy
import time

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._pytree import tree_leaves

import fxplan
import models_zoo
from fxplan.measure.meter import GiB, measure_step


def sweep(model, inputs, loss, points: int) -> dict:
    """Minimum, minimum accepted, and the budget sweep on fake inputs."""
    vanilla = measure_step(model, inputs, fake=True, loss_fn=loss).peak_bytes
    try:
        fxplan.rewrite(model, budget_bytes=1, example_inputs=inputs, loss_fn=loss)
        raise SystemExit("a 1-byte budget was accepted")
    except fxplan.BudgetError as exc:
        low = exc.min_feasible_bytes
    at_low = fxplan.rewrite(model, low / GiB, example_inputs=inputs, loss_fn=loss).fxplan_measured_peak_bytes
    top = int(vanilla * 1.02)
    results = []
    for k in range(points):
        budget = low + (top - low) * k // (points - 1)
        module = fxplan.rewrite(model, budget_bytes=budget, example_inputs=inputs, loss_fn=loss)
        peak = module.fxplan_measured_peak_bytes
        fits = peak <= budget and peak == measure_step(module, inputs, fake=True, loss_fn=loss).peak_bytes
        results.append((budget, peak, module.fxplan_plan.recompute_fraction, fits))
    monotonic = all(rec_j < rec_i or (rec_j == rec_i and peak_j <= peak_i)
                    for i, (_, peak_i, rec_i, _) in enumerate(results)
                    for budget_j, peak_j, rec_j, _ in results[i + 1:] if peak_i <= budget_j)
    return dict(vanilla=vanilla, low=low, low_accepted=at_low <= low,
                fits=all(r[3] for r in results), monotonic=monotonic,
                worst=max(r[1] / r[0] for r in results),
                recompute=(results[0][2], results[-1][2]))


def same_gradients(entry, input_size: int | None) -> bool:
    """One real step of the rewrite at its middle budget against the original: outputs and gradients bitwise."""
    torch.manual_seed(0)
    original = entry.build()
    inputs = entry.example_inputs(batch_size=max(2, entry.min_batch), input_size=input_size)
    vanilla = measure_step(original, inputs, fake=True, loss_fn=entry.loss).peak_bytes
    low = fxplan.min_budget_bytes(original, inputs, loss_fn=entry.loss)
    reference = copy.deepcopy(original)
    rewritten = fxplan.rewrite(copy.deepcopy(original), budget_bytes=(low + vanilla) // 2, example_inputs=inputs,
                               loss_fn=entry.loss)
    outputs = []
    for m in (reference, rewritten):
        torch.manual_seed(1)
        out = m(*inputs)
        entry.loss(out).backward()
        outputs.append(out)
    same = all(torch.equal(a, b) for a, b in zip(tree_leaves(outputs[0]), tree_leaves(outputs[1])))
    grads = dict(rewritten.named_parameters())
    return same and all((p.grad is None and grads[n].grad is None) or torch.equal(p.grad, grads[n].grad)
                        for n, p in reference.named_parameters())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="+")
    parser.add_argument("--batch-size", type=int, default=None)
    parser.add_argument("--input-size", type=int, default=None)
    parser.add_argument("--quick-input-size", type=int, default=64, help="input size of the real gradient check")
    parser.add_argument("--points", type=int, default=6)
    args = parser.parse_args()
    entries = models_zoo.resolve_all(args.names)
    print("model | input | vanilla GiB | min GiB | min accepted | budgets | all fit | monotonic | "
          "max peak/budget | recompute at min .. top | grads bitwise | seconds")
    for name, entry in zip(args.names, entries):
        start = time.perf_counter()
        torch.manual_seed(0)
        model = entry.build()
        with FakeTensorMode():
            inputs = entry.example_inputs(batch_size=args.batch_size, input_size=args.input_size)
        r = sweep(model, inputs, entry.loss, args.points)
        grads = same_gradients(entry, args.quick_input_size)
        print(f"{name} | {'x'.join(map(str, inputs[0].shape))} | {r['vanilla'] / GiB:.3f} | {r['low'] / GiB:.3f} | "
              f"{'yes' if r['low_accepted'] else 'NO'} | {args.points} | {'yes' if r['fits'] else 'NO'} | "
              f"{'yes' if r['monotonic'] else 'NO'} | {r['worst']:.4f} | "
              f"{100 * r['recompute'][0]:.1f}% .. {100 * r['recompute'][1]:.1f}% | {'yes' if grads else 'NO'} | "
              f"{time.perf_counter() - start:.0f}", flush=True)


if __name__ == "__main__":
    main()
