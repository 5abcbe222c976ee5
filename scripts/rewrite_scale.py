"""End-to-end time of ``fxplan.rewrite`` against one fake-tensor training step of the same model.

Usage: python scripts/rewrite_scale.py [--models synthetic:300,synthetic:1000,resnet50] [--repeats 1]
                                       [--batch N] [--fresh]

The goal: ``fxplan.rewrite`` (capture, plan, rewrite, budget fit) in at most 3x the time of one
fake-tensor step, with no budget and with a middle budget (halfway between the smallest measured peak
``rewrite`` reaches and the step's own peak). Two steps are timed, interleaved with the rewrites: the bare
step (forward and backward of a fake copy of the model under its fake mode, no meter, the copy made
beforehand), which the goal's ratios are taken against (``x bare``), and fxplan's metered one
(``fxplan.measure_step(model, inputs, fake=True)``: a fake copy, then the step under fxplan's storage
meter), against which sessions before 32 reported them (``x metered``).
``synthetic:N`` is scripts/planner_scale.py's residual network of N nodes (batch 8, sequence 128, width
64); ``gpt2:L`` a GPT-2 of L layers from transformers (width 64, 4 heads, vocabulary 128, random init,
batch 4, sequence 128; about 46 + 41 L nodes as captured); other names are zoo networks, ``timm:NAME`` or
``hf:NAME`` (``models_zoo.resolve``) at ``--batch`` (default: 8). Everything runs on fake tensors in one
process per model (``--fresh``: a child process each, so that its peak RSS is its own): the trace (capture and cost
propagation) and the approximate DP's memory-centric solve with the rewrite's memory model (``sweep``)
timed on their own, a warm-up step, then per repeat the step, ``rewrite`` without a budget and
``rewrite`` at the middle budget, interleaved; medians and ranges over the repeats (``--half``: no
no-budget rewrite, and the budget is half the plain step's peak). The breakdown
(seconds inside ``fxplan.planner.search`` per stage, from the first no-budget rewrite; with ``--half``, from the
first budget rewrite, followed by the plan it chose) says where the time goes:
``trace`` capture and cost propagation, ``capture`` the part of it that captures the graph (``symbolic_trace``
or ``torch.export``, on a fake copy), ``probe`` the replay's gradient probe (``step_model``), ``solve``
the DP solves of the candidate plans, ``replay`` their predicted peaks, ``codegen`` + ``measure`` the
fake-tensor steps of the candidates measured, ``region trace`` the trace of the graph with every recomputed
region or unit (:mod:`fxplan.planner.variants`), ``splice`` the cost graphs of their subsets.
"""

from __future__ import annotations

import argparse
import resource
import statistics
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

from torch._subclasses.fake_tensor import FakeTensorMode

import fxplan
import fxplan.costs.trace as tracing
from fxplan import api as rewriting
from fxplan.capture.capturers import as_call
from fxplan.capture.fakes import fake_copy, fake_mode_of
from fxplan.costs.trace import trace
from fxplan.measure.meter import default_loss
from fxplan.planner import plan_meter as meter
from fxplan.planner import search, variants
from fxplan.solvers import dp
from fxplan.solvers.sweep_model import SweepModel

sys.path.insert(0, str(Path(__file__).resolve().parent))
from planner_scale import residual_net  # noqa: E402

STAGES = {"trace": [(rewriting, "trace")], "capture": [(tracing, "capture"), (tracing, "export_after")],
          "probe": [(search, "step_model")], "solve": [(search, "plan_graph")],
          "min": [(search, "predicted_min_budget_bytes_graph"), (search, "min_budget_bytes_graph")],  # older name
          "replay": [(search, "replay")],
          "codegen": [(meter, "segment_module")], "measure": [(meter, "measure_fake")],
          "region trace": [(variants, "trace")], "splice": [(variants, "spliced")]}
try:  # the frontier's plans are solved in fxplan.planner.frontier (in fxplan.planner.search at older commits)
    from fxplan.planner import frontier

    STAGES["solve"].append((frontier, "plan_graph"))
    STAGES["min"] += [(frontier, "predicted_min_budget_bytes_graph"), (frontier, "min_budget_bytes_graph")]
