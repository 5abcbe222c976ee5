"""PyTorch's automatic selective checkpointing as a peer (fxplan.compare.peers.sac_ilp_peer) on tiny models, CPU."""

from __future__ import annotations

import copy

import pytest
import torch
from tiny_models import hf_loss, tiny_gpt2, token_batch, train_step
from torch import nn

import fxplan
from fxplan.capture.capturers import as_call
from fxplan.compare import peers, torch_sac
from fxplan.compare.methods import default_methods, select_methods
from fxplan.errors import BudgetError, FxplanError

transformers = pytest.importorskip("transformers")
pytest.importorskip("pulp")
pytest.importorskip("pwlf")
pytestmark = pytest.mark.usefixtures("one_torch_thread")  # as every bitwise comparison of the suite runs


@pytest.fixture(scope="module")
def gpt2_peer():
    """A tiny GPT-2 (dropout on), its sac-ilp peer at 0.5, an unplanned copy, and the batch."""
    model = tiny_gpt2()
    reference = copy.deepcopy(model)
    batch = token_batch()
    peer = peers.sac_ilp_peer(model, batch, hf_loss, 0.5)
    return peer, model, reference, batch


def test_gpt2_peer_is_bitwise_exact_and_peaks_lower(gpt2_peer):
    peer, _, reference, batch = gpt2_peer
    plan = peer.fxplan_sac
    assert plan.discard, "at 0.5 torch's sac_milp checkpoints some modules"
    assert plan.smallest_budget_bytes < plan.budget_bytes < plan.baseline_peak_bytes
    for seed in (1, 2):  # two steps: other dropout masks, gradients accumulated
        loss, grads = train_step(peer, batch, seed)
        ref_loss, ref_grads = train_step(reference, batch, seed)
        assert torch.equal(loss, ref_loss)
        assert all(torch.equal(a, b) for a, b in zip(grads, ref_grads))
    peer.zero_grad(set_to_none=True)
    reference.zero_grad(set_to_none=True)
    unplanned = fxplan.measure_step(reference, batch, fake=True, loss_fn=hf_loss).peak_bytes
    fake = fxplan.measure_step(peer, batch, fake=True, loss_fn=hf_loss).peak_bytes
    real = fxplan.measure_step(peer, batch, loss_fn=hf_loss).peak_bytes
    assert fake < unplanned and real < unplanned


def test_gpt2_peer_checkpoints_the_chosen_modules_of_a_copy(gpt2_peer):
    peer, model, _, _ = gpt2_peer
    for path in peer.fxplan_sac.discard:
        assert isinstance(peer.get_submodule(path).__dict__.get("forward"), torch_sac.SACForward)
    assert not any("forward" in m.__dict__ for m in model.modules()), "the model itself is left as it is"
    assert all(p is q for p, q in zip(peer.parameters(), model.parameters())), "parameters are shared"
    assert list(peer.state_dict()) == list(model.state_dict())


def test_budgets_are_placed_between_the_smallest_and_the_unplanned_peak():
    model = tiny_gpt2()
    ids = torch.randint(0, 1000, (2, 32), generator=torch.Generator().manual_seed(0))
    stats = torch_sac.collect(model, as_call({"input_ids": ids, "labels": ids}), hf_loss, torch_sac.CPU_BENCHMARK)
    smallest = torch_sac.smallest_budget(stats)
    assert 2 * stats.parameter_bytes < smallest < stats.baseline_peak_bytes
    plan, decisions = torch_sac.solve(stats, smallest, smallest)
    assert plan.discard and set(decisions) == set(plan.discard)
    assert plan.predicted_peak_bytes <= smallest
    none, _ = torch_sac.solve(stats, int(stats.baseline_peak_bytes * 1.01), smallest)
    assert none.discard == {}, "no checkpointing above the unplanned peak"
    with pytest.raises(BudgetError, match="sac_milp found no plan"):
        torch_sac.solve(stats, int(smallest * 0.9), smallest)


class SharedReLU(nn.Module):
    """One ReLU module called twice, as torchvision's Bottleneck calls its ``relu``."""

    def __init__(self, c: int = 8):
        super().__init__()
        self.a, self.b = nn.Linear(c, c), nn.Linear(c, c)
        self.relu = nn.ReLU()

    def forward(self, x):
        return self.relu(self.b(self.relu(self.a(x))))


class Net(nn.Module):
    def __init__(self, blocks: int = 3, shared: bool = False):
        super().__init__()
        self.blocks = nn.ModuleList(SharedReLU() for _ in range(blocks))
        if shared:  # one block with children called at every step
            self.blocks = nn.ModuleList([self.blocks[0]] * blocks)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


def test_a_leaf_called_twice_is_planned_and_exact():
    torch.manual_seed(0)
    model = Net()
    x = torch.randn(64, 8)
    peer = peers.sac_ilp_peer(model, (x,), None, 0.0)
    assert peer.fxplan_sac.dropped_repeats == [f"Net.blocks.{i}.relu" for i in range(3)]
    assert peer.fxplan_sac.discard
    reference = copy.deepcopy(model)
    peer(x).sum().backward()
    reference(x).sum().backward()
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(peer.parameters(), reference.parameters()))


