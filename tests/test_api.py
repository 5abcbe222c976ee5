"""The public planning API: fxplan.plan, fxplan.min_budget_bytes, fxplan.rewrite and budget fidelity."""

import copy
import io
import logging
import re

import pytest
import torch
import torchvision
from torch._subclasses.fake_tensor import FakeTensorMode

import fxplan
from fxplan import BudgetError, FxplanError
from fxplan.measure.meter import measure_step

GiB = 1024**3


@pytest.fixture(scope="module")
def resnet():
    torch.manual_seed(0)
    return torchvision.models.resnet18(weights=None).train()


@pytest.fixture(scope="module")
def fake_batch():
    with FakeTensorMode():
        return (torch.randn(64, 3, 224, 224),)


@pytest.fixture(scope="module")
def vanilla_peak(resnet, fake_batch):
    return measure_step(resnet, fake_batch, fake=True).peak_bytes


@pytest.mark.parametrize("fraction", [0.8, 0.7])
def test_rewrite_fits_the_budget_when_measured(resnet, fake_batch, vanilla_peak, fraction):
    budget = fraction * vanilla_peak
    optimized = fxplan.rewrite(resnet, budget / GiB, example_inputs=fake_batch)
    measured = measure_step(optimized, fake_batch, fake=True).peak_bytes
    assert measured <= budget
    assert optimized.fxplan_measured_peak_bytes == measured
    assert optimized.fxplan_plan.num_segments > 1
    assert optimized.state_dict().keys() == resnet.state_dict().keys()


def test_smallest_budget_is_what_none_gives_and_below_it_is_a_budget_error(resnet, fake_batch, vanilla_peak):
    smallest = fxplan.rewrite(resnet, None, example_inputs=fake_batch)
    reached = smallest.fxplan_measured_peak_bytes
    assert reached < 0.7 * vanilla_peak
    with pytest.raises(BudgetError) as info:
        fxplan.rewrite(resnet, 0.5 * reached / GiB, example_inputs=fake_batch)
    assert info.value.min_feasible_bytes is not None
    assert info.value.min_feasible_bytes <= reached
    assert re.search(r"\d (KiB|MiB|GiB) \(\d+ bytes\)", str(info.value))  # sizes in the unit that fits them


def test_memory_centric_is_not_above_time_centric(resnet, fake_batch, vanilla_peak):
    budget = 0.8 * vanilla_peak / GiB
    time_centric = fxplan.rewrite(resnet, budget, example_inputs=fake_batch, strategy="time")
    memory_centric = fxplan.rewrite(resnet, budget, example_inputs=fake_batch, strategy="memory")
    # Predicted peaks are ordered exactly; measured ones may differ by a few tensors of bookkeeping.
    assert memory_centric.fxplan_plan.predicted_peak_bytes <= time_centric.fxplan_plan.predicted_peak_bytes
    assert memory_centric.fxplan_measured_peak_bytes <= 1.01 * time_centric.fxplan_measured_peak_bytes
    assert memory_centric.fxplan_plan.recompute_fraction >= time_centric.fxplan_plan.recompute_fraction


def test_plan_api_and_min_budget(resnet, fake_batch, vanilla_peak):
    smallest = fxplan.min_budget_bytes(resnet, fake_batch)
    assert 0 < smallest < vanilla_peak
    p = fxplan.plan(resnet, fake_batch, budget_gb=0.8 * vanilla_peak / GiB)
    assert p.predicted_peak_bytes <= 0.8 * vanilla_peak
    assert 0 < p.recompute_fraction <= 1
    # a partition of the graph's nodes: a recomputed region replaces a convolution, its BatchNorm and ReLU
    assert sum(len(s) for s in p.segments) == 69 - 2 * len(p.regions)
    assert fxplan.Plan.from_json(p.to_json()) == p
    with pytest.raises(BudgetError) as info:
        fxplan.plan(resnet, fake_batch, budget_gb=0.5 * smallest / GiB)
    assert info.value.min_feasible_bytes == smallest


def test_chen_solver_through_the_api(resnet, fake_batch, vanilla_peak):
    p = fxplan.plan(resnet, fake_batch, budget_gb=0.95 * vanilla_peak / GiB, solver="chen")
    assert p.solver == "chen" and p.num_segments > 1


