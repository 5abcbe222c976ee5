"""The report of ``fxplan compare``: report.md, report.json, report.html and PNG plots.

* ``report.json``: every row (:class:`fxplan.compare.driver.Row` as a dict), the timelines and how the run was made;
* ``report.md``: a table shaped like Kusumoto et al.'s Table 1 (peak at the main batch and reduction
  against vanilla, per network and method), what every column means, then per network every method's
  measured numbers;
* ``report.html``: the same tables with the plots inline (base64 PNG), one self-contained file;
* ``tradeoff-<network>.png``: memory against step-time ratio, every method on one chart (the paper's
  Figure 3 view); ``timeline-<network>.png``: live bytes after every op of one step, vanilla against
  fxplan's plan.

matplotlib (the ``report`` extra) draws the plots; without it the tables are still written and the
report says the plots are missing.
"""

from __future__ import annotations

import base64
import html
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from fxplan.common.console import format_count, format_table
from fxplan.compare.driver import Comparison, Row
from fxplan.compare.front import front, front_rows
from fxplan.measure.meter import GiB, MiB
from fxplan.measure.timing import describe_ratio

#: Table-1 columns: (heading, method row name). A column no network has a row for is left out.
TABLE1 = (
    ("vanilla", "vanilla"), ("checkpoint_sequential", "checkpoint_sequential"),
    ("HF checkpointing", "hf-checkpointing"), ("Chen", "chen"),
    ("ApproxDP+MC", "approx-memory"), ("ExactDP+MC", "exact-memory"),
    ("ApproxDP+TC", "approx-time"), ("ExactDP+TC", "exact-time"),
)

_PEER_COLUMNS = ("checkpoint_sequential", "hf-checkpointing")

METERS = (
    "Peaks are whole-step peaks: parameters, buffers, inputs, activations, gradients and backward "
    "temporaries. The main-batch peak (the paper's batch for Table 1's networks, the zoo's batch for "
    "the others) is measured exactly on fake tensors (fxplan.measure_step, fake=True; nothing is "
    "allocated). torch.compile cannot be measured that way (a dispatch mode does not see compiled code), "
    "so its rows have no main-batch peak: compare them in the small-batch columns, where every method is "
    "measured alike on a real step (torch.profiler allocation events on the CPU, the caching allocator on "
    "CUDA). Small-batch reductions are not the main-batch reductions: parameters and gradients weigh more "
    "at a small batch. Models too large for a real step here are measured on fake tensors only."
)

