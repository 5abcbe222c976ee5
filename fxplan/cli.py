"""The ``fxplan`` command line: ``fxplan zoo``, ``profile MODEL``, ``plan MODEL``, ``compare MODEL...``.

MODEL is a zoo name (``fxplan zoo``), a torchvision builder name (``mobilenet_v2``), ``timm:NAME`` or
``hf:NAME`` (``models_zoo.resolve``). Every name and argument is checked before any work starts: an
unknown name, a non-finite budget or an unknown method is one error line and a non-zero exit.

Everything runs on fake tensors unless ``--real`` is given (or, in ``compare``, for the small real steps),
so paper-scale batches are profiled on a laptop in seconds. Progress goes to stderr, results to stdout.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable, Sequence
from typing import Any

import torch

from fxplan.capture.fakes import DATA_DEPENDENT, FakeMode, data_dependent_error, without_values
from fxplan.common.console import Progress, format_bytes, format_table
from fxplan.compare.methods import DEFAULT_COMPILE_BUDGETS, DEFAULT_CURVE_POINTS, DEFAULT_SAC_BUDGETS
from fxplan.errors import BudgetError, FxplanError, TraceError
from fxplan.measure.meter import GiB, MiB, measure_step

MODEL_HELP = ("a zoo network (see 'fxplan zoo'), a torchvision builder name (e.g. mobilenet_v2), timm:NAME, "
              "or hf:NAME (a transformers config class or model type, e.g. hf:gpt2)")

# ------------------------------------------------------------------------------------- argument types


def _number(text: str, cast: Callable[[str], Any], what: str, ok: Callable[[Any], bool]) -> Any:
    try:
        value = cast(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be {what}, got {text!r}") from None
    if isinstance(value, float) and not math.isfinite(value) or not ok(value):
        raise argparse.ArgumentTypeError(f"must be {what}, got {text!r}")
    return value


def positive_int(text: str) -> int:
    return _number(text, int, "a positive integer", lambda v: v > 0)


def positive_gib(text: str) -> float:
    return _number(text, float, "a positive, finite number of GiB", lambda v: v > 0)


def seconds(text: str) -> float:
    return _number(text, float, "a finite number of seconds >= 0 (0: no limit)", lambda v: v >= 0)


def fractions(text: str) -> tuple[float, ...]:
    """Comma-separated numbers in [0, 1] ('' for none)."""
    return tuple(_number(part.strip(), float, "comma-separated numbers between 0 and 1", lambda v: 0 <= v <= 1)
                 for part in text.split(",") if part.strip())


def names(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


# ------------------------------------------------------------------------------------------ commands


def load_model(name: str, batch_size: int | None, input_size: int | None, *, real: bool, progress: Progress):
    """Resolve ``name``, build the model and its example inputs (fake tensors unless ``real``)."""
    import models_zoo

    entry = models_zoo.resolve(name)
    if real and entry.fake_only:
        raise FxplanError(f"{name} is measured on fake tensors only ({entry.description}); drop --real")
    with progress.step(f"building {name}"):
        torch.manual_seed(0)
        model = entry.build()
    if real:
        inputs = entry.example_inputs(batch_size=batch_size, input_size=input_size)
    else:
        with FakeMode():
            inputs = without_values(entry.example_inputs(batch_size=batch_size, input_size=input_size))
    return entry, model, inputs


def cmd_zoo(args: argparse.Namespace) -> int:
    import models_zoo
    from fxplan.compare.driver import describe_input

    rows = []
    for name in models_zoo.names():
        e = models_zoo.get(name)
        rows.append((name, e.paper_batch, describe_input(e.kind, e.input_size), e.paper_nodes or "-", e.description))
    print(format_table(("network", "batch", "input", "paper #V", "description"), rows))
    print("\nAlso accepted: torchvision builder names (e.g. mobilenet_v2), timm:NAME, hf:NAME (e.g. hf:gpt2).")
    return 0


def cmd_profile(args: argparse.Namespace) -> int:
    from fxplan.costs.trace import trace

    progress = Progress(args.quiet)
    entry, model, inputs = load_model(args.model, args.batch_size, args.input_size, real=args.real,
                                      progress=progress)
    with progress.step("measuring one training step" + ("" if args.real else " (fake tensors)")):
        stats = measure_step(model, inputs, fake=not args.real, loss_fn=entry.loss)
    shape = "x".join(str(d) for d in inputs[0].shape)
    traced: TraceError | None = None
    try:
        with progress.step("tracing and propagating shapes"):
            cg = trace(model, inputs)
    except TraceError as exc:
        traced = exc
        print(f"{args.model}: input {shape}; no graph (fxplan cannot trace this model, see below)")
    else:
        print(f"{args.model}: input {shape}, {cg.number_of_nodes()} compute nodes, {cg.number_of_edges()} edges, "
              f"parameters {format_bytes(cg.graph['param_bytes'])}")
        print()
        _print_top_nodes(cg, "M", "largest outputs", args.top)
        print()
        cost = "predicted forward time on this machine" if cg.graph.get("T_seconds") else "forward FLOPs"
        _print_top_nodes(cg, "T", f"most expensive ({cost})", args.top)
    print()
    print(f"vanilla peak of one training step, measured with {stats.meter} ({stats.seconds:.1f} s):")
    print(stats.table())
    print(f"peak: {format_bytes(stats.peak_bytes)} ({stats.peak_bytes} bytes)")
    if traced is not None:
        raise traced
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    """Plan, rewrite and measure, exactly as ``fxplan.rewrite`` does: one answer for one budget."""
    from fxplan.api import budget_note, rewrite

    progress = Progress(args.quiet)
    entry, model, inputs = load_model(args.model, args.batch_size, args.input_size, real=False,
                                      progress=progress)
    with progress.step(f"planning ({args.solver}, {args.strategy}-centric) and measuring candidate plans"):
        module = rewrite(model, args.budget_gb, example_inputs=inputs, strategy=args.strategy,
                         solver=args.solver, loss_fn=entry.loss)
    plan = module.fxplan_plan
    print(plan.summary())
    note = budget_note(plan)
    if note:
        print(f"Note: {note}.")
    if args.json:
        with open(args.json, "w") as f:
            f.write(plan.to_json(indent=1))
        print(f"plan written to {args.json}")
    return 0


def budget_gb_at_least(n_bytes: int) -> str:
    """The ``--budget-gb`` value, to 3 significant digits, that is the least such value at or above ``n_bytes``
    once the command line turns it back into bytes (rounded up, as ``fxplan.rewrite`` does)."""
    gib = n_bytes / GiB
    decimals = max(0, 2 - math.floor(math.log10(gib))) if gib > 0 else 3
    step = 10.0 ** -decimals
    value = math.ceil(gib / step - 1e-9) * step
    while math.ceil(float(f"{value:.{decimals}f}") * GiB) < n_bytes:  # float error below the exact value
        value += step
    return f"{value:.{decimals}f}"


def budget_error_line(exc: BudgetError) -> str:
    """A :class:`BudgetError`'s message with its advice in the command line's terms: the ``--budget-gb`` value that
    fits instead of the Python API's ``budget_bytes=...``."""
    if exc.min_feasible_bytes is None or not exc.advice:
        return str(exc)
    return (f"{exc.fact} Pass --budget-gb {budget_gb_at_least(exc.min_feasible_bytes)} or more, or a smaller "
            "--batch-size.")


