"""How well each memory prediction matches the measured peak, per zoo network, on the plans fxplan chooses.

Usage: python scripts/prediction_accuracy.py [NAME ...] [--points K] [--batch-size N] [--nested K]

For each network (paper batch, zoo loss, fake tensors): the measured search of ``fxplan.rewrite``
chooses plans at the smallest budget and at K budgets evenly spaced from there to the vanilla peak;
every plan the search measured on the way is compared with three predictions of its whole-step peak:
the replay (``fxplan.planner.replay``, what ``fxplan.plan``/``rewrite`` show), the sweep model
(``fxplan.solvers.sweep_model``, what the approximate DP plans with) and the autograd model (the solvers'
default). Errors are (predicted - measured) / measured. ``--nested K``: the replay's largest error on K
random nested plans (:mod:`fxplan.planner.nested`) per network, too.
"""

from __future__ import annotations

import argparse
import os
import random
import sys

from torch._subclasses.fake_tensor import FakeTensorMode

import models_zoo
from fxplan.cli import format_table
from fxplan.costs.trace import trace
from fxplan.measure.meter import measure_step
from fxplan.planner.planning import non_activation_bytes
from fxplan.planner.replay import replay_blocks
from fxplan.planner.search import Search
from fxplan.solvers.lowersets import GraphIndex
from fxplan.solvers.memory_model import AutogradModel, evaluate_chain
from fxplan.solvers.subplans import Block, as_children
from fxplan.solvers.sweep_model import SweepModel

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
from models_awkward import chunks  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", default=[n for n in models_zoo.names() if n != "lstm_lm"])
    parser.add_argument("--points", type=int, default=6)
    parser.add_argument("--batch-size", type=int, default=None)
    parser.add_argument("--nested", type=int, default=0, metavar="K",
                        help="also replay and measure K random nested plans per network")
    args = parser.parse_args()
    rows = []
    for name in args.names:
        entry = models_zoo.resolve(name)
        model = entry.build()
        with FakeTensorMode():
            inputs = entry.example_inputs(batch_size=args.batch_size)
        cg = trace(model, inputs)
        # the replay's errors are what this script shows: measure the candidates a trusted replay would rank
        search = Search(cg, model, inputs, solver="approx", loss_fn=entry.loss, trust_replay=False)
        low = search.smallest().measured
        vanilla = measure_step(model, inputs, fake=True, loss_fn=entry.loss).peak_bytes
        for k in range(args.points + 1):
            search.choose(low + (vanilla - low) * k // args.points, "time")
        ix = GraphIndex.build(cg)
        models = {"autograd": AutogradModel().bind(ix), "sweep": SweepModel().bind(ix)}
        resident = non_activation_bytes(cg, model)
        errors: dict[str, list[float]] = {"replay": [], "sweep": [], "autograd": []}
        for c in search.candidates:
            if c.measured is None:
                continue
            errors["replay"].append(c.replayed / c.measured - 1)
            chain = [ix.mask(low_set) for low_set in c.plan.lower_sets]
            for label, bm in models.items():
                errors[label].append((evaluate_chain(bm, chain)[0] + resident) / c.measured - 1)
        nested = nested_errors(cg, search, args.nested)
        rows.append((name, len(errors["replay"]), *(f"{min(e):+.1%} .. {max(e):+.1%}" for e in errors.values()),
                     f"{max(abs(x) for x in errors['replay']):.2%}",
                     f"{max(abs(x) for x in nested):.2%}" if nested else "-"))
        print(f"{name} done", flush=True)
    print(format_table(("network", "plans measured", "replay error", "sweep model error", "autograd model error",
                        "replay max |error|", f"nested plans: replay max |error| ({args.nested})"), rows))


def nested_errors(cg, search: Search, count: int) -> list[float]:
    """Replay errors on ``count`` random nested plans (seeded): 2-8 segments, one or two of those before the
    last split into 2-3 sub-segments, the first of which is split again in two plans out of three."""
    order = [v for s in search.candidates[0].plan.segments for v in s]
    rng, errors = random.Random(0), []
    for _ in range(count):
        flat = _chunks(order, rng.randint(2, 8))
        blocks = [Block(s) for s in flat]
        for i in rng.sample(range(len(flat) - 1), min(len(flat) - 1, rng.randint(1, 2))):
            subs = [Block(c) for c in _chunks(flat[i], rng.randint(2, 3))]
            if rng.random() < 2 / 3 and len(subs[0].names) >= 2:
                subs[0] = Block(subs[0].names, [Block(c) for c in _chunks(subs[0].names, 2)])
            blocks[i] = Block(flat[i], subs)
        got = search.meter.measure([b.names for b in blocks], as_children(blocks))
        if got is not None:
            errors.append(replay_blocks(cg, search.step, blocks).peak_bytes / got[0] - 1)
    return errors


def _chunks(names: list[str], k: int) -> list[list[str]]:
    """``names`` cut into at most ``k`` consecutive runs of near-equal length (none empty)."""
    return chunks(names, max(1, min(k, len(names))))


if __name__ == "__main__":
    main()