except ImportError:
    pass
try:  # the candidates are made and replayed in fxplan.planner.candidates (in fxplan.planner.search at older commits)
    from fxplan.planner import candidates

    for stage, attr in (("probe", "step_model"), ("solve", "plan_graph"), ("min", "predicted_min_budget_bytes_graph"),
                        ("min", "min_budget_bytes_graph"), ("replay", "replay")):
        STAGES[stage].append((candidates, attr))
except ImportError:
    pass


def build(name: str, batch: int):
    """(model, fake inputs, loss_fn) for ``synthetic:N`` or a zoo name."""
    if name.startswith("synthetic:"):
        net, x = residual_net(int(name.split(":")[1]))
        return net, (x,), None
    if name.startswith("gpt2:"):
        from models_zoo.hf import HFModel

        gpt = HFModel("GPT2Config", "causal-lm", dict(n_layer=int(name.split(":")[1]), n_embd=64, n_head=4,
                                                      vocab_size=128, n_positions=128))
        entry = gpt.entry(name, 4, 128, name, quick_input_size=128)
        net = entry.build()
        with FakeTensorMode():
            return net, tuple(entry.example_inputs()), entry.loss
    import models_zoo

    entry = models_zoo.resolve(name)
    net = entry.build()
    with FakeTensorMode():
        inputs = entry.example_inputs(batch_size=batch)
    return net, tuple(inputs), entry.loss


_SECONDS: dict[str, list[float]] = defaultdict(list)


def instrument() -> dict[str, list[float]]:
    """Wrap the search's stages (once per process) so their seconds are recorded (module docstring)."""
    seconds = _SECONDS
    if getattr(search, "_timed", False):
        return seconds
    search._timed = True
    for stage, (module, attr) in ((stage, place) for stage, places in STAGES.items() for place in places):
        fn = getattr(module, attr, None)
        if fn is None:  # an older fxplan (the "before" of a comparison) without this stage
            continue

        def timed(*a, _fn=fn, _stage=stage, **k):
            t0 = time.perf_counter()
            try:
                return _fn(*a, **k)
            finally:
                seconds[_stage].append(time.perf_counter() - t0)

        setattr(module, attr, timed)
    return seconds


#: CPU seconds of this process per clocked call (``clock``), by the order of the calls.
CPU: list[float] = []


def clock(fn) -> tuple[float, object]:
    """Wall seconds of ``fn()`` and its result; its CPU seconds are appended to ``CPU`` (on a shared machine
    CPU time moves less with the load than wall time: fake tensors compute nothing, so a step is one thread)."""
    t0, c0 = time.perf_counter(), time.process_time()
    out = fn()
    CPU.append(time.process_time() - c0)
    return time.perf_counter() - t0, out


def spread(xs: list[float]) -> str:
    return f"{statistics.median(xs):.2f}" + (f" [{min(xs):.2f}-{max(xs):.2f}]" if len(xs) > 1 else "")


def stages(seconds: dict[str, list[float]]) -> str:
    return ", ".join(f"{k} {sum(v):.1f}" + (f" ({len(v)}x)" if len(v) > 1 else "") for k, v in seconds.items())


def bare_step(net, inputs, loss) -> float:
    """Seconds of one forward and backward of a fake copy of ``net`` under its fake mode, without a meter
    (module docstring)."""
    mode = fake_mode_of(net, inputs)
    model, call = fake_copy(net, mode), as_call(inputs)
    t0 = time.perf_counter()
    with mode:
        (loss or default_loss)(model(*call.args, **call.kwargs)).backward()
    return time.perf_counter() - t0


def ratio(seconds: list[float], step: float) -> str:
    return f"{spread(seconds)} ({statistics.median(seconds) / step:.1f}x)"


