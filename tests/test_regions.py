"""Recomputed regions (``fxplan.capture.regions``): which chains are matched, that the graph with them computes
the same bits as the model (outputs, gradients, buffers; train, eval, no grad), that the replay and the
meter agree on it, and that ``fxplan.rewrite`` chooses between the graph with and without them as
``fxplan.planner.variants`` says."""

from __future__ import annotations

import copy
import io

import pytest
import torch
import torch.nn.functional as F
import torchvision
from torch import nn

import fxplan
from fxplan.capture.capturers import capture
from fxplan.capture.regions import find_regions, with_regions
from fxplan.costs import timecost
from fxplan.costs.trace import trace
from fxplan.errors import BudgetError, FxplanError
from fxplan.measure.meter import measure_step
from fxplan.planner.replay import replay
from fxplan.planner.step_model import step_model
from fxplan.planner.variants import Searches
from fxplan.rewriter.codegen import segment_module
from fxplan.solvers.plans import Plan

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def small_densenet() -> nn.Module:
    torch.manual_seed(0)
    return torchvision.models.DenseNet(growth_rate=8, block_config=(2, 2), num_init_features=16, bn_size=2)


class WritesAnInputLater(nn.Module):
    """A concatenation's input overwritten in place after the region: the model's BatchNorm kept the
    concatenation, so the step runs; a region keeping the input would not."""

    def __init__(self):
        super().__init__()
        self.conv0, self.bn, self.conv = nn.Conv2d(3, 4, 1), nn.BatchNorm2d(8), nn.Conv2d(8, 4, 1)

    def forward(self, x):
        a = self.conv0(x)
        b = self.conv(F.relu(self.bn(torch.cat([a, a * 2], 1))))
        a.relu_()
        return b + a


class PreActivation(nn.Module):
    """Regions of every supported shape: functional ReLU, a convolution with bias, BatchNorm without
    running statistics or affine parameters, Conv1d, and chains that must not match."""

    def __init__(self):
        super().__init__()
        self.bn1, self.conv1 = nn.BatchNorm2d(3), nn.Conv2d(3, 6, 3, padding=1, bias=True)
        self.bn2, self.conv2 = nn.BatchNorm2d(9, track_running_stats=False), nn.Conv2d(9, 4, 1, bias=False)
        self.bn3, self.conv3 = nn.BatchNorm1d(4, affine=False), nn.Conv1d(4, 4, 3, stride=2)
        self.bn4, self.relu4, self.conv4 = nn.BatchNorm2d(4), nn.ReLU(), nn.Conv2d(4, 4, 1)
        self.hooked_bn, self.hooked_conv = nn.BatchNorm2d(4), nn.Conv2d(4, 4, 1)
        self.hooked_conv.register_forward_hook(lambda module, args, out: None)

    def forward(self, x):
        a = self.conv1(F.relu(self.bn1(x)))                              # region
        b = self.conv2(torch.relu(self.bn2(torch.cat([x, a], dim=1))))   # region with its concatenation
        c = self.conv3(F.relu(self.bn3(b.flatten(2))))                   # Conv1d region
        d = self.relu4(self.bn4(b))
        e = self.conv4(d) + d                                            # d has another reader: no region
        f = self.hooked_conv(F.relu(self.hooked_bn(e)))                  # a hooked module: no region
        return c.sum() + f.mean()


def step(model, x):
    model.zero_grad(set_to_none=True)
    y = model(x)
    (y if y.dim() == 0 else y.square().mean()).backward()
    return y


def assert_same_step(model, other, x, steps=2):
    """``steps`` training steps of both from the same state give the same bits everywhere."""
    for _ in range(steps):
        y, z = step(model, x), step(other, x)
        assert torch.equal(y, z)
        for (name, p), q in zip(model.named_parameters(), other.parameters()):
            assert (p.grad is None and q.grad is None) or torch.equal(p.grad, q.grad), name
        for (name, b), c in zip(model.named_buffers(), other.buffers()):
            assert torch.equal(b, c), name


def regions_module(model, x):
    captured = capture(model, (x,))
    return with_regions(captured, find_regions(captured.gm)).gm


def test_matches_the_supported_chains_only():
    model = PreActivation()
    regions = find_regions(capture(model, (torch.randn(2, 3, 8, 8),)).gm)
    assert [r.conv for r in regions] == ["conv1", "conv2", "conv3"]
    assert [r.cat is not None for r in regions] == [False, True, False]
    densenet = find_regions(capture(small_densenet(), (torch.randn(2, 3, 32, 32),)).gm)
    assert len(densenet) == 9  # two convolutions per dense layer, one per transition
    x = torch.randn(2, 3, 8, 8)
    assert find_regions(capture(WritesAnInputLater(), (x,)).gm) == []
    model = WritesAnInputLater()
    step(model, x)  # the model itself trains
    assert_same_step(copy.deepcopy(model), fxplan.rewrite(model, example_inputs=(x,)), x)


