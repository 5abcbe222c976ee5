"""Planning time against the capture: ``fxplan.rewrite`` and ``fxplan.auto_checkpoint``, with and without a budget,
beside the goal of at most 3x the capture + 2 s, side by side in one run.

The capture is ``torch.export`` (non-strict) of the same model and call for models fxplan captures by export (the
Hugging Face ones: GPT-2, Llama, and a 2-layer Mamba of width 64 with its reference scan), and one warm fake step
(``fxplan.measure_step(fake=True)``) for models ``symbolic_trace`` captures. The budget is halfway between the
unplanned peak and the smallest one ``fxplan.rewrite`` reaches. Each model is built afresh (random weights from its
config class) and each call runs once, one thread. Run:

    python scripts/planning_time.py [--models gpt2 llama resnet50 mamba]
"""

from __future__ import annotations

import argparse
import time

import torch

import fxplan


def _gpt2():
    import transformers

    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=4, n_embd=128, n_head=4, vocab_size=1000,
                                                                 n_positions=64, use_cache=False))
    ids = torch.randint(0, 1000, (4, 64), generator=torch.Generator().manual_seed(0))
    return model, {"input_ids": ids, "labels": ids}, _hf_loss, "export"


def _llama():
    import transformers

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        num_hidden_layers=4, hidden_size=128, intermediate_size=344, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=1000, use_cache=False))
    ids = torch.randint(0, 1000, (4, 64), generator=torch.Generator().manual_seed(0))
    return model, {"input_ids": ids, "labels": ids}, _hf_loss, "export"


def _mamba():
    import transformers

    torch.manual_seed(0)
    model = transformers.MambaForCausalLM(transformers.MambaConfig(num_hidden_layers=2, hidden_size=64,
                                                                   vocab_size=1000, use_cache=False))
    ids = torch.randint(0, 1000, (4, 64), generator=torch.Generator().manual_seed(0))
    return model, {"input_ids": ids, "labels": ids}, _hf_loss, "export"


def _resnet50():
    import torchvision

    torch.manual_seed(0)
    return torchvision.models.resnet50(), (torch.randn(96, 3, 224, 224),), None, "fake step"


MODELS = {"gpt2": _gpt2, "llama": _llama, "resnet50": _resnet50, "mamba": _mamba}


def _hf_loss(output):
    return output.loss


def _capture_seconds(model, inputs, loss_fn, kind: str) -> float:
    if kind == "export":
        start = time.perf_counter()
        torch.export.export(model, (), inputs, strict=False)
        return time.perf_counter() - start
    fxplan.measure_step(model, inputs, fake=True, loss_fn=loss_fn)  # warm
    start = time.perf_counter()
    fxplan.measure_step(model, inputs, fake=True, loss_fn=loss_fn)
    return time.perf_counter() - start


def _timed(fn, *args, **kwargs) -> tuple[float, object]:
    start = time.perf_counter()
    out = fn(*args, **kwargs)
    return time.perf_counter() - start, out


def _share(seconds: float, goal: float) -> str:
    return f"{seconds:.1f} ({seconds / goal:.1f}x)"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}, one thread")
    print(f"{'model':<10}{'capture s':>10}{'goal s':>8}  " + "".join(f"{h:>13}" for h in (
        "rewrite none", "rewrite mid", "auto none", "auto mid")))
    for name in args.models:
        model, inputs, loss_fn, kind = MODELS[name]()
        capture = _capture_seconds(model, inputs, loss_fn, kind)
        goal = 3 * capture + 2
        vanilla = fxplan.measure_step(model, inputs, fake=True, loss_fn=loss_fn).peak_bytes
        none_s, smallest = _timed(fxplan.rewrite, model, None, example_inputs=inputs, loss_fn=loss_fn)
        middle = (vanilla + smallest.fxplan_measured_peak_bytes) // 2
        mid_s, _ = _timed(fxplan.rewrite, model, budget_bytes=middle, example_inputs=inputs, loss_fn=loss_fn)
        cells = [_share(none_s, goal), _share(mid_s, goal)]
        for budget in (None, middle):
            fxplan.remove_checkpoints(model)
            start = time.perf_counter()
            try:
                fxplan.auto_checkpoint(model, example_inputs=inputs, loss_fn=loss_fn, budget_bytes=budget)
                cells.append(_share(time.perf_counter() - start, goal))
            except fxplan.BudgetError:  # the model's modules take no plan this low
                cells.append(f"refused {time.perf_counter() - start:.1f}")
        fxplan.remove_checkpoints(model)
        row = "".join(f"{c:>13}" for c in cells)
        print(f"{name:<10}{capture:>10.2f}{goal:>8.1f}  {row}", flush=True)
    print("cells: seconds (share of the goal, 3x the capture + 2 s); refused: a BudgetError after that many seconds")


if __name__ == "__main__":
    main()