#: What each column of the per-network tables means (written into the report).
COLUMNS = (
    ("method", "vanilla: the model as it is. checkpoint_sequential: torch.utils.checkpoint over "
               "round(sqrt(n)) segments of a chain-shaped model. hf-checkpointing: Hugging Face's own "
               "activation checkpointing of every layer (transformers models only). torch.compile@F: "
               "aot_eager with activation_memory_budget=F, a fraction of the saved activations, not bytes. "
               "chen, approx-*, exact-*: fxplan's plans (Chen et al.'s; Kusumoto et al.'s approximate and "
               "exact DP, time- or memory-centric) at the smallest budget each reaches. NAME@P (curve points): "
               "fxplan at the budget P of the way from the smallest feasible peak (0) to vanilla's (1)."),
    ("status", "ok, not applicable, timed out (planning ran past --time-limit), crashed (a measured step "
               "failed) or error (preparing failed); the note says why."),
    ("peak GiB @batch B", "measured peak of one step at the main batch B, on fake tensors (exact)."),
    ("vs vanilla", "change of that peak against vanilla's."),
    ("peak MiB @batch b", "measured peak of one real step at the small batch b, every method with the same "
                          "meter; the only peak torch.compile has."),
    ("vs vanilla (small)", "change of the small-batch peak against vanilla's at the small batch."),
    ("step-time ratio", "real step time at the small batch / vanilla's: the median over interleaved rounds "
                        "of the method's step over vanilla's step in the same round, and in brackets the "
                        "interquartile range of those per-round ratios. A range that contains 1.0 is marked "
                        "'within noise': the method is not told apart from vanilla, faster or slower."),
    ("predicted ratio", "fxplan's plans: the step-time ratio the plan's time costs predict, 1 + predicted "
                        "recomputation seconds / (3 x predicted forward seconds), a backward pass taken as "
                        "two forward passes (fxplan.costs.timecost; roofline by default)."),
    ("recompute (measured)", "FLOPs the method's step runs beyond vanilla's step at the main batch, counted with "
                             "torch.utils.flop_counter, / FLOPs of one vanilla forward pass. The flop counter "
                             "counts matrix products and convolutions only: recomputed normalisations, "
                             "activations and copies add nothing to this column."),
    ("recompute (planned)", "fxplan's plans: the forward cost the plan recomputes in backward / one forward pass, "
                            "as fxplan's cost model prices each node (roofline time by default, where memory-bound "
                            "ops such as normalisations and activations cost time too), less what checkpoint's "
                            "early stop skips; for auto-checkpoint, the ops its checkpointed modules recompute, "
                            "priced the same way. It differs from the measured column because the two weigh ops "
                            "differently (time against FLOPs): a plan that recomputes mostly cheap elementwise "
                            "ops is high here and low there, one that recomputes matrix products the other way "
                            "round. Either can pass 100%: values recomputed more than once (a nested plan "
                            "recomputes a sub-segment again at each level; a cheap value is recomputed for each "
                            "node that keeps it)."),
    ("predicted peak GiB", "the peak fxplan's memory model predicts for the chosen plan. It may be above "
                           "the measured peak, and above the budget: the model over-predicts, and fxplan "
                           "holds the *measured* peak to the budget, so a plan predicted above it is kept "
                           "when its measured peak fits."),
    ("budget", "what the method was given: a budget (measured whole-step peak), 'smallest "
               "feasible', a compile fraction or a segment count."),
    ("planning", "wall time to produce the module: tracing, solving, code generation and measuring "
                 "candidate plans (for torch.compile: compiling)."),
    ("note", "why a method did not run or failed, or how its real steps were made."),
)

#: What each column of the memory/step-time front tables means (written into the report).
FRONT_COLUMNS = (
    ("family", "baseline (vanilla), peer (another tool) or fxplan."),
    ("peak vs vanilla (small batch)", "change of the small-batch peak against vanilla's, as in the table above."),
    ("step-time ratio, ratio IQR", "the step-time ratio and its interquartile range, as in the table above."),
    ("on the front", "yes where no other point dominates it: none has a peak as low and a step-time ratio as "
                     "low, and one of the two lower."),
    ("dominated by", "of the points that dominate it, the one of lowest step-time ratio; 'within noise' where "
                     "this point's ratio range contains that point's ratio."),
)


def _gib(b: int | None) -> str:
    return "-" if b is None else f"{b / GiB:.2f}"


def _mib(b: int | None) -> str:
    return "-" if b is None else f"{b / MiB:.1f}"


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{-100 * x:+.0f}%".replace("+-", "-").replace("-0%", "0%")


def _secs(x: float | None) -> str:
    return "-" if x is None else (f"{x:.2f} s" if x < 100 else f"{x:.0f} s")


def _frac(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.0f}%"


def _recompute(x: float | None) -> str:
    """A recompute share, with why where it passes one forward pass (the column legend says more)."""
    return _frac(x) + ("" if x is None or x <= 1.0 else " (recomputed more than once)")


def _table1_cell(row: Row | None) -> str:
    if row is None:
        return "not run"
    if row.status != "ok":
        return row.status
    if row.peak_bytes is None:
        return "-"
    if row.method == "vanilla":
        return f"{_gib(row.peak_bytes)} GiB"
    return f"{_gib(row.peak_bytes)} ({_pct(row.reduction)})"


def table1(comparison: Comparison) -> tuple[list[str], list[list[str]]]:
    """Header and rows of the Table-1-shaped summary (peak at the main batch, GiB, and reduction)."""
    present = {r.method for r in comparison.rows}
    applicable = {r.method for r in comparison.rows if r.status != "not applicable"}
    # A column no network ran is left out, and so is a peer's column where it applied to no network.
    columns = [(h, m) for h, m in TABLE1 if m == "vanilla" or m in applicable
               or (m in present and m not in _PEER_COLUMNS)]
    header = ["network", "input, batch", *[h for h, _ in columns]]
    rows = []
    for net in comparison.networks():
        by = {r.method: r for r in comparison.rows_for(net)}
        any_row = comparison.rows_for(net)[0]
        rows.append([net, f"{any_row.input_label or f'{any_row.input_size}²'}, {any_row.batch}",
                     *[_table1_cell(by.get(m)) for _, m in columns]])
    return header, rows


