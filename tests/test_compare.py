"""fxplan compare: peers, rows, failures that become rows, the CLI handler (tiny networks, CPU)."""

from __future__ import annotations

import json
import math
import time

import pytest
import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils.checkpoint import checkpoint

import fxplan
from fxplan import cli
from fxplan.compare import peers
from fxplan.compare.driver import compare_network
from fxplan.compare.methods import Context, Method, MethodTimeout, Prepared, default_methods, select_methods, time_limit


class TinyChain(nn.Module):
    """A chain of top-level children with a functional flatten in between (checkpoint_sequential fits)."""

    def __init__(self):
        super().__init__()
        self.c1 = nn.Conv2d(3, 8, 3, padding=1)
        self.b1 = nn.BatchNorm2d(8)
        self.r1 = nn.ReLU()
        self.c2 = nn.Conv2d(8, 8, 3, padding=1)
        self.r2 = nn.ReLU()
        self.c3 = nn.Conv2d(8, 8, 3, padding=1)
        self.r3 = nn.ReLU()
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(8, 10)

    def forward(self, x):
        x = self.r1(self.b1(self.c1(x)))
        x = self.r3(self.c3(self.r2(self.c2(x))))
        return self.fc(torch.flatten(self.pool(x), 1))


class TinySkip(nn.Module):
    def __init__(self):
        super().__init__()
        self.c1 = nn.Conv2d(3, 4, 3, padding=1)
        self.c2 = nn.Conv2d(4, 4, 3, padding=1)

    def forward(self, x):
        y = self.c1(x)
        return self.c2(y) + y


def loss(out):
    return out.square().mean()


def inputs(batch, size):
    return (torch.randn(batch, 3, size, size),)


class _HalfCheckpointed(nn.Module):
    """Test-only stand-in for an fxplan plan: the first half of the chain recomputed."""

    def __init__(self, model):
        super().__init__()
        self.chain = peers.as_sequential(model)

    def forward(self, x):
        half = len(self.chain) // 2
        x = checkpoint(self.chain[:half], x, use_reentrant=False)
        return self.chain[half:](x)


def _stub_plan(ctx):
    return Prepared(_HalfCheckpointed(ctx.model), {"budget": "stub", "planned_recompute_fraction": 0.5})


def _broken(ctx):
    raise RuntimeError("boom: this method cannot handle the model")


def _slow(ctx):
    with time_limit(ctx.time_limit):
        time.sleep(30)
    raise AssertionError("the time limit did not fire")


class _Crashes(nn.Module):
    def forward(self, x):
        raise RuntimeError("crash in forward")


def _crashing(ctx):
    return Prepared(_Crashes())


@pytest.fixture(scope="module")
def rows():
    torch.manual_seed(0)
    methods = [m for m in default_methods(compile_budgets=(0.5,), curve_points=())
               if m.name in ("vanilla", "checkpoint_sequential", "torch.compile@0.5")]
    methods += [Method("stub-plan", "fxplan", _stub_plan), Method("broken", "fxplan", _broken),
                Method("slow", "fxplan", _slow), Method("crashing", "fxplan", _crashing)]
    rows, timelines = compare_network("tiny", TinyChain(), loss, inputs, batch=16, input_size=32, small_batch=4,
                                      small_input_size=32, methods=methods, repeats=2, time_limit_s=0.5)
    return {r.method: r for r in rows}, timelines


def test_every_method_has_a_row_in_order(rows):
    by, _ = rows
    assert list(by) == ["vanilla", "checkpoint_sequential", "torch.compile@0.5", "stub-plan", "broken", "slow",
                        "crashing"]
    assert by["vanilla"].status == "ok" and by["vanilla"].reduction == 0.0 and by["vanilla"].time_ratio == 1.0


def test_numbers_are_consistent_with_vanilla(rows):
    by, _ = rows
    v = by["vanilla"]
    for r in by.values():
        if r.peak_bytes is not None:
            assert math.isclose(r.reduction, 1 - r.peak_bytes / v.peak_bytes)
        if r.small_peak_bytes is not None:
            assert math.isclose(r.small_reduction, 1 - r.small_peak_bytes / v.small_peak_bytes)
        if r.step_seconds is not None:  # the median of per-round ratios, inside its own range
            assert r.ratio_low <= r.time_ratio <= r.ratio_high


def test_recomputation_lowers_the_peak_and_is_counted(rows):
    by, _ = rows
    for name in ("checkpoint_sequential", "stub-plan"):
        r = by[name]
        assert r.status == "ok", r.note
        assert r.peak_bytes < by["vanilla"].peak_bytes
        assert 0 < r.recompute_fraction < 1
    assert by["vanilla"].recompute_fraction == 0
    assert by["checkpoint_sequential"].segments == round(math.sqrt(9))