def _print_top_nodes(cg, attr: str, title: str, top: int) -> None:
    nodes = sorted(cg.nodes, key=lambda v: cg.nodes[v][attr], reverse=True)[:top]
    unit = cg.graph.get("T_seconds")
    rows = [(v, cg.nodes[v]["kind"], f"{cg.nodes[v]['M'] / MiB:.1f}",
             f"{cg.nodes[v]['T'] * unit * 1e3:.3f}" if unit else f"{cg.nodes[v]['T'] / 1e9:.2f}") for v in nodes]
    print(f"{title}:")
    print(format_table(("node", "kind", "output MiB", "forward ms" if unit else "GFLOPs"), rows))


def cmd_compare(args: argparse.Namespace) -> int:
    """Run the comparison, print the summary table, write the report; exit 1 if, on some network, none
    of the methods asked for (``--methods``; by default any method) worked."""
    import models_zoo
    from fxplan.compare.driver import compare_models
    from fxplan.compare.methods import default_methods, select_methods
    from fxplan.compare.report import summary_table, write_report

    entries = models_zoo.resolve_all(args.models)
    sac_budgets = args.sac_budgets
    if sac_budgets is None:  # sac-ilp times the model's ops on real tensors at the main batch: run where asked
        asked = any(m.split("@")[0] == "sac-ilp" for m in args.methods or ())
        sac_budgets = DEFAULT_SAC_BUDGETS if asked else ()
    methods = default_methods(args.compile_budgets, args.curve_points, exact=not args.no_exact,
                              sac_budgets=sac_budgets)
    if args.methods:
        methods = select_methods(methods, args.methods)
    device = parse_device(args.device)
    comparison = compare_models(
        entries, batch_size=args.batch_size, input_size=args.input_size, small_batch=args.small_batch,
        small_input_size=args.small_input_size, methods=methods, progress=Progress(args.quiet),
        repeats=args.repeats, threads=args.threads, time_limit_s=args.time_limit or None, device=device)
    comparison.meta["command"] = compare_command_line(args)
    paths = write_report(comparison, args.out)
    print(summary_table(comparison))
    print()
    print("report: " + ", ".join(str(p) for p in paths))
    failed = comparison.failed_networks(args.methods or None)
    if failed:
        asked = ", ".join(args.methods) if args.methods else "any method"
        print(f"fxplan: error: {asked} did not work on {', '.join(failed)} (see the status and note columns)",
              file=sys.stderr)
        return 1
    return 0


