"""Hugging Face transformers in the zoo: models built from config classes, random init, training losses.

transformers is optional (the ``transformers`` extra): this module imports it only when a model is built
or a name is resolved, and says how to install it when it is missing. Nothing is downloaded: every model
comes from a config class (explicit sizes, or the class's defaults for ``hf:NAME``) through
``AutoModelFor*.from_config``, randomly initialised, with ``use_cache=False`` (a training step keeps no
key/value cache) and transformers' default attention (SDPA).

A model is called with positional tensors only, as ``fxplan.measure_step`` and ``fxplan compare`` do:

=====================  ==========================================  ===========================================
task                   inputs                                      loss (synthetic labels, no RNG drawn)
=====================  ==========================================  ===========================================
``causal-lm``          ``(input_ids,)`` ``(batch, seq)``           next-token cross-entropy; labels shifted
                                                                   left and the last position ignored, as
                                                                   transformers' own causal-LM loss does
``masked-lm``          ``(input_ids,)``                            cross-entropy on 15% of the positions
                                                                   (the others ignored, as in BERT's MLM)
``seq2seq-lm``         ``(input_ids, None, decoder_input_ids)``,   cross-entropy of the decoder logits
                       decoder length ``max(1, seq // 4)``         (T5 pre-training: 512 in, 114 out)
``image-classification`` ``(pixel_values,)`` ``(batch, 3, H, H)``  cross-entropy over the classes
=====================  ==========================================  ===========================================

Labels follow :func:`models_zoo.entry.synthetic_targets` (the label of flattened position ``k`` is
``(k * 7919) % classes``), so a recomputing executor and a plain step see the same labels.
"""

from __future__ import annotations

import contextlib
import difflib
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fxplan.errors import FxplanError
from models_zoo.entry import ZooEntry, synthetic_cross_entropy, synthetic_targets, tensor_leaves

#: Label value that cross-entropy ignores (transformers' convention).
IGNORE = -100
#: Share of positions that carry a masked-LM label (Devlin et al. 2019, section 3.1: 15%).
MLM_PERCENT = 15

#: ``AutoModelFor*`` class per task, and the mapping of transformers that says which model types have it.
_AUTO = {
    "seq2seq-lm": ("AutoModelForSeq2SeqLM", "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES"),
    "masked-lm": ("AutoModelForMaskedLM", "MODEL_FOR_MASKED_LM_MAPPING_NAMES"),
    "causal-lm": ("AutoModelForCausalLM", "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES"),
    "image-classification": ("AutoModelForImageClassification", "MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES"),
}


def require_transformers() -> Any:
    """The transformers module, or a clear :class:`FxplanError` saying how to install it."""
    try:
        import transformers
    except ImportError:
        raise FxplanError("this model needs Hugging Face transformers, which is not installed: "
                          "pip install 'fxplan[transformers]'") from None
    return transformers


@contextlib.contextmanager
def _quiet_transformers() -> Iterator[None]:
    """Silence transformers' warnings about default configs (e.g. token ids) while a model is built."""
    from transformers.utils import logging

    level = logging.get_verbosity()
    logging.set_verbosity_error()
    try:
        yield
    finally:
        logging.set_verbosity(level)


# -------------------------------------------------------------------------------------------- losses


def output_logits(output: Any) -> Tensor:
    """The logits of a model output: ``output.logits`` of a transformers ``ModelOutput``, else its first tensor."""
    logits = getattr(output, "logits", None)
    if isinstance(logits, Tensor):
        return logits
    leaves = tensor_leaves(output)
    if not leaves:
        raise FxplanError(f"the model returned no tensor ({type(output).__name__}), so no loss can be formed")
    return leaves[0]


def causal_lm_loss(output: Any) -> Tensor:
    """Next-token cross-entropy: the label of position ``t`` is the synthetic token of ``t + 1``.

    Labels are shifted, not logits (a shifted view of the logits would be copied by the flattening), and
    the last position, which has no next token, is ignored: what transformers' ``ForCausalLMLoss`` does.
    """
    logits = output_logits(output)
    labels = F.pad(synthetic_targets(logits, class_dim=-1)[..., 1:], (0, 1), value=IGNORE)
    return F.cross_entropy(logits.flatten(0, -2), labels.flatten(), ignore_index=IGNORE)


def masked_lm_loss(output: Any) -> Tensor:
    """Cross-entropy on the positions ``k`` with ``k % 100 < 15`` (15%), the others ignored."""
    logits = output_logits(output)
    labels = synthetic_targets(logits, class_dim=-1).flatten()
    position = torch.arange(labels.numel(), device=labels.device)
    labels = torch.where(position % 100 < MLM_PERCENT, labels, IGNORE)
    return F.cross_entropy(logits.flatten(0, -2), labels, ignore_index=IGNORE)