def test_compiled_peer_is_measured_at_the_small_batch_only(rows):
    by, _ = rows
    r = by["torch.compile@0.5"]
    assert r.status == "ok", r.note
    assert r.peak_bytes is None and r.small_peak_bytes > 0 and r.time_ratio is not None
    assert "small batch" in r.note


def test_failures_become_rows_that_say_why(rows):
    by, _ = rows
    assert by["broken"].status == "error" and "boom" in by["broken"].note
    assert by["slow"].status == "timed out" and "0.5 s" in by["slow"].note
    assert by["crashing"].status == "crashed" and "crash in forward" in by["crashing"].note
    for name in ("broken", "slow", "crashing"):
        assert by[name].peak_bytes is None and by[name].time_ratio is None


def test_timeline_of_vanilla_is_recorded(rows):
    _, timelines = rows
    tl = timelines["vanilla"]
    assert len(tl) > 10 and all(b >= 0 for _, b in tl)


def test_as_sequential_matches_forward():
    torch.manual_seed(0)
    model = TinyChain().eval()
    seq = peers.as_sequential(model).eval()
    x = torch.randn(2, 3, 8, 8)
    torch.testing.assert_close(seq(x), model(x))
    assert len(seq) == 10  # 9 children + torch.flatten


def test_as_sequential_flattens_nested_sequentials():
    model = nn.Sequential(nn.Linear(4, 4), nn.Sequential(nn.ReLU(), nn.Linear(4, 2)))
    assert len(peers.as_sequential(model)) == 3


def test_skip_connection_is_not_applicable():
    with pytest.raises(peers.NotApplicable, match="not a chain"):
        peers.checkpoint_sequential_peer(TinySkip())


def test_time_limit_interrupts():
    with pytest.raises(MethodTimeout, match="timed out after 0.2 s"):
        with time_limit(0.2):
            time.sleep(10)


def test_parser_registers_compare():
    args = cli.build_parser().parse_args(["compare", "resnet50", "vgg19", "--batch-size", "8", "--out", "d",
                                          "--methods", "approx-time,torch.compile", "--compile-budgets", "0.5"])
    assert args.models == ["resnet50", "vgg19"] and args.batch_size == 8 and args.out == "d"
    assert args.methods == ["approx-time", "torch.compile"] and args.compile_budgets == (0.5,)
    assert args.func is cli.cmd_compare
    assert cli.compare_command_line(args) == ("fxplan compare resnet50 vgg19 --batch-size 8 --out d "
                                              "--methods approx-time,torch.compile --compile-budgets 0.5")


def test_select_methods_keeps_vanilla_first_and_expands_series():
    methods = default_methods(compile_budgets=(0.5, 0.25), curve_points=(0.5,))
    chosen = [m.name for m in select_methods(methods, ["torch.compile", "approx-time@0.5"])]
    assert chosen == ["vanilla", "torch.compile@0.5", "torch.compile@0.25", "approx-time@0.5"]
    with pytest.raises(fxplan.FxplanError, match="'nosuch'.*valid methods: vanilla"):
        select_methods(methods, ["approx-time", "nosuch"])


def _tiny_entry(monkeypatch):
    from models_zoo import lookup
    from models_zoo.entry import ZooEntry

    tiny = ZooEntry("tiny", 8, 16, None, "test chain", TinyChain, loss)
    real = lookup.resolve
    monkeypatch.setattr(lookup, "resolve", lambda name: tiny if name == "tiny" else real(name))


def test_cli_handler_writes_the_report(tmp_path, monkeypatch, capsys):
    _tiny_entry(monkeypatch)
    code = cli.main(["compare", "tiny", "--out", str(tmp_path), "--compile-budgets", "", "--curve-points", "",
                     "--no-exact", "--repeats", "1", "--quiet"])
    assert code == 0
    doc = json.loads((tmp_path / "report.json").read_text())
    methods = {r["method"]: r for r in doc["rows"]}
    assert {"vanilla", "checkpoint_sequential", "chen", "approx-time", "approx-memory"} <= set(methods)
    assert methods["hf-checkpointing"]["status"] == "not applicable"
    assert doc["meta"]["command"] == (f"fxplan compare tiny --out {tmp_path} --repeats 1 --compile-budgets '' "
                                      "--curve-points '' --no-exact")
    for name in ("report.md", "report.html"):
        assert (tmp_path / name).exists()
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        pass
    else:
        assert (tmp_path / "tradeoff-tiny.png").exists()
    assert "checkpoint_sequential" in capsys.readouterr().out


