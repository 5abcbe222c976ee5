"""Planning in parts: models whose whole step stops at data-dependent Python (torchvision's Faster R-CNN in training,
a Hugging Face speech encoder with LayerDrop) are planned in the submodules that capture, the rest run eagerly as
written; real models, real autograd, the whole step measured on real steps."""

from __future__ import annotations

import copy
import random

import numpy as np
import pytest
import torch
from torch import nn

import fxplan

torchvision = pytest.importorskip("torchvision")
pytestmark = pytest.mark.usefixtures("one_torch_thread")  # as every bitwise comparison of the suite runs

MiB = 1024**2


def _seeded(seed: int) -> None:
    torch.manual_seed(seed)
    np.random.seed(seed)
    random.seed(seed)


def _step(model: nn.Module, inputs, loss_fn, seed: int, optimizer: torch.optim.Optimizer, inside: tuple[str, ...]):
    """One training step from the random state ``seed``: the loss, the gradients, and the modules its forward called
    (recomputation in backward calls checkpointed modules again), but for those inside the parts at ``inside``."""
    called = []
    handles = [m.register_forward_pre_hook(lambda _m, _a, name=name: called.append(name))
               for name, m in model.named_modules() if name and not name.startswith(tuple(p + "." for p in inside))]
    _seeded(seed)
    try:
        out = model(*inputs) if isinstance(inputs, tuple) else model(**inputs)
    finally:
        for h in handles:
            h.remove()
    loss = loss_fn(out)
    loss.backward()
    grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.detach(), grads, called


def _assert_trains_as_the_original(planned: nn.Module, original: nn.Module, inputs, loss_fn,
                                   rewritten: tuple[str, ...] = ()) -> list[list[str]]:
    """Two SGD steps of both, seeded alike: losses, gradients, modules called (but inside the ``rewritten`` parts,
    whose generated code calls no submodule) and state bitwise equal."""
    opt_a = torch.optim.SGD(planned.parameters(), lr=0.01)
    opt_b = torch.optim.SGD(original.parameters(), lr=0.01)
    calls = []
    for seed in (11, 12):
        loss, grads, called = _step(planned, inputs, loss_fn, seed, opt_a, rewritten)
        ref_loss, ref_grads, ref_called = _step(original, inputs, loss_fn, seed, opt_b, rewritten)
        assert torch.equal(loss, ref_loss)
        assert len(grads) == len(ref_grads) and all(torch.equal(a, b) for a, b in zip(grads, ref_grads))
        assert called == ref_called
        calls.append(called)
    assert list(planned.state_dict()) == list(original.state_dict())
    for (name, a), (_, b) in zip(planned.state_dict().items(), original.state_dict().items()):
        assert torch.equal(a, b), name
    return calls


def _detector() -> nn.Module:
    torch.manual_seed(0)
    return torchvision.models.detection.fasterrcnn_mobilenet_v3_large_320_fpn(
        weights=None, weights_backbone=None, num_classes=3, min_size=128, max_size=160).train()


def _detection_batch():
    g = torch.Generator().manual_seed(1)
    images = [torch.rand(3, 128, 160, generator=g), torch.rand(3, 160, 128, generator=g)]
    targets = [{"boxes": torch.tensor([[10.0, 20.0, 60.0, 80.0]]), "labels": torch.tensor([1])},
               {"boxes": torch.tensor([[5.0, 5.0, 50.0, 90.0], [30.0, 30.0, 100.0, 100.0]]),
                "labels": torch.tensor([2, 1])}]
    return images, targets


def _detection_loss(out):
    return sum(out.values())


