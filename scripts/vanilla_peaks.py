"""Print the measured vanilla peak of one training step for each zoo network at its paper batch.

Usage: python scripts/vanilla_peaks.py [NAME ...]   (default: the networks of Table 1 and lstm_lm)

Measured with fxplan.measure_step on fake tensors (exact, nothing allocated); parameters, buffers,
inputs, activations and gradients are all counted.
"""

from __future__ import annotations

import sys
import time

from torch._subclasses.fake_tensor import FakeTensorMode

import models_zoo
from fxplan.common.console import format_table
from fxplan.costs.trace import trace
from fxplan.measure.meter import GiB, MiB, measure_step


def main(names: list[str]) -> None:
    rows = []
    for name in names or models_zoo.paper_names():
        entry = models_zoo.get(name)
        print(f"measuring {name} ...", file=sys.stderr, flush=True)
        model = entry.build()
        with FakeTensorMode():
            inputs = entry.example_inputs()
        start = time.perf_counter()
        nodes = trace(model, inputs).number_of_nodes()
        stats = measure_step(model, inputs, fake=True, loss_fn=entry.loss)
        b = stats.breakdown
        rows.append((name, entry.paper_batch, "x".join(map(str, inputs[0].shape)), nodes,
                     f"{b.get('parameters', 0) / MiB:.0f}", f"{b.get('activations', 0) / GiB:.2f}",
                     f"{stats.peak_bytes / GiB:.2f}", f"{time.perf_counter() - start:.1f}"))
    print(format_table(("network", "batch", "input shape", "FX nodes", "params MiB", "activations GiB",
                        "peak GiB", "seconds"), rows))


if __name__ == "__main__":
    main(sys.argv[1:])
