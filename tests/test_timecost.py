"""Node time costs in seconds (fxplan.costs.timecost) and the timing helper (fxplan.measure.timing); no wall-clock
asserts."""

from __future__ import annotations

import dataclasses
import platform

import pytest
import torch
import torch.nn as nn
from torch._subclasses.fake_tensor import FakeTensorMode

from fxplan.common import cache
from fxplan.costs import timecost
from fxplan.costs.op_census import NodeCensus
from fxplan.costs.timecost import T_SECONDS, device_speed, op_key
from fxplan.costs.trace import trace
from fxplan.errors import FxplanError
from fxplan.measure import timing
from fxplan.measure.timing import describe_ratio, fixed_threads, quartiles, time_interleaved
from fxplan.solvers.plans import Plan


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(8, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.relu = nn.ReLU()
        self.conv2 = nn.Conv2d(8, 8, 3, padding=1)

    def forward(self, x):
        return torch.flatten(self.conv2(self.relu(self.bn(self.conv1(x)))), 1)


def test_bytes_moved_per_aten_op():
    x = torch.randn(1000)
    with NodeCensus({}) as c:
        torch.relu(x)
    assert (c.ops, c.bytes_moved) == (1, 8000)  # reads 4000 bytes, writes 4000
    with NodeCensus({}) as c:
        x.view(10, 100)
    assert (c.ops, c.bytes_moved) == (1, 0)      # a view moves nothing
    with NodeCensus({}) as c:
        x.relu_()
    assert c.bytes_moved == 8000                 # in place: reads and writes its input
    with FakeTensorMode() as mode, NodeCensus({}) as c:
        mode.from_tensor(x) + 1
    assert c.bytes_moved == 8000                 # counted on fake tensors alike


def test_device_speed_is_measured_once_per_machine(tmp_path, monkeypatch):
    """The figures are read back from the cache file, so every process plans with the same costs."""
    monkeypatch.setenv(cache.CACHE_DIR_ENV, str(tmp_path))
    monkeypatch.setattr(timecost, "_SPEEDS", {})
    measured = device_speed("cpu")
    assert (tmp_path / "device_speed.json").exists()
    planted = timecost.DeviceSpeed("cpu", 1e9, 2e9, 3e-6, measured.threads)
    cache.write_cache({timecost._machine_key(torch.device("cpu")): dataclasses.asdict(planted)}, timecost.SPEEDS_FILE)
    monkeypatch.setattr(timecost, "_SPEEDS", {})  # a new process
    assert device_speed("cpu") == planted


def test_measuring_on_a_new_machine_leaves_the_random_generators_as_they_were(tmp_path, monkeypatch):
    """The benchmark and the op timings of a first use (nothing cached) run on random tensors and random ops: the
    user's next draws are the ones they would have been without fxplan."""
    monkeypatch.setenv(cache.CACHE_DIR_ENV, str(tmp_path))
    monkeypatch.setattr(timecost, "_SPEEDS", {})
    monkeypatch.setattr(timecost, "_MEASURED", {})
    torch.manual_seed(3)
    expected = torch.rand(4)
    torch.manual_seed(3)
    device_speed("cpu")
    timecost.measure_seconds(nn.Dropout(0.5), (torch.empty(64, 64),), {}, torch.device("cpu"))
    assert timecost._MEASURED and torch.equal(torch.rand(4), expected)


def test_slow_op_kinds_are_priced_at_their_own_rate():
    """An op kind the benchmark found slow moves its bytes at its rate; the kinds the benchmark names are the
    ones a trace records (a BatchNorm in training apart from one in evaluation)."""
    speed = timecost.DeviceSpeed("cpu", 1e9, 2e9, 0.0, 1, {"native_batch_norm[True]": 1e8})
    assert speed.seconds(0, 4e8, 0, {"native_batch_norm[True]": 1e8, "relu": 3e8}) == pytest.approx(1.0 + 0.15)
    assert speed.seconds(0, 4e8, 0) == pytest.approx(0.2)
    x = torch.randn(2, 8, 8, 8)
    with NodeCensus({}) as train:
        timecost.SLOW_OP_PROBES["batch norm (training)"](x)()
    with NodeCensus({}) as model_census:
        nn.BatchNorm2d(8).train()(x)
    with NodeCensus({}) as evaluation:
        nn.BatchNorm2d(8).eval()(x)
    for census in (train, model_census):
        assert "native_batch_norm[True]" in census.op_bytes
    assert "native_batch_norm[False]" in evaluation.op_bytes and "native_batch_norm[True]" not in evaluation.op_bytes
    with NodeCensus({}) as pool:
        nn.MaxPool2d(3, 2, 1)(x)
    with NodeCensus({}) as probe:
        timecost.SLOW_OP_PROBES["max pooling"](x)()
    assert set(pool.op_bytes) == set(probe.op_bytes) == {"max_pool2d_with_indices"}


def test_roofline_prices_memory_bound_ops():
    x = torch.randn(4, 8, 16, 16)
    flops = trace(Block(), (x,), cost_model="flops")
    roof = trace(Block(), (x,), cost_model="roofline")
    assert roof.graph["T_seconds"] == T_SECONDS and roof.graph["cost_model"] == "roofline"
    speed = device_speed("cpu")
    for v in roof.nodes:
        assert roof.nodes[v]["T"] * T_SECONDS >= speed.op_seconds  # every node costs at least one op
    # bn and relu are memory-bound: against a conv they cost more than FLOPs say
    for v in ("bn", "relu"):
        assert roof.nodes[v]["T"] / roof.nodes["conv1"]["T"] > flops.nodes[v]["T"] / flops.nodes["conv1"]["T"]
    # a view costs its op, not its bytes: four times the data, the same cost (relu's grows)
    big = trace(Block(), (torch.randn(16, 8, 16, 16),), cost_model="roofline")
    assert big.nodes["flatten"]["T"] == pytest.approx(roof.nodes["flatten"]["T"])
    assert big.nodes["relu"]["T"] > roof.nodes["relu"]["T"]


def test_the_fused_model_prices_a_step_as_inductor_runs_it():
    """Under inductor a BatchNorm and a ReLU run inside the kernels that read them: they cost one op's floor, a
    convolution its FLOPs, whatever the data's size."""
    x = torch.randn(4, 8, 16, 16)
    fused = trace(Block(), (x,), cost_model="fused")
    speed = device_speed("cpu")
    assert fused.graph["cost_model"] == "fused" and fused.graph["T_seconds"] == T_SECONDS
    for v in ("bn", "relu", "flatten"):
        assert fused.nodes[v]["T"] * T_SECONDS == pytest.approx(speed.op_seconds)
    conv = fused.nodes["conv1"]
    assert conv["T"] * T_SECONDS == pytest.approx(max(conv["flops"] / speed.flops_per_s, speed.op_seconds))
    big = trace(Block(), (torch.randn(16, 8, 16, 16),), cost_model="fused")
    assert big.nodes["relu"]["T"] == pytest.approx(fused.nodes["relu"]["T"])


def test_measured_model_leaves_the_model_alone_and_shares_equal_layers():
    torch.manual_seed(0)
    model = Block()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    x = torch.randn(2, 8, 8, 8, requires_grad=True)  # conv1's input records autograd history, as conv2's
    cg = trace(model, (x,), cost_model="measured")
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())  # BN statistics untouched
    assert cg.graph["cost_model"] == "measured" and all(cg.nodes[v]["T"] > 0 for v in cg.nodes)
    assert cg.nodes["conv1"]["T"] == cg.nodes["conv2"]["T"]  # equal layers and shapes: timed once


