"""The command line: zoo listing, profile and plan output, model names, argument errors before any work."""

import subprocess
import sys
from pathlib import Path

import pytest

from fxplan import cli
from fxplan.cli import main
from fxplan.common.console import format_table

ROOT = Path(__file__).resolve().parents[1]


def test_zoo_lists_every_network(capsys):
    import models_zoo

    assert main(["zoo"]) == 0
    out = capsys.readouterr().out
    for name in models_zoo.names():
        assert name in out
    assert "seq 1024" in out and "hf:NAME" in out


def test_profile_prints_nodes_and_breakdown(capsys):
    assert main(["profile", "vgg19", "--batch-size", "2", "--input-size", "64", "--quiet", "--top", "3"]) == 0
    out = capsys.readouterr().out
    assert "46 compute nodes" in out
    assert "largest outputs" in out and "most expensive" in out
    for category in ("parameters", "activations", "gradients", "peak"):
        assert category in out


def test_profile_accepts_a_torchvision_builder_name(capsys):
    assert main(["profile", "mobilenet_v2", "--batch-size", "2", "--input-size", "32", "--quiet", "--top", "1"]) == 0
    assert "mobilenet_v2: input 2x3x32x32" in capsys.readouterr().out


def test_unknown_model_is_one_clean_error_line(capsys):
    assert main(["profile", "no-such-net", "--quiet"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no-such-net" in err and "resnet50" in err


@pytest.mark.parametrize("name, message", [
    ("timm:no_such_model", "unknown timm model"), ("hf:NoSuchConfig", "unknown Hugging Face model"),
    ("fasterrcnn_resnet50_fpn", "detection model"),
])
def test_other_unknown_or_unsupported_names(name, message, capsys):
    pytest.importorskip("timm" if name.startswith("timm:") else "transformers")
    assert main(["plan", name, "--quiet"]) == 1
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["profile", "vgg19", "--batch-size", "0"], "--batch-size: must be a positive integer"),
    (["plan", "vgg19", "--budget-gb", "nan"], "--budget-gb: must be a positive, finite number of GiB"),
    (["plan", "vgg19", "--budget-gb", "inf"], "--budget-gb: must be a positive, finite number of GiB"),
    (["plan", "vgg19", "--budget-gb", "-1"], "--budget-gb: must be a positive, finite number of GiB"),
    (["compare", "vgg19", "--compile-budgets", "0.5,nan"], "--compile-budgets: must be comma-separated numbers"),
    (["compare", "vgg19", "--curve-points", "2"], "--curve-points: must be comma-separated numbers between 0 and 1"),
    (["compare", "vgg19", "--time-limit", "inf"], "--time-limit: must be a finite number of seconds"),
])
def test_bad_numbers_are_rejected_while_parsing(argv, message, capsys, monkeypatch):
    """Argument errors exit 2 before any model is resolved or built."""
    monkeypatch.setattr(cli, "load_model", lambda *a, **k: pytest.fail("work started"))
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    assert message in capsys.readouterr().err


def test_plan_gives_the_rewrite_answer_with_the_measured_peak(capsys, tmp_path):
    import fxplan
    import models_zoo
    from fxplan.solvers.plans import Plan

    out_json = tmp_path / "plan.json"
    # resnet50 at batch 16, 64²: vanilla 0.270 GiB, smallest plan 0.221 GiB measured
    argv = ["plan", "resnet50", "--batch-size", "16", "--input-size", "64", "--budget-gb", "0.24", "--quiet"]
    assert main([*argv, "--json", str(out_json)]) == 0
    text = capsys.readouterr().out
    assert "measured" in text and "equation (1)" not in text and "T=" not in text
    plan = Plan.from_json(out_json.read_text())
    entry = models_zoo.get("resnet50")
    direct = fxplan.rewrite(entry.build(), 0.24, example_inputs=entry.example_inputs(16, 64), loss_fn=entry.loss)
    assert plan.segments == direct.fxplan_plan.segments and len(plan.segments) > 1
    assert plan.measured_peak_bytes == direct.fxplan_measured_peak_bytes <= 0.24 * 2**30


def test_python_dash_m_entry_point():
    out = subprocess.run([sys.executable, "-m", "fxplan", "--help"], capture_output=True, text=True, check=True)
    assert "profile" in out.stdout


def test_format_table_aligns_numbers_right_and_text_left():
    text = format_table(("name", "n"), [("a", 1), ("bbb", 22)])
    assert text.splitlines() == ["name   n", "----  --", "a      1", "bbb   22"]


@pytest.mark.parametrize("argv, message", [
    ([], "usage: check_meter.py"), (["nosuch"], "unknown model 'nosuch'"),
    (["vgg19", "zero"], "must be a positive integer"),
])
def test_check_meter_usage_errors(argv, message):
    run = subprocess.run([sys.executable, str(ROOT / "scripts" / "check_meter.py"), *argv], capture_output=True,
                         text=True, cwd=ROOT, env={"PYTHONPATH": str(ROOT), "PATH": ""})
    assert run.returncode == 2 and message in run.stderr and "Traceback" not in run.stderr