def seq2seq_lm_loss(output: Any) -> Tensor:
    """Cross-entropy of the decoder logits against synthetic labels (every position)."""
    logits = output_logits(output)
    return F.cross_entropy(logits.flatten(0, -2), synthetic_targets(logits, class_dim=-1).flatten())


def image_classification_loss(output: Any) -> Tensor:
    """Cross-entropy of the class logits against synthetic labels."""
    return synthetic_cross_entropy(output_logits(output), class_dim=1)


LOSSES = {"causal-lm": causal_lm_loss, "masked-lm": masked_lm_loss, "seq2seq-lm": seq2seq_lm_loss,
          "image-classification": image_classification_loss}


# -------------------------------------------------------------------------------------------- inputs


def _token_inputs(vocab: int, seq2seq: bool, entry: ZooEntry, batch: int, seq: int, device: Any) -> tuple:
    ids = torch.randint(0, vocab, (batch, seq), device=device)
    if not seq2seq:
        return (ids,)
    return (ids, None, torch.randint(0, vocab, (batch, max(1, seq // 4)), device=device))


def _pixel_inputs(channels: int, entry: ZooEntry, batch: int, size: int, device: Any) -> tuple:
    return (torch.randn(batch, channels, size, size, device=device),)


# ------------------------------------------------------------------------------------------- building


@dataclass(frozen=True)
class HFModel:
    """A transformers model: config class name, task, and the config's sizes (empty: the class's defaults)."""

    config: str
    task: str
    sizes: dict[str, Any] = field(default_factory=dict)

    def make_config(self) -> Any:
        transformers = require_transformers()
        with _quiet_transformers():
            config = getattr(transformers, self.config)(**self.sizes)
        if hasattr(config, "use_cache"):
            config.use_cache = False
        return config

    def build(self) -> nn.Module:
        """A fresh, randomly initialised model (on the current default device)."""
        transformers = require_transformers()
        config = self.make_config()
        with _quiet_transformers():
            return getattr(transformers, _AUTO[self.task][0]).from_config(config)

    def setting(self, key: str, default: Any = None) -> Any:
        """A config value: from ``sizes`` when given there (no import), else from the config class's defaults."""
        if key in self.sizes:
            return self.sizes[key]
        return getattr(self.make_config(), key, default)

    def entry(self, name: str, batch: int, size: int, description: str, *, quick_input_size: int | None,
              fake_only: bool = False) -> ZooEntry:
        """A :class:`ZooEntry` for this model: ``size`` is the sequence length, or the image side."""
        if self.task == "image-classification":
            channels = int(self.setting("num_channels", 3))
            make_inputs, kind, in_channels = partial(_pixel_inputs, channels), "classification", channels
        else:
            make_inputs = partial(_token_inputs, int(self.setting("vocab_size")), self.task == "seq2seq-lm")
            kind, in_channels = "language", 0
        return ZooEntry(name, batch, size, None, description, self.build, LOSSES[self.task], kind=kind,
                        in_channels=in_channels, make_inputs=make_inputs, quick_input_size=quick_input_size,
                        fake_only=fake_only)


#: The zoo's transformers: explicit sizes of the published models (random init), and tiny sizes for tests.
ZOO: dict[str, tuple[HFModel, HFModel]] = {
    "gpt2_small": (
        HFModel("GPT2Config", "causal-lm", dict(n_layer=12, n_embd=768, n_head=12, vocab_size=50257,
                                                 n_positions=1024)),
        HFModel("GPT2Config", "causal-lm", dict(n_layer=2, n_embd=32, n_head=2, vocab_size=128, n_positions=64)),
    ),
    "llama_1b": (
        # TinyLlama-1.1B's shape: 22 layers, hidden 2048, grouped-query attention (32 heads, 4 KV heads).
        HFModel("LlamaConfig", "causal-lm", dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
                                                  num_attention_heads=32, num_key_value_heads=4, vocab_size=32000,
                                                  max_position_embeddings=2048)),
        HFModel("LlamaConfig", "causal-lm", dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                                  num_attention_heads=2, num_key_value_heads=1, vocab_size=128,
                                                  max_position_embeddings=64)),
    ),
    "bert_base": (
        HFModel("BertConfig", "masked-lm", dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                                                 intermediate_size=3072, vocab_size=30522,
                                                 max_position_embeddings=512)),
        HFModel("BertConfig", "masked-lm", dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                                 intermediate_size=64, vocab_size=128, max_position_embeddings=64)),
    ),
    "t5_small": (
        HFModel("T5Config", "seq2seq-lm", dict(d_model=512, d_ff=2048, d_kv=64, num_layers=6, num_heads=8,
                                                vocab_size=32128)),
        HFModel("T5Config", "seq2seq-lm", dict(d_model=32, d_ff=64, d_kv=16, num_layers=2, num_heads=2,
                                                vocab_size=128)),
    ),
    "vit_base_16": (
        HFModel("ViTConfig", "image-classification", dict(hidden_size=768, num_hidden_layers=12,
                                                           num_attention_heads=12, intermediate_size=3072,
                                                           image_size=224, patch_size=16, num_labels=1000,
                                                           num_channels=3)),
        HFModel("ViTConfig", "image-classification", dict(hidden_size=32, num_hidden_layers=2,
                                                           num_attention_heads=2, intermediate_size=64,
                                                           image_size=32, patch_size=8, num_labels=10,
                                                           num_channels=3)),
    ),
}


