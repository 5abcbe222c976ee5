"""On a CUDA device: what fxplan does with a model whose LSTM runs on cuDNN.

cuDNN's RNN keeps a reserve buffer for backward that its fake kernel reports as 0 bytes, so fxplan refuses
to plan it on fake tensors (:data:`fxplan.measure.scratch.UNCOUNTABLE_ON_FAKE`). This script checks, on the device:

1. with cuDNN on, ``fxplan.rewrite`` raises :class:`fxplan.FxplanError` naming the way out;
2. with cuDNN off (the way out), the rewritten model's gradients equal the plain model's to the bit, and
   fxplan's fake-tensor meter agrees with the caching allocator (``max_memory_allocated``) on the plain
   step and on the rewritten one.

Usage: python scripts/cudnn_rnn_check.py [--batch-size N] [--steps T] [--device cpu]
"""

from __future__ import annotations

import argparse
import copy

import torch
from torch import nn

import fxplan
from fxplan.measure.meter import measure_step

MiB = 2**20


class LSTMClassifier(nn.Module):
    """Two stacked LSTM layers and a linear head on the last step's hidden state."""

    def __init__(self, features: int = 256, hidden: int = 512, classes: int = 10) -> None:
        super().__init__()
        self.lstm = nn.LSTM(features, hidden, num_layers=2, batch_first=True)
        self.head = nn.Linear(hidden, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.lstm(x)
        return self.head(out[:, -1])


def gradients(module: nn.Module, x: torch.Tensor) -> dict[str, torch.Tensor]:
    """The parameters' gradients after one step of ``module`` on ``x`` (loss: sum of the output)."""
    module.zero_grad(set_to_none=True)
    module(x).sum().backward()
    return {name: p.grad.clone() for name, p in module.named_parameters()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--steps", type=int, default=256, help="sequence length")
    parser.add_argument("--device", default="cuda", help="cpu: a dry run of the script, nothing checked")
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("needs a CUDA device")
    torch.manual_seed(0)
    model = LSTMClassifier().to(device)
    x = torch.randn(args.batch_size, args.steps, 256, device=device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (dry run)"
    print(f"{name}, torch {torch.__version__}, cuDNN {torch.backends.cudnn.version()}")

    try:
        fxplan.rewrite(copy.deepcopy(model), example_inputs=(x,))
        print("cuDNN on: NOT refused (fxplan planned a cuDNN RNN on fake tensors)")
    except fxplan.FxplanError as exc:
        print(f"cuDNN on: refused, {type(exc).__name__}: {str(exc)[:400]}")

    with torch.backends.cudnn.flags(enabled=False):
        plain_fake = measure_step(model, (x,), fake=True).peak_bytes
        plain_real = measure_step(model, (x,)).peak_bytes
        rewritten = fxplan.rewrite(copy.deepcopy(model), example_inputs=(x,))
        planned = rewritten.fxplan_measured_peak_bytes
        rewritten_real = measure_step(rewritten, (x,)).peak_bytes
        expected = gradients(copy.deepcopy(model), x)
        got = gradients(rewritten, x)
    same = all(torch.equal(expected[name], got[name]) for name in expected)
    print(f"cuDNN off: plain step {plain_real / MiB:.1f} MiB on the allocator, {plain_fake / MiB:.1f} MiB on "
          f"fxplan's meter ({plain_real / plain_fake - 1:+.2%})")
    print(f"cuDNN off: fxplan.rewrite(model, None) {rewritten_real / MiB:.1f} MiB on the allocator, "
          f"{planned / MiB:.1f} MiB planned ({rewritten_real / planned - 1:+.2%}), "
          f"{rewritten_real / plain_real - 1:+.1%} against the plain step; recompute "
          f"{rewritten.fxplan_plan.recomputed_fraction:.0%}")
    print(f"cuDNN off: gradients {'bitwise equal' if same else 'DIFFER'} to the plain model's")


if __name__ == "__main__":
    main()
