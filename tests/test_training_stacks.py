"""A rewritten module in a training stack: the model's ``forward`` signature and output containers, the model's
buffers and nothing more, and plans applied again to the model, to a fresh one of its configuration and after JSON."""

from __future__ import annotations

import collections
import copy
import inspect
import io

import pytest
import torch
import torchvision

import fxplan
from fxplan import FxplanError
from fxplan.capture import effects
from fxplan.capture.capturers import capture
from fxplan.capture.fakes import tensor_attributes
from fxplan.measure.meter import measure_step
from fxplan.solvers.plans import Plan

transformers = pytest.importorskip("transformers")


def _gpt2(seed: int = 0, n_layer: int = 2) -> torch.nn.Module:
    torch.manual_seed(seed)
    config = transformers.GPT2Config(n_layer=n_layer, n_embd=64, n_head=2, vocab_size=1000, n_positions=64)
    return transformers.GPT2LMHeadModel(config).train()


def _two_segments(model: torch.nn.Module, example_inputs) -> Plan:
    """A plan of two segments (the captured graph's compute nodes cut in half, in graph order), made without a
    search: what these tests check does not depend on which plan runs."""
    gm = capture(model, example_inputs).gm
    names = [n.name for n in gm.graph.nodes if effects.is_compute(n)]
    half = len(names) // 2
    return Plan([names[:half], names[half:]], [], [], 0, [], 0.0, 0.0, 0.0, None, "time", "approx-dp", "autograd")


def _step(module: torch.nn.Module, *args, **kwargs):
    """The output and parameter gradients of one training step (dropout drawing the same numbers each time)."""
    module.zero_grad(set_to_none=True)
    torch.manual_seed(1)
    out = module(*args, **kwargs)
    if isinstance(out, torch.Tensor):
        loss = out.sum()
    else:
        loss = out.loss if hasattr(out, "loss") else sum(v.sum() for v in out.values())
    loss.backward()
    return out, [p.grad.clone() for p in module.parameters()]


def test_a_rewritten_transformer_has_the_models_signature_takes_its_keywords_and_adds_no_buffers():
    model = _gpt2()
    ids = torch.randint(0, 1000, (2, 16))
    call = {"input_ids": ids, "labels": ids}
    rewritten = fxplan.rewrite(model, plan=_two_segments(model, call), example_inputs=call)
    # Hugging Face Trainer keeps the dataset columns named by forward's parameters
    signature = inspect.signature(model.forward)
    assert inspect.signature(rewritten.forward) == signature
    assert {"input_ids", "labels", "attention_mask"} <= set(inspect.signature(rewritten.forward).parameters)
    loaded = io.BytesIO()
    torch.save(rewritten, loaded)
    loaded.seek(0)
    lazy = fxplan.rewrite(model, budget_gb=1.0)  # plans on its first call
    for other in (copy.deepcopy(rewritten), torch.load(loaded, weights_only=False), lazy, copy.deepcopy(lazy)):
        assert inspect.signature(other.forward) == signature
    # a keyword call as the model takes it runs the plan, returns the model's output type and trains exactly
    assert rewritten.unplanned_reason(input_ids=ids, labels=ids) is None
    (expected, grads), (got, got_grads) = _step(model, input_ids=ids, labels=ids), _step(rewritten, **call)
    assert type(got) is type(expected)
    assert torch.equal(got.loss, expected.loss) and torch.equal(got.logits, expected.logits)
    assert all(torch.equal(a, b) for a, b in zip(grads, got_grads))
    # torch.export lifts tensor constants of the forward; the rewritten module holds them, not as buffers
    assert {name for name, _ in rewritten.named_buffers()} == {name for name, _ in model.named_buffers()}
    assert set(rewritten.state_dict()) == set(model.state_dict())


def test_a_segmentation_model_rewritten_returns_its_ordered_dict():
    torch.manual_seed(0)
    model = torchvision.models.segmentation.deeplabv3_mobilenet_v3_large(weights=None, weights_backbone=None,
                                                                         num_classes=3, aux_loss=True).train()
    x = torch.randn(2, 3, 32, 32)
    reference = copy.deepcopy(model)
    plan = _two_segments(model, (x,))
    for example_inputs in ((x,), None):  # with example inputs and without (a graph of symbolic_trace either way)
        rewritten = fxplan.rewrite(model, plan=plan, example_inputs=example_inputs)
        (expected, grads), (got, got_grads) = _step(reference, x), _step(rewritten, x)
        assert type(expected) is collections.OrderedDict
        assert type(got) is collections.OrderedDict and list(got) == list(expected) == ["out", "aux"]
        assert all(torch.equal(expected[k], got[k]) for k in expected)
        assert all(torch.equal(a, b) for a, b in zip(grads, got_grads))