def test_a_detector_is_planned_in_parts_within_the_budget_and_trains_exactly():
    """Faster R-CNN draws its image size with .item() in training: its backbone is planned, the transform, the
    proposals and the box sampling run eagerly; the whole step's real peak is below the unplanned one's and within
    the budget, and two steps are bitwise the original's."""
    model, inputs = _detector(), _detection_batch()
    original = copy.deepcopy(model)
    with torch.random.fork_rng(devices=[]):
        unplanned = fxplan.measure_step(model, inputs, loss_fn=_detection_loss).peak_bytes
    budget = unplanned - MiB
    state = torch.random.get_rng_state()
    fxplan.auto_checkpoint(model, budget_bytes=budget, example_inputs=inputs, loss_fn=_detection_loss)
    assert torch.equal(torch.random.get_rng_state(), state)  # planning drew nothing the model's steps will
    plan = model.fxplan_plan
    assert isinstance(plan, fxplan.AppliedPlan) and plan.regions
    assert plan.measured_peak_bytes <= budget < plan.vanilla_peak_bytes
    with torch.random.fork_rng(devices=[]):
        real = fxplan.measure_step(model, inputs, loss_fn=_detection_loss).peak_bytes
    assert real <= budget < unplanned
    summary = plan.summary()
    assert "planned: backbone (BackboneWithFPN)" in summary
    assert "transform.py:" in summary and "roi_heads (RoIHeads): runs eagerly: data-dependent code" in summary
    assert all(r.path.startswith("backbone.") for r in plan.regions)
    again = fxplan.AppliedPlan.from_json(plan.to_json())
    assert again.regions == plan.regions and [p.path for p in again.parts] == [p.path for p in plan.parts]
    _assert_trains_as_the_original(model, original, inputs, _detection_loss)


def _speech_encoder(layers: int = 4, layerdrop: float = 0.5, samples: int = 4000) -> tuple[nn.Module, dict]:
    transformers = pytest.importorskip("transformers")
    config = transformers.Wav2Vec2Config(
        hidden_size=32, num_hidden_layers=layers, num_attention_heads=2, intermediate_size=64, conv_dim=(16, 16),
        conv_stride=(5, 2), conv_kernel=(10, 3), num_feat_extract_layers=2, layerdrop=layerdrop,
        num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=2)  # SpecAugment on: numpy draws its masks
    torch.manual_seed(0)
    model = transformers.Wav2Vec2Model(config).train()
    return model, {"input_values": torch.randn(2, samples, generator=torch.Generator().manual_seed(2))}


def _speech_loss(out):
    return out.last_hidden_state.pow(2).mean()


def test_a_speech_encoder_with_layerdrop_is_planned_in_parts_and_drops_the_same_layers():
    """Wav2Vec2's LayerDrop decides with `if not skip_the_layer` on a random tensor: the encoder runs eagerly, its
    draws with it, and its parts are planned; two steps drop the same layers as the original, with bitwise equal
    outputs and gradients, and planning leaves the random generators as they were."""
    model, inputs = _speech_encoder()
    original = copy.deepcopy(model)
    _seeded(5)
    states = torch.random.get_rng_state(), np.random.get_state()[1].copy(), random.getstate()
    fxplan.auto_checkpoint(model, example_inputs=inputs, loss_fn=_speech_loss)
    assert torch.equal(torch.random.get_rng_state(), states[0])
    assert (np.random.get_state()[1] == states[1]).all() and random.getstate() == states[2]
    plan = model.fxplan_plan
    assert plan.regions and plan.measured_peak_bytes < plan.vanilla_peak_bytes
    summary = plan.summary()
    assert "modeling_wav2vec2.py:" in summary and "encoder (Wav2Vec2Encoder): runs eagerly" in summary
    assert all(f"planned: encoder.layers.{i} (Wav2Vec2EncoderLayer)" in summary for i in range(4))
    assert any(r.path.startswith("encoder.layers.") for r in plan.regions)
    calls = _assert_trains_as_the_original(model, original, inputs, _speech_loss)
    layers = [{n for n in called if n.count(".") == 2 and n.startswith("encoder.layers.")} for called in calls]
    assert any(len(ran) < 4 for ran in layers)  # LayerDrop dropped layers, the same as the original's


