"""Per-rank peaks of a Llama-style decoder sharded per layer with FSDP2, planned by ``fxplan.auto_checkpoint``
for budgets per rank, side by side in one run.

One process plays one rank of ``--world`` ranks: a fake process group (PyTorch's testing ``FakeStore``, backend
``"fake"``) stands in for the others, so the collectives exchange nothing and the script runs on a laptop. The
model is built from its config class (random weights, ``use_cache=False``) and sharded as torchtitan shards a
decoder: ``fully_shard`` on each layer, then on the root. Every peak is one training step of one rank's batch on
fake tensors, as :func:`fxplan.measure_step` measures it with ``shard=``: the parameters and gradients as their
shards, each layer's parameters while FSDP2 holds them gathered. The unsharded step is printed beside it. Run:

    python scripts/fsdp_peaks.py [--world 8] [--layers 8] [--width 512] [--batch-size 2] [--seq 256]
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist
import transformers
from torch.distributed.fsdp import fully_shard
from torch.testing._internal.distributed.fake_pg import FakeStore

import fxplan
from fxplan.errors import BudgetError

MiB = 2**20


def _loss(output):
    return output.loss


def _shard_per_layer(model) -> None:
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world", type=int, default=8)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--budgets", type=float, nargs="+", default=[0.8, 0.6])
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=args.world)
    torch.manual_seed(0)
    config = transformers.LlamaConfig(num_hidden_layers=args.layers, hidden_size=args.width,
                                      intermediate_size=int(2.6875 * args.width), num_attention_heads=args.width // 64,
                                      num_key_value_heads=max(1, args.width // 256), vocab_size=args.vocab,
                                      use_cache=False)
    model = transformers.LlamaForCausalLM(config)
    ids = torch.randint(0, args.vocab, (args.batch_size, args.seq), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "labels": ids}
    params = sum(p.numel() for p in model.parameters())
    print(f"Llama {args.layers}x{args.width}, {params / 1e6:.1f} M parameters, batch {args.batch_size}x{args.seq} "
          f"per rank, {args.world} ranks, torch {torch.__version__}, transformers {transformers.__version__}")
    unsharded = fxplan.measure_step(model, batch, fake=True, loss_fn=_loss)
    per_rank = fxplan.measure_step(model, batch, fake=True, loss_fn=_loss, shard=_shard_per_layer)
    print(f"{'row':<34}{'peak MiB':>10}{'share':>8}{'planning s':>12}")
    print(f"{'unsharded, unplanned':<34}{unsharded.peak_bytes / MiB:>10.1f}{'-':>8}{'-':>12}")
    print(f"{'per rank, unplanned':<34}{per_rank.peak_bytes / MiB:>10.1f}{1.0:>8.3f}{'-':>12}")
    for share in args.budgets:
        fxplan.remove_checkpoints(model)
        budget = int(share * per_rank.peak_bytes)
        start = time.perf_counter()
        try:
            fxplan.auto_checkpoint(model, example_inputs=batch, loss_fn=_loss, budget_bytes=budget,
                                   shard=_shard_per_layer)
        except BudgetError as error:
            print(f"{f'per rank, planned for {share}':<34}  refused: smallest measured "
                  f"{error.min_feasible_bytes / MiB:.1f} MiB ({error.min_feasible_bytes / per_rank.peak_bytes:.3f})")
            continue
        seconds = time.perf_counter() - start
        peak = model.fxplan_plan.measured_peak_bytes
        print(f"{f'per rank, planned for {share}':<34}{peak / MiB:>10.1f}{peak / per_rank.peak_bytes:>8.3f}"
              f"{seconds:>12.1f}")
    print(per_rank.table())
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