def test_rewrite_with_a_given_plan_trains_like_the_original(resnet):
    p = fxplan.plan(resnet, (torch.randn(2, 3, 32, 32),), budget_gb=None, strategy="memory")
    optimized = fxplan.rewrite(resnet, plan=p)
    x = torch.randn(2, 3, 32, 32)
    ref = torchvision.models.resnet18(weights=None).train()
    ref.load_state_dict(resnet.state_dict())
    ref(x).sum().backward()
    optimized(x).sum().backward()
    for (name, a), b in zip(ref.named_parameters(), resnet.parameters()):
        assert torch.equal(a.grad, b.grad), name
    resnet.zero_grad(set_to_none=True)


def test_a_rewritten_model_survives_torch_save_and_load():
    torch.manual_seed(0)
    model = torchvision.models.resnet18(weights=None).train()
    x = torch.randn(2, 3, 32, 32)
    # the captured graph, no regions: its segments are traced again on loading with the capture's tracer class
    optimized = fxplan.rewrite(copy.deepcopy(model), budget_bytes=measure_step(model, (x,), fake=True).peak_bytes,
                               example_inputs=(x,))
    buffer = io.BytesIO()
    torch.save(optimized, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    assert loaded.code == optimized.code
    for module in (model, loaded):
        module(x).sum().backward()
    for (name, a), b in zip(model.named_parameters(), loaded.parameters()):
        assert torch.equal(a.grad, b.grad), name


def test_lazy_rewrite_plans_on_first_call_and_replans_on_new_shapes(resnet, caplog):
    lazy = fxplan.rewrite(resnet, 0.5)
    assert lazy.fxplan_plan is None
    assert lazy.state_dict().keys() == resnet.state_dict().keys()
    with caplog.at_level(logging.INFO, logger="fxplan"):
        lazy(torch.randn(2, 3, 32, 32)).sum().backward()
        first = lazy.fxplan_plan
        lazy(torch.randn(2, 3, 32, 32)).sum().backward()
        assert lazy.fxplan_plan is first
        lazy(torch.randn(4, 3, 32, 32)).sum().backward()
        second = lazy.fxplan_plan
        lazy(torch.randn(2, 3, 32, 32)).sum().backward()  # back to the first shape: its plan, not a new one
    assert second is not first and lazy.fxplan_plan is first
    messages = [r.getMessage() for r in caplog.records]
    assert any("planning for input shapes" in m for m in messages)
    assert any("planning for them" in m for m in messages)
    assert any("planned before; running that plan" in m for m in messages)
    # each planning says what it is doing: the trace, then the plan chosen with its seconds and steps
    traced = [m for m in messages if m.startswith("fxplan: traced ResNet with symbolic_trace: ")]
    planned = [m for m in messages if m.endswith("measured on fake tensors)") and "planned in" in m]
    assert len(traced) == len(planned) == 2, messages
    lazy.eval()
    with torch.no_grad():
        assert lazy(torch.randn(1, 3, 32, 32)).shape == (1, 1000)
    resnet.zero_grad(set_to_none=True)
    resnet.train()


def test_bad_arguments_are_fxplan_errors(resnet, fake_batch):
    with pytest.raises(FxplanError, match="budget_gb"):
        fxplan.rewrite(resnet, -1, example_inputs=fake_batch)
    with pytest.raises(FxplanError, match="solver"):
        fxplan.rewrite(resnet, 1, example_inputs=fake_batch, solver="magic")
    with pytest.raises(FxplanError, match="strategy"):
        fxplan.plan(resnet, fake_batch, budget_gb=1, strategy="fast")
    with pytest.raises(FxplanError, match="nn.Module"):
        fxplan.rewrite(lambda x: x, 1)


def test_rewrite_keeps_nothing_alive_once_its_result_is_dropped():
    """fxplan holds no global reference to what it planned: dropping the model and the rewritten module frees
    both (a weakly keyed cache of planning contexts once kept every traced model for the whole process)."""
    import gc
    import weakref

    torch.manual_seed(0)
    model = torchvision.models.resnet18(weights=None).train()
    with FakeTensorMode():
        inputs = (torch.randn(2, 3, 32, 32),)
    optimized = fxplan.rewrite(model, None, example_inputs=inputs)
    gone = [weakref.ref(model), weakref.ref(optimized)]
    del model, optimized
    gc.collect()
    assert [ref() for ref in gone] == [None, None]
