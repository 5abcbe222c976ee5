"""Keep, recompute or offload: the peaks fxplan reaches on a Llama-style decoder with recomputation alone and with
offloading, by both routes, side by side in one run.

Every peak is one training step measured on fake tensors (device bytes; the host copies of offloaded values apart),
the loss the sum of the logits. Rows: the unplanned step; the smallest peak of ``fxplan.rewrite`` and of
``fxplan.auto_checkpoint``, each without and with ``offload=True``; then the plan each route chooses for a budget of
``--budget`` times the unplanned peak, with what it recomputes and what its copies are predicted to add. On a CPU the
copies are priced as exposed (host and device are one memory there). Run:

    python scripts/offload_peaks.py [--layers 8] [--width 64] [--batch-size 4] [--seq 128] [--budget 0.5]
"""

from __future__ import annotations

import argparse
import copy
import time

import torch
import transformers

import fxplan

MiB = 2**20


def _loss(output):
    return output.logits.float().sum()


def _llama(args):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=256, hidden_size=args.width, intermediate_size=2 * args.width,
                                      num_hidden_layers=args.layers, num_attention_heads=4, num_key_value_heads=4,
                                      max_position_embeddings=max(256, args.seq), use_cache=False)
    return transformers.LlamaForCausalLM(config)


def _rewrite_row(name, model, ids, budget, offload):
    start = time.perf_counter()
    plan = fxplan.plan(model, (ids,), budget_bytes=budget, offload=offload, loss_fn=_loss)
    copies = "" if plan.exposed_copy_seconds is None else f"{1000 * plan.exposed_copy_seconds:.2f} ms"
    return (name, plan.measured_peak_bytes, plan.host_peak_bytes or 0, 100 * plan.recomputed_fraction, copies,
            len(plan.offloaded), time.perf_counter() - start)


def _auto_row(name, model, ids, budget, offload):
    start = time.perf_counter()
    planned = fxplan.auto_checkpoint(copy.deepcopy(model), example_inputs=(ids,), budget_bytes=budget,
                                     offload=offload, loss_fn=_loss)
    applied = planned.fxplan_plan
    copies = f"{100 * applied.exposed_copy_fraction:.1f}% of a forward" if offload else ""
    return (name, applied.measured_peak_bytes, applied.host_peak_bytes, 100 * applied.recompute_fraction, copies,
            applied.offloaded_calls, time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--budget", type=float, default=0.5, help="a budget as a share of the unplanned peak")
    args = parser.parse_args()
    torch.set_num_threads(1)
    model = _llama(args)
    ids = torch.randint(0, 256, (args.batch_size, args.seq), generator=torch.Generator().manual_seed(0))
    vanilla = fxplan.measure_step(model, (ids,), fake=True, loss_fn=_loss).peak_bytes
    budget = int(args.budget * vanilla)
    rows = [("unplanned", vanilla, 0, 0.0, "", 0, 0.0)]
    for offload in (False, True):
        tag = "offload" if offload else "recompute"
        rows.append(_rewrite_row(f"rewrite, smallest, {tag}", model, ids, None, offload))
        rows.append(_auto_row(f"auto_checkpoint, smallest, {tag}", model, ids, None, offload))
    for offload in (False, True):
        tag = "offload" if offload else "recompute"
        rows.append(_rewrite_row(f"rewrite, {args.budget:g} of unplanned, {tag}", model, ids, budget, offload))
        rows.append(_auto_row(f"auto_checkpoint, {args.budget:g} of unplanned, {tag}", model, ids, budget, offload))
    print(f"Llama {args.layers} layers, width {args.width}, vocabulary 256, batch {args.batch_size} x {args.seq}; "
          f"torch {torch.__version__}; fake steps, device bytes")
    print("| plan | device peak | vs unplanned | host copies | recomputed | exposed copies | offloaded | planning |")
    print("|---|---|---|---|---|---|---|---|")
    for name, peak, host, recomputed, copies, count, seconds in rows:
        print(f"| {name} | {peak / MiB:.2f} MiB | {peak / vanilla:.3f} | {host / MiB:.2f} MiB | {recomputed:.1f}% | "
              f"{copies} | {count} | {seconds:.1f} s |")


if __name__ == "__main__":
    main()