def detail_header(rows: Sequence[Row]) -> list[str]:
    """Column headings of a network's table, with its two batches in them."""
    first = rows[0]
    small = f"peak MiB @batch {first.small_batch}" if first.small_batch else "peak MiB @small batch"
    return ["method", "status", f"peak GiB @batch {first.batch}", "vs vanilla", small, "vs vanilla (small)",
            "step-time ratio", "predicted ratio", "recompute (measured)", "recompute (planned)",
            "predicted peak GiB", "budget", "planning", "note"]


def detail_rows(rows: Sequence[Row]) -> list[list[str]]:
    out = []
    for r in rows:
        out.append([r.method, r.status, _gib(r.peak_bytes), _pct(r.reduction), _mib(r.small_peak_bytes),
                    _pct(r.small_reduction), describe_ratio(r.time_ratio, r.ratio_low, r.ratio_high),
                    describe_ratio(r.predicted_time_ratio, None, None), _recompute(r.recompute_fraction),
                    _recompute(r.planned_recompute_fraction), _gib(r.predicted_peak_bytes), r.budget or "-",
                    _secs(r.plan_seconds), r.note or ""])
    return out


def _real_steps(rows: Sequence[Row]) -> str:
    first = rows[0]
    if not first.small_batch:
        return "no real steps (too large for one here: fake tensors only)"
    size = first.input_label.replace(str(first.input_size), str(first.small_input_size), 1)
    return f"real steps at batch {first.small_batch}, {size} ({first.small_meter or 'no real step ran'})"


def summary_table(comparison: Comparison) -> str:
    """Plain-text summary for the terminal: the main rows of every network."""
    header = ["network", "method", "status", "peak GiB", "vs vanilla", "small batch vs vanilla", "time ratio",
              "recompute", "planning"]
    rows = [[r.network, r.method, r.status, _gib(r.peak_bytes), _pct(r.reduction), _pct(r.small_reduction),
             describe_ratio(r.time_ratio, r.ratio_low, r.ratio_high), _recompute(r.recompute_fraction),
             _secs(r.plan_seconds)]
            for r in comparison.rows if r.main]
    return format_table(header, rows)


def file_stem(network: str) -> str:
    """A file-name-safe form of a network name (``timm:resnet50`` -> ``timm-resnet50``)."""
    return "".join(c if c.isalnum() or c in "._-" else "-" for c in network)


def _md_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    def esc(c: str) -> str:
        return str(c).replace("|", "\\|").replace("\n", " ")

    lines = ["| " + " | ".join(map(esc, header)) + " |", "| " + " | ".join("---" for _ in header) + " |"]
    lines += ["| " + " | ".join(map(esc, row)) + " |" for row in rows]
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------- plots

_STYLE = {"vanilla": ("k", "s"), "checkpoint_sequential": ("tab:purple", "D"), "torch.compile": ("tab:blue", "^"),
          "hf-checkpointing": ("tab:cyan", "P"),
          "chen": ("tab:green", "o"), "approx-time": ("tab:red", "o"), "approx-memory": ("tab:orange", "v"),
          "exact-time": ("tab:brown", "x"), "exact-memory": ("tab:pink", "+")}


def _series(name: str) -> str:
    return name.split("@")[0]


