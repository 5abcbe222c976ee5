"""fxplan.rewrite at a series of budgets on one zoo network: measured peak, recomputation, time.

Usage: python scripts/budget_sweep.py MODEL BUDGET... [--of-vanilla] [--batch-size N] [--input-size H] [--solver S]

Each budget is a separate ``fxplan.rewrite(model, budget_gb, example_inputs=...)`` call on fake inputs
(the paper's batch by default) with the zoo's training loss, as a user would make it; in GiB, or with
``--of-vanilla`` as fractions of the plain step's measured peak. A budget below what fxplan reaches prints
the BudgetError's smallest measured peak instead. MODEL is any name ``fxplan compare`` takes
(``models_zoo.resolve``), or ``tiny:NAME``, a transformer of the zoo at 2 layers and width 32 (the tests'
``models_zoo.hf.tiny_entry``); parameters are initialised after ``torch.manual_seed(0)``.
"""

from __future__ import annotations

import argparse
import time

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import fxplan
import models_zoo
from fxplan.measure.meter import GiB, measure_step
from models_zoo import hf


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("budgets", nargs="+", type=float, help="budgets in GiB (--of-vanilla: fractions)")
    parser.add_argument("--of-vanilla", action="store_true", help="budgets as fractions of the plain step's peak")
    parser.add_argument("--batch-size", type=int, default=None)
    parser.add_argument("--input-size", type=int, default=None)
    parser.add_argument("--solver", default="approx", choices=("approx", "exact", "chen"))
    args = parser.parse_args()
    if args.model.startswith("tiny:"):
        entry = hf.tiny_entry(args.model.removeprefix("tiny:"))
    else:
        entry = models_zoo.resolve(args.model)
    torch.manual_seed(0)
    model = entry.build()
    with FakeTensorMode():
        inputs = entry.example_inputs(batch_size=args.batch_size, input_size=args.input_size)
    vanilla = measure_step(model, inputs, fake=True, loss_fn=entry.loss).peak_bytes
    print(f"{args.model}, input {'x'.join(map(str, inputs[0].shape))}, solver {args.solver}, plain step "
          f"{vanilla} bytes ({vanilla / GiB:.3f} GiB)")
    print(f"{'budget':>10}  {'budget bytes':>14}  {'measured bytes':>14}  {'predicted':>12}  {'recompute':>9}  "
          f"{'segments':>8}  {'nested':>6}  {'regions':>7}  {'seconds':>7}")
    for budget in args.budgets:
        budget_bytes = (int(budget * vanilla) if args.of_vanilla
                        else fxplan.planner.planning.whole_step_budget(budget, None))
        start = time.perf_counter()
        try:
            module = fxplan.rewrite(model, budget_bytes=budget_bytes, example_inputs=inputs, solver=args.solver,
                                    loss_fn=entry.loss)
        except fxplan.BudgetError as exc:
            print(f"{budget:>10.3f}  {budget_bytes:>14}  BudgetError: smallest measured peak "
                  f"{exc.min_feasible_bytes} bytes  ({time.perf_counter() - start:.1f} s)")
            continue
        plan = module.fxplan_plan
        print(f"{budget:>10.3f}  {budget_bytes:>14}  {module.fxplan_measured_peak_bytes:>14}  "
              f"{plan.predicted_peak_bytes:>12}  {plan.recompute_fraction:>9.3f}  {plan.num_segments:>8}  "
              f"{'yes' if plan.children else 'no':>6}  {len(plan.regions):>7}  {time.perf_counter() - start:>7.1f}",
              flush=True)


if __name__ == "__main__":
    main()
