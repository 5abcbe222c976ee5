"""Cross-check fxplan's peak-memory meter against an independent one on a real CPU step.

Usage: python scripts/check_meter.py MODEL [BATCH] [--input-size H]

MODEL is any name the fxplan command line accepts (zoo, torchvision builder, timm:NAME, hf:NAME).
Prints the fake-tensor measurement (fxplan.measure_step, fake=True), the real live-storage
measurement, and the peak read from torch.profiler's allocation events on the real step.
Real steps allocate the whole step: mind the machine's RAM at large batches.
"""

from __future__ import annotations

import argparse

from torch._subclasses.fake_tensor import FakeTensorMode

import models_zoo
from fxplan.cli import positive_int
from fxplan.console import filter_native_logs
from fxplan.errors import FxplanError
from fxplan.measure import MiB, measure_step, measure_step_profiler


def check(name: str, batch: int | None, size: int | None) -> None:
    entry = models_zoo.resolve(name)
    if entry.fake_only:
        raise FxplanError(f"{name} is too large for a real step here ({entry.description})")
    model = entry.build()
    with FakeTensorMode():
        fake_inputs = entry.example_inputs(batch_size=batch, input_size=size)
    fake = measure_step(model, fake_inputs, fake=True, loss_fn=entry.loss)
    print(f"{name} batch {fake_inputs[0].shape[0]}")
    print(f"fxplan, fake tensors      : {fake.peak_bytes / MiB:10.1f} MiB ({fake.seconds:.1f} s)", flush=True)
    inputs = entry.example_inputs(batch_size=batch, input_size=size)
    real = measure_step(model, inputs, loss_fn=entry.loss)
    print(f"fxplan, real CPU step     : {real.peak_bytes / MiB:10.1f} MiB ({real.seconds:.1f} s)", flush=True)
    with filter_native_logs():
        prof = measure_step_profiler(model, inputs, loss_fn=entry.loss)
    gap = (fake.peak_bytes - prof.peak_bytes) / prof.peak_bytes
    print(f"torch.profiler allocations: {prof.peak_bytes / MiB:10.1f} MiB ({prof.seconds:.1f} s)")
    print(f"fake vs profiler: {gap:+.2%}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="check_meter.py", description=__doc__.splitlines()[0])
    parser.add_argument("model", help="a model name, as for 'fxplan profile'")
    parser.add_argument("batch", nargs="?", type=positive_int, default=None, help="default: the model's batch")
    parser.add_argument("--input-size", type=positive_int, default=None, help="default: the model's")
    args = parser.parse_args(argv)
    try:
        check(args.model, args.batch, args.input_size)
    except FxplanError as exc:
        parser.error(str(exc))


if __name__ == "__main__":
    main()
