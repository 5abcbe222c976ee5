"""Peaks of one compiled training step: the unplanned model, ``fxplan.auto_checkpoint`` and ``fxplan.rewrite``
under torch.compile, beside compile's own ``activation_memory_budget``, side by side in one run.

A tiny GPT-2 from its config class (random weights, dropout off, ``use_cache=False``), one batch of token ids.
Each compiled module runs one step to compile, then one measured step; the peak is read from torch.profiler's
allocation events (:func:`fxplan.measure.meter.profiled_step_peak`, which sees compiled kernels' buffers) and
printed as a share of the eager unplanned step's peak, measured the same way. The last rows plan for the
compiled step itself (``compile_backend``), at budgets that are shares of that eager peak. Run:

    python scripts/compile_peaks.py [--batch-size 16] [--backend inductor]
"""

from __future__ import annotations

import argparse
import copy
import time

import torch
import torch._functorch.config as functorch_config
import transformers

import fxplan
from fxplan.measure.meter import profiled_step_peak


def _loss(output):
    return output.loss


def _compiled_peak(model, batch, backend: str, **compile_config) -> tuple[int, float]:
    torch._dynamo.reset()
    start = time.perf_counter()
    with functorch_config.patch(**compile_config):
        compiled = torch.compile(model, backend=backend)
        _loss(compiled(**batch)).backward()  # compiles forward and backward, not measured
        model.zero_grad(set_to_none=True)
        peak = profiled_step_peak(compiled, batch, _loss)
    model.zero_grad(set_to_none=True)
    return peak, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--backend", default="inductor")
    args = parser.parse_args()
    torch.set_num_threads(1)
    transformers.logging.set_verbosity_error()
    config = transformers.GPT2Config(n_layer=2, n_embd=128, n_head=4, vocab_size=1000, n_positions=64,
                                     use_cache=False, attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config)
    ids = torch.randint(0, 1000, (args.batch_size, 64), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "labels": ids}
    eager = profiled_step_peak(model, batch, _loss)
    model.zero_grad(set_to_none=True)
    fake_vanilla = fxplan.measure_step(model, batch, fake=True, loss_fn=_loss).peak_bytes
    print(f"tiny GPT-2 2x128, batch {args.batch_size}x64, torch {torch.__version__}, backend {args.backend}; "
          f"eager unplanned peak {eager / 2**20:.1f} MiB (profiler)")
    print("| method | planned for (fake, share of unplanned) | compiled peak (share of eager unplanned) | s |")
    print("|---|---|---|---|")

    def row(name: str, planned: str, module, **compile_config) -> None:
        peak, seconds = _compiled_peak(module, batch, args.backend, **compile_config)
        print(f"| {name} | {planned} | {peak / eager:.3f} | {seconds:.0f} |")

    row("unplanned", "-", model)
    for budget in (0.5, 0.3):
        row(f"activation_memory_budget={budget}", "-", model, activation_memory_budget=budget)
    for share in (0.7, None):
        planned = copy.deepcopy(model)
        fxplan.auto_checkpoint(planned, example_inputs=batch, loss_fn=_loss,
                               budget_bytes=share and int(share * fake_vanilla))
        measured = planned.fxplan_plan.measured_peak_bytes / fake_vanilla
        row(f"auto_checkpoint ({'smallest' if share is None else share})", f"{measured:.3f}", planned)
        rewritten = fxplan.rewrite(model, budget_bytes=share and int(share * fake_vanilla), example_inputs=batch,
                                   loss_fn=_loss)
        row(f"rewrite ({'smallest' if share is None else share})",
            f"{rewritten.fxplan_measured_peak_bytes / fake_vanilla:.3f}", rewritten)
    for share in (0.5, 0.45):
        planned = copy.deepcopy(model)
        try:
            fxplan.auto_checkpoint(planned, example_inputs=batch, loss_fn=_loss, budget_bytes=int(share * eager),
                                   compile_backend=args.backend)
        except fxplan.BudgetError as error:
            print(f"| auto_checkpoint (compiled, {share}) | refused: {error.fact} | - | - |")
            continue
        measured = planned.fxplan_plan.measured_peak_bytes / eager
        row(f"auto_checkpoint (compiled, {share})", f"{measured:.3f} (compiled)", planned)


if __name__ == "__main__":
    main()
