"""The tiny Hugging Face models and steps the tests of fxplan in a training stack share."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


def tiny_gpt2(seed: int = 0, **config: Any) -> nn.Module:
    """A 2-layer GPT-2 of width 128 (vocabulary 1000, 64 positions, no cache), its weights drawn from ``seed``."""
    import transformers

    torch.manual_seed(seed)
    settings = dict(n_layer=2, n_embd=128, n_head=4, vocab_size=1000, n_positions=64, use_cache=False) | config
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(**settings))


def token_batch(batch_size: int = 4, length: int = 64) -> dict[str, torch.Tensor]:
    """Token ids from a fixed generator, as inputs and labels."""
    ids = torch.randint(0, 1000, (batch_size, length), generator=torch.Generator().manual_seed(0))
    return {"input_ids": ids, "labels": ids}


def hf_loss(output: Any) -> torch.Tensor:
    return output.loss


def train_step(model: nn.Module, batch: dict, seed: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """One step with the random state set from ``seed`` (the same dropout masks for two models): loss, gradients."""
    torch.manual_seed(seed)
    loss = model(**batch).loss
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()]


def trainer_losses(model: nn.Module, rows: list[dict], out: str, max_steps: int) -> tuple[list[float], Any]:
    """The logged losses of ``max_steps`` steps of a Hugging Face ``Trainer`` with default arguments (batch 4, CPU,
    seed 0, nothing saved) on the dataset ``rows``, and the trainer."""
    import transformers

    args = transformers.TrainingArguments(output_dir=out, per_device_train_batch_size=4, max_steps=max_steps,
                                          logging_steps=1, report_to=[], use_cpu=True, seed=0, save_strategy="no",
                                          disable_tqdm=True)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=rows)
    trainer.train()
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry], trainer
