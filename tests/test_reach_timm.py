"""Reach: timm models (BatchNorm subclasses, drop-path, shape assertions), rewritten exactly.

Each tiny model is rewritten at the smallest budget fxplan reaches and halfway to the vanilla peak, and
checked by :func:`reach_checks.assert_rewrite_exact`.
"""

from __future__ import annotations

import pytest
import torch
from reach_checks import assert_rewrite_exact_at_two_budgets

timm = pytest.importorskip("timm")

pytestmark = pytest.mark.usefixtures("one_torch_thread")


TIMM = ["resnext26ts", "efficientnet_b0", "regnety_002", "cspdarknet53", "densenet121", "mobilevit_xxs",
        "tf_efficientnet_b0", "dla34"]


@pytest.mark.parametrize("name", TIMM)
def test_timm_rewritten_exactly_at_two_budgets(name):
    torch.manual_seed(0)
    try:  # drop-path on where the model has it: a random op whose train/eval flag must follow the mode
        model = timm.create_model(name, pretrained=False, num_classes=5, drop_rate=0.1, drop_path_rate=0.1)
    except TypeError:
        model = timm.create_model(name, pretrained=False, num_classes=5, drop_rate=0.1)
    x = (torch.randn(2, 3, 64, 64),)
    assert_rewrite_exact_at_two_budgets(model, x)