def parse_device(name: str | None) -> torch.device:
    """The device that ``--device NAME`` names (None: CUDA when present, else the CPU); a clear error otherwise."""
    if name is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise FxplanError(f"--device: not a device name: {name!r} (e.g. cpu, cuda, cuda:1)") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise FxplanError("--device cuda: no CUDA device is available here")
    return device


#: ``fxplan compare`` options and their defaults, for :func:`compare_command_line`.
COMPARE_DEFAULTS: dict[str, Any] = {
    "batch_size": None, "input_size": None, "small_batch": None, "small_input_size": None,
    "out": "fxplan-compare", "repeats": 5, "threads": None, "time_limit": 120.0, "device": None, "methods": None,
    "compile_budgets": DEFAULT_COMPILE_BUDGETS, "curve_points": DEFAULT_CURVE_POINTS,
    "sac_budgets": None,
}


def compare_command_line(args: argparse.Namespace) -> str:
    """The ``fxplan compare`` command that reproduces this run (non-default options only)."""
    parts = ["fxplan", "compare", *args.models]
    for name, default in COMPARE_DEFAULTS.items():
        value = getattr(args, name, default)
        if value == default:
            continue
        if isinstance(value, (list, tuple)):
            value = ",".join(f"{v:g}" if isinstance(v, float) else str(v) for v in value) or "''"
        parts += [f"--{name.replace('_', '-')}", str(value)]
    if getattr(args, "no_exact", False):
        parts.append("--no-exact")
    return " ".join(parts)


# -------------------------------------------------------------------------------------------- parser


