"""fxplan.auto_checkpoint: the plan applied to the model's own modules, exact, measured, and reversible."""

from __future__ import annotations

import copy
import inspect

import pytest
import torch
from tiny_models import hf_loss, tiny_gpt2, token_batch, train_step, trainer_losses
from torch import nn

import fxplan
from fxplan.apply.regions import RegionPlan

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("one_torch_thread")  # as every bitwise comparison of the suite runs


@pytest.fixture(scope="module")
def planned_gpt2():
    """A tiny GPT-2 planned at its smallest peak, beside an unplanned copy."""
    model = tiny_gpt2()
    reference = copy.deepcopy(model)
    batch = token_batch()
    result = fxplan.auto_checkpoint(model, example_inputs=batch, loss_fn=hf_loss)
    return result, model, reference, batch


def test_returns_the_model_itself_with_its_class_names_and_signature(planned_gpt2):
    result, model, reference, _ = planned_gpt2
    assert result is model
    assert type(model) is type(reference)
    assert list(model.state_dict()) == list(reference.state_dict())
    assert [n for n, _ in model.named_modules()] == [n for n, _ in reference.named_modules()]
    assert inspect.signature(model.forward) == inspect.signature(reference.forward)
    assert model.fxplan_plan.regions, "the smallest peak checkpoints some modules"


def test_steps_are_bitwise_equal_and_the_peak_is_lower(planned_gpt2):
    _, model, reference, batch = planned_gpt2
    for seed in (1, 2):  # two steps: dropout draws, gradients accumulated
        loss, grads = train_step(model, batch, seed)
        ref_loss, ref_grads = train_step(reference, batch, seed)
        assert torch.equal(loss, ref_loss)
        assert all(torch.equal(a, b) for a, b in zip(grads, ref_grads))
    model.zero_grad(set_to_none=True)
    reference.zero_grad(set_to_none=True)
    plan = model.fxplan_plan
    real = fxplan.measure_step(model, batch, loss_fn=hf_loss).peak_bytes
    unplanned = fxplan.measure_step(reference, batch, loss_fn=hf_loss).peak_bytes
    assert real < unplanned
    assert real <= plan.measured_peak_bytes  # the real step peaks where the fake one said
    assert plan.vanilla_peak_bytes == unplanned


def test_a_budget_is_held_or_refused_with_the_smallest_peak():
    model = tiny_gpt2()
    ids = torch.randint(0, 1000, (4, 64), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "labels": ids}
    vanilla = fxplan.measure_step(model, batch, fake=True, loss_fn=hf_loss).peak_bytes
    budget = int(0.85 * vanilla)
    fxplan.auto_checkpoint(model, budget_bytes=budget, example_inputs=batch, loss_fn=hf_loss)
    assert model.fxplan_plan.measured_peak_bytes <= budget
    assert fxplan.measure_step(model, batch, fake=True, loss_fn=hf_loss).peak_bytes <= budget
    with pytest.raises(fxplan.BudgetError) as refused:
        fxplan.auto_checkpoint(tiny_gpt2(), budget_bytes=vanilla // 10, example_inputs=batch, loss_fn=hf_loss)
    smallest = refused.value.min_feasible_bytes
    assert smallest is not None and vanilla // 10 < smallest < vanilla


def test_plan_comes_off_and_goes_on_again_through_json(planned_gpt2):
    _, model, _, batch = planned_gpt2
    plan = model.fxplan_plan
    text = plan.to_json()
    fresh = tiny_gpt2(seed=3)
    fxplan.auto_checkpoint(fresh, example_inputs=batch, loss_fn=hf_loss, plan=fxplan.AppliedPlan.from_json(text))
    assert [r.path for r in fresh.fxplan_plan.regions] == [r.path for r in plan.regions]
    assert fresh.fxplan_plan.measured_peak_bytes == plan.measured_peak_bytes
    fxplan.remove_checkpoints(fresh)
    assert not any("forward" in vars(m) for m in fresh.modules())
    assert "fxplan_plan" not in vars(fresh)
    assert "checkpointed module" in plan.summary()


def test_a_plan_for_another_class_is_refused(planned_gpt2):
    _, model, _, _ = planned_gpt2
    with pytest.raises(fxplan.FxplanError, match="made for GPT2LMHeadModel"):
        fxplan.auto_checkpoint(nn.Linear(4, 4), example_inputs=(torch.randn(2, 4),), plan=model.fxplan_plan)


class _Block(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.conv = nn.Conv2d(width, width, 3, padding=1)
        self.bn = nn.BatchNorm2d(width)
        self.drop = nn.Dropout(0.2)

    def forward(self, x):
        return x + self.drop(torch.relu(self.bn(self.conv(x))))


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, 16, 3, padding=1)
        self.blocks = nn.Sequential(*[_Block(16) for _ in range(4)])
        self.head = nn.Linear(16, 10)

    def forward(self, x):
        return self.head(self.blocks(self.stem(x)).mean((2, 3)))


def test_batchnorm_buffers_and_dropout_stay_exact():
    torch.manual_seed(0)
    model = _Net()
    reference = copy.deepcopy(model)
    x = torch.randn(8, 3, 32, 32)
    fxplan.auto_checkpoint(model, example_inputs=(x,))
    assert model.fxplan_plan.regions
    for seed in (1, 2):
        torch.manual_seed(seed)
        model(x).sum().backward()
        torch.manual_seed(seed)
        reference(x).sum().backward()
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(model.parameters(), reference.parameters()))
    for (name, a), (_, b) in zip(model.state_dict().items(), reference.state_dict().items()):
        assert torch.equal(a, b), name  # running statistics updated once per step, as in the model
    with torch.no_grad():  # evaluation runs the modules' own forward
        model.eval(), reference.eval()
        assert torch.equal(model(x), reference(x))


