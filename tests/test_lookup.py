"""Model names the command line accepts: zoo, torchvision builders, timm:NAME, hf:NAME, and clear refusals."""

from __future__ import annotations

import sys

import pytest
import torch

import models_zoo
from fxplan.errors import FxplanError
from models_zoo import lookup


def test_zoo_names_resolve_to_the_zoo_entries():
    for name in models_zoo.names():
        assert models_zoo.resolve(name) is models_zoo.get(name)


@pytest.mark.parametrize("name, batch, size", [("mobilenet_v2", 32, 224), ("inception_v3", 32, 299),
                                               ("vit_h_14", 32, 224), ("r3d_18", 8, 112),
                                               ("deeplabv3_mobilenet_v3_large", 8, 520)])
def test_torchvision_builders(name, batch, size):
    entry = models_zoo.resolve(name)
    assert (entry.paper_batch, entry.input_size) == (batch, size)
    assert entry.fake_only == (name == "vit_h_14")  # 2.4 GiB of parameters
    with torch.device("meta"):
        model = entry.build()
        out = model(*entry.example_inputs(batch_size=2, input_size=entry.quick_input_size or size, device="meta"))
    assert entry.loss(out).shape == ()


def test_torchvision_builders_download_nothing(monkeypatch):
    """Segmentation builders default to an ImageNet backbone: weights_backbone=None must be passed."""
    import torch.hub

    monkeypatch.setattr(torch.hub, "load_state_dict_from_url", lambda *a, **k: pytest.fail("download"))
    assert not models_zoo.resolve("fcn_resnet50").fake_only


def test_unknown_names_are_refused_with_suggestions():
    with pytest.raises(FxplanError, match=r"unknown model 'resnet5O'.*did you mean resnet50"):
        models_zoo.resolve("resnet5O")
    with pytest.raises(FxplanError, match="detection model"):
        models_zoo.resolve("fasterrcnn_resnet50_fpn")
    with pytest.raises(FxplanError, match=r"unknown model 'a'.*; unknown model 'b'"):
        models_zoo.resolve_all(["vgg19", "a", "b"])


def test_timm_names():
    pytest.importorskip("timm")
    entry = models_zoo.resolve("timm:resnet18")
    assert entry.name == "timm:resnet18" and entry.input_size == 224 and not entry.fake_only
    with pytest.raises(FxplanError, match="did you mean timm:resnet18"):
        models_zoo.resolve("timm:resnet1")


@pytest.mark.parametrize("name, task", [("gpt2", "causal-lm"), ("GPT2Config", "causal-lm"),
                                        ("bert", "masked-lm"), ("t5", "seq2seq-lm"),
                                        ("vit", "image-classification")])
def test_hf_names_pick_a_task_with_a_training_loss(name, task):
    pytest.importorskip("transformers")
    entry = models_zoo.resolve(f"hf:{name}")
    assert entry.loss_fn is models_zoo.hf.LOSSES[task]
    assert entry.name == f"hf:{name}" and not entry.fake_only


def test_hf_default_llama_is_fake_only():
    """LlamaConfig() is the 7B model: 25 GiB of parameters, measured on fake tensors only."""
    pytest.importorskip("transformers")
    entry = models_zoo.resolve("hf:llama")
    assert entry.fake_only and "fake tensors only" in entry.description
    assert next(entry.build().parameters()).device.type == "meta"


def test_hf_unknown_names():
    pytest.importorskip("transformers")
    with pytest.raises(FxplanError, match="did you mean hf:gptj, hf:gpt2"):
        models_zoo.resolve("hf:gpt3")
    with pytest.raises(FxplanError, match="no seq2seq-LM, masked-LM, causal-LM or image-classification"):
        models_zoo.resolve("hf:wav2vec2")


@pytest.mark.parametrize("module, prefix", [("timm", "timm:resnet18"), ("transformers", "hf:gpt2")])
def test_missing_optional_package_is_a_clear_error(module, prefix, monkeypatch):
    monkeypatch.setitem(sys.modules, module, None)  # import now raises ImportError
    with pytest.raises(FxplanError, match=rf"pip install 'fxplan\[{'timm' if module == 'timm' else 'transformers'}\]'"):
        models_zoo.resolve(prefix)


def test_large_models_are_fake_only(monkeypatch):
    monkeypatch.setattr(lookup, "REAL_PARAMETER_LIMIT", 1000)
    entry = models_zoo.resolve("mobilenet_v2")
    assert entry.fake_only and entry.quick_input_size is None
    assert next(entry.build().parameters()).device.type == "meta"
