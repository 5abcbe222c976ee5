"""The block-checkpointing peer (fxplan.compare.peers.block_checkpoint_peer) and scripts/peer_tables.py on tiny
models."""

from __future__ import annotations

import copy
import importlib.util
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from fxplan.compare import peers
from fxplan.measure.timing import Timing

ROOT = Path(__file__).resolve().parents[1]


class Block(nn.Module):
    """A residual block with in-place ops, like torchvision's BasicBlock."""

    def __init__(self, c: int):
        super().__init__()
        self.conv = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(c)
        self.relu = nn.ReLU(inplace=True)

    def forward(self, x):
        out = self.bn(self.conv(x))
        out += x
        return self.relu(out)


class Net(nn.Module):
    def __init__(self, c: int = 4, blocks: int = 3):
        super().__init__()
        self.stem = nn.Conv2d(3, c, 3, padding=1)
        self.body = nn.Sequential(*(Block(c) for _ in range(blocks)))
        self.head = nn.Linear(c, 5)

    def forward(self, x):
        return self.head(self.body(self.stem(x)).mean((2, 3)))


class DenseLayer(nn.Module):
    """Takes the list of all earlier features, as torchvision's _DenseLayer does."""

    def __init__(self, c_in: int, growth: int):
        super().__init__()
        self.bn = nn.BatchNorm2d(c_in)
        self.conv = nn.Conv2d(c_in, growth, 3, padding=1)

    def forward(self, features: list[torch.Tensor]):
        return self.conv(torch.relu(self.bn(torch.cat(features, 1))))


class DenseNet(nn.Module):
    """Appends each layer's output to the very list it passed to the layer (torchvision's _DenseBlock)."""

    def __init__(self, c: int = 3, growth: int = 2, layers: int = 3):
        super().__init__()
        self.layers = nn.ModuleList(DenseLayer(c + i * growth, growth) for i in range(layers))

    def forward(self, x):
        features = [x]
        for layer in self.layers:
            features.append(layer(features))
        return torch.cat(features, 1).mean()