def run(name: str, batch: int, repeats: int, seconds: dict[str, list[float]], half: bool = False) -> str:
    net, inputs, loss = build(name, batch)
    t_trace, cg = clock(lambda: trace(net, inputs))
    t_solve, _ = clock(lambda g=cg: dp.solve(g, None, strategy="memory", memory_model=SweepModel()))
    cg = None  # the rewrites trace their own graph
    fxplan.measure_step(net, inputs, fake=True, loss_fn=loss)  # warm-up
    bare_step(net, inputs, loss)
    steps, bare, free, mid, breakdown, middle, peak, nodes = [], [], [], [], "", None, None, 0
    cpu_steps, cpu_mid = [], []
    for r in range(repeats):
        bare.append(bare_step(net, inputs, loss))
        t, st = clock(lambda: fxplan.measure_step(net, inputs, fake=True, loss_fn=loss))
        steps.append(t)
        cpu_steps.append(CPU[-1])
        seconds.clear()
        if half:  # no no-budget rewrite: the budget is half the plain step's peak
            t, m2 = clock(lambda b=st.peak_bytes // 2: fxplan.rewrite(net, example_inputs=inputs, loss_fn=loss,
                                                                      budget_bytes=b))
            mid.append(t)
            cpu_mid.append(CPU[-1])
            nodes = sum(len(s) for s in m2.fxplan_plan.segments)
            peak = (None, m2.fxplan_measured_peak_bytes, st.peak_bytes)
            if r == 0:  # the budget rewrite's stages, and the plan chosen (to compare versions)
                breakdown = stages(seconds) + (f"; chosen: {m2.fxplan_plan.num_segments} segments, recompute "
                                               f"{m2.fxplan_plan.recompute_fraction:.4f}, {peak[1]} bytes")
            continue
        t, m = clock(lambda: fxplan.rewrite(net, example_inputs=inputs, loss_fn=loss))
        free.append(t)
        if r == 0:
            breakdown = stages(seconds)
            middle = (m.fxplan_measured_peak_bytes + st.peak_bytes) // 2
            nodes = sum(len(s) for s in m.fxplan_plan.segments)
        t, m2 = clock(lambda b=middle: fxplan.rewrite(net, example_inputs=inputs, loss_fn=loss, budget_bytes=b))
        mid.append(t)
        cpu_mid.append(CPU[-1])
        peak = (m.fxplan_measured_peak_bytes, m2.fxplan_measured_peak_bytes, st.peak_bytes)
    step, bare_s = statistics.median(steps), statistics.median(bare)
    cpu_ratio = statistics.median(cpu_mid) / statistics.median(cpu_steps)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    free_s = f"{ratio(free, bare_s)} / {statistics.median(free) / step:.1f}x" if free else "not run"
    no_budget = "-" if peak[0] is None else f"{peak[0] / 2**20:.0f}"
    return (f"| {name} | {nodes} | {t_trace:.1f} | {t_solve:.1f} | {spread(bare)} / {spread(steps)} | {free_s} | "
            f"{ratio(mid, bare_s)} / {statistics.median(mid) / step:.1f}x | "
            f"{spread(cpu_steps)} / {spread(cpu_mid)} ({cpu_ratio:.1f}x) | "
            f"{no_budget} / {peak[1] / 2**20:.0f} / {peak[2] / 2**20:.0f} | {rss:.0f} | {breakdown} |")


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="synthetic:300,synthetic:1000,resnet50")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--fresh", action="store_true", help="each model in a child process (its own peak RSS)")
    p.add_argument("--half", action="store_true",
                   help="skip the no-budget rewrite; the middle budget is half the plain step's peak")
    p.add_argument("--no-header", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if not args.no_header:
        print("| model | nodes | trace s | MC solve s | fake step s: bare / metered | "
              "rewrite, no budget s (x bare) / x metered | rewrite, middle budget s (x bare) / x metered | "
              "CPU s: metered step / middle budget (x) | "
              "measured peak MiB: no budget / middle / plain step | peak RSS MB | breakdown s |")
        print("|---|---|---|---|---|---|---|---|---|---|---|", flush=True)
    for name in args.models.split(","):
        if args.fresh:
            subprocess.run([sys.executable, __file__, "--models", name, "--repeats", str(args.repeats),
                            "--batch", str(args.batch), "--no-header"] + ["--half"] * args.half, check=False)
            continue
        print(run(name, args.batch, args.repeats, instrument(), args.half), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
