"""fxplan.rewrite at a series of budgets on one zoo network: measured peak, recomputation, time.

Usage: python scripts/budget_sweep.py MODEL BUDGET_GIB... [--batch-size N] [--input-size H] [--solver S]

Each budget is a separate ``fxplan.rewrite(model, budget_gb, example_inputs=...)`` call on fake inputs
(the paper's batch by default) with the zoo's training loss, as a user would make it. A budget below
what fxplan reaches prints the BudgetError's smallest measured peak instead.
"""

from __future__ import annotations

import argparse
import time

from torch._subclasses.fake_tensor import FakeTensorMode

import fxplan
import models_zoo
from fxplan.measure import GiB


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", choices=models_zoo.names())
    parser.add_argument("budgets", nargs="+", type=float, help="budgets in GiB")
    parser.add_argument("--batch-size", type=int, default=None)
    parser.add_argument("--input-size", type=int, default=None)
    parser.add_argument("--solver", default="approx", choices=("approx", "exact", "chen"))
    args = parser.parse_args()
    entry = models_zoo.get(args.model)
    model = entry.build()
    with FakeTensorMode():
        inputs = entry.example_inputs(batch_size=args.batch_size, input_size=args.input_size)
    print(f"{args.model}, input {'x'.join(map(str, inputs[0].shape))}, solver {args.solver}")
    print(f"{'budget GiB':>10}  {'measured GiB':>12}  {'predicted GiB':>13}  {'recompute':>9}  {'segments':>8}  "
          f"{'seconds':>7}")
    for budget in args.budgets:
        start = time.perf_counter()
        try:
            module = fxplan.rewrite(model, budget, example_inputs=inputs, solver=args.solver, loss_fn=entry.loss)
        except fxplan.BudgetError as exc:
            print(f"{budget:>10.2f}  BudgetError: smallest measured peak {exc.min_feasible_bytes / GiB:.3f} GiB"
                  f"  ({time.perf_counter() - start:.1f} s)")
            continue
        plan = module.fxplan_plan
        print(f"{budget:>10.2f}  {module.fxplan_measured_peak_bytes / GiB:>12.3f}  "
              f"{plan.predicted_peak_bytes / GiB:>13.3f}  {plan.recompute_fraction:>9.3f}  {plan.num_segments:>8}  "
              f"{time.perf_counter() - start:>7.1f}", flush=True)


if __name__ == "__main__":
    main()
