"""Reach: Hugging Face transformers (captured by torch.export), rewritten exactly.

Each tiny model is rewritten at the smallest budget fxplan reaches and halfway to the vanilla peak, and
checked by :func:`reach_checks.assert_rewrite_exact`.
"""

from __future__ import annotations

import pytest
from reach_checks import assert_rewrite_exact, assert_rewrite_exact_at_two_budgets, hf_model, middle_budget_gb
from torch import nn

pytest.importorskip("transformers")

pytestmark = pytest.mark.usefixtures("one_torch_thread")


class LogitsOnly(nn.Module):
    """The wrapping users write: ``forward(input_ids)`` returns the logits tensor."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, input_ids):
        return self.inner(input_ids=input_ids).logits


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("family", ["gpt2", "llama", "bert", "t5", "vit"])
def test_transformers_rewritten_exactly_at_two_budgets(family, attn):
    model, inputs = hf_model(family, attn)
    opt = assert_rewrite_exact_at_two_budgets(model, inputs)
    assert len(opt.fxplan_segments) > 1


@pytest.mark.parametrize("family", ["gpt2", "bert"])
def test_transformers_wrapped_positional(family):
    model, inputs = hf_model(family, "sdpa")
    wrapped = LogitsOnly(model)
    ids = (inputs["input_ids"],)
    _, middle = middle_budget_gb(wrapped, ids)
    assert_rewrite_exact(wrapped, ids, middle)
