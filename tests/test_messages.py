"""fxplan's messages in plain words: log lines say what fxplan does and why, sizes in the unit that fits them, counts
with their nouns in agreement, one name per thing, and advice in the terms of the interface the user holds."""

from __future__ import annotations

import logging
import math
import types
from dataclasses import replace

import pytest
import torch
from torch import nn

import fxplan
from fxplan import BudgetError, FxplanError, cli
from fxplan.apply.applied import AppliedPlan
from fxplan.apply.regions import RegionPlan
from fxplan.common.console import format_count
from fxplan.compare.driver import Comparison, Row
from fxplan.compare.report import detail_rows, summary_table, write_report
from fxplan.costs.trace import trace
from fxplan.planner import candidates
from fxplan.planner.variants import Searches
from fxplan.solvers.plans import regions_recomputed

GiB = 2**30


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(64, 64), nn.GELU()) for _ in range(4)])


def _x() -> torch.Tensor:
    return torch.randn(32, 64)


def _info(caplog) -> str:
    return "\n".join(r.getMessage() for r in caplog.records if r.levelno >= logging.INFO and r.name == "fxplan")


def _debug(caplog) -> str:
    return "\n".join(r.getMessage() for r in caplog.records if r.levelno == logging.DEBUG and r.name == "fxplan")


def test_a_hugging_face_model_is_captured_with_export_and_the_trace_error_is_at_debug(caplog):
    transformers = pytest.importorskip("transformers")
    from fxplan.capture.capturers import capture

    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=100, n_positions=16, use_cache=False,
                                     bos_token_id=0, eos_token_id=0)
    ids = torch.randint(0, 100, (2, 8))
    with caplog.at_level(logging.DEBUG, logger="fxplan"):
        captured = capture(transformers.GPT2LMHeadModel(config), {"input_ids": ids, "labels": ids})
    assert captured.method == "torch.export"
    info = _info(caplog)
    assert "capturing GPT2LMHeadModel with torch.export (symbolic_trace cannot trace its forward)" in info
    assert "co_varnames" not in info and "stopped inside" not in info and "typical causes" not in info
    assert "symbolic_trace of GPT2LMHeadModel failed: stopped inside module" in _debug(caplog)


@pytest.mark.parametrize("solver, level", [("approx", logging.DEBUG), ("exact", logging.INFO)])
def test_a_dp_that_cannot_add_its_smallest_plans_gives_no_advice_to_use_the_default(monkeypatch, caplog, solver,
                                                                                    level):
    """The other DP's smallest plans are extras of the search: where that DP refuses the graph, the log says so
    without the refusal's advice ("use the approximate DP") to a user of the approximate DP, and at DEBUG only
    then, since nothing they asked for is missing."""
    model, x = _mlp(), _x()
    cg = trace(model, (x,))
    other = "exact" if solver == "approx" else "approx"

    def refuses(cg, model, *, solver, **kwargs):
        assert solver == other
        raise FxplanError("the DP would examine 9,000,000 moves between 300 lower sets, more than the 1,000 allowed "
                          "(memory); use the approximate DP (solver='approx', exact=False), or a smaller budget")

    monkeypatch.setattr(candidates, "exact_family_size", lambda cg: 10**6)  # the families differ: the other DP is asked
    monkeypatch.setattr(candidates, "predicted_min_budget_bytes_graph", refuses)
    with caplog.at_level(logging.DEBUG, logger="fxplan"):
        plans = candidates._others_smallest_plans(cg, model, solver)
    assert plans  # Chen's plans are still there
    said = [r for r in caplog.records if "smallest plans" in r.getMessage()]
    assert len(said) == 1 and said[0].levelno == level
    text = said[0].getMessage()
    assert f"leave out the {other} DP's smallest plans" in text and "9,000,000 moves" in text
    assert "use the approximate DP" not in text and "solver='approx'" not in text


def test_sizes_and_counts_in_the_log_and_summary_of_a_tiny_model(caplog):
    with caplog.at_level(logging.INFO, logger="fxplan"):
        plan = fxplan.plan(_mlp(), (_x(),), budget_gb=1.5)
    info = _info(caplog)
    assert plan.num_segments == 1
    assert "fxplan: 1 segment," in info and "1 segments" not in info
    assert "measured peak 161.8 KiB" in info and "0.000 GiB" not in info and "a budget of 1.50 GiB" in info
    text = plan.summary()
    assert "Plan: 1 segment," in text and "161.8 KiB measured" in text and "keeps 0 values" in text
    assert "0.00 GiB" not in text


