"""The rewritten model under DistributedDataParallel: 2 CPU processes, gloo backend.

Each rank trains DDP(original) and DDP(rewritten) side by side on its own data shard; after every
step the all-reduced gradients, the outputs and the buffers (BatchNorm statistics are broadcast from
rank 0 by DDP) must be bitwise equal. All-reduce sums the same per-rank gradients in the same order
for both models, so bitwise equality is expected, not just closeness.
"""

from __future__ import annotations

import copy

import torch
import torch.fx as fx
from dist_helpers import assert_ranks_agree
from models_awkward import DenseNetBlock, chunks, compute_names, loss_of
from torch.nn.parallel import DistributedDataParallel as DDP

from fxplan.rewriter.codegen import segment_module


def _check(rank: int) -> list[str]:
    torch.manual_seed(0)  # same initial weights on both ranks
    model = DenseNetBlock()
    gm = fx.symbolic_trace(copy.deepcopy(model))
    rewritten = segment_module(gm, chunks(compute_names(gm), 4))
    ref = DDP(model)
    opt = DDP(rewritten)
    sgd_ref = torch.optim.SGD(ref.parameters(), lr=0.1)
    sgd_opt = torch.optim.SGD(opt.parameters(), lr=0.1)
    mismatches = []
    for step in range(2):
        x = torch.randn(2, 3, 12, 12, generator=torch.Generator().manual_seed(100 * step + rank))
        outs = []
        for ddp, sgd in ((ref, sgd_ref), (opt, sgd_opt)):
            sgd.zero_grad()
            torch.manual_seed(10 * step + rank)  # dropout draws differ per rank, same per model
            out = ddp(x)
            loss_of(out).backward()
            outs.append(out)
        if not torch.equal(outs[0], outs[1]):
            mismatches.append(f"step {step}: output")
        for (name, p), q in zip(ref.module.named_parameters(), opt.module.parameters()):
            if not torch.equal(p.grad, q.grad):
                mismatches.append(f"step {step}: grad {name}")
        for (name, a), b in zip(ref.module.state_dict().items(), opt.module.state_dict().values()):
            if not torch.equal(a, b):
                mismatches.append(f"step {step}: {name}")
        sgd_ref.step()
        sgd_opt.step()
    return mismatches


def test_ddp_gradients_equal_ddp_over_original():
    assert_ranks_agree(_check)