def test_the_tensor_constants_of_a_graph_are_no_buffers_of_the_rewrite_and_follow_its_conversions():
    swin = pytest.importorskip("timm.models.swin_transformer")
    torch.manual_seed(0)
    model = swin.SwinTransformer(img_size=32, patch_size=4, window_size=4, embed_dim=16, depths=(1, 1),
                                 num_heads=(1, 2), num_classes=3).train()
    x = torch.randn(2, 3, 32, 32)
    plan = _two_segments(model, (x,))
    rewritten = fxplan.rewrite(model, plan=plan, example_inputs=(x,))
    constants = tensor_attributes(rewritten)
    assert constants  # the shifted windows' attention masks, which symbolic_trace makes constants
    buffers = {name for name, _ in model.named_buffers()}
    for module in (rewritten, copy.deepcopy(rewritten)):
        assert {name for name, _ in module.named_buffers()} == buffers
        assert set(module.state_dict()) == set(model.state_dict())
    # the meter counts the constants as state the step starts with, as it counted them when they were buffers
    stats = measure_step(rewritten, (x,), fake=True)
    assert stats.peak_bytes == rewritten.fxplan_measured_peak_bytes
    state = {t.untyped_storage()._cdata: t.untyped_storage().nbytes() for t in [*model.buffers(), *constants]}
    assert stats.breakdown["buffers"] == sum(state.values())
    reference = copy.deepcopy(model)
    (expected, grads), (got, got_grads) = _step(reference, x), _step(rewritten, x)
    assert torch.equal(expected, got) and all(torch.equal(a, b) for a, b in zip(grads, got_grads))
    # .to() / .double() convert them with the parameters
    double = copy.deepcopy(rewritten).double()
    assert all(t.dtype == torch.float64 for t in tensor_attributes(double) if t.is_floating_point())
    assert double(x.double()).dtype == torch.float64


@pytest.fixture(scope="module")
def gpt2_rewritten():
    model = _gpt2()
    ids = torch.randint(0, 1000, (4, 32))
    call = {"input_ids": ids, "labels": ids}
    unplanned = measure_step(model, call, fake=True).peak_bytes
    return model, call, fxplan.rewrite(model, budget_bytes=int(0.7 * unplanned), example_inputs=call)


def test_a_plan_applies_again_to_its_model_a_fresh_one_and_after_json(gpt2_rewritten):
    model, call, rewritten = gpt2_rewritten
    plan = rewritten.fxplan_plan
    assert plan.num_segments > 1 and plan.regions  # segments and units of recomputed inputs: named by node
    fresh = _gpt2(seed=1)
    again = [
        fxplan.rewrite(model, plan=plan, example_inputs=call),
        fxplan.rewrite(rewritten, plan=plan, example_inputs=call),  # the rewritten module stands for its model
        fxplan.rewrite(fresh, plan=plan, example_inputs=call),
        fxplan.rewrite(model, plan=Plan.from_json(plan.to_json()), example_inputs=call),
    ]
    for module in again:
        assert module.fxplan_measured_peak_bytes == plan.measured_peak_bytes
        assert module.fxplan_plan.segments == plan.segments and module.fxplan_plan.regions == plan.regions
    assert fxplan.plan(rewritten, call, budget_bytes=plan.budget_bytes).segments == plan.segments
    (expected, grads), (got, got_grads) = _step(copy.deepcopy(fresh), **call), _step(again[2], **call)
    assert torch.equal(expected.loss, got.loss) and all(torch.equal(a, b) for a, b in zip(grads, got_grads))


def test_a_plan_for_another_configuration_is_refused_with_the_reason(gpt2_rewritten):
    _, call, rewritten = gpt2_rewritten
    plan = rewritten.fxplan_plan
    with pytest.raises(FxplanError, match="does not fit|another model"):
        fxplan.rewrite(_gpt2(n_layer=3), plan=plan, example_inputs=call)
    segments_only = Plan.from_dict({**plan.to_dict(), "regions": [], "region_recompute_fraction": 0.0})
    with pytest.raises(FxplanError, match="does not fit GPT2LMHeadModel.*leaves out"):
        fxplan.rewrite(_gpt2(n_layer=3), plan=segments_only, example_inputs=call)


def test_a_rewritten_transformer_reaches_the_models_own_attributes_and_methods(tmp_path):
    model = _gpt2()
    ids = torch.randint(0, 1000, (2, 16))
    call = {"input_ids": ids, "labels": ids}
    rewritten = fxplan.rewrite(model, plan=_two_segments(model, call), example_inputs=call)
    assert rewritten.config is model.config
    _step(rewritten, **call)
    torch.optim.SGD(rewritten.parameters(), lr=0.1).step()
    rewritten.save_pretrained(tmp_path)  # the trained weights: the rewrite's parameters are the model's
    loaded = type(model).from_pretrained(tmp_path)
    assert all(torch.equal(a, b) for a, b in zip(loaded.state_dict().values(), rewritten.state_dict().values()))
    rewritten.eval()
    generated = rewritten.generate(ids[:, :4], max_new_tokens=3, do_sample=False)
    assert torch.equal(generated, model.eval().generate(ids[:, :4], max_new_tokens=3, do_sample=False))
    with pytest.raises(AttributeError):
        getattr(rewritten, "no_such_attribute")  # noqa: B009