def test_format_count_and_the_applied_plans_summary():
    assert format_count(1, "segment") == "1 segment" and format_count(0, "segment") == "0 segments"
    assert format_count(2, "child", "children") == "2 children" and format_count(1, "child", "children") == "1 child"
    region = RegionPlan("layers.0", ("aten.mm.default",), (True,))
    applied = AppliedPlan("Net", "(2, 8)", [region], 3 << 20, 5 << 20, None)
    text = applied.summary()
    assert "1 checkpointed module;" in text and "of their 1 op call," in text and "1 of 1 op call saved" in text
    assert "3.0 MiB" in text and "5.0 MiB" in text


def test_a_recompute_share_above_one_forward_pass_says_why():
    """A nested plan recomputes a sub-segment again at each level holding it: the summary says so beside a share
    above 100%, and says nothing beside one below."""
    plan = fxplan.plan(_mlp(), (_x(),), budget_gb=1.5)
    below = replace(plan, recompute_fraction=0.5)
    assert "recomputed more than once" not in below.summary()
    nested = replace(plan, recompute_fraction=2.546, early_stop_fraction=0.0, children={"0": below})
    line = next(ln for ln in nested.summary().splitlines() if "recomputed in backward:" in ln)
    assert "254.6% of one forward pass (values recomputed more than once: nested plan" in line


def test_the_log_and_the_summary_count_recomputed_values_alike(caplog):
    """The graph with every unit of recomputed inputs is logged with the count and name that the summary of a plan
    on that graph uses: the distinct cheap values dropped, not the units holding them."""
    model, x = _mlp(), _x()
    searches = Searches(trace(model, (x,), probe_units=True), model, (x,), solver="approx")
    with caplog.at_level(logging.INFO, logger="fxplan"):
        variant = searches.with_regions()
    assert variant is not None
    first = next(variant.search.by_recompute(True))
    variant.search.measure(first)
    plan = variant.result(first, None).fxplan_plan
    phrase = regions_recomputed(plan.regions)
    assert phrase.endswith("cheap values") and int(phrase.split()[0]) >= 2
    assert f"made the graph with {phrase} recomputed in backward" in _info(caplog)
    assert f"  {phrase} (" in plan.summary()
    assert "regions" not in _info(caplog)


def _tiny_entry(monkeypatch):
    """The command line's model loading, answering with the tiny MLP (the zoo's smallest take seconds)."""
    model, x = _mlp(), _x()
    monkeypatch.setattr(cli, "load_model", lambda *a, **k: (types.SimpleNamespace(loss=None), model, (x,)))
    return model, x


