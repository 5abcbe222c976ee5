"""fxplan.costs.op_census: the trace's one dispatch mode counts what separate counters count."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.flop_counter import FlopCounterMode

from fxplan.capture.effects import written_arguments
from fxplan.costs.op_census import NewStorages, NodeCensus, buffer_names, op_traffic, tensors


class Mixed(nn.Module):
    """Convolution, BatchNorm (writes its running statistics), attention, a temporary freed inside, views."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(4, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.proj = nn.Linear(8, 24)

    def forward(self, x):
        h = self.bn(self.conv(x)).relu()
        seq = h.flatten(2).transpose(1, 2)                     # a view: moves nothing
        q, k, v = self.proj(seq).chunk(3, dim=-1)
        a = F.scaled_dot_product_attention(q, k, v)
        return (a * torch.exp(a)).sum()                       # exp(a) is freed before the op ends


class _Traffic(TorchDispatchMode):
    """The ops run and the bytes they move, counted on their own (pytree's flattening)."""

    def __init__(self):
        super().__init__()
        self.ops = self.bytes_moved = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        leaves = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        written = [t for t in tree_leaves(written_arguments(func, args, kwargs)) if isinstance(t, torch.Tensor)]
        self.ops += 1
        self.bytes_moved += op_traffic(leaves, written, [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)])
        return out


def test_node_census_counts_what_the_separate_counters_count():
    with FakeTensorMode() as mode:
        model = Mixed().train()  # fake parameters and buffers
        x = torch.randn(2, 4, 6, 6)
    census = NodeCensus(buffer_names(model))
    with mode:
        flops, traffic, fresh = FlopCounterMode(display=False), _Traffic(), NewStorages()
        with flops, traffic, fresh:
            model(x)
        separate = (flops.get_total_flops(), traffic.ops, traffic.bytes_moved, fresh.peak_bytes)
        with census:
            model(x)
    assert separate[0] > 0 and separate[2] > 0 and separate[3] > 0
    assert (census.flops, census.ops, census.bytes_moved, census.peak_bytes) == separate
    assert set(census.written) == {"bn.running_mean", "bn.running_var", "bn.num_batches_tracked"}


def test_tensors_finds_tensors_in_any_nesting_in_pytree_order():
    a, b, c = torch.zeros(1), torch.ones(2), torch.zeros(3)
    assert [t.numel() for t in tensors((a, [1, None, (b, "x")], {"k": c}))] == [1, 2, 3]
    assert tensors(a)[0] is a and tensors((1, 2.0, None)) == []