def plot_tradeoff(rows: Sequence[Row], path: Path) -> Path:
    """Peak against step-time ratio, every method on one chart: left at the main batch (fake meter),
    right at the small batch relative to vanilla (one meter for all, torch.compile included)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.8))
    panels = ((axes[0], lambda r: None if r.peak_bytes is None else r.peak_bytes / GiB,
               f"peak at batch {rows[0].batch} (GiB, fake tensors)"),
              (axes[1], lambda r: None if r.small_reduction is None else 1 - r.small_reduction,
               f"peak at batch {rows[0].small_batch} / vanilla's (real step)"))
    for ax, xof, label in panels:
        groups: dict[str, list[tuple[float, float, str]]] = {}
        for r in rows:
            x = xof(r)
            if r.status == "ok" and x is not None and r.time_ratio is not None:
                groups.setdefault(_series(r.method), []).append((x, r.time_ratio, r.method))
        for series, pts in groups.items():
            color, marker = _STYLE.get(series, ("gray", "o"))
            pts.sort()
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker=marker, color=color, label=series,
                    linestyle="-" if len(pts) > 1 else "none")
        if ax is axes[1]:
            best = front(rows)
            ax.plot([1 - r.small_reduction for r in best], [r.time_ratio for r in best], color="black",
                    linestyle=":", linewidth=1, drawstyle="steps-post", label="measured front")
        ax.set_xlabel(label)
        ax.set_ylabel("step time / vanilla's")
        ax.grid(alpha=0.3)
        if groups:
            ax.legend(fontsize=8)
    fig.suptitle(f"{rows[0].network}: memory-time trade-off (step times at batch {rows[0].small_batch})")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def plot_timeline(network: str, timelines: dict[str, list[tuple[str, int]]], batch: int, path: Path) -> Path:
    """Live bytes after every op of one step (forward then backward), one line per method."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 4))
    for name, tl in timelines.items():
        color, _ = _STYLE.get(_series(name), ("gray", "o"))
        ax.plot(range(len(tl)), [b / GiB for _, b in tl], color=color, label=f"{name} ({format_count(len(tl), 'op')})",
                lw=1)
    ax.set_xlabel("op (forward, then backward)")
    ax.set_ylabel("live GiB")
    ax.set_title(f"{network}: memory over one training step at batch {batch} (fake tensors)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


# --------------------------------------------------------------------------------------------- writing


def write_report(comparison: Comparison, out_dir: str | Path) -> list[Path]:
    """Write report.json, the plots, report.md and report.html into ``out_dir``; return the paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = [_write_json(comparison, out / "report.json")]
    plots: dict[str, list[Path]] = {}
    plot_error = ""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        plot_error = "matplotlib is not installed (pip install 'fxplan[report]'), so no plots were drawn."
    for net in comparison.networks():
        rows = comparison.rows_for(net)
        if plot_error:
            break
        plots[net] = []
        try:
            if any(r.time_ratio is not None for r in rows):
                plots[net].append(plot_tradeoff(rows, out / f"tradeoff-{file_stem(net)}.png"))
            if comparison.timelines.get(net):
                plots[net].append(plot_timeline(net, comparison.timelines[net], rows[0].batch,
                                                out / f"timeline-{file_stem(net)}.png"))
        except Exception as exc:  # a plot must not cost the tables
            plot_error = f"plotting failed: {type(exc).__name__}: {exc}"
    paths += [p for ps in plots.values() for p in ps]
    md = render_markdown(comparison, plots, plot_error)
    (out / "report.md").write_text(md)
    paths.append(out / "report.md")
    (out / "report.html").write_text(render_html(comparison, plots, plot_error))
    paths.append(out / "report.html")
    return paths


def _write_json(comparison: Comparison, path: Path) -> Path:
    doc = {"meta": comparison.meta, "rows": [r.to_dict() for r in comparison.rows],
           "timelines": {net: {m: [[op, b] for op, b in tl] for m, tl in tls.items()}
                         for net, tls in comparison.timelines.items()}}
    path.write_text(json.dumps(doc, indent=1))
    return path


def _header_lines(comparison: Comparison) -> list[str]:
    meta = comparison.meta
    lines = []
    if meta.get("command"):
        lines.append(f"Command: `{meta['command']}`")
    lines.append(f"Machine: {meta.get('machine', '?')}, torch {meta.get('torch', '?')}; "
                 f"started {meta.get('started', '?')}; {meta.get('repeats', '?')} interleaved timed rounds after "
                 f"a warm-up round, {meta.get('threads', '?')} threads.")
    lines += [f"Warning: {w}" for w in meta.get("warnings", [])]
    return lines


TABLE1_NOTE = ("Shaped like Kusumoto et al. (2019) Table 1; MC = memory-centric, TC = time-centric, at the "
               "smallest budget for which the solver finds a plan.")


def render_markdown(comparison: Comparison, plots: dict[str, list[Path]], plot_error: str = "") -> str:
    parts = ["# fxplan compare", "", *_header_lines(comparison), "",
             "## Peak memory at the main batch (GiB, reduction against vanilla)", "", TABLE1_NOTE, "",
             _md_table(*table1(comparison)), "", METERS, "", "## Columns of the per-network tables", ""]
    parts += [f"- **{name}**: {text}" for name, text in COLUMNS]
    parts += ["", "Columns of the memory/step-time front tables:", ""]
    parts += [f"- **{name}**: {text}" for name, text in FRONT_COLUMNS]
    parts.append("")
    if plot_error:
        parts += [f"Plots: {plot_error}", ""]
    for net in comparison.networks():
        rows = comparison.rows_for(net)
        parts += [f"## {net}", "",
                  f"Main batch {rows[0].batch} at {rows[0].input_label or rows[0].input_size}; {_real_steps(rows)}.",
                  "", _md_table(detail_header(rows), detail_rows(rows)), ""]
        header, table = front_rows(rows)
        if table:
            parts += [f"Memory/step-time front at batch {rows[0].small_batch} (every method on one meter):", "",
                      _md_table(header, table), ""]
        for p in plots.get(net, []):
            parts += [f"![{p.stem}]({p.name})", ""]
    return "\n".join(parts)


def _html_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    head = "".join(f"<th>{html.escape(str(h))}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in row) + "</tr>" for row in rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def render_html(comparison: Comparison, plots: dict[str, list[Path]], plot_error: str = "") -> str:
    """One self-contained page: the markdown report's tables with the plots inline as base64 PNG."""
    style = ("body{font-family:sans-serif;max-width:1400px;margin:2em auto}table{border-collapse:collapse;"
             "font-size:13px;margin:1em 0}td,th{border:1px solid #ccc;padding:3px 6px;text-align:left}"
             "th{background:#f0f0f0}img{max-width:100%}")
    parts = [f"<!doctype html><html><head><meta charset='utf-8'><title>fxplan compare</title>"
             f"<style>{style}</style></head><body><h1>fxplan compare</h1>"]
    parts += [f"<p>{html.escape(line).replace('`', '')}</p>" for line in _header_lines(comparison)]
    parts += ["<h2>Peak memory at the main batch (GiB, reduction against vanilla)</h2>",
              f"<p>{html.escape(TABLE1_NOTE)}</p>", _html_table(*table1(comparison)), f"<p>{html.escape(METERS)}</p>",
              "<h2>Columns of the per-network tables</h2><ul>"]
    parts += [f"<li><b>{html.escape(name)}</b>: {html.escape(text).replace('*', '')}</li>" for name, text in COLUMNS]
    parts.append("</ul><p>Columns of the memory/step-time front tables:</p><ul>")
    parts += [f"<li><b>{html.escape(name)}</b>: {html.escape(text)}</li>" for name, text in FRONT_COLUMNS]
    parts.append("</ul>")
    if plot_error:
        parts.append(f"<p>Plots: {html.escape(plot_error)}</p>")
    for net in comparison.networks():
        rows = comparison.rows_for(net)
        parts += [f"<h2>{html.escape(net)}</h2>",
                  f"<p>Main batch {rows[0].batch} at {html.escape(rows[0].input_label)}; "
                  f"{html.escape(_real_steps(rows))}.</p>",
                  _html_table(detail_header(rows), detail_rows(rows))]
        header, table = front_rows(rows)
        if table:
            parts += [f"<p>Memory/step-time front at batch {rows[0].small_batch} (every method on one meter):</p>",
                      _html_table(header, table)]
        for p in plots.get(net, []):
            data = base64.b64encode(p.read_bytes()).decode("ascii")
            parts.append(f"<p><img alt='{html.escape(p.stem)}' src='data:image/png;base64,{data}'></p>")
    parts.append("</body></html>")
    return "\n".join(parts)


def load_rows(path: str | Path) -> list[dict[str, Any]]:
    """The rows of a written report.json (for scripts and docs)."""
    return json.loads(Path(path).read_text())["rows"]


__all__ = ["load_rows", "plot_timeline", "plot_tradeoff", "render_html", "render_markdown", "summary_table",
           "table1", "write_report"]
