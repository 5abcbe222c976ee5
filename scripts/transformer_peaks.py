"""Main-batch peaks of the zoo's transformers: vanilla, Hugging Face checkpointing and fxplan, in one run.

Usage: python scripts/transformer_peaks.py [NAME ...]   (default: gpt2_small bert_base t5_small vit_base_16)

Every peak is one whole training step measured on fake tensors (exact; nothing is allocated) with the
same meter, :func:`fxplan.measure_step`, at the zoo's main batch and input size. fxplan's row is
``fxplan.rewrite(model, None)``: the smallest measured peak it reaches, with the recomputation that
costs and the seconds planning took.
"""

from __future__ import annotations

import sys
import time

import torch

import fxplan
import models_zoo
from fxplan.common.console import format_table
from fxplan.compare import peers
from fxplan.measure.meter import GiB

DEFAULT = ["gpt2_small", "bert_base", "t5_small", "vit_base_16"]


def measure(name: str) -> list[list[str]]:
    entry = models_zoo.get(name)
    torch.manual_seed(0)
    model = entry.build()
    inputs = entry.example_inputs()  # real CPU tensors (meta for a fake_only entry); measured on fake ones
    vanilla = fxplan.measure_step(model, inputs, fake=True, loss_fn=entry.loss).peak_bytes
    hf = fxplan.measure_step(peers.hf_checkpointing_peer(model), inputs, fake=True, loss_fn=entry.loss).peak_bytes
    start = time.perf_counter()
    module = fxplan.rewrite(model, None, example_inputs=inputs, loss_fn=entry.loss)
    seconds = time.perf_counter() - start
    plan = module.fxplan_plan
    ours = module.fxplan_measured_peak_bytes

    def row(method: str, peak: int, recompute: str, extra: str) -> list[str]:
        return [name, method, f"{peak / GiB:.2f}", f"{100 * (peak / vanilla - 1):+.1f}%", recompute, extra]

    return [row("vanilla", vanilla, "0%", ""),
            row("hf-checkpointing", hf, "every layer", ""),
            row("fxplan rewrite(None)", ours, f"{100 * plan.recompute_fraction:.0f}% of a forward",
                f"{plan.num_segments} segments, planned in {seconds:.0f} s")]


def main(names: list[str]) -> None:
    for name in names:
        rows = measure(name)
        print(format_table(["network", "method", "peak GiB", "vs vanilla", "recomputed", "note"], rows), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:] or DEFAULT)
