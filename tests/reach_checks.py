"""What "rewritten exactly" means for a model a user brings, checked the same way for every model.

:func:`assert_rewrite_exact` rewrites a model at a budget and checks, against an untouched deep copy of
the original: the user's model is not changed by planning; ``state_dict`` keys (and non-persistent
buffers) are the original's; in train mode (same seed) the output, every parameter gradient and every
buffer are bitwise equal after a step, and in eval mode the output too; the output has the original's
type (Hugging Face ``ModelOutput`` included); the measured peak of the plan is within the budget.
:func:`hf_model` builds the tiny Hugging Face models these checks run on.
"""

from __future__ import annotations

import copy
from typing import Any

import torch

import fxplan
from fxplan.capture.capturers import as_call


def loss_of(output: Any) -> torch.Tensor:
    """The model's own loss when it computes one (Hugging Face with labels), else the sum of outputs."""
    loss = getattr(output, "loss", None)
    if isinstance(loss, torch.Tensor):
        return loss
    return fxplan.measure.meter.default_loss(output)


def _forward(model: torch.nn.Module, inputs: Any, seed: int = 1) -> Any:
    call = as_call(inputs)
    torch.manual_seed(seed)
    return model(*call.args, **call.kwargs)


def _state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _non_persistent(model: torch.nn.Module) -> set[str]:
    return {f"{name}.{b}".lstrip(".") for name, m in model.named_modules() for b in m._non_persistent_buffers_set}


def assert_same_state(ref: torch.nn.Module, opt: torch.nn.Module, what: str) -> None:
    a, b = ref.state_dict(), opt.state_dict()
    assert list(a) == list(b), f"{what}: state_dict keys differ: {set(a) ^ set(b)}"
    differ = [k for k in a if not torch.equal(a[k], b[k])]
    assert not differ, f"{what}: buffers or parameters differ: {differ[:5]}"


def assert_rewrite_exact(model: torch.nn.Module, inputs: Any, budget_gb: float | None,
                         **rewrite_kwargs: Any) -> torch.nn.Module:
    """Rewrite ``model`` at ``budget_gb`` and assert it behaves exactly like the original; return it."""
    model.train()
    model.zero_grad(set_to_none=True)  # deepcopy does not copy .grad: start both from none
    ref = copy.deepcopy(model)
    before = _state(model)
    opt = fxplan.rewrite(model, budget_gb, example_inputs=inputs, loss_fn=loss_of, **rewrite_kwargs)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items()), "planning changed the model"
    assert list(opt.state_dict()) == list(ref.state_dict()), "state_dict keys differ"
    assert _non_persistent(opt) >= _non_persistent(ref), "a non-persistent buffer became persistent"
    if budget_gb is not None:
        assert opt.fxplan_measured_peak_bytes <= budget_gb * 2**30
        real = fxplan.measure_step(opt, inputs, loss_fn=loss_of).peak_bytes  # real tensors, not fake
        assert real <= budget_gb * 2**30, f"real peak {real} above the budget"

    for step in range(2):
        out_ref, out_opt = _forward(ref, inputs, seed=step), _forward(opt, inputs, seed=step)
        assert type(out_ref) is type(out_opt)
        assert torch.equal(loss_of(out_ref), loss_of(out_opt)), f"train output differs at step {step}"
        loss_of(out_ref).backward()
        loss_of(out_opt).backward()
        for (name, p), q in zip(ref.named_parameters(), opt.parameters()):
            assert (p.grad is None) == (q.grad is None), name
            assert p.grad is None or torch.equal(p.grad, q.grad), f"gradient of {name} differs at step {step}"
        assert_same_state(ref, opt, f"train step {step}")
    ref.eval()
    opt.eval()
    out_ref, out_opt = _forward(ref, inputs), _forward(opt, inputs)
    assert torch.equal(loss_of(out_ref), loss_of(out_opt)), "eval output differs"
    assert_same_state(ref, opt, "eval")
    model.train()
    return opt


def assert_rewrite_exact_at_two_budgets(model: torch.nn.Module, inputs: Any) -> torch.nn.Module:
    """:func:`assert_rewrite_exact` at the smallest peak fxplan reaches (budget None), then halfway from that
    peak to the vanilla peak (the budgets of :func:`middle_budget_gb`, without searching for the smallest
    peak twice); returns the first rewrite. ``model`` must be in train mode without ``.grad``."""
    vanilla = fxplan.measure_step(model, inputs, fake=True, loss_fn=loss_of).peak_bytes  # before steps add .grad
    opt = assert_rewrite_exact(model, inputs, None)
    assert_rewrite_exact(model, inputs, (opt.fxplan_measured_peak_bytes + vanilla) / 2 / 2**30)
    return opt


def middle_budget_gb(model: torch.nn.Module, inputs: Any) -> tuple[float, float]:
    """(smallest measured peak fxplan reaches, halfway to the vanilla peak), in GiB."""
    smallest = fxplan.rewrite(model, None, example_inputs=inputs, loss_fn=loss_of).fxplan_measured_peak_bytes
    vanilla = fxplan.measure_step(model, inputs, fake=True, loss_fn=loss_of).peak_bytes
    return smallest / 2**30, (smallest + vanilla) / 2 / 2**30


VOCAB = 96


def tokens(*shape: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, shape, generator=torch.Generator().manual_seed(sum(shape)))


def hf_model(family: str, attn: str) -> tuple[torch.nn.Module, dict]:
    """A tiny random-init model of ``family`` and keyword inputs with labels (so it returns a loss)."""
    import transformers as tf

    torch.manual_seed(0)
    small = dict(num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=4)
    if family == "gpt2":
        model = tf.GPT2LMHeadModel(tf.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=VOCAB, n_positions=32,
                                                 attn_implementation=attn))
        return model, {"input_ids": tokens(2, 12), "labels": tokens(2, 12)}
    if family == "llama":
        model = tf.LlamaForCausalLM(tf.LlamaConfig(**small, num_key_value_heads=2, vocab_size=VOCAB,
                                                   attn_implementation=attn))
        return model, {"input_ids": tokens(2, 12), "labels": tokens(2, 12)}
    if family == "bert":
        model = tf.BertForMaskedLM(tf.BertConfig(**small, vocab_size=VOCAB, attn_implementation=attn))
        # long enough that activations, not the embedding's gradient, set the peak
        return model, {"input_ids": tokens(4, 32), "attention_mask": torch.ones(4, 32, dtype=torch.long),
                       "labels": tokens(4, 32)}
    if family == "t5":
        model = tf.T5ForConditionalGeneration(tf.T5Config(num_layers=2, d_model=32, d_ff=64, num_heads=4, d_kv=8,
                                                          vocab_size=VOCAB, attn_implementation=attn))
        return model, {"input_ids": tokens(2, 10), "decoder_input_ids": tokens(2, 6), "labels": tokens(2, 6)}
    if family == "vit":
        model = tf.ViTForImageClassification(tf.ViTConfig(**small, image_size=32, patch_size=4, num_labels=5,
                                                          attn_implementation=attn))
        return model, {"pixel_values": torch.randn(4, 3, 32, 32), "labels": torch.tensor([1, 3, 0, 4])}
    raise ValueError(family)
