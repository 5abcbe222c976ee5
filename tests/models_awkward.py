"""Small models that exercise what a recomputing rewriter gets wrong easily.

Each one is cheap (a few ms per step on the CPU) and traceable by ``torch.fx.symbolic_trace``.
``AWKWARD`` maps a name to ``(constructor, make_inputs)``; inputs are a tuple of positional args.
"""

from __future__ import annotations

import operator

import torch
import torch.nn.functional as F
from torch import nn
from torchvision.models.densenet import _DenseBlock, _Transition


class MultiInOut(nn.Module):
    """Two inputs, a dict output, a skip connection from an input-side value to the output."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 16)
        self.b = nn.Linear(4, 16)
        self.mid = nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 16))
        self.head = nn.Linear(16, 3)

    def forward(self, x, y):
        ha = torch.tanh(self.a(x))
        hb = torch.sigmoid(self.b(y))
        h = self.mid(ha * hb)
        return {"logits": self.head(h), "skip": ha, "both": (h, hb.sum())}


class Tied(nn.Module):
    """A submodule called twice, and a weight shared by an encoder and a decoder."""

    def __init__(self):
        super().__init__()
        self.enc = nn.Linear(10, 6)
        self.block = nn.Sequential(nn.Linear(6, 6), nn.GELU())
        self.dec = nn.Linear(6, 10)
        self.dec.weight = nn.Parameter(self.enc.weight.t().detach().clone())
        self.proj = nn.Linear(10, 6, bias=False)
        self.proj.weight = self.enc.weight  # tied: used by enc and proj (two uses)

    def forward(self, x):
        h = self.block(self.block(self.enc(x)))
        return self.dec(h) + self.proj(x).sum(-1, keepdim=True)


class InplaceZoo(nn.Module):
    """In-place ops of every spelling, some on values that recomputation reads again."""

    def __init__(self):
        super().__init__()
        self.l1 = nn.Linear(6, 6)
        self.l2 = nn.Linear(6, 6)
        self.l3 = nn.Linear(6, 6)
        self.act = nn.ReLU(inplace=True)
        self.hard = nn.Hardtanh(-0.5, 0.5, inplace=True)

    def forward(self, x):
        x.mul_(2.0)  # overwrites the caller's input, as the original model does
        h = self.l1(x)
        s = h + 1.0  # reads h before it is overwritten
        h.add_(2.0)  # x.add_(y); later readers see the new h
        t = s + h
        u = operator.iadd(t, s)  # operator.iadd
        v = F.relu(u, inplace=True)
        w = self.act(self.l2(v))  # ReLU(inplace=True) on a fresh value
        w2 = torch.relu_(w * 1.5)
        z = self.hard(w2 - 0.25) * 2.0
        z.mul_(0.5)
        return self.l3(z) + h.sum()


class BNNet(nn.Module):
    """BatchNorm in all flavours: 2d, 1d with cumulative average, a BN module called twice."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.conv2 = nn.Conv2d(4, 4, 3, padding=1)
        self.shared = nn.BatchNorm2d(4, momentum=None)
        self.relu = nn.ReLU(inplace=True)
        self.fc = nn.Linear(4, 5)
        self.bn1d = nn.BatchNorm1d(5)

    def forward(self, x):
        h = self.relu(self.bn(self.conv(x)))
        h = self.relu(self.shared(self.conv2(h)))
        h = self.shared(self.conv2(h)) + h
        h = F.adaptive_avg_pool2d(h, 1).flatten(1)
        return self.bn1d(self.fc(h))


@torch.fx.wrap  # a leaf of symbolic_trace: the BatchNorm module reaches it as a get_attr node of the graph
def bn_relu_of(bn: nn.BatchNorm2d, x: torch.Tensor) -> torch.Tensor:
    return torch.relu(bn(x))


class ModuleArgNet(nn.Module):
    """A function handed a BatchNorm module runs it: its buffers change inside a call_function node."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.conv2 = nn.Conv2d(4, 4, 3, padding=1)
        self.fc = nn.Linear(4, 3)

    def forward(self, x):
        h = self.conv2(bn_relu_of(self.bn, self.conv(x)))
        return self.fc(F.adaptive_avg_pool2d(torch.relu(h), 1).flatten(1))


class RandomNet(nn.Module):
    """Dropout as a module and a function, and a rand_like noise term."""

    def __init__(self):
        super().__init__()
        self.l1 = nn.Linear(8, 16)
        self.drop = nn.Dropout(0.3)
        self.l2 = nn.Linear(16, 16)
        self.l3 = nn.Linear(16, 4)

    def forward(self, x):
        h = self.drop(torch.relu(self.l1(x)))
        g = F.dropout(self.l2(h), p=0.5, training=self.training)
        noise = torch.rand_like(g) * 0.1
        return self.l3(g + noise + h)


class DenseNetBlock(nn.Module):
    """A torchvision DenseNet dense block and transition (with dropout inside the dense layers)."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, 16, 3, padding=1, bias=False)
        self.block = _DenseBlock(
            num_layers=4, num_input_features=16, bn_size=2, growth_rate=8, drop_rate=0.1
        )
        self.trans = _Transition(16 + 4 * 8, 24)
        self.head = nn.Linear(24, 5)

    def forward(self, x):
        h = self.trans(self.block(self.stem(x)))
        return self.head(F.adaptive_avg_pool2d(h, 1).flatten(1))