def test_a_budget_above_the_unplanned_peak_is_said_by_the_api_and_the_command_line(monkeypatch, capsys, caplog):
    _tiny_entry(monkeypatch)
    with caplog.at_level(logging.INFO, logger="fxplan"):
        assert cli.main(["plan", "tiny", "--budget-gb", "1.5", "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "Note: the budget of 1.50 GiB is at or above the unplanned peak of one training step (161.8 KiB " in out
    assert "at or above the unplanned peak" in _info(caplog)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="fxplan"):
        fxplan.plan(_mlp(), (_x(),), budget_bytes=160_000)  # below the unplanned peak: nothing to say
    assert "unplanned peak" not in _info(caplog)


def test_a_budget_error_on_the_command_line_names_the_flag_in_gib_rounded_up(monkeypatch, capsys):
    model, x = _tiny_entry(monkeypatch)
    with pytest.raises(BudgetError) as refused:  # the Python API keeps its own advice
        fxplan.rewrite(model, budget_bytes=1000, example_inputs=(x,))
    smallest = refused.value.min_feasible_bytes
    assert f"budget_bytes={smallest} is accepted" in str(refused.value)
    assert cli.main(["plan", "tiny", "--budget-gb", "0.000001", "--quiet"]) == 1
    err = capsys.readouterr().err
    assert "budget_bytes" not in err and "solver=" not in err
    value = err.split("--budget-gb ")[1].split()[0]
    digits = value.lstrip("0.")
    assert len(digits) == 3, value  # 3 significant digits
    assert math.ceil(float(value) * GiB) >= smallest  # rounded up: it fits
    assert float(value) - 10 ** -(len(value.split(".")[1])) < smallest / GiB  # and it is the least that does
    assert cli.main(["plan", "tiny", "--budget-gb", value, "--quiet"]) == 0
    assert cli.budget_gb_at_least(523955952) == "0.488" and cli.budget_gb_at_least(GiB + 1) == "1.01"


def _row(method, **kw):
    return Row("net", method, "fxplan", batch=32, input_size=224, small_batch=4, small_input_size=224, **kw)


def test_the_report_explains_its_columns_and_shares_above_one_forward_pass(tmp_path):
    rows = [_row("vanilla", peak_bytes=8 * GiB, small_peak_bytes=400 << 20, step_seconds=1.0, reduction=0.0,
                 small_reduction=0.0, time_ratio=1.0),
            _row("approx-time", peak_bytes=4 * GiB, small_peak_bytes=250 << 20, step_seconds=1.3, reduction=0.5,
                 small_reduction=0.375, time_ratio=1.3, recompute_fraction=0.87, planned_recompute_fraction=1.18)]
    comparison = Comparison(rows, {}, {"command": "fxplan compare net"})
    cells = detail_rows(rows)[1]
    assert "87%" in cells and "118% (recomputed more than once)" in cells
    assert "87%" in summary_table(comparison)
    write_report(comparison, tmp_path)
    md = (tmp_path / "report.md").read_text()
    legend = md.split("## net")[0]
    header = next(line for line in md.splitlines() if line.startswith("| method | status | peak GiB"))
    for column in header.strip("| ").split(" | "):
        name = column.replace("@batch 32", "@batch B").replace("@batch 4", "@batch b")
        assert f"**{name}**" in legend, name  # every column of the table is in the legend
    measured = next(line for line in legend.splitlines() if line.startswith("- **recompute (measured)**"))
    planned = next(line for line in legend.splitlines() if line.startswith("- **recompute (planned)**"))
    assert "flop_counter" in measured and "matrix products and convolutions only" in measured
    assert "cost model" in planned and "differs from the measured column" in planned
    assert "recomputed more than once" in planned


def test_profile_prints_sizes_in_the_unit_that_fits(monkeypatch, capsys):
    _tiny_entry(monkeypatch)
    assert cli.main(["profile", "tiny", "--quiet", "--top", "1"]) == 0
    out = capsys.readouterr().out
    assert "parameters 65.0 KiB" in out and " GiB" not in out
    peak = next(line for line in out.splitlines() if line.startswith("peak: "))
    assert peak.split()[2] == "KiB", peak


def test_planning_says_every_few_seconds_what_stage_it_is_in(monkeypatch, caplog):
    """Planning a large model takes minutes inside searches that log nothing until they end: a line at INFO, every
    ``HEARTBEAT_S`` seconds, names the model, the seconds so far, the stage and the plans measured; no thread is left
    behind."""
    import threading

    import torchvision

    from fxplan.common import heartbeat

    monkeypatch.setattr(heartbeat, "HEARTBEAT_S", 0.01)
    model = torchvision.models.resnet18()
    x = torch.randn(2, 3, 32, 32)
    with caplog.at_level(logging.INFO, logger="fxplan"):
        fxplan.rewrite(model, example_inputs=(x,))
        fxplan.auto_checkpoint(model, example_inputs=(x,))
    fxplan.remove_checkpoints(model)
    lines = [r.getMessage() for r in caplog.records if " s so far: " in r.getMessage()]
    stages = {line.split(" s so far: ")[1].split(" (")[0] for line in lines}
    assert any(line.startswith("fxplan: planning ResNet, ") for line in lines)
    assert any(line.startswith("fxplan: planning ResNet's modules, ") for line in lines)
    assert "capturing and tracing the model" in stages and "measuring the canonical plans of least peak" in stages
    assert any(line.endswith("measured on fake tensors)") for line in lines)
    assert not [t for t in threading.enumerate() if t.name == "fxplan-heartbeat"]
    assert heartbeat._beats() == []