def _add_size_options(p: argparse.ArgumentParser, batch_help: str, size_help: str) -> None:
    p.add_argument("--batch-size", type=positive_int, default=None, help=batch_help)
    p.add_argument("--input-size", type=positive_int, default=None, help=size_help)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fxplan", description="Memory planning for PyTorch training.")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("zoo", help="list the networks of the model zoo").set_defaults(func=cmd_zoo)
    batch_help = "default: the paper's batch for its networks, else the zoo's or a realistic one"
    size_help = "image side, or sequence length for language models (default: the model's)"

    prof = sub.add_parser("profile", help="trace a model and measure its vanilla peak memory")
    prof.add_argument("model", help=MODEL_HELP)
    _add_size_options(prof, batch_help, size_help)
    prof.add_argument("--real", action="store_true", help="run on real CPU tensors instead of fake ones")
    prof.add_argument("--top", type=positive_int, default=8, help="how many nodes to list (default 8)")
    prof.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    prof.set_defaults(func=cmd_profile)

    pl = sub.add_parser("plan", help="find a recomputation plan within a memory budget, and measure it",
                        description="Plan, rewrite and measure exactly as fxplan.rewrite does, on fake tensors.")
    pl.add_argument("model", help=MODEL_HELP)
    pl.add_argument("--budget-gb", type=positive_gib, default=None,
                    help="measured peak of the whole step in GiB (default: the smallest fxplan reaches)")
    pl.add_argument("--strategy", choices=("time", "memory"), default="time",
                    help="time: least recomputation within the budget; memory: lowest peak")
    pl.add_argument("--solver", choices=("approx", "exact", "chen"), default="approx")
    _add_size_options(pl, batch_help, size_help)
    pl.add_argument("--json", metavar="FILE", help="also write the plan as JSON")
    pl.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    pl.set_defaults(func=cmd_plan)

    cmp = sub.add_parser(
        "compare", help="measure fxplan's plans against vanilla, checkpoint_sequential, torch.compile and "
                        "Hugging Face checkpointing",
        description="Measure every method on each model and write report.md/.json/.html and PNG plots. Exit "
                    "status 1 when, on some model, none of the methods asked for worked.")
    cmp.add_argument("models", nargs="+", metavar="MODEL", help=MODEL_HELP)
    _add_size_options(cmp, "batch of the main (fake-tensor) peaks; " + batch_help, size_help)
    cmp.add_argument("--small-batch", type=positive_int, default=None,
                     help="batch of the real steps (timing, like-for-like peaks; default: from min(4, batch) "
                          "doubled until a vanilla step takes 0.5 s, at most 8 times that)")
    cmp.add_argument("--small-input-size", type=positive_int, default=None, help="input size of the real steps")
    cmp.add_argument("--methods", type=names, default=None, metavar="LIST",
                     help="comma-separated methods (default: all): vanilla, checkpoint_sequential, "
                          "hf-checkpointing, torch.compile, sac-ilp, auto-checkpoint, chen, approx-time, "
                          "approx-memory, exact-time, exact-memory, or one point such as torch.compile@0.5; "
                          "vanilla always runs")
    cmp.add_argument("--out", default="fxplan-compare", help="report directory (default ./fxplan-compare)")
    cmp.add_argument("--repeats", type=positive_int, default=5,
                     help="timed rounds, every method once per round, after a warm-up round (default 5)")
    cmp.add_argument("--threads", type=positive_int, default=None,
                     help="torch threads while timing (default: torch's current count)")
    cmp.add_argument("--time-limit", type=seconds, default=120.0,
                     help="seconds allowed for an exact DP (default 120; 0: no limit)")
    cmp.add_argument("--compile-budgets", type=fractions, default=DEFAULT_COMPILE_BUDGETS,
                     help="activation_memory_budget values for torch.compile, comma-separated ('' for none)")
    cmp.add_argument("--sac-budgets", type=fractions, default=None,
                     help="budgets for PyTorch's automatic selective checkpointing (sac-ilp), as fractions of the "
                          "way from the smallest its ILP meets (0) to the unplanned peak (1), comma-separated "
                          "(default: none, or 0.5 where --methods names sac-ilp; it times the model's ops on real "
                          "tensors at the main batch)")
    cmp.add_argument("--curve-points", type=fractions, default=DEFAULT_CURVE_POINTS,
                     help="extra budgets for the trade-off curve, as fractions of the way from the smallest "
                          "feasible budget (0) to vanilla's peak (1), comma-separated (default 0.5; '' for none)")
    cmp.add_argument("--no-exact", action="store_true", help="skip the exact DP rows")
    cmp.add_argument("--device", default=None, help="device of the real steps (default: cuda if present, else cpu)")
    cmp.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    cmp.set_defaults(func=cmd_compare)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except BudgetError as exc:
        print(f"fxplan: error: {budget_error_line(exc)}", file=sys.stderr)
        return 1
    except FxplanError as exc:
        print(f"fxplan: error: {exc}", file=sys.stderr)
        return 1
    except DATA_DEPENDENT as exc:  # a step on fake tensors that no entry point refused itself
        print(f"fxplan: error: {data_dependent_error(exc, f'one training step of {args.model}')}", file=sys.stderr)
        return 1
    except torch.OutOfMemoryError as exc:
        print(f"fxplan: error: out of memory ({exc}); drop --real to measure with fake tensors", file=sys.stderr)
        return 1
