"""Cross-check fxplan's peak-memory meter against an independent one on a real CPU step.

Usage: python scripts/check_meter.py MODEL [BATCH] [--input-size H] [--plan]

MODEL is any name the fxplan command line accepts (zoo, torchvision builder, timm:NAME, hf:NAME).
Prints the fake-tensor measurement (fxplan.measure_step, fake=True), the real live-storage
measurement, and the peak read from torch.profiler's allocation events on the real step, and, at the
profiler's peak, the bytes allocated *and freed inside* the operator running there: kernel scratch,
which a dispatch-level meter (fxplan's) cannot see. With ``--plan`` the same for the module
``fxplan.rewrite(model, None)`` returns (its smallest plan). Real steps allocate the whole step: mind the
machine's RAM at large batches.
"""

from __future__ import annotations

import argparse

from torch._subclasses.fake_tensor import FakeTensorMode

import models_zoo
from fxplan.cli import positive_int
from fxplan.common.console import filter_native_logs
from fxplan.errors import FxplanError
from fxplan.measure.meter import MiB, measure_step, measure_step_profiler


def scratch_at_peak(model, inputs, loss_fn) -> tuple[int, dict[str, int]]:
    """The peak of the bytes allocated during one real step of ``model`` (profiler events; what existed
    before the step not counted) and, per operator, the bytes live at that peak that were allocated inside
    it and are freed before it returns (kernel scratch)."""
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    with filter_native_logs(), profile(activities=[ProfilerActivity.CPU], profile_memory=True,
                                       record_shapes=True, with_stack=True) as prof:
        loss_fn(model(*inputs)).backward()
    model.zero_grad(set_to_none=True)

    def outermost_op(node):  # the operator a dispatch-level meter sees, the outermost aten:: one: (name, start)
        found = None
        while node is not None:
            found = (node.name, node.start_time_ns) if node.name.startswith("aten::") else found
            node = node.parent
        return found

    events, stack = [], list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        node = stack.pop()
        stack.extend(node.children)
        if node.typed[0] == _EventType.Allocation:
            events.append((node.start_time_ns, node.typed[1].ptr, node.typed[1].alloc_size, outermost_op(node)))
    events.sort(key=lambda e: e[0])
    live, current, peak, at_peak, scratch_ids = {}, 0, 0, {}, set()
    for n, (_, ptr, size, op) in enumerate(events):
        if size > 0:
            live[ptr] = (n, size, op)
        elif ptr in live:
            born, _, made_in = live.pop(ptr)
            if made_in is not None and made_in == op:
                scratch_ids.add(born)
        current += size
        if current > peak:
            peak, at_peak = current, dict(live)
    scratch: dict[str, int] = {}
    for n, size, op in at_peak.values():
        if n in scratch_ids:
            scratch[op[0]] = scratch.get(op[0], 0) + size
    return peak, scratch


def check(name: str, batch: int | None, size: int | None, plan: bool) -> None:
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
    _print_scratch(model, inputs, entry.loss, fake.peak_bytes)
    if plan:
        import fxplan

        rewritten = fxplan.rewrite(model, None, example_inputs=fake_inputs, loss_fn=entry.loss)
        rewritten_fake = measure_step(rewritten, fake_inputs, fake=True, loss_fn=entry.loss).peak_bytes
        print(f"fxplan.rewrite(model, None): fake tensors {rewritten_fake / MiB:.1f} MiB")
        _print_scratch(rewritten, inputs, entry.loss, rewritten_fake)


def _print_scratch(model, inputs, loss_fn, fake_peak: int) -> None:
    with filter_native_logs():
        profiled = measure_step_profiler(model, inputs, loss_fn=loss_fn).peak_bytes
    _, scratch = scratch_at_peak(model, inputs, loss_fn)
    parts = ", ".join(f"{op} {b / MiB:.1f} MiB" for op, b in sorted(scratch.items(), key=lambda kv: -kv[1]) if b)
    print(f"  profiler peak {profiled / MiB:.1f} MiB ({(profiled - fake_peak) / MiB:+.1f} MiB against the fake "
          f"meter); kernel scratch live at the profiler's peak: {parts or 'none'}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="check_meter.py", description=__doc__.splitlines()[0])
    parser.add_argument("model", help="a model name, as for 'fxplan profile'")
    parser.add_argument("batch", nargs="?", type=positive_int, default=None, help="default: the model's batch")
    parser.add_argument("--input-size", type=positive_int, default=None, help="default: the model's")
    parser.add_argument("--plan", action="store_true", help="also check fxplan.rewrite(model, None)'s module")
    args = parser.parse_args(argv)
    try:
        check(args.model, args.batch, args.input_size, args.plan)
    except FxplanError as exc:
        parser.error(str(exc))


if __name__ == "__main__":
    main()
