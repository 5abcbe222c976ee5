"""Tests of models_zoo: registry, inputs, losses, torch.fx node counts against Kusumoto et al. Table 1."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.fx
from torch import nn
from torch._subclasses import FakeTensor, FakeTensorMode

import models_zoo
from fxplan.errors import FxplanError
from models_zoo.entry import synthetic_targets, tensor_leaves, weighted_cross_entropy
from models_zoo.unet import UNet, unet_output_size

IMAGE_NETS = ["resnet50", "resnet152", "vgg19", "densenet161", "googlenet", "unet", "pspnet"]
ALL_NETS = IMAGE_NETS + ["lstm_lm"]

# Kusumoto et al. (2019), Table 1 and section 5: (batch, input size, #V).
PAPER = {
    "resnet50": (96, 224, 176), "resnet152": (48, 224, 516), "vgg19": (64, 224, 46),
    "densenet161": (32, 224, 568), "googlenet": (256, 224, 134), "unet": (8, 572, 60),
    "pspnet": (2, 713, 385),
}

# Networks whose torch.fx graph cannot match the paper's Chainer graph; docs/zoo.md explains the count.
DOCUMENTED_FX_NODES = {"googlenet": 216}

# Small inputs for real forward passes: (batch, input size).
# Batch 2: in train mode BatchNorm on the last 1x1 feature maps needs more than one value per channel.
SMALL = {name: (2, 32) for name in IMAGE_NETS} | {"unet": (1, 188), "pspnet": (2, 33), "lstm_lm": (3, 6)}

COMPUTE_OPS = ("call_module", "call_function", "call_method")


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def built() -> dict[str, nn.Module]:
    """Each network built once for this module (building resnet152, densenet161, pspnet takes seconds), and
    freed after it: kept for the whole session, the 1.4 GB of parameters would weigh on every later test."""
    cache: dict[str, nn.Module] = {}

    def get(name: str) -> nn.Module:
        if name not in cache:
            torch.manual_seed(0)
            cache[name] = models_zoo.get(name).build()
        return cache[name]

    return get  # type: ignore[return-value]


def compute_nodes(gm: torch.fx.GraphModule) -> int:
    return sum(n.op in COMPUTE_OPS for n in gm.graph.nodes)


def test_names_and_unknown_name():
    assert models_zoo.paper_names() == ALL_NETS
    assert models_zoo.names() == ALL_NETS + models_zoo.transformer_names()
    with pytest.raises(FxplanError) as info:
        models_zoo.get("resnet5O")
    for name in models_zoo.names():
        assert name in str(info.value)


@pytest.mark.parametrize("name", IMAGE_NETS)
def test_paper_settings(name):
    e = models_zoo.get(name)
    assert (e.paper_batch, e.input_size, e.paper_nodes) == PAPER[name]
    assert e.name == name and e.description
    with pytest.raises(dataclasses.FrozenInstanceError):
        e.name = "other"


def test_lstm_settings():
    e = models_zoo.get("lstm_lm")
    assert (e.paper_batch, e.input_size, e.paper_nodes) == (20, 512, None)


@pytest.mark.parametrize("name", ALL_NETS)
def test_build_is_fresh_cpu_train(name, built):
    model = built(name)
    assert isinstance(model, nn.Module) and model.training
    assert all(m.training for m in model.modules())
    assert all(p.device.type == "cpu" and not isinstance(p, FakeTensor) for p in model.parameters())


def test_builds_are_independent(built):
    a, b = built("googlenet"), models_zoo.get("googlenet").build()
    assert a is not b
    assert not torch.equal(a.fc.weight, b.fc.weight)  # fresh random initialisation each time


@pytest.mark.parametrize("name", ALL_NETS)
def test_example_inputs_shapes(name):
    e = models_zoo.get(name)
    batch, size = SMALL[name]
    (x,) = e.example_inputs(batch, size)
    if name == "lstm_lm":
        assert x.shape == (size, batch) and x.dtype == torch.long
        assert 0 <= int(x.min()) and int(x.max()) < 10_000
    else:
        assert x.shape == (batch, e.in_channels, size, size) and x.dtype == torch.float32


@pytest.mark.parametrize("name", ALL_NETS)
def test_default_inputs_under_fake_mode(name):
    e = models_zoo.get(name)
    with FakeTensorMode():
        (x,) = e.example_inputs()
    assert isinstance(x, FakeTensor)
    batch, size, *_ = PAPER.get(name, (20, 512))
    assert x.shape[:1] == (batch,) if name != "lstm_lm" else x.shape == (512, 20)
    if name != "lstm_lm":
        assert x.shape[-1] == size


def test_input_validation():
    with pytest.raises(FxplanError, match="188"):
        models_zoo.get("unet").example_inputs(1, 224)
    with pytest.raises(FxplanError, match="batch_size >= 2"):
        models_zoo.get("pspnet").example_inputs(1, 65)
    with pytest.raises(FxplanError):
        models_zoo.get("resnet50").example_inputs(2, 0)


def test_unet_valid_sizes():
    assert unet_output_size(572) == 388
    assert unet_output_size(188) == 4
    valid = [s for s in range(1, 700) if _valid_unet(s)]
    assert valid[0] == 188 and 572 in valid
    assert all((s - 124) % 16 == 0 for s in valid)


def _valid_unet(size: int) -> bool:
    try:
        unet_output_size(size)
    except FxplanError:
        return False
    return True


@pytest.mark.parametrize("name", IMAGE_NETS)
def test_fx_node_count(name, built):
    gm = torch.fx.symbolic_trace(built(name))
    count = compute_nodes(gm)
    paper = models_zoo.get(name).paper_nodes
    if name in DOCUMENTED_FX_NODES:
        assert count == DOCUMENTED_FX_NODES[name]
    else:
        assert abs(count - paper) <= 0.05 * paper, (name, count, paper)


def test_lstm_traces(built):
    gm = torch.fx.symbolic_trace(built("lstm_lm"))
    targets = [n.target for n in gm.graph.nodes if n.op == "call_module"]
    assert "rnn" in targets  # nn.LSTM stays one leaf node
    assert [n.op for n in gm.graph.nodes].count("placeholder") == 1


def _expected_outputs(name: str, batch: int, size: int) -> list[tuple[int, ...]]:
    if name == "googlenet":
        return [(batch, 1000)] * 3  # logits and both auxiliary classifiers
    if name == "unet":
        return [(batch, 2, unet_output_size(size), unet_output_size(size))]
    if name == "pspnet":
        return [(batch, 21, size, size)] * 2  # main and auxiliary logits at the input size
    if name == "lstm_lm":
        return [(size, batch, 10_000), (2, batch, 650), (2, batch, 650)]
    return [(batch, 1000)]


@pytest.mark.parametrize("name", ALL_NETS)
def test_forward_shapes_traced_output_and_loss(name, built):
    """Small real forward: documented output shapes, the fx-traced module gives the same outputs, and the
    loss is a deterministic finite scalar that draws no random numbers."""
    e = models_zoo.get(name)
    model = built(name)
    batch, size = SMALL[name]
    inputs = e.example_inputs(batch, size)
    torch.manual_seed(1)  # same dropout masks for both runs
    out = model(*inputs)
    assert [tuple(t.shape) for t in tensor_leaves(out)] == _expected_outputs(name, batch, size)
    torch.manual_seed(1)
    traced = tensor_leaves(torch.fx.symbolic_trace(model)(*inputs))
    for got, want in zip(traced, tensor_leaves(out), strict=True):
        torch.testing.assert_close(got, want)
    rng = torch.random.get_rng_state()
    loss = e.loss(out)
    assert torch.equal(rng, torch.random.get_rng_state())  # synthetic targets draw no random numbers
    assert loss.shape == () and math.isfinite(loss.item())
    assert torch.equal(loss, e.loss(out))


def test_unet_backward_reaches_every_parameter():
    torch.manual_seed(0)
    model = UNet(channels=(4, 8, 16, 32))
    (x,) = models_zoo.get("unet").example_inputs(2, 188)
    models_zoo.get("unet").loss(model(x)).backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())


def test_paper_size_outputs_on_meta():
    """At the paper's settings (572² and 713² inputs) the outputs have the documented shapes."""
    unet, psp = models_zoo.get("unet"), models_zoo.get("pspnet")
    with torch.device("meta"):
        out = unet.build()(*unet.example_inputs())
        assert tuple(out.shape) == (8, 2, 388, 388)
        model = psp.build()
        assert [tuple(t.shape) for t in model(*psp.example_inputs())] == [(2, 21, 713, 713)] * 2
        out = model.eval()(torch.randn(1, 3, 65, 65))
    assert isinstance(out, torch.Tensor) and out.shape == (1, 21, 65, 65)  # eval: main logits only


