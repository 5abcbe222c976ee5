"""The zoo's registry: every named network with its paper settings, builder, inputs and loss."""

from __future__ import annotations

from functools import partial
from typing import Any

import torch
import torchvision
from torch import Tensor

from fxplan.errors import FxplanError
from models_zoo import hf
from models_zoo.entry import ZooEntry, weighted_cross_entropy
from models_zoo.lstm_lm import VOCAB_SIZE, LSTMLanguageModel, lm_loss
from models_zoo.pspnet import PSPNet
from models_zoo.unet import UNet, unet_output_size


def _tv(name: str, **kwargs: Any) -> torch.nn.Module:
    return getattr(torchvision.models, name)(weights=None, **kwargs)


def _token_inputs(entry: ZooEntry, batch: int, seq_len: int, device: Any) -> tuple[Tensor, ...]:
    return (torch.randint(0, VOCAB_SIZE, (seq_len, batch), device=device),)


_CE = weighted_cross_entropy(0.0)

_ENTRIES: dict[str, ZooEntry] = {
    e.name: e
    for e in (
        ZooEntry("resnet50", 96, 224, 176, "torchvision ResNet-50", partial(_tv, "resnet50"), _CE,
                 quick_input_size=112),
        ZooEntry("resnet152", 48, 224, 516, "torchvision ResNet-152", partial(_tv, "resnet152"), _CE,
                 quick_input_size=112),
        ZooEntry("vgg19", 64, 224, 46, "torchvision VGG-19 (no BatchNorm)", partial(_tv, "vgg19"), _CE,
                 quick_input_size=112),
        ZooEntry("densenet161", 32, 224, 568, "torchvision DenseNet-161", partial(_tv, "densenet161"), _CE,
                 quick_input_size=112),
        ZooEntry(
            "googlenet", 256, 224, 134, "torchvision GoogLeNet with both auxiliary classifiers (train mode)",
            partial(_tv, "googlenet", aux_logits=True, init_weights=True), weighted_cross_entropy(0.3),
            quick_input_size=112,
        ),
        ZooEntry(
            "unet", 8, 572, 60, "original U-Net: valid convolutions, 1 input channel, 2 classes",
            UNet, weighted_cross_entropy(0.0), kind="segmentation", in_channels=1,
            check_size=unet_output_size, quick_input_size=188,
        ),
        ZooEntry(
            "pspnet", 2, 713, 385,
            "PSPNet, dilated ResNet-101 (deep stem), PPM bins 1-2-3-6, aux head, 21 classes",
            PSPNet, weighted_cross_entropy(0.4), kind="segmentation", min_batch=2, quick_input_size=113,
        ),
        ZooEntry(
            "lstm_lm", 20, 512, None, "2-layer LSTM language model, vocab 10k, emb/hidden 650, dropout 0.5",
            LSTMLanguageModel, lm_loss, kind="language", in_channels=0, make_inputs=_token_inputs,
            quick_input_size=64,
        ),
        *hf.zoo_entries(),
    )
}


def names() -> list[str]:
    """Names of all zoo networks: the seven image networks of Kusumoto et al.'s Table 1, ``lstm_lm``, then
    the transformers (:func:`transformer_names`)."""
    return list(_ENTRIES)


def paper_names() -> list[str]:
    """The networks of Kusumoto et al.'s Table 1 and ``lstm_lm``: everything that needs only torchvision."""
    return [name for name in _ENTRIES if name not in hf.ZOO]


def transformer_names() -> list[str]:
    """The zoo's Hugging Face transformers (building them needs transformers)."""
    return list(hf.ZOO)


def get(name: str) -> ZooEntry:
    """The entry called ``name``; raises :class:`FxplanError` listing the valid names if there is none."""
    try:
        return _ENTRIES[name]
    except (KeyError, TypeError):
        raise FxplanError(f"unknown zoo model {name!r}; valid names: {', '.join(_ENTRIES)}") from None
