"""Model names the command line accepts, each resolved to a :class:`ZooEntry` before any work starts.

=====================  =====================================================================================
name                   model
=====================  =====================================================================================
a zoo name             :func:`models_zoo.get` (``fxplan zoo`` lists them)
a torchvision builder  ``torchvision.models.get_model(NAME, weights=None)``: classification (e.g.
                       ``mobilenet_v2``), segmentation and video models; detection and optical-flow models
                       need targets in train mode and are refused
``timm:NAME``          ``timm.create_model(NAME, pretrained=False)`` (needs timm)
``hf:NAME``            a transformers config class (``GPT2Config``) or model type (``gpt2``) at its default
                       sizes, through ``AutoModelFor*.from_config`` (needs transformers; see
                       :mod:`models_zoo.hf`)
=====================  =====================================================================================

Every model is randomly initialised; nothing is downloaded. Losses are cross-entropies against synthetic
labels (:mod:`models_zoo.entry`). A model outside the zoo whose parameters take more than
:data:`REAL_PARAMETER_LIMIT` bytes (counted on the ``meta`` device) becomes a ``fake_only`` entry: it is
built on ``meta`` and measured on fake tensors only, since one real training step would need several
times that much memory.
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import torch
from torch import Tensor

from fxplan.errors import FxplanError
from models_zoo import hf, registry
from models_zoo.entry import ZooEntry, build_on_meta, weighted_cross_entropy

#: Parameters above this many bytes (1 GiB, 268M fp32 parameters): built on ``meta``, fake tensors only.
REAL_PARAMETER_LIMIT = 2**30
#: Defaults for models outside the zoo.
#: Real steps (timing, like-for-like peaks) use the default input size, except for segmentation
#: networks, which are fully convolutional.
IMAGE_BATCH, IMAGE_SIZE, QUICK_IMAGE_SIZE = 32, 224, 128
SEGMENTATION_BATCH, SEGMENTATION_SIZE = 8, 520   # torchvision's segmentation recipe crops 480-520
VIDEO_BATCH, VIDEO_FRAMES = 8, 16                # torchvision's video recipe: clips of 16 frames
#: Auxiliary-head loss weights: GoogLeNet's 0.3 for classifiers (Szegedy et al. 2015), torchvision's
#: segmentation recipe 0.5 for the ``aux`` output.
CLASSIFIER_AUX_WEIGHT, SEGMENTATION_AUX_WEIGHT = 0.3, 0.5

_UNSUPPORTED_TORCHVISION = ("detection", "optical_flow", "quantization")


def resolve(name: str) -> ZooEntry:
    """The entry for a command-line model name, or an :class:`FxplanError` that says what names are valid."""
    if not isinstance(name, str) or not name:
        raise FxplanError(f"a model name must be a non-empty string, got {name!r}")
    if name in registry.names():
        return registry.get(name)
    if name.startswith("hf:"):
        entry, model = hf.named_entry(name.removeprefix("hf:"))
        return _fit_to_machine(entry, model.build)
    if name.startswith("timm:"):
        return _timm(name.removeprefix("timm:"))
    entry = _torchvision(name)
    if entry is not None:
        return entry
    known = list(dict.fromkeys(registry.names() + _torchvision_names()))
    close = difflib.get_close_matches(name, known, n=3)
    raise FxplanError(
        f"unknown model {name!r}: not a zoo network ({', '.join(registry.names())}), a torchvision builder "
        "(torchvision.models.list_models()), timm:NAME or hf:NAME"
        + (f"; did you mean {', '.join(close)}?" if close else ""))


def resolve_all(names: Sequence[str]) -> list[ZooEntry]:
    """:func:`resolve` every name first, so that one bad name fails before any work; all bad names in one error."""
    entries, errors = [], []
    for name in names:
        try:
            entries.append(resolve(name))
        except FxplanError as exc:
            errors.append(str(exc))
    if errors:
        raise FxplanError("; ".join(errors))
    return entries


def parameter_bytes(builder: Callable[[], torch.nn.Module]) -> int:
    """Bytes of the parameters of ``builder()``, counted on the ``meta`` device (:func:`build_on_meta`)."""
    return sum(p.numel() * p.element_size() for p in build_on_meta(builder).parameters())


def _fit_to_machine(entry: ZooEntry, builder: Callable[[], torch.nn.Module]) -> ZooEntry:
    size = parameter_bytes(builder)
    if size <= REAL_PARAMETER_LIMIT:
        return entry
    return dataclasses.replace(entry, fake_only=True, quick_input_size=None,
                               description=f"{entry.description}; {size / 2**30:.1f} GiB of parameters: "
                                           "fake tensors only")


# ------------------------------------------------------------------------------------------ torchvision


def _torchvision_names() -> list[str]:
    import torchvision

    return list(torchvision.models.list_models())


def _group(name: str) -> str:
    """'classification', 'segmentation', 'video', or the unsupported group a torchvision name belongs to."""
    from torchvision import models

    for group in ("segmentation", "video", *_UNSUPPORTED_TORCHVISION):
        if name in models.list_models(module=getattr(models, group)):
            return group
    return "classification"


def _default_size(name: str) -> int:
    """The input side torchvision's recipes train ``name`` at: the smallest crop among its weights.

    The smallest, not the default weights' crop: ``vit_h_14``'s default weights are for 518², but the model
    built with ``weights=None`` takes 224² like its other weights. Inception-v3 gets its 299² (its
    auxiliary classifier needs it in train mode).
    """
    from torchvision import models

    try:
        weights = list(models.get_model_weights(name))
    except (ValueError, KeyError):
        return IMAGE_SIZE
    crops = [int(crop[0]) for w in weights if (crop := getattr(w.transforms(), "crop_size", None))]
    return min(crops, default=IMAGE_SIZE)


def _builder(name: str) -> Callable[[], torch.nn.Module]:
    """``get_model(name, weights=None)``, and ``weights_backbone=None`` where the builder has that argument:
    its default would download an ImageNet backbone."""
    import inspect

    from torchvision import models

    kwargs: dict[str, Any] = {"weights": None}
    if "weights_backbone" in inspect.signature(models.get_model_builder(name)).parameters:
        kwargs["weights_backbone"] = None
    return partial(models.get_model, name, **kwargs)


def _video_inputs(entry: ZooEntry, batch: int, size: int, device: Any) -> tuple[Tensor, ...]:
    return (torch.randn(batch, 3, VIDEO_FRAMES, size, size, device=device),)


def _torchvision(name: str) -> ZooEntry | None:
    if name not in _torchvision_names():
        return None
    group = _group(name)
    if group in _UNSUPPORTED_TORCHVISION:
        raise FxplanError(f"torchvision {name} is a {group.replace('_', '-')} model: fxplan's command line "
                          "measures classification, segmentation and video models (a detection or flow model "
                          "needs targets to train); use the Python API with your own loss_fn")
    builder = _builder(name)
    common = dict(paper_nodes=None, description=f"torchvision {name} (weights=None)", builder=builder,
                  min_batch=2)  # BatchNorm on 1x1 maps needs two values per channel in train mode
    if group == "segmentation":  # fully convolutional: real steps at a small size
        entry = ZooEntry(name, SEGMENTATION_BATCH, SEGMENTATION_SIZE, **common,
                         loss_fn=weighted_cross_entropy(SEGMENTATION_AUX_WEIGHT), kind="segmentation",
                         quick_input_size=QUICK_IMAGE_SIZE)
    elif group == "video":
        entry = ZooEntry(name, VIDEO_BATCH, _default_size(name), **common, loss_fn=weighted_cross_entropy(0.0),
                         kind="video", make_inputs=_video_inputs)
    else:
        entry = ZooEntry(name, IMAGE_BATCH, _default_size(name), **common,
                         loss_fn=weighted_cross_entropy(CLASSIFIER_AUX_WEIGHT))
    return _fit_to_machine(entry, builder)


# ------------------------------------------------------------------------------------------------- timm


def _timm(name: str) -> ZooEntry:
    try:
        import timm
    except ImportError:
        raise FxplanError(f"timm:{name} needs timm, which is not installed: pip install 'fxplan[timm]'") from None
    if not timm.is_model(name):
        close = difflib.get_close_matches(name, timm.list_models(), n=3)
        raise FxplanError(f"unknown timm model 'timm:{name}' (timm.list_models() lists them)"
                          + (f"; did you mean {', '.join('timm:' + c for c in close)}?" if close else ""))
    cfg = timm.get_pretrained_cfg(name)
    size = int(cfg.input_size[-1]) if cfg is not None else IMAGE_SIZE
    builder = partial(timm.create_model, name, pretrained=False)
    entry = ZooEntry(f"timm:{name}", IMAGE_BATCH, size, None, f"timm {name} (pretrained=False)", builder,
                     weighted_cross_entropy(CLASSIFIER_AUX_WEIGHT), min_batch=2)
    return _fit_to_machine(entry, builder)