def test_a_module_with_nothing_to_discard_is_no_candidate_and_vit_is_exact():
    """A Hugging Face ViT's patch embedding (a convolution, then views) has no op memory in SACEstimator's
    statistics, whose trade-off curve divides by it: it is left out, the rest is planned."""
    from models_zoo import hf

    entry = hf.tiny_entry("vit_base_16")
    torch.manual_seed(0)
    model = entry.build()
    inputs = entry.example_inputs(2, 32)
    peer = peers.sac_ilp_peer(model, inputs, entry.loss, 0.5)
    assert "ViTForImageClassification.vit.embeddings.patch_embeddings" in peer.fxplan_sac.no_memory
    assert peer.fxplan_sac.discard
    reference = copy.deepcopy(model)
    for m in (peer, reference):
        torch.manual_seed(1)
        entry.loss(m(*inputs)).backward()
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(peer.parameters(), reference.parameters()))


def test_a_module_with_children_called_twice_is_refused():
    torch.manual_seed(0)
    with pytest.raises(FxplanError, match="runs 3 times in one step"):
        peers.sac_ilp_peer(Net(shared=True), (torch.randn(4, 8),), None, 0.5)


def test_bad_fraction_and_accelerator_modes_are_refused():
    with pytest.raises(FxplanError, match=r"memory_budget_fraction must be in \[0, 1\]"):
        peers.sac_ilp_peer(Net(), (torch.randn(4, 8),), None, 1.5)
    if torch.accelerator.is_available():
        pytest.skip("an accelerator is here: torch's own modes run")
    for mode in torch_sac.TORCH_MODES:
        with pytest.raises(FxplanError, match="needs an accelerator"):
            peers.sac_ilp_peer(Net(), (torch.randn(4, 8),), None, 0.5, runtime_mode=mode)


def test_registered_as_a_compare_method():
    methods = select_methods(default_methods(compile_budgets=(), curve_points=(), sac_budgets=(0.5, 0.25)), ["sac-ilp"])
    assert [(m.name, m.family) for m in methods] == [("vanilla", "baseline"), ("sac-ilp@0.5", "peer"),
                                                      ("sac-ilp@0.25", "peer")]


def test_compare_measures_the_peer_at_the_main_batch_and_in_real_steps():
    """``fxplan compare``'s row: planned on the fake main-batch inputs, measured there and in a real small step."""
    from fxplan.compare.driver import compare_network
    from models_zoo import hf

    entry = hf.tiny_entry("gpt2_small")
    torch.manual_seed(0)
    methods = select_methods(default_methods(compile_budgets=(), curve_points=()), ["sac-ilp@0.5"])
    rows, _ = compare_network("tiny-gpt2", entry.build(), entry.loss, lambda b, s: entry.example_inputs(b, s),
                              batch=4, input_size=64, small_batch=2, small_input_size=16, methods=methods, repeats=1,
                              input_label="seq 64")
    vanilla, sac = rows
    assert sac.method == "sac-ilp@0.5" and sac.status == "ok", sac.note
    assert sac.peak_bytes < vanilla.peak_bytes and sac.small_peak_bytes < vanilla.small_peak_bytes
    assert sac.recompute_fraction > 0


def test_a_model_on_meta_is_priced_by_the_roofline_and_planned():
    """A model too large for real tensors (built on ``meta``) has its ops priced by FLOPs and bytes instead of timed
    on real tensors; the plan is the same kind, and exact on a real model given the same mode."""
    with torch.device("meta"):
        on_meta = tiny_gpt2()
    assert torch_sac.default_runtime_mode(on_meta) == torch_sac.CPU_ROOFLINE
    batch = token_batch()
    meta_batch = {k: v.to("meta") for k, v in batch.items()}
    peer = peers.sac_ilp_peer(on_meta, meta_batch, hf_loss, 0.5)
    assert peer.fxplan_sac.runtime_mode == torch_sac.CPU_ROOFLINE and peer.fxplan_sac.discard
    unplanned = fxplan.measure_step(on_meta, meta_batch, fake=True, loss_fn=hf_loss).peak_bytes
    assert fxplan.measure_step(peer, meta_batch, fake=True, loss_fn=hf_loss).peak_bytes < unplanned

    model = tiny_gpt2()
    reference = copy.deepcopy(model)
    real_peer = peers.sac_ilp_peer(model, batch, hf_loss, 0.5, runtime_mode=torch_sac.CPU_ROOFLINE)
    assert real_peer.fxplan_sac.discard
    loss, grads = train_step(real_peer, batch, 1)
    ref_loss, ref_grads = train_step(reference, batch, 1)
    assert torch.equal(loss, ref_loss) and all(torch.equal(a, b) for a, b in zip(grads, ref_grads))