@pytest.mark.parametrize("make,shape", [(small_densenet, (2, 3, 32, 32)), (PreActivation, (2, 3, 8, 8))])
def test_the_graph_with_regions_computes_the_same_bits(make, shape):
    model = make()
    x = torch.randn(*shape)
    reference = copy.deepcopy(model)
    regions = regions_module(model, x)
    assert list(regions.state_dict()) == list(reference.state_dict())
    assert_same_step(reference, regions, x)
    # eval mode, with gradients (running statistics used, and saved) and without
    reference.eval()
    regions.eval()
    assert_same_step(reference, regions, x, steps=1)
    with torch.no_grad():
        assert torch.equal(reference(x), regions(x))


def test_copies_saved_modules_and_autocast():
    """A module with regions deep-copies and saves like any GraphModule; under autocast a region runs as the
    plain chain, so it computes what the model does there too."""
    model = small_densenet()
    x = torch.randn(2, 3, 32, 32)
    regions = regions_module(model, x)
    assert_same_step(copy.deepcopy(model), copy.deepcopy(regions), x)
    buffer = io.BytesIO()
    torch.save(regions, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    assert_same_step(copy.deepcopy(model), loaded, x)
    reference = copy.deepcopy(model)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert_same_step(reference, regions, x, steps=1)


def test_frozen_parameters_and_inputs_that_need_gradients():
    model = small_densenet()
    for module in model.modules():
        if isinstance(module, nn.BatchNorm2d):
            module.requires_grad_(False)
    x = torch.randn(2, 3, 32, 32)
    reference = copy.deepcopy(model)
    regions = regions_module(model, x)
    assert_same_step(reference, regions, x, steps=1)
    xs = [x.clone().requires_grad_(), x.clone().requires_grad_()]
    assert torch.equal(step(reference, xs[0]), step(regions, xs[1]))
    assert torch.equal(xs[0].grad, xs[1].grad)


def test_gradients_of_gradients_are_the_models():
    """Under ``create_graph=True`` the region differentiates its recomputed chain: second derivatives equal
    the model's up to the order of floating-point sums (float64 here; first derivatives stay bit-exact)."""
    model = small_densenet().double()
    x = torch.randn(2, 3, 32, 32, dtype=torch.float64)
    reference = copy.deepcopy(model)
    regions = regions_module(model, x)
    results = []
    for m in (reference, regions):
        grads = torch.autograd.grad(m(x).square().sum(), list(m.parameters()), create_graph=True)
        results.append((grads, torch.autograd.grad(sum(g.square().sum() for g in grads), list(m.parameters()))))
    for g, h in zip(results[0][0], results[1][0]):
        assert torch.equal(g, h)
    for g, h in zip(results[0][1], results[1][1]):
        torch.testing.assert_close(g, h, rtol=1e-8, atol=1e-9 * g.abs().max().item())


def test_the_replay_counts_what_a_region_keeps_and_its_weights_gradients():
    model = small_densenet().train()
    x = torch.randn(2, 3, 32, 32)
    captured = capture(model, (x,))
    cg = trace(model, (x,), captured=with_regions(captured, find_regions(captured.gm)))
    names = list(cg.nodes)
    a, b = len(names) // 3, 2 * len(names) // 3
    for segments in ([names], [names[:a], names[a:]], [names[:a], names[a:b], names[b:]]):
        predicted = replay(cg, step_model(cg, model, (x,)), segments).peak_bytes
        module = segment_module(cg.graph["gm"], segments)
        measured = measure_step(module, (x,), fake=True).peak_bytes
        assert abs(predicted - measured) <= 0.01 * measured, (len(segments), predicted, measured)


#: A quiet benchmark of the 2-core CPU at one thread (device_speed.json, 2026-11-25): which graph costs less
#: turns on the BatchNorm and concatenation rates, which a machine under load measures up to 30% lower.
QUIET_CPU = timecost.DeviceSpeed(
    device="cpu", flops_per_s=1.539e11, bytes_per_s=2.580e10, op_seconds=1.558e-6, threads=1,
    op_bytes_per_s={"native_batch_norm[True]": 4.048e9, "max_pool2d_with_indices": 9.024e8, "avg_pool2d": 2.453e9,
                    "cat": 4.972e9, "native_layer_norm": 9.843e9, "_softmax[False]": 1.174e10, "gelu": 1.197e10})


def test_rewrite_chooses_the_cheaper_graph_and_stays_exact(monkeypatch):
    monkeypatch.setitem(timecost._SPEEDS, timecost._machine_key(torch.device("cpu")), QUIET_CPU)
    torch.manual_seed(0)  # one dense block of six layers: long concatenations, where regions pay
    model = torchvision.models.DenseNet(growth_rate=8, block_config=(6,), num_init_features=16, bn_size=2).train()
    x = torch.randn(4, 3, 64, 64)
    searches = Searches(trace(model, (x,)), model, (x,), solver="approx")
    vanilla = measure_step(model, (x,), fake=True).peak_bytes
    regions = searches.with_regions()
    lowest = searches.lowest()
    assert lowest == min(v.search.lowest().measured for v in searches.variants)
    assert fxplan.min_budget_bytes(model, (x,)) == lowest
    only_regions = regions.search.measure(next(regions.search.walk()))  # every region, no segment
    chose_regions = False
    for budget in (None, lowest, only_regions, (lowest + vanilla) // 2, vanilla):
        reference = copy.deepcopy(model)
        module = fxplan.rewrite(model, budget_bytes=budget, example_inputs=(x,)) if budget else \
            fxplan.rewrite(model, example_inputs=(x,))
        plan = module.fxplan_plan
        assert budget is None or plan.measured_peak_bytes <= budget
        # the plan is the cheaper of the two searches' choices for this budget: their canonical plans first
        canonical = [variant.recomputed_T(c) for variant in searches.variants if budget is not None
                     for c in [variant.search.least_recompute(budget)] if c is not None]
        costs = []
        for variant in searches.variants if not canonical else []:
            try:
                chosen = variant.search.choose(budget, "time")
            except BudgetError:
                continue
            if budget is None and chosen.measured > lowest * 1.001:
                continue
            costs.append(variant.recomputed_T(chosen))
        assert plan.recompute_fraction * plan.total_T == pytest.approx(min(canonical or costs), rel=1e-9)
        assert bool(plan.regions) == (plan.region_recompute_fraction > 0)
        if plan.regions:
            chose_regions = True
            assert plan.regions == [r.conv for r in regions.regions]
            assert "the BatchNorm and ReLU in front of" in plan.summary() and " output (" in plan.summary()
        assert_same_step(reference, module, x, steps=1)
        model = reference
        model.zero_grad(set_to_none=True)  # the peaks above are of a model without .grad
    assert chose_regions
    with pytest.raises(BudgetError) as error:
        fxplan.rewrite(model, budget_bytes=lowest - 1, example_inputs=(x,))
    assert error.value.min_feasible_bytes == lowest


def test_a_plan_with_regions_runs_again_from_json():
    model = small_densenet().train()
    x = torch.randn(4, 3, 64, 64)
    variant = Searches(trace(model, (x,)), model, (x,), solver="approx").with_regions()
    planned = variant.result(variant.search.choose(None, "time"), None)
    plan = planned.fxplan_plan
    assert plan.regions and plan.region_recompute_fraction > 0
    again = fxplan.rewrite(model, plan=Plan.from_json(plan.to_json()), example_inputs=(x,))
    assert again.code == planned.code
    assert again.fxplan_measured_peak_bytes == plan.measured_peak_bytes
    assert fxplan.rewrite(model, plan=plan).code == planned.code  # without inputs: symbolic_trace
    assert_same_step(copy.deepcopy(model), again, x)
    buffer = io.BytesIO()
    torch.save(again, buffer)  # segments over regions: both are traced again on loading
    buffer.seek(0)
    assert_same_step(copy.deepcopy(model), torch.load(buffer, weights_only=False), x)
    with pytest.raises(FxplanError, match="no recomputed region"):
        fxplan.rewrite(model, plan=Plan.from_dict({**plan.to_dict(), "regions": ["features_conv0"]}))


def test_a_failure_with_regions_leaves_the_captured_graphs_answer(caplog):
    model = small_densenet().train()
    x = torch.randn(4, 3, 64, 64)
    searches = Searches(trace(model, (x,)), model, (x,), solver="approx")
    regions = searches.with_regions()

    def broken(*args, **kwargs):
        raise RuntimeError("a model the regions do not suit")

    regions.search.choose = broken
    plain = searches.plain.search.choose(None, "time")
    with caplog.at_level("WARNING", logger="fxplan"):
        chosen = searches.choose(None, "time")
    assert chosen.variant is searches.plain and chosen.candidate is plain
    assert "planning with recomputed regions failed (RuntimeError: a model the regions do not suit)" in caplog.text
    assert searches.with_regions() is None and searches.variants == [searches.plain]
