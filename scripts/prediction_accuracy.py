"""How well each memory prediction matches the measured peak, per zoo network, on the plans fxplan chooses.

Usage: python scripts/prediction_accuracy.py [NAME ...] [--points K] [--batch-size N]

For each network (paper batch, zoo loss, fake tensors): the measured search of ``fxplan.rewrite``
chooses plans at the smallest budget and at K budgets evenly spaced from there to the vanilla peak;
every plan the search measured on the way is compared with three predictions of its whole-step peak:
the replay (``fxplan.replay``, what ``fxplan.plan``/``rewrite`` show), the sweep model
(``fxplan.sweep_model``, what the approximate DP plans with) and the autograd model (the solvers'
default). Errors are (predicted - measured) / measured.
"""

from __future__ import annotations

import argparse

from torch._subclasses.fake_tensor import FakeTensorMode

import models_zoo
from fxplan.cli import format_table
from fxplan.lowersets import GraphIndex
from fxplan.measure import measure_step
from fxplan.memory_model import AutogradModel, evaluate_chain
from fxplan.planning import resident_bytes
from fxplan.search import Search
from fxplan.sweep_model import SweepModel
from fxplan.trace import trace


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", default=[n for n in models_zoo.names() if n != "lstm_lm"])
    parser.add_argument("--points", type=int, default=6)
    parser.add_argument("--batch-size", type=int, default=None)
    args = parser.parse_args()
    rows = []
    for name in args.names:
        entry = models_zoo.resolve(name)
        model = entry.build()
        with FakeTensorMode():
            inputs = entry.example_inputs(batch_size=args.batch_size)
        cg = trace(model, inputs)
        search = Search(cg, model, inputs, solver="approx", loss_fn=entry.loss)
        low = search.smallest().measured
        vanilla = measure_step(model, inputs, fake=True, loss_fn=entry.loss).peak_bytes
        for k in range(args.points + 1):
            search.choose(low + (vanilla - low) * k // args.points, "time")
        ix = GraphIndex.build(cg)
        models = {"autograd": AutogradModel().bind(ix), "sweep": SweepModel().bind(ix)}
        resident = resident_bytes(cg, model)
        errors: dict[str, list[float]] = {"replay": [], "sweep": [], "autograd": []}
        for c in search.candidates:
            if c.measured is None:
                continue
            errors["replay"].append(c.replayed / c.measured - 1)
            chain = [ix.mask(low_set) for low_set in c.plan.lower_sets]
            for label, bm in models.items():
                errors[label].append((evaluate_chain(bm, chain)[0] + resident) / c.measured - 1)
        rows.append((name, len(errors["replay"]), *(f"{min(e):+.1%} .. {max(e):+.1%}" for e in errors.values()),
                     f"{max(abs(x) for x in errors['replay']):.2%}"))
        print(f"{name} done", flush=True)
    print(format_table(("network", "plans measured", "replay error", "sweep model error", "autograd model error",
                        "replay max |error|"), rows))


if __name__ == "__main__":
    main()