def test_op_key_tells_shapes_and_modules_apart():
    conv, x = nn.Conv2d(3, 3, 1), torch.randn(1, 3, 4, 4)
    device = torch.device("cpu")
    assert op_key(conv, (x,), {}, device) == op_key(nn.Conv2d(3, 3, 1), (x.clone(),), {}, device)
    assert op_key(conv, (x,), {}, device) != op_key(conv, (torch.randn(2, 3, 4, 4),), {}, device)
    assert op_key(conv, (x,), {}, device) != op_key(nn.Conv2d(3, 3, 1, bias=False), (x,), {}, device)


def test_meta_models_fall_back_to_flops(caplog):
    with torch.device("meta"):
        model = nn.Sequential(nn.Conv2d(8, 8, 3), nn.ReLU())
    cg = trace(model, (torch.randn(2, 8, 8, 8, device="meta"),))
    assert cg.graph["cost_model"] == "flops" and cg.graph["T_seconds"] is None
    assert "cannot time nodes on meta" in caplog.text


def test_unknown_cost_model_is_a_clear_error():
    with pytest.raises(FxplanError, match="cost_model must be one of roofline, measured"):
        trace(Block(), (torch.randn(1, 8, 4, 4),), cost_model="seconds")


def test_plan_reports_predicted_extra_seconds():
    plan = Plan([["a"], ["b"]], [["a"], ["a", "b"]], [["a"], []], 0, [0, 0], 0.0, 0.25, 0.25, None, "time",
                "approx-dp", "autograd", total_T=2e6, segment_T=[5e5, 1.5e6], T_seconds=1e-6)
    assert plan.predicted_extra_seconds == pytest.approx(0.5)
    assert "predicted to add 500 ms to each training step" in plan.summary()
    assert Plan.from_json(plan.to_json()).predicted_extra_seconds == pytest.approx(0.5)
    flops_plan = Plan.from_dict({**plan.to_dict(), "T_seconds": None})
    assert flops_plan.predicted_extra_seconds is None and "predicted to add" not in flops_plan.summary()