def test_region_json_round_trip_keeps_decisions():
    region = RegionPlan("blocks.0", ("aten.mm.default", "aten.relu.default", "aten.mm.default"),
                        (True, False, False), ("4x4", "4x4", "4x4"), ("aten.relu.default",))
    again = RegionPlan.from_dict(region.to_dict())
    assert again == region
    assert again.decisions() == {"aten.mm.default": (True, False)}


def _tiny_llama(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=128, intermediate_size=256,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=1000,
                                      max_position_embeddings=64, use_cache=False)
    return transformers.LlamaForCausalLM(config)


@pytest.mark.parametrize("make", [tiny_gpt2, _tiny_llama], ids=["gpt2", "llama"])
def test_trainer_with_default_arguments_trains_the_planned_model_within_its_budget(make, tmp_path):
    """Trainer keeps the dataset's columns (the signature is the model's), its losses are the unplanned
    model's, a real step of the trained model peaks within the budget, and save_model / from_pretrained round
    trip (GPT-2's weights are tied)."""
    pytest.importorskip("accelerate")
    ids = torch.randint(0, 1000, (12, 64), generator=torch.Generator().manual_seed(0))
    rows = [{"input_ids": row, "labels": row} for row in ids]

    def train(model, out):
        return trainer_losses(model, rows, str(out), max_steps=3)

    planned = make()
    batch = {"input_ids": ids[:4], "labels": ids[:4]}
    budget = int(0.7 * fxplan.measure_step(planned, batch, fake=True, loss_fn=hf_loss).peak_bytes)
    fxplan.auto_checkpoint(planned, budget_bytes=budget, example_inputs=batch, loss_fn=hf_loss)
    assert planned.fxplan_plan.regions
    losses, trainer = train(planned, tmp_path / "planned")
    reference, _ = train(make(), tmp_path / "reference")
    assert len(losses) == 3 and losses == reference
    planned.zero_grad(set_to_none=True)
    assert fxplan.measure_step(planned, batch, loss_fn=hf_loss).peak_bytes <= budget  # a real step, profiled
    trainer.save_model(str(tmp_path / "saved"))
    loaded = type(planned).from_pretrained(str(tmp_path / "saved"))
    for (name, a), (_, b) in zip(planned.state_dict().items(), loaded.state_dict().items()):
        assert torch.equal(a, b), name
    assert planned.generate(ids[:1, :8], max_new_tokens=4, do_sample=False).shape == (1, 12)


def test_a_model_no_mapping_lowers_is_left_as_it_is():
    """ResNet-50's in-place ReLUs and BatchNorms leave its checkpointed modules above its unplanned peak: no
    plan is applied rather than one that peaks higher."""
    import torchvision
    from torch._subclasses.fake_tensor import FakeTensorMode

    model = torchvision.models.resnet50()
    with FakeTensorMode():
        x = (torch.randn(16, 3, 112, 112),)
    fxplan.auto_checkpoint(model, example_inputs=x)
    plan = model.fxplan_plan
    assert plan.measured_peak_bytes <= plan.vanilla_peak_bytes
    assert not plan.regions or plan.measured_peak_bytes < plan.vanilla_peak_bytes


def test_a_module_writing_into_its_input_in_place_is_no_region():
    """Checkpoint would run such a module again from the values it wrote: it is left out, the others stay."""
    from fxplan.apply.eligible import regionable_modules
    from fxplan.capture.capturers import as_call

    class AddOne(nn.Module):
        def forward(self, x):
            return x.add_(1)

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), AddOne(), nn.ReLU(inplace=True), nn.Linear(32, 4))
    regionable, _ = regionable_modules(model, as_call((torch.randn(8, 16),)), None)
    assert {"0", "3"} <= regionable
    assert not regionable & {"1", "2"}


def test_a_drop_path_written_in_place_trains_exactly_whatever_the_decisions_around_it():
    """timm's DropPath makes its mask with new_empty, fills it with bernoulli_ and scales it with div_ in place. An
    in-place write takes the decision of the call that made what it writes: with the mask recomputed and div_ saved
    over it (a mix an auto_checkpoint plan made), the recomputed mask was not scaled and gradients differed."""
    timm = pytest.importorskip("timm")
    from fxplan.apply import runtime

    torch.manual_seed(0)
    model = timm.create_model("convnext_atto", num_classes=5, drop_path_rate=0.1).train()
    reference = copy.deepcopy(model)
    mixed = RegionPlan("stages.3", ops=("aten.new_empty.default", "aten.bernoulli_.float", "aten.div_.Tensor") * 2
                       + ("aten.mul.Tensor",) * 4, save=(False, False, True) * 2 + (True,) * 4)
    x = torch.randn(2, 3, 64, 64)
    with runtime.installed(model, [mixed]):
        torch.manual_seed(1)
        model(x).sum().backward()
    torch.manual_seed(1)
    reference(x).sum().backward()
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(model.parameters(), reference.parameters()))