def test_a_detector_is_rewritten_in_parts_within_the_budget_and_trains_exactly():
    """fxplan.rewrite of Faster R-CNN in training: the model's own class comes back, its backbone rewritten and
    checkpointed whole, the rest shared with the user's model, which is left as it was; the whole step's real peak
    is within the budget, the plan goes through JSON to a fresh model with the same peak, and two steps are
    bitwise the original's."""
    model, inputs = _detector(), _detection_batch()
    original = copy.deepcopy(model)
    with torch.random.fork_rng(devices=[]):
        unplanned = fxplan.measure_step(model, inputs, loss_fn=_detection_loss).peak_bytes
    budget = unplanned - 8 * MiB
    state = torch.random.get_rng_state()
    rewritten = fxplan.rewrite(model, budget_bytes=budget, example_inputs=inputs, loss_fn=_detection_loss)
    assert torch.equal(torch.random.get_rng_state(), state)
    assert type(rewritten) is type(model) and rewritten.backbone is not model.backbone
    assert rewritten.transform is model.transform and rewritten.rpn.anchor_generator is model.rpn.anchor_generator
    assert not any(isinstance(m, torch.fx.GraphModule) for m in model.modules())  # the user's model as it was
    plan = rewritten.fxplan_plan
    assert isinstance(plan, fxplan.AppliedPlan) and "backbone" in plan.rewritten and not plan.regions
    assert plan.measured_peak_bytes <= budget < plan.vanilla_peak_bytes
    with torch.random.fork_rng(devices=[]):
        real = fxplan.measure_step(rewritten, inputs, loss_fn=_detection_loss).peak_bytes
    assert real <= plan.measured_peak_bytes <= budget < unplanned
    summary = plan.summary()
    assert "planned: backbone (BackboneWithFPN): checkpointed whole, rewritten in" in summary
    assert "roi_heads (RoIHeads): runs eagerly: data-dependent code" in summary and "roi_heads.py:" in summary
    again = fxplan.AppliedPlan.from_json(plan.to_json())
    reapplied = fxplan.rewrite(_detector(), plan=again, example_inputs=inputs, loss_fn=_detection_loss)
    assert reapplied.fxplan_plan.measured_peak_bytes == plan.measured_peak_bytes
    _assert_trains_as_the_original(rewritten, original, inputs, _detection_loss, tuple(plan.rewritten))


def test_a_speech_encoder_with_layerdrop_is_rewritten_in_parts_and_drops_the_same_layers():
    """fxplan.rewrite of Wav2Vec2 with LayerDrop: each encoder layer is rewritten and checkpointed whole, so the
    forward keeps only the layers' inputs; planning leaves the random generators as they were, and the same
    layers are dropped as by the original, bitwise. For a budget above the smallest peak, fewer parts are planned."""
    model, inputs = _speech_encoder(layers=6, layerdrop=0.2, samples=2000)
    original = copy.deepcopy(model)
    _seeded(5)
    states = torch.random.get_rng_state(), np.random.get_state()[1].copy(), random.getstate()
    rewritten = fxplan.rewrite(model, example_inputs=inputs, loss_fn=_speech_loss)
    assert torch.equal(torch.random.get_rng_state(), states[0])
    assert (np.random.get_state()[1] == states[1]).all() and random.getstate() == states[2]
    plan = rewritten.fxplan_plan
    assert {f"encoder.layers.{i}" for i in range(6)} <= set(plan.rewritten)
    assert plan.measured_peak_bytes < 0.5 * plan.vanilla_peak_bytes
    assert "encoder (Wav2Vec2Encoder): runs eagerly: data-dependent code" in plan.summary()
    calls = _assert_trains_as_the_original(rewritten, original, inputs, _speech_loss, tuple(plan.rewritten))
    assert any(len({n for n in called if n.startswith("encoder.layers.")}) < 6 for called in calls)
    budget = (plan.measured_peak_bytes + plan.vanilla_peak_bytes) // 2  # a part checkpointed costs a forward of it
    _seeded(5)
    fewer = fxplan.rewrite(original, budget_bytes=budget, example_inputs=inputs, loss_fn=_speech_loss).fxplan_plan
    assert fewer.measured_peak_bytes <= budget and 0 < len(fewer.rewritten) < len(plan.rewritten)


class _NumpyMask(nn.Module):
    """Fails capture for a reason that is not data-dependent: a mask drawn with numpy, which a graph would repeat."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.emb = nn.Linear(8, 8), nn.Linear(8, 8), nn.Parameter(torch.randn(8))

    def forward(self, x):
        h = self.b(torch.tanh(self.a(x)))
        m = torch.tensor(np.random.rand(2, 4) < 0.3)
        return torch.where(m[..., None], self.emb, h)


def test_a_capture_failing_for_another_reason_keeps_its_error():
    """Only data-dependent code is planned in parts: another refusal of the capture is raised as before, and the
    generators are left as they were."""
    np.random.seed(3)
    state = np.random.get_state()[1].copy()
    with pytest.raises(fxplan.TraceError, match="numpy.random's global generator"):
        fxplan.auto_checkpoint(_NumpyMask(), example_inputs=(torch.randn(2, 4, 8),))
    assert (np.random.get_state()[1] == state).all()