def test_synthetic_targets_and_weighted_loss():
    logits = torch.zeros(3, 5, 4, 4)
    t = synthetic_targets(logits)
    assert t.shape == (3, 4, 4) and t.dtype == torch.long
    assert set(t.unique().tolist()) == set(range(5))
    loss = weighted_cross_entropy(0.3)
    assert torch.isclose(loss(logits), torch.tensor(math.log(5)))
    with_aux = loss((logits, torch.zeros(3, 5), torch.zeros(3, 5)))
    assert torch.isclose(with_aux, torch.tensor(1.6 * math.log(5)))


def test_lstm_core_shares_parameters_and_matches_model(built):
    model = built("lstm_lm")
    core = model.core()
    assert {id(p) for p in core.parameters()} <= {id(p) for p in model.rnn.parameters()}
    assert len(list(core.parameters())) == len(list(model.rnn.parameters())) == 8
    (tokens,) = models_zoo.get("lstm_lm").example_inputs(2, 4)
    model.eval()
    try:
        logits, (h, c) = model(tokens)
        unrolled = model.forward_unrolled(tokens)
        torch.testing.assert_close(unrolled, logits, atol=1e-5, rtol=1e-4)
        core = model.core()
        assert not core.training
        state = core.init_hidden(2)
        assert len(state) == 4 and state[0].shape == (2, 650)
        emb = model.encoder(tokens)
        for t in range(tokens.shape[0]):
            y, state = core(emb[t], state)
        torch.testing.assert_close(torch.stack(state[0::2]), h, atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(torch.stack(state[1::2]), c, atol=1e-5, rtol=1e-4)
        y.sum().backward()
        assert model.rnn.weight_hh_l0.grad is not None and model.rnn.weight_hh_l0.grad.abs().sum() > 0
    finally:
        model.zero_grad(set_to_none=True)
        model.train()


@pytest.mark.parametrize("name", ALL_NETS)
def test_quick_input_size_is_accepted(name):
    entry = models_zoo.get(name)
    size = entry.quick_input_size or entry.input_size
    assert size <= entry.input_size
    (x,) = entry.example_inputs(batch_size=entry.min_batch, input_size=size)
    assert size in x.shape