def test_unknown_name_fails_before_any_work(tmp_path, monkeypatch, capsys):
    """`compare tiny nosuch` must not measure tiny first."""
    _tiny_entry(monkeypatch)
    monkeypatch.setattr("fxplan.compare.driver.compare_network", lambda *a, **k: pytest.fail("work started"))
    assert cli.main(["compare", "tiny", "nosuch", "--out", str(tmp_path / "r"), "--quiet"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "unknown model 'nosuch'" in err
    assert not (tmp_path / "r").exists()
    assert cli.main(["compare", "tiny", "--methods", "approx-tim", "--out", str(tmp_path / "r"), "--quiet"]) == 1
    assert "unknown method 'approx-tim'" in capsys.readouterr().err


def test_only_requested_method_failing_is_a_nonzero_exit(tmp_path, monkeypatch, capsys):
    _tiny_entry(monkeypatch)
    args = ["compare", "tiny", "--out", str(tmp_path), "--repeats", "1", "--quiet"]
    assert cli.main([*args, "--methods", "hf-checkpointing"]) == 1  # not a transformers model
    assert "hf-checkpointing did not work on tiny" in capsys.readouterr().err
    assert cli.main([*args, "--methods", "checkpoint_sequential"]) == 0


def test_fake_only_network_is_measured_on_fake_tensors_only():
    """A model built on the meta device: main-batch peaks only; torch.compile cannot apply."""
    with torch.device("meta"):
        model = TinyChain()
    methods = [m for m in default_methods(compile_budgets=(0.5,), curve_points=())
               if m.name in ("vanilla", "checkpoint_sequential", "torch.compile@0.5")]
    rows, _ = compare_network("meta", model, loss, lambda b, s: (torch.randn(b, 3, s, s, device="meta"),),
                              batch=16, input_size=32, small_batch=2, small_input_size=16, methods=methods,
                              real_steps=False)
    by = {r.method: r for r in rows}
    assert by["vanilla"].status == "ok" and by["vanilla"].peak_bytes > 0 and by["vanilla"].small_batch == 0
    assert by["checkpoint_sequential"].peak_bytes < by["vanilla"].peak_bytes
    assert by["checkpoint_sequential"].step_seconds is None and by["checkpoint_sequential"].small_peak_bytes is None
    assert by["torch.compile@0.5"].status == "not applicable"


def test_fxplan_rows_use_the_real_planner():
    methods = [m for m in default_methods(compile_budgets=(), curve_points=(0.5,))
               if m.name in ("vanilla", "approx-time", "approx-time@0.5")]
    rows, _ = compare_network("tiny", TinyChain(), loss, inputs, batch=16, input_size=32, small_batch=2,
                              small_input_size=16, methods=methods, repeats=1)
    by = {r.method: r for r in rows}
    for name in ("approx-time", "approx-time@0.5"):
        r = by[name]
        assert r.status == "ok", r.note
        assert r.predicted_peak_bytes and r.segments and r.plan_seconds is not None
        assert math.isclose(r.reduction, 1 - r.peak_bytes / by["vanilla"].peak_bytes)
    assert not by["approx-time@0.5"].main


def test_export_captured_model_real_steps_run_a_plan_for_the_small_batch():
    """A graph torch.export captured is specialised to the main batch's shapes: the real steps at the
    small batch must run a plan made for that batch, not the original forward reported as fxplan's."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=64, n_positions=32)
    model = transformers.GPT2LMHeadModel(config)
    lm_loss = lambda out: out.logits.float().pow(2).mean()  # noqa: E731
    main, small = (torch.randint(0, 64, (4, 16)),), (torch.randint(0, 64, (2, 8)),)
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fake_main = tuple(mode.from_tensor(x) for x in main)
    ctx = Context("gpt2", model, lm_loss, fake_main, small, torch.device("cpu"), None)
    (method,) = [m for m in default_methods(compile_budgets=(), curve_points=()) if m.name == "approx-memory"]
    prepared = method.prepare(ctx)
    assert prepared.module.unplanned_reason(*small) is not None
    assert prepared.real_module is not None and prepared.real_module.unplanned_reason(*small) is None
    assert "small batch" in prepared.info["note"]


def test_auto_checkpoint_has_a_row_beside_the_rewrite():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=256, n_positions=32, use_cache=False)
    model = transformers.GPT2LMHeadModel(config)
    lm_loss = lambda out: out.logits.float().pow(2).mean()  # noqa: E731
    make = lambda batch, size: (torch.randint(0, 256, (batch, size or 16)),)  # noqa: E731
    methods = select_methods(default_methods(compile_budgets=(), curve_points=()), ["auto-checkpoint"])
    rows, _ = compare_network("gpt2", model, lm_loss, make, batch=8, input_size=32, small_batch=2,
                              small_input_size=32, methods=methods, repeats=1, timeline=False)
    by = {r.method: r for r in rows}
    assert by["auto-checkpoint"].status == "ok", by["auto-checkpoint"].note
    assert by["auto-checkpoint"].peak_bytes < by["vanilla"].peak_bytes
    assert "checkpointed modules" in by["auto-checkpoint"].note
    assert not hasattr(model, "fxplan_plan")  # planned on a copy: the model compared stays unplanned
