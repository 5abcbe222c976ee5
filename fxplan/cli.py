"""The ``fxplan`` command line: ``fxplan zoo``, ``profile MODEL``, ``plan MODEL``, ``compare MODEL...``.

Everything runs on fake tensors unless ``--real`` is given, so paper-scale batches are profiled on a
laptop in seconds. Progress goes to stderr, results to stdout.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from fxplan.errors import FxplanError
from fxplan.measure import GiB, MiB, measure_step
from fxplan.trace import trace


class Progress:
    """Prints 'step... done (1.2 s)' lines to stderr so long work shows it is alive."""

    def __init__(self, quiet: bool = False):
        self.quiet = quiet

    def step(self, what: str):
        return _ProgressStep(what, self.quiet)


class _ProgressStep:
    def __init__(self, what: str, quiet: bool):
        self.what, self.quiet = what, quiet

    def __enter__(self):
        self.start = time.perf_counter()
        if not self.quiet:
            print(f"{self.what} ...", end="", file=sys.stderr, flush=True)
        return self

    def __exit__(self, exc_type, exc, tb):
        if not self.quiet:
            status = "failed" if exc_type else "done"
            print(f" {status} ({time.perf_counter() - self.start:.1f} s)", file=sys.stderr, flush=True)
        return False


def format_table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A plain aligned text table: numeric columns right-aligned, text columns left-aligned."""
    cells = [list(map(str, header))] + [[str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    numeric = [all(_looks_numeric(row[i]) for row in cells[1:]) for i in range(len(header))]

    def line(row):
        return "  ".join(c.rjust(w) if num else c.ljust(w) for c, w, num in zip(row, widths, numeric)).rstrip()

    return "\n".join([line(cells[0]), "  ".join("-" * w for w in widths), *map(line, cells[1:])])


def _looks_numeric(cell: str) -> bool:
    try:
        float(cell.replace(",", "").rstrip("%x"))
    except ValueError:
        return cell == "-"
    return True


def _zoo_entry(name: str):
    import models_zoo

    return models_zoo.get(name)


def load_model(name: str, batch_size: int | None, input_size: int | None, *, real: bool, progress: Progress):
    """Build a zoo network and its example inputs (fake tensors unless ``real``)."""
    entry = _zoo_entry(name)
    with progress.step(f"building {name}"):
        model = entry.build()
    if real:
        inputs = entry.example_inputs(batch_size=batch_size, input_size=input_size)
    else:
        with FakeTensorMode():
            inputs = entry.example_inputs(batch_size=batch_size, input_size=input_size)
    return entry, model, inputs


def cmd_zoo(args) -> int:
    import models_zoo

    rows = []
    for name in models_zoo.names():
        e = models_zoo.get(name)
        rows.append((name, e.paper_batch, e.input_size, e.paper_nodes or "-", e.description))
    print(format_table(("network", "paper batch", "input", "paper #V", "description"), rows))
    return 0


def cmd_profile(args) -> int:
    progress = Progress(args.quiet)
    entry, model, inputs = load_model(args.model, args.batch_size, args.input_size, real=args.real,
                                      progress=progress)
    with progress.step("tracing and propagating shapes"):
        cg = trace(model, inputs)
    with progress.step("measuring one training step" + ("" if args.real else " (fake tensors)")):
        stats = measure_step(model, inputs, fake=not args.real, loss_fn=entry.loss)
    shape = "x".join(str(d) for d in inputs[0].shape)
    print(f"{args.model}: input {shape}, {cg.number_of_nodes()} compute nodes, {cg.number_of_edges()} edges, "
          f"parameters {cg.graph['param_bytes'] / MiB:.1f} MiB")
    print()
    _print_top_nodes(cg, "M", "largest outputs", args.top)
    print()
    _print_top_nodes(cg, "T", "most expensive (forward FLOPs)", args.top)
    print()
    print(f"vanilla peak of one training step, measured with {stats.meter} ({stats.seconds:.1f} s):")
    print(stats.table())
    print(f"peak: {stats.peak_bytes / GiB:.3f} GiB ({stats.peak_bytes} bytes)")
    return 0


def cmd_plan(args) -> int:
    from fxplan.planning import budget_to_bytes, plan_graph

    progress = Progress(args.quiet)
    entry, model, inputs = load_model(args.model, args.batch_size, args.input_size, real=False,
                                      progress=progress)
    with progress.step("tracing and propagating shapes"):
        cg = trace(model, inputs)
    budget = budget_to_bytes(args.budget_gb)
    with progress.step(f"planning ({args.solver}, {args.strategy}-centric)"):
        result = plan_graph(cg, model, budget, strategy=args.strategy, solver=args.solver)
    print(result.summary())
    if args.json:
        with open(args.json, "w") as f:
            f.write(result.to_json(indent=1))
        print(f"plan written to {args.json}")
    return 0


def _print_top_nodes(cg, attr: str, title: str, top: int) -> None:
    nodes = sorted(cg.nodes, key=lambda v: cg.nodes[v][attr], reverse=True)[:top]
    rows = [(v, cg.nodes[v]["kind"], f"{cg.nodes[v]['M'] / MiB:.1f}", f"{cg.nodes[v]['T'] / 1e9:.2f}")
            for v in nodes]
    print(f"{title}:")
    print(format_table(("node", "kind", "output MiB", "GFLOPs"), rows))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fxplan", description="Memory planning for PyTorch training.")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("zoo", help="list the networks of the model zoo").set_defaults(func=cmd_zoo)

    prof = sub.add_parser("profile", help="trace a zoo network and measure its vanilla peak memory")
    prof.add_argument("model", help="a zoo network name (see 'fxplan zoo')")
    prof.add_argument("--batch-size", type=int, default=None, help="default: the paper's batch")
    prof.add_argument("--input-size", type=int, default=None, help="image side (or sequence length)")
    prof.add_argument("--real", action="store_true", help="run on real CPU tensors instead of fake ones")
    prof.add_argument("--top", type=int, default=8, help="how many nodes to list (default 8)")
    prof.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    prof.set_defaults(func=cmd_profile)

    pl = sub.add_parser("plan", help="find a recomputation plan for a zoo network within a memory budget")
    pl.add_argument("model", help="a zoo network name (see 'fxplan zoo')")
    pl.add_argument("--budget-gb", type=float, default=None,
                    help="peak memory of the whole step in GiB (default: the smallest feasible)")
    pl.add_argument("--strategy", choices=("time", "memory"), default="time",
                    help="time: least recomputation within the budget; memory: lowest peak")
    pl.add_argument("--solver", choices=("approx", "exact", "chen"), default="approx")
    pl.add_argument("--batch-size", type=int, default=None, help="default: the paper's batch")
    pl.add_argument("--input-size", type=int, default=None, help="image side (or sequence length)")
    pl.add_argument("--json", metavar="FILE", help="also write the plan as JSON")
    pl.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    pl.set_defaults(func=cmd_plan)

    from fxplan.compare import add_compare_parser

    add_compare_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    for name in ("batch_size", "input_size", "top", "budget_gb"):
        value = getattr(args, name, None)
        if value is not None and value <= 0:
            print(f"fxplan: error: --{name.replace('_', '-')} must be positive", file=sys.stderr)
            return 2
    try:
        return args.func(args)
    except FxplanError as exc:
        print(f"fxplan: error: {exc}", file=sys.stderr)
        return 1
    except torch.OutOfMemoryError as exc:
        print(f"fxplan: error: out of memory ({exc}); drop --real to measure with fake tensors", file=sys.stderr)
        return 1
