"""Cross-check fxplan's peak-memory meter against an independent one on a real CPU step.

Usage: python scripts/check_meter.py MODEL [BATCH]

Prints the fake-tensor measurement (fxplan.measure_step, fake=True), the real live-storage
measurement, and the peak read from torch.profiler's allocation events on the real step.
Real steps allocate the whole step: mind the machine's RAM at large batches.
"""

from __future__ import annotations

import sys

from torch._subclasses.fake_tensor import FakeTensorMode

import models_zoo
from fxplan.measure import MiB, measure_step, measure_step_profiler


def main(name: str, batch: int | None) -> None:
    entry = models_zoo.get(name)
    model = entry.build()
    with FakeTensorMode():
        fake_inputs = entry.example_inputs(batch_size=batch)
    fake = measure_step(model, fake_inputs, fake=True, loss_fn=entry.loss)
    print(f"{name} batch {fake_inputs[0].shape[0]}")
    print(f"fxplan, fake tensors      : {fake.peak_bytes / MiB:10.1f} MiB ({fake.seconds:.1f} s)", flush=True)
    inputs = entry.example_inputs(batch_size=batch)
    real = measure_step(model, inputs, loss_fn=entry.loss)
    print(f"fxplan, real CPU step     : {real.peak_bytes / MiB:10.1f} MiB ({real.seconds:.1f} s)", flush=True)
    prof = measure_step_profiler(model, inputs, loss_fn=entry.loss)
    gap = (fake.peak_bytes - prof.peak_bytes) / prof.peak_bytes
    print(f"torch.profiler allocations: {prof.peak_bytes / MiB:10.1f} MiB ({prof.seconds:.1f} s)")
    print(f"fake vs profiler: {gap:+.2%}")


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else None)