def _x(*shape):
    return lambda: (torch.randn(*shape),)


class StepCounter(nn.Module):
    """Counts its calls in a buffer (like a power-iteration vector, an EMA, ...)."""

    def __init__(self):
        super().__init__()
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))

    def forward(self, x):
        self.steps.add_(1)
        return x * 2.0


class RunningMean(nn.Module):
    """Keeps a running mean in a buffer, updated in place in two steps; the first leaves its initial zeros
    as they are, so only the buffer's version counter shows that tracing ran it."""

    def __init__(self):
        super().__init__()
        self.register_buffer("mean", torch.zeros(3))
        self.l = nn.Linear(3, 3)

    def forward(self, x):
        m = self.mean.mul_(0.9)
        m = m.add_(0.1 * x.detach().mean(0))
        return torch.tanh(self.l(x) - m).sum()


AWKWARD = {
    "multi_in_out": (MultiInOut, lambda: (torch.randn(5, 8), torch.randn(5, 4))),
    "tied": (Tied, _x(5, 10)),
    "inplace_zoo": (InplaceZoo, _x(5, 6)),
    "bn": (BNNet, _x(3, 3, 8, 8)),
    "module_arg": (ModuleArgNet, _x(3, 3, 8, 8)),
    "random": (RandomNet, _x(5, 8)),
    "densenet_block": (DenseNetBlock, _x(2, 3, 12, 12)),
}


# ----------------------------------------------------------------------------------------------
# helpers shared by the rewriter's tests


def compute_names(gm) -> list[str]:
    """Names of the compute nodes of a traced module, in program order."""
    return [n.name for n in gm.graph.nodes if n.op in ("call_module", "call_function", "call_method")]


def chunks(names: list[str], k: int) -> list[list[str]]:
    """Split a list into ``k`` contiguous, non-empty chunks of near-equal size."""
    n = len(names)
    return [names[i * n // k : (i + 1) * n // k] for i in range(k)]


def random_plan(gm, rng, k: int) -> list[list[str]]:
    """A random increasing lower-set sequence: a random topological order cut into ``k`` chunks.

    The order respects data edges and :func:`fxplan.capture.effects.ordering_edges`, so it is usually
    *not* the program order (branches interleave differently), which is what a planner produces.
    """
    from fxplan.capture.effects import ordering_edges

    names = compute_names(gm)
    nodes = {n.name: n for n in gm.graph.nodes}
    preds = {v: {u.name for u in nodes[v].all_input_nodes if u.name in set(names)} for v in names}
    for a, b in ordering_edges(gm):
        preds[b].add(a)
    done: list[str] = []
    left = list(names)
    while left:
        ready = [v for v in left if preds[v] <= set(done)]
        v = rng.choice(ready)
        done.append(v)
        left.remove(v)
    cuts = sorted(rng.sample(range(1, len(done)), k - 1)) if k > 1 else []
    bounds = [0, *cuts, len(done)]
    return [done[a:b] for a, b in zip(bounds, bounds[1:])]


def loss_of(out) -> torch.Tensor:
    """Sum of every tensor in a (possibly nested) output, as a float32/64 scalar."""
    leaves = [t for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
    return sum((t.float() * (i + 1)).sum() for i, t in enumerate(leaves))


def step(model, inputs, seed: int = 0):
    """One forward + backward with a fixed seed; returns the output (inputs are copied first)."""
    torch.manual_seed(seed)
    out = model(*[t.clone() if isinstance(t, torch.Tensor) else t for t in inputs])
    loss_of(out).backward()
    return out


def assert_same_training(ref, opt, inputs, steps: int = 2, lr: float = 0.1) -> None:
    """Train ``ref`` and ``opt`` side by side; outputs, gradients, state must match bitwise."""
    for s in range(steps):
        out_r = step(ref, inputs, seed=s)
        out_o = step(opt, inputs, seed=s)
        flat_r = torch.utils._pytree.tree_leaves(out_r)
        flat_o = torch.utils._pytree.tree_leaves(out_o)
        assert len(flat_r) == len(flat_o)
        for a, b in zip(flat_r, flat_o):
            assert torch.equal(a, b), f"step {s}: outputs differ"
        named_r = dict(ref.named_parameters())
        named_o = dict(opt.named_parameters())
        assert named_r.keys() == named_o.keys()
        for name, p in named_r.items():
            q = named_o[name]
            assert (p.grad is None) == (q.grad is None), name
            if p.grad is not None:
                assert torch.equal(p.grad, q.grad), f"step {s}: gradient of {name} differs"
        sd_r, sd_o = ref.state_dict(), opt.state_dict()
        assert list(sd_r) == list(sd_o)
        for name in sd_r:
            assert torch.equal(sd_r[name], sd_o[name]), f"step {s}: {name} differs"
        with torch.no_grad():
            for p, q in zip(ref.parameters(), opt.parameters()):
                if p.grad is not None:
                    p -= lr * p.grad
                    q -= lr * q.grad
                p.grad = None
                q.grad = None
