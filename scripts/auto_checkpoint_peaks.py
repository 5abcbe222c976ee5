"""Smallest peaks of one training step: unplanned, ``fxplan.auto_checkpoint`` and ``fxplan.rewrite``, side by side.

Tiny Hugging Face decoders from config classes (random weights, ``use_cache=False``) and a torchvision CNN, on
fake tensors (exact peaks, nothing allocated); seconds of planning beside each. Run:

    python scripts/auto_checkpoint_peaks.py
"""

from __future__ import annotations

import time

import torch
import torchvision
import transformers

import fxplan


def _decoders():
    ids = torch.randint(0, 1000, (4, 64), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "labels": ids}
    gpt2 = transformers.GPT2Config(n_layer=2, n_embd=128, n_head=4, vocab_size=1000, n_positions=64, use_cache=False)
    llama = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=128, intermediate_size=256,
                                     num_attention_heads=4, num_key_value_heads=2, vocab_size=1000, use_cache=False)
    yield "gpt2 2x128, 4x64", lambda: transformers.GPT2LMHeadModel(gpt2), batch, lambda o: o.loss
    yield "llama 2x128, 4x64", lambda: transformers.LlamaForCausalLM(llama), batch, lambda o: o.loss
    yield "resnet18, 8x3x64x64", torchvision.models.resnet18, (torch.randn(8, 3, 64, 64),), None


def main() -> None:
    transformers.logging.set_verbosity_error()
    print("| model | unplanned | auto_checkpoint | s | rewrite | s |")
    print("|---|---|---|---|---|---|")
    for name, build, call, loss_fn in _decoders():
        torch.manual_seed(0)
        model = build()
        vanilla = fxplan.measure_step(model, call, fake=True, loss_fn=loss_fn).peak_bytes
        t0 = time.perf_counter()
        fxplan.auto_checkpoint(model, example_inputs=call, loss_fn=loss_fn)
        applied, t_applied = model.fxplan_plan.measured_peak_bytes, time.perf_counter() - t0
        fxplan.remove_checkpoints(model)
        t0 = time.perf_counter()
        rewritten = fxplan.rewrite(model, example_inputs=call, loss_fn=loss_fn).fxplan_measured_peak_bytes
        t_rewrite = time.perf_counter() - t0
        mib = 2**20
        print(f"| {name} | {vanilla / mib:.1f} MiB | {applied / mib:.1f} MiB ({applied / vanilla:.2f}) | "
              f"{t_applied:.1f} | {rewritten / mib:.1f} MiB ({rewritten / vanilla:.2f}) | {t_rewrite:.1f} |")


if __name__ == "__main__":
    main()