class Inner(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


class Outer(nn.Module):
    """As many instances as the Inner blocks it holds: the outer class must win the tie (GPT2Block)."""

    def __init__(self):
        super().__init__()
        self.inner, self.norm = Inner(), nn.LayerNorm(4)

    def forward(self, x):
        return x + self.inner(self.norm(x))


def step(module: nn.Module, x: torch.Tensor, owner: nn.Module | None = None) -> tuple[torch.Tensor, dict]:
    """Output and gradients (by ``owner``'s parameter names; default ``module``'s) of one step of ``module``."""
    module.zero_grad(set_to_none=True)
    out = module(x)
    out.sum().backward()
    return out.detach(), {n: p.grad.clone() for n, p in (owner or module).named_parameters()}


def test_block_class_is_the_most_frequent_block_and_the_outer_one_on_ties():
    assert peers.block_class(Net()) is Block
    assert peers.block_class(DenseNet()) is DenseLayer
    assert peers.block_class(nn.Sequential(Outer(), Outer())) is Outer
    assert peers.block_class(Net(), "Block") is Block


def test_block_class_says_why_when_there_is_no_repeated_block():
    with pytest.raises(peers.NotApplicable, match="occurs twice"):
        peers.block_class(nn.Sequential(Block(2), nn.Linear(2, 2)))
    with pytest.raises(peers.NotApplicable, match="no submodule of class 'Bottleneck'"):
        peers.block_class(Net(), "Bottleneck")


@pytest.mark.parametrize("selective", [False, True])
@pytest.mark.parametrize("make", [Net, DenseNet])
def test_block_checkpointing_matches_vanilla_and_leaves_the_model_alone(make, selective):
    torch.manual_seed(0)
    model = make()
    reference = copy.deepcopy(model)
    peer = peers.block_checkpoint_peer(model, selective=selective)
    assert peer.fxplan_blocks == 3
    assert sum(isinstance(m, peers.CheckpointedBlock) for m in peer.modules()) == 3
    assert not any(isinstance(m, peers.CheckpointedBlock) for m in model.modules())
    assert {p.data_ptr() for p in peer.parameters()} == {p.data_ptr() for p in model.parameters()}
    x = torch.randn(2, 3, 8, 8)
    out, grads = step(peer, x, model)
    ref_out, ref_grads = step(reference, x)
    torch.testing.assert_close(out, ref_out)
    for name, g in ref_grads.items():
        torch.testing.assert_close(grads[name], g, msg=name)


def test_block_checkpointing_recomputes_in_backward():
    calls = []
    model = Net()
    model.body[0].conv.register_forward_hook(lambda *_: calls.append(1))
    step(peers.block_checkpoint_peer(model), torch.randn(2, 3, 8, 8))
    assert len(calls) == 2  # once in forward, once recomputed in backward


# ---------------------------------------------------------------------------------------- peer_tables


def _script():
    """scripts/peer_tables.py as a module (registered first: its dataclasses look their module up)."""
    if "peer_tables" not in sys.modules:
        spec = importlib.util.spec_from_file_location("peer_tables", ROOT / "scripts" / "peer_tables.py")
        sys.modules["peer_tables"] = module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    return sys.modules["peer_tables"]


def _timed(name, peak, samples, family="fxplan"):
    t = Timing(name, samples=list(samples))
    return _script().Row(name, family, module=nn.Identity(), peak=peak, timing=t)


def test_dominated_by_names_the_fastest_fxplan_row_at_or_below_the_peak_and_no_slower():
    script = _script()
    peer = _timed("peer", 100, [2.0, 2.0, 2.0], family="peer")
    rows = [peer, _timed("too-big", 101, [1.0, 1.0, 1.0]), _timed("slow", 90, [3.0, 3.0, 3.0]),
            _timed("fast", 100, [1.8, 2.0, 1.6])]
    assert script.dominated_by(peer, rows) == "fast: 0.90x (0.80-1.00), within noise"
    rows = [peer, _timed("too-big", 101, [1.0, 1.0, 1.0]), _timed("slow", 90, [3.0, 3.0, 3.0])]
    assert script.dominated_by(peer, rows).startswith("not dominated: the fastest fxplan row at or below its peak, "
                                                      "slow, takes 1.50x")
    assert script.dominated_by(peer, rows[:2]) == "not dominated: no fxplan row at or below its peak"


def test_peer_table_smoke_on_a_tiny_model():
    script = _script()
    torch.manual_seed(0)
    model = Net(c=8, blocks=4)
    inputs = (torch.randn(4, 3, 16, 16),)
    wanted = [n for n in script.row_names([0.5]) if "compile" not in n]  # compiling is the slow part
    rows, cells = script.peer_table(model, inputs, lambda out: out.square().mean(), wanted=wanted, rounds=1,
                                    threads=1, log=lambda s: None)
    # Hugging Face's own checkpointing applies to transformers models only: its rows are left out here
    assert [r.name for r in rows] == [n for n in wanted if "hf-checkpointing" not in n]
    by_name = {r.name: r for r in rows}
    for r in rows:
        assert r.module is not None and r.timing is not None, (r.name, r.note)
        assert r.peak > 0 and r.fake_peak > 0
    for peer in ("blocks", "blocks-selective", "sac-ilp@0.5"):
        assert by_name[f"fxplan@{peer}"].peak <= by_name[peer].peak
    assert by_name["sac-ilp@0.5"].module.fxplan_sac.discard, "PyTorch's sac_milp checkpoints some blocks"
    assert by_name["auto-checkpoint"].fake_peak <= by_name["vanilla"].fake_peak
    # fxplan's own meter (on a model this small the real-step meter also sees convolution workspaces)
    assert by_name["fxplan-smallest"].fake_peak <= by_name["fxplan-middle"].fake_peak <= by_name["vanilla"].fake_peak
    assert len(cells) == len(rows) and all(len(c) == len(script.HEADER) for c in cells)
    dominated = {c[0]: c[-1] for c in cells if c[0] in ("blocks", "blocks-selective", "sac-ilp@0.5")}
    assert all(d.startswith(("fxplan", "not dominated")) for d in dominated.values()), dominated
    assert "fxplan-smallest" in script.meter_check(rows)


def test_peer_table_has_hugging_face_checkpointing_rows_for_a_transformer():
    pytest.importorskip("transformers")
    from models_zoo import hf

    script = _script()
    torch.manual_seed(0)
    entry = hf.tiny_entry("gpt2_small")
    wanted = ["hf-checkpointing", "fxplan@hf-checkpointing"]
    rows, _ = script.peer_table(entry.build().train(), entry.example_inputs(2, 16), entry.loss, wanted=wanted,
                                rounds=1, threads=1, log=lambda s: None)
    by_name = {r.name: r for r in rows}
    assert [r.name for r in rows] == ["vanilla", *wanted]
    assert by_name["hf-checkpointing"].module is not None, by_name["hf-checkpointing"].note
    assert by_name["fxplan@hf-checkpointing"].peak <= by_name["hf-checkpointing"].peak
