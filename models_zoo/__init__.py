"""Networks used by fxplan benchmarks, tests and CLI: the benchmarks of Kusumoto et al. (2019, Table 1),
an LSTM language model for BPTT planning (Gruslys et al. 2016), and five Hugging Face transformers
(:mod:`models_zoo.hf`; building them needs the optional transformers package).

>>> import models_zoo
>>> entry = models_zoo.get("resnet50")
>>> model = entry.build()                                  # fresh, random, CPU, train mode
>>> (x,) = entry.example_inputs(batch_size=2, input_size=64)
>>> entry.loss(model(x)).backward()

See docs/zoo.md for the table of networks, node counts and parameter counts. :func:`resolve` also
accepts torchvision builder names, ``timm:NAME`` and ``hf:NAME`` (:mod:`models_zoo.lookup`).
"""

from __future__ import annotations

from models_zoo import hf
from models_zoo.entry import ZooEntry, synthetic_cross_entropy, synthetic_targets, weighted_cross_entropy
from models_zoo.lookup import resolve, resolve_all
from models_zoo.lstm_lm import LSTMCore, LSTMLanguageModel, lm_loss
from models_zoo.pspnet import PSPNet
from models_zoo.registry import get, names, paper_names, transformer_names
from models_zoo.unet import UNet, unet_output_size

__all__ = [
    "LSTMCore", "LSTMLanguageModel", "PSPNet", "UNet", "ZooEntry", "get", "hf", "lm_loss", "names", "paper_names",
    "resolve", "resolve_all", "synthetic_cross_entropy", "synthetic_targets", "transformer_names",
    "unet_output_size", "weighted_cross_entropy",
]
