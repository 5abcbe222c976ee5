"""``ZooEntry``: one benchmark network with its paper settings, inputs and training loss.

An entry is data plus three callables (builder, input maker, loss). It never downloads weights and never
touches a device other than the one asked for. Inputs come from plain torch factory calls (``torch.randn``,
``torch.randint``), so calling :meth:`ZooEntry.example_inputs` inside ``torch._subclasses.FakeTensorMode()``
returns fake tensors and allocates nothing. Models are built on the CPU with real parameters (some
initialisers, e.g. GoogLeNet's truncated normal, cannot run under fake tensors); converting a built model
to fake tensors is the measuring code's job.

Losses (:meth:`ZooEntry.loss`) reduce whatever the model returns to a scalar with *synthetic* targets that
consume no random numbers: the target at flattened position ``k`` is ``(k * 7919) % classes``. A
recomputing executor and a plain training step therefore see identical targets, and the global RNG stream
is the same with and without a plan.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fxplan.errors import FxplanError

#: A prime that spreads synthetic targets over the classes.
_TARGET_STRIDE = 7919


def synthetic_targets(logits: Tensor, class_dim: int = 1) -> Tensor:
    """Deterministic class indices for ``logits``: shape of ``logits`` without ``class_dim``, dtype long."""
    classes = logits.shape[class_dim]
    shape = [s for d, s in enumerate(logits.shape) if d != class_dim % logits.dim()]
    n = 1
    for s in shape:
        n *= s
    return ((torch.arange(n, device=logits.device) * _TARGET_STRIDE) % classes).reshape(shape)


def synthetic_cross_entropy(logits: Tensor, class_dim: int = 1) -> Tensor:
    """Mean cross-entropy of ``logits`` against :func:`synthetic_targets`."""
    if class_dim % logits.dim() != 1:
        logits = logits.movedim(class_dim, 1)
    return F.cross_entropy(logits, synthetic_targets(logits, 1))


def tensor_leaves(output: Any) -> list[Tensor]:
    """The tensors in a model output (a tensor, or nested tuples/lists/dicts/namedtuples), in order."""
    if isinstance(output, Tensor):
        return [output]
    if isinstance(output, dict):
        return [t for v in output.values() for t in tensor_leaves(v)]
    if isinstance(output, (tuple, list)):
        return [t for v in output for t in tensor_leaves(v)]
    return []


def weighted_cross_entropy(aux_weight: float, class_dim: int = 1) -> Callable[[Any], Tensor]:
    """Loss ``CE(main) + aux_weight * sum(CE(aux_i))``: the first tensor of the output is the main logits.

    This is how GoogLeNet (weight 0.3, Szegedy et al. 2015, section 6) and PSPNet (weight 0.4, Zhao et al.
    2017, section 3.4) train their auxiliary classifiers. A plain tensor output gives plain CE.
    """

    def loss(output: Any) -> Tensor:
        main, *aux = tensor_leaves(output)
        total = synthetic_cross_entropy(main, class_dim)
        for a in aux:
            total = total + aux_weight * synthetic_cross_entropy(a, class_dim)
        return total

    return loss


def build_on_meta(builder: Callable[[], nn.Module]) -> nn.Module:
    """``builder()`` on the ``meta`` device: shapes only, nothing allocated.

    A builder that reads values while it initialises (RegNet computes its widths from tensors) cannot run
    on ``meta``; it is built on the CPU once and moved to ``meta``.
    """
    try:
        with torch.device("meta"):
            return builder()
    except Exception:  # any failure on meta means the builder needs real values
        return builder().to("meta")


def _image_inputs(entry: ZooEntry, batch: int, size: int, device: Any) -> tuple[Tensor, ...]:
    return (torch.randn(batch, entry.in_channels, size, size, device=device),)


@dataclass(frozen=True)
class ZooEntry:
    """A benchmark network: paper settings (Kusumoto et al. 2019, Table 1), builder, inputs and loss.

    ``input_size`` is the height (= width) of the square image input, or the sequence length for a
    language model. ``paper_nodes`` is #V from Table 1 (``None`` where the paper has no such network).
    ``min_batch`` is the smallest batch the model trains with (BatchNorm on 1x1 maps needs 2).
    ``quick_input_size`` is a small input size the network accepts, for quick real steps (timing on a
    CPU); ``None`` means the paper's size. For networks outside Table 1, ``paper_batch`` is the default
    batch (a realistic training batch for that model).

    ``fake_only`` entries are too large to train for real on a small machine (e.g. a 1B-parameter
    decoder): :meth:`build` makes the model on the ``meta`` device (shapes only, nothing allocated) and
    :meth:`example_inputs` makes ``meta`` inputs by default, so the step can only be measured on fake
    tensors (:func:`fxplan.measure_step` with ``fake=True`` converts both).
    """

    name: str
    paper_batch: int
    input_size: int
    paper_nodes: int | None
    description: str
    builder: Callable[[], nn.Module] = field(repr=False)
    loss_fn: Callable[[Any], Tensor] = field(repr=False)
    kind: str = "classification"
    in_channels: int = 3
    min_batch: int = 1
    make_inputs: Callable[[ZooEntry, int, int, Any], tuple[Tensor, ...]] = field(
        default=_image_inputs, repr=False
    )
    check_size: Callable[[int], Any] | None = field(default=None, repr=False)
    quick_input_size: int | None = None
    fake_only: bool = False

    def build(self) -> nn.Module:
        """A fresh, randomly initialised model on the CPU in train mode (no weights are downloaded).

        For a ``fake_only`` entry the model is built on the ``meta`` device instead (:func:`build_on_meta`).
        """
        return (build_on_meta(self.builder) if self.fake_only else self.builder()).train()

    def example_inputs(
        self, batch_size: int | None = None, input_size: int | None = None, *, device: Any = None
    ) -> tuple[Tensor, ...]:
        """Positional inputs for one training step; defaults are the paper's batch and input size.

        Uses the global RNG (seed it with ``torch.manual_seed`` for repeatable inputs). Raises
        :class:`FxplanError` for a batch below ``min_batch`` or an input size the network cannot take.
        ``device`` defaults to the CPU, or to ``meta`` for a ``fake_only`` entry.
        """
        batch = self.paper_batch if batch_size is None else int(batch_size)
        size = self.input_size if input_size is None else int(input_size)
        if batch < self.min_batch:
            raise FxplanError(
                f"{self.name} needs batch_size >= {self.min_batch} in train mode, got {batch}"
            )
        if size < 1:
            raise FxplanError(f"{self.name}: input_size must be positive, got {size}")
        if self.check_size is not None:
            self.check_size(size)
        if device is None and self.fake_only:
            device = "meta"
        return self.make_inputs(self, batch, size, device)

    def loss(self, output: Any) -> Tensor:
        """Scalar training loss of a model output, with synthetic targets (see the module docstring)."""
        return self.loss_fn(output)

