"""The compare report: files, JSON rows, Table-1 cells, error rows, plots inline, no matplotlib."""

from __future__ import annotations

import json
import sys

import pytest

from fxplan.compare.driver import Comparison, Row
from fxplan.compare.report import load_rows, summary_table, table1, write_report
from fxplan.measure.meter import GiB


def _row(method, family, peak, small, seconds, **kw):
    return Row("net", method, family, batch=32, input_size=224, small_batch=4, small_input_size=224,
               peak_bytes=peak, small_peak_bytes=small, step_seconds=seconds, **kw)


@pytest.fixture()
def comparison():
    rows = [
        _row("vanilla", "baseline", 8 * GiB, 400 << 20, 1.0, reduction=0.0, small_reduction=0.0, time_ratio=1.0),
        _row("checkpoint_sequential", "peer", None, None, None, status="crashed",
             note="one step at batch 32 (fake tensors): RuntimeError: modified by an inplace operation"),
        _row("torch.compile@0.5", "peer", None, 300 << 20, 1.2, small_reduction=0.25, time_ratio=1.2),
        _row("approx-time", "fxplan", 4 * GiB, 250 << 20, 1.3, reduction=0.5, small_reduction=0.375,
             time_ratio=1.3, ratio_low=1.2, ratio_high=1.4, recompute_fraction=0.3, planned_recompute_fraction=0.28,
             predicted_time_ratio=1.25),
        _row("approx-time@0.5", "fxplan", 6 * GiB, 320 << 20, 1.1, reduction=0.25, small_reduction=0.2,
             time_ratio=1.02, ratio_low=0.97, ratio_high=1.08, main=False),
        _row("exact-time", "fxplan", None, None, None, status="timed out", note="timed out after 120 s (planning)"),
        _row("chen", "fxplan", None, None, None, status="error", note="preparing: FxplanError: no plan"),
    ]
    timelines = {"net": {"vanilla": [("conv", 1 << 30), ("relu", 2 << 30)],
                         "approx-time": [("conv", 1 << 30), ("relu", 1 << 30)]}}
    return Comparison(rows, timelines, {"command": "fxplan compare net", "machine": "2-core CPU", "torch": "x"})


def test_all_files_are_written(comparison, tmp_path):
    pytest.importorskip("matplotlib", reason="plots need the 'report' extra (matplotlib)")
    paths = write_report(comparison, tmp_path / "out")
    names = {p.name for p in paths}
    assert {"report.md", "report.json", "report.html", "tradeoff-net.png", "timeline-net.png"} <= names
    for p in paths:
        assert p.exists() and p.stat().st_size > 0
    assert (tmp_path / "out" / "tradeoff-net.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_json_has_every_row_and_the_meta(comparison, tmp_path):
    write_report(comparison, tmp_path)
    rows = load_rows(tmp_path / "report.json")
    assert [r["method"] for r in rows] == [r.method for r in comparison.rows]
    doc = json.loads((tmp_path / "report.json").read_text())
    assert doc["meta"]["command"] == "fxplan compare net"
    assert doc["timelines"]["net"]["vanilla"][1] == ["relu", 2 << 30]


def test_table1_cells(comparison):
    header, rows = table1(comparison)
    cells = dict(zip(header, rows[0]))
    assert cells["vanilla"] == "8.00 GiB"
    assert cells["ApproxDP+TC"] == "4.00 (-50%)"
    assert cells["ExactDP+TC"] == "timed out"
    assert cells["checkpoint_sequential"] == "crashed"
    assert cells["Chen"] == "error"
    assert "ExactDP+MC" not in header and "HF checkpointing" not in header  # no network ran them


def test_table1_marks_a_method_run_on_another_network_only(comparison):
    comparison.rows.append(Row("gpt", "vanilla", "baseline", batch=8, input_size=1024, input_label="seq 1024",
                               peak_bytes=2 * GiB))
    comparison.rows.append(Row("gpt", "hf-checkpointing", "peer", batch=8, input_size=1024, peak_bytes=GiB,
                               reduction=0.5))
    header, rows = table1(comparison)
    cells = {row[0]: dict(zip(header, row)) for row in rows}
    assert cells["gpt"]["input, batch"] == "seq 1024, 8" and cells["gpt"]["HF checkpointing"] == "1.00 (-50%)"
    assert cells["net"]["HF checkpointing"] == "not run" and cells["gpt"]["Chen"] == "not run"


def test_markdown_and_html_carry_failures_and_plots(comparison, tmp_path):
    pytest.importorskip("matplotlib", reason="plots need the 'report' extra (matplotlib)")
    write_report(comparison, tmp_path)
    md = (tmp_path / "report.md").read_text()
    assert "Table 1" in md and "`fxplan compare net`" in md
    assert "| method | status | peak GiB @batch 32 |" in md and "peak MiB @batch 4" in md
    for column in ("step-time ratio", "predicted peak GiB", "NAME@P"):  # every column is explained
        assert f"{column}" in md.split("## net")[0]
    assert "1.30x (1.20-1.40) | 1.25x |" in md and "1.20x |" in md  # torch.compile's row has no range
    assert "1.02x (0.97-1.08), within noise" in md  # never shown as a speed-up or a slow-down
    assert "modified by an inplace operation" in md and "timed out after 120 s" in md
    assert "![tradeoff-net](tradeoff-net.png)" in md
    page = (tmp_path / "report.html").read_text()
    assert page.count("data:image/png;base64,") == 2
    assert "modified by an inplace operation" in page


def test_front_table_marks_dominated_points(comparison, tmp_path):
    pytest.importorskip("matplotlib", reason="plots need the 'report' extra (matplotlib)")
    write_report(comparison, tmp_path)
    md = (tmp_path / "report.md").read_text()
    front = md.split("Memory/step-time front")[1]
    # approx-time: -38% at 1.30x; torch.compile@0.5: -25% at 1.20x; approx-time@0.5: -20% at 1.02x, vanilla
    lines = {line.split("|")[1].strip(): line for line in front.splitlines() if line.startswith("| ")}
    assert "| yes |" in lines["approx-time"] and "| yes |" in lines["torch.compile@0.5"]
    assert "| yes |" in lines["approx-time@0.5"] and "| yes |" in lines["vanilla"]


def test_front_of_points():
    from fxplan.compare.front import front

    def point(name, reduction, ratio):
        return Row("n", name, "fxplan", small_reduction=reduction, time_ratio=ratio)

    a, b, c, d = point("a", 0.5, 1.3), point("b", 0.4, 1.4), point("c", 0.2, 1.1), point("d", 0.0, 1.0)
    assert [r.method for r in front([b, a, d, c])] == ["a", "c", "d"]  # b: more memory and slower than a


def test_summary_lists_main_rows_only(comparison):
    text = summary_table(comparison)
    assert "approx-time" in text and "exact-time" in text
    assert "approx-time@0.5" not in text


def test_report_without_matplotlib_still_has_tables(comparison, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now raises ImportError
    paths = write_report(comparison, tmp_path)
    assert not any(p.suffix == ".png" for p in paths)
    md = (tmp_path / "report.md").read_text()
    assert "matplotlib is not installed" in md and "ApproxDP+TC" in md


def test_table1_leaves_out_a_peer_that_applied_to_no_network(comparison):
    comparison.rows.append(_row("hf-checkpointing", "peer", None, None, None, status="not applicable",
                                note="not a Hugging Face transformers model"))
    header, _ = table1(comparison)
    assert "HF checkpointing" not in header and "checkpoint_sequential" in header  # that one crashed
