"""Models planned in parts: the whole step's real peak unplanned, with ``fxplan.auto_checkpoint`` and with
``fxplan.rewrite``, side by side, for the smallest peak; seconds of planning beside each.

Models whose training forward branches on data, built from their classes with random weights: torchvision's Faster
R-CNN MobileNetV3-320 (two images, fake targets; its transform draws the image size with ``.item()``) and a Hugging
Face Wav2Vec2 with LayerDrop (6 layers of width 32, two clips of 2,000 samples). Peaks are of real steps on the CPU
(``fxplan.measure_step``, live storages), from one random state, so that LayerDrop drops the same layers in each.
Run:

    python scripts/parts_peaks.py
"""

from __future__ import annotations

import copy
import time

import torch
import torchvision
import transformers

import fxplan


def _detector():
    torch.manual_seed(0)
    model = torchvision.models.detection.fasterrcnn_mobilenet_v3_large_320_fpn(
        weights=None, weights_backbone=None, num_classes=3, min_size=128, max_size=160).train()
    g = torch.Generator().manual_seed(1)
    images = [torch.rand(3, 128, 160, generator=g), torch.rand(3, 160, 128, generator=g)]
    targets = [{"boxes": torch.tensor([[10.0, 20.0, 60.0, 80.0]]), "labels": torch.tensor([1])},
               {"boxes": torch.tensor([[5.0, 5.0, 50.0, 90.0], [30.0, 30.0, 100.0, 100.0]]),
                "labels": torch.tensor([2, 1])}]
    return model, (images, targets), lambda out: sum(out.values())


def _speech_encoder():
    config = transformers.Wav2Vec2Config(
        hidden_size=32, num_hidden_layers=6, num_attention_heads=2, intermediate_size=64, conv_dim=(16, 16),
        conv_stride=(5, 2), conv_kernel=(10, 3), num_feat_extract_layers=2, layerdrop=0.2,
        num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=2)
    torch.manual_seed(0)
    model = transformers.Wav2Vec2Model(config).train()
    inputs = {"input_values": torch.randn(2, 2000, generator=torch.Generator().manual_seed(2))}
    return model, inputs, lambda out: out.last_hidden_state.pow(2).mean()


def _real_peak(model, inputs, loss_fn) -> int:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(5)
        return fxplan.measure_step(model, inputs, loss_fn=loss_fn).peak_bytes


def _planned(plan_fn, model, inputs, loss_fn):
    torch.manual_seed(5)
    t0 = time.perf_counter()
    planned = plan_fn(model, inputs, loss_fn)
    return planned, time.perf_counter() - t0


def main() -> None:
    torch.set_num_threads(1)
    transformers.logging.set_verbosity_error()
    print("| model | unplanned | auto_checkpoint | s | rewrite | s |")
    print("|---|---|---|---|---|---|")
    for name, build in (("Faster R-CNN MobileNetV3-320, 2 images", _detector),
                        ("Wav2Vec2 6x32, LayerDrop 0.2, 2x2000", _speech_encoder)):
        model, inputs, loss_fn = build()
        vanilla = _real_peak(model, inputs, loss_fn)
        auto, auto_s = _planned(lambda m, x, f: fxplan.auto_checkpoint(copy.deepcopy(m), example_inputs=x, loss_fn=f),
                                model, inputs, loss_fn)
        rewritten, rewrite_s = _planned(lambda m, x, f: fxplan.rewrite(m, example_inputs=x, loss_fn=f),
                                        model, inputs, loss_fn)
        peaks = [_real_peak(m, inputs, loss_fn) for m in (auto, rewritten)]
        cells = [f"{peak / 1e6:.1f} MB ({peak / vanilla:.2f})" for peak in peaks]
        print(f"| {name} | {vanilla / 1e6:.1f} MB | {cells[0]} | {auto_s:.1f} | {cells[1]} | {rewrite_s:.1f} |")


if __name__ == "__main__":
    main()