def zoo_entries() -> list[ZooEntry]:
    """The zoo's transformer entries (listing them imports nothing; building them needs transformers)."""
    specs = {  # name: (batch, sequence or image side, description, quick input size, fake tensors only)
        "gpt2_small": (8, 1024, "GPT-2 small (124M) causal LM, transformers GPT2LMHeadModel", 128, False),
        "llama_1b": (4, 2048, "Llama-style 1.1B decoder (TinyLlama's shape), causal LM; fake tensors only",
                     None, True),
        "bert_base": (16, 512, "BERT-base (110M) masked LM, transformers BertForMaskedLM", 128, False),
        "t5_small": (32, 512, "T5-small (60M) seq2seq LM, 512 tokens in, 128 out", 128, False),
        "vit_base_16": (64, 224, "ViT-B/16 (86M) image classifier, 1000 classes", 224, False),
    }
    return [ZOO[name][0].entry(name, batch, size, text, quick_input_size=quick, fake_only=fake)
            for name, (batch, size, text, quick, fake) in specs.items()]


def tiny_entry(name: str) -> ZooEntry:
    """The zoo transformer ``name`` with tiny sizes (2 layers, width 32): same code paths, seconds to run."""
    if name not in ZOO:
        raise FxplanError(f"no transformer zoo entry {name!r}; valid names: {', '.join(ZOO)}")
    model = ZOO[name][1]
    size = model.sizes.get("image_size", 16)
    return model.entry(name, 2, size, f"tiny {name} (tests)", quick_input_size=size)


# ------------------------------------------------------------------------------------------- hf:NAME

#: Defaults for ``hf:NAME``: (batch, longest sequence) for text, batch for images.
TEXT_BATCH, TEXT_SEQ, IMAGE_BATCH, QUICK_SEQ = 8, 512, 32, 64


def config_class_name(name: str) -> str:
    """The config class of ``hf:NAME``: a config class name (``GPT2Config``) or a model type (``gpt2``)."""
    transformers = require_transformers()
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    if name in CONFIG_MAPPING_NAMES:
        return CONFIG_MAPPING_NAMES[name]
    cls = getattr(transformers, name, None) if name.endswith("Config") else None
    if isinstance(cls, type) and issubclass(cls, transformers.PretrainedConfig) and getattr(cls, "model_type", ""):
        return name
    known = sorted(set(CONFIG_MAPPING_NAMES) | set(CONFIG_MAPPING_NAMES.values()))
    close = difflib.get_close_matches(name, known, n=3)
    raise FxplanError(f"unknown Hugging Face model 'hf:{name}': not a transformers config class (e.g. GPT2Config) "
                      "nor a model type (e.g. gpt2, as in transformers.AutoConfig.for_model)"
                      + (f"; did you mean {', '.join('hf:' + c for c in close)}?" if close else ""))


def task_of(config_name: str) -> str:
    """The training task fxplan uses for a config class: the first of seq2seq LM, masked LM, causal LM and
    image classification that transformers has a model for (so BERT is a masked LM, GPT-2 a causal one)."""
    transformers = require_transformers()
    from transformers.models.auto import modeling_auto

    model_type = getattr(transformers, config_name).model_type
    for task, (_, mapping) in _AUTO.items():
        if model_type in getattr(modeling_auto, mapping, {}):
            return task
    raise FxplanError(f"hf:{model_type} has no seq2seq-LM, masked-LM, causal-LM or image-classification model in "
                      "transformers, so fxplan cannot form a training loss for it from the command line; use the "
                      "Python API with your own loss_fn")


def named_entry(name: str) -> tuple[ZooEntry, HFModel]:
    """The entry of ``hf:NAME`` at the config class's default sizes (see :data:`TEXT_BATCH` and friends)."""
    config_name = config_class_name(name)
    model = HFModel(config_name, task_of(config_name))
    config = model.make_config()
    if model.task == "image-classification":
        image = getattr(config, "image_size", 224)
        size = int(image[0] if isinstance(image, (tuple, list)) else image)
        batch, quick = IMAGE_BATCH, size  # learned position embeddings fix the image size
    else:
        longest = next((getattr(config, a) for a in ("max_position_embeddings", "n_positions")
                        if isinstance(getattr(config, a, None), int)), TEXT_SEQ)
        size, batch = min(TEXT_SEQ, longest), TEXT_BATCH
        quick = min(QUICK_SEQ, size)
    description = f"transformers {config_name}() defaults, {model.task}, random init"
    return model.entry(f"hf:{name}", batch, size, description, quick_input_size=quick), model