# ------------------------------------------------------------------------------------------ timing


def test_interleaved_rounds_give_per_round_ratios():
    clock = iter(range(1, 1000))
    calls: list[str] = []

    def step(name, seconds):
        def run():
            calls.append(name)
            next(clock)
            return seconds
        return run

    timings = time_interleaved({"vanilla": step("vanilla", 1.0), "plan": step("plan", 1.2),
                                "fast": step("fast", 0.9)}, baseline="vanilla", rounds=4, warmup=1)
    assert len(calls) == 15 and calls[:3] == ["vanilla", "plan", "fast"]
    assert calls[3:6] == ["plan", "fast", "vanilla"]  # the order rotates from round to round
    assert timings["plan"].samples == [1.2] * 4 and timings["plan"].ratio == pytest.approx(1.2)
    assert timings["vanilla"].within_noise and not timings["plan"].within_noise
    assert timings["fast"].ratio == pytest.approx(0.9)


def test_a_failing_step_is_dropped_and_kept_as_error():
    def broken():
        raise RuntimeError("boom")

    timings = time_interleaved({"vanilla": lambda: 1.0, "broken": broken}, baseline="vanilla", rounds=2)
    assert isinstance(timings["broken"].error, RuntimeError) and timings["broken"].samples == []
    assert timings["vanilla"].samples == [1.0, 1.0]
    with pytest.raises(FxplanError, match="baseline"):
        time_interleaved({"a": lambda: 1.0}, baseline="vanilla", rounds=1)


def test_ratio_text_never_calls_noise_a_speed_up():
    assert describe_ratio(0.97, 0.9, 1.05) == "0.97x (0.90-1.05), within noise"
    assert describe_ratio(1.2, 1.1, 1.3) == "1.20x (1.10-1.30)"
    assert describe_ratio(None, None, None) == "-"
    assert quartiles([1.0, 2.0]) == (1.0, 2.0) and quartiles([1, 2, 3, 4, 5]) == (2, 4)


def test_timing_makes_the_allocator_steady_first(monkeypatch):
    """Every timed step runs after :func:`fxplan.measure.timing.steady_allocator` (which pins glibc's thresholds)."""
    calls: list[str] = []
    monkeypatch.setattr(timing, "steady_allocator", lambda: calls.append("steady"))
    time_interleaved({"vanilla": lambda: calls.append("step") or 1.0}, baseline="vanilla", rounds=1, warmup=1)
    assert calls == ["steady", "step", "step"]


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="pins glibc's malloc")
def test_steady_allocator_pins_glibc_thresholds():
    assert timing.steady_allocator() is True
    assert timing.steady_allocator() is True  # idempotent


def test_fixed_threads_restores_the_count():
    before = torch.get_num_threads()
    with fixed_threads(1) as n:
        assert n == 1 == torch.get_num_threads()
    assert torch.get_num_threads() == before
    with pytest.raises(FxplanError), fixed_threads(0):
        pass


def test_batch_for_step_doubles_until_a_step_is_long_enough():
    from fxplan.measure.timing import batch_for_step

    asked: list[int] = []

    def step_at(batch):
        asked.append(batch)
        return 0.1 * batch

    assert batch_for_step(step_at, 4, most=64) == (8, pytest.approx(0.8))
    assert asked == [4, 4, 8, 8]  # each batch warmed up once, then timed
    assert batch_for_step(lambda b: 0.01, 4, most=20)[0] == 20  # capped: the caller warns
