"""The rewritten model trains exactly like the original: outputs, gradients, buffers, random draws.

Everything here runs on the CPU in float32 and compares with ``torch.equal`` (bitwise): the CPU
kernels used are deterministic, recomputation replays the same kernels on the same inputs, and the
autograd graph of a program-order plan is the original's plus identity-gradient copy nodes.
Plans that reorder nodes (random topological orders) are compared bitwise too, on models where no
value gets three or more gradient contributions; see ``fxplan.rewriter.codegen`` for why that matters.
"""

from __future__ import annotations

import copy
import random
import re

import pytest
import torch
import torch.fx as fx
import torchvision
from models_awkward import (
    AWKWARD,
    BNNet,
    DenseNetBlock,
    RandomNet,
    assert_same_training,
    chunks,
    compute_names,
    random_plan,
    step,
)
from torch.utils.checkpoint import checkpoint, checkpoint_sequential

from fxplan.rewriter.codegen import segment_module

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def rewrite_copy(model: torch.nn.Module, plan_fn) -> torch.nn.Module:
    """Trace a deep copy of ``model`` and rewrite it with the plan ``plan_fn(gm)``."""
    gm = fx.symbolic_trace(copy.deepcopy(model))
    return segment_module(gm, plan_fn(gm))


@pytest.mark.parametrize("name", sorted(AWKWARD))
@pytest.mark.parametrize("k", [2, 5])
def test_awkward_contiguous_plans_bitwise(name, k):
    ctor, make_inputs = AWKWARD[name]
    torch.manual_seed(0)
    model = ctor()
    inputs = make_inputs()
    opt = rewrite_copy(model, lambda gm, k=k: chunks(compute_names(gm), k))
    assert_same_training(copy.deepcopy(model), opt, inputs)


@pytest.mark.parametrize("name", sorted(AWKWARD))
def test_awkward_every_two_segment_cut_bitwise(name):
    """Every cut point, so every in-place op meets a segment boundary right before it."""
    ctor, make_inputs = AWKWARD[name]
    torch.manual_seed(0)
    model = ctor()
    inputs = make_inputs()
    names = compute_names(fx.symbolic_trace(model))
    ref = copy.deepcopy(model)
    out_ref = step(ref, inputs)
    grads_ref = [p.grad for p in ref.parameters()]
    stride = max(1, len(names) // 12)  # at most ~12 cuts per model, to stay fast
    for cut in range(1, len(names), stride):
        opt = rewrite_copy(model, lambda gm, cut=cut: [names[:cut], names[cut:]])
        out = step(opt, inputs)
        for a, b in zip(torch.utils._pytree.tree_leaves(out_ref), torch.utils._pytree.tree_leaves(out)):
            assert torch.equal(a, b), f"cut {cut}"
        for g, p in zip(grads_ref, opt.parameters()):
            assert torch.equal(g, p.grad), f"cut {cut}"


@pytest.mark.parametrize("name", sorted(AWKWARD))
def test_awkward_random_lower_set_sequences_bitwise(name):
    """Non-contiguous plans: random topological orders (branches deferred) cut at random."""
    ctor, make_inputs = AWKWARD[name]
    torch.manual_seed(0)
    model = ctor()
    inputs = make_inputs()
    rng = random.Random(name)
    for _trial in range(3):
        k = rng.randint(2, 6)
        opt = rewrite_copy(model, lambda gm, k=k: random_plan(gm, rng, k))
        assert_same_training(copy.deepcopy(model), opt, inputs, steps=1)


def test_skip_branch_deferred_to_later_segment():
    """A hand-made non-contiguous plan: the skip branch of a residual block runs a segment later."""
    torch.manual_seed(0)
    model = torchvision.models.resnet18()
    x = torch.randn(2, 3, 16, 16)
    names = compute_names(fx.symbolic_trace(model))
    skip = ["layer2_0_downsample_0", "layer2_0_downsample_1"]
    main = [v for v in names if v not in skip]
    cut = main.index("add_2")  # the add that joins layer2.0's branches
    plan = [main[:cut], skip + main[cut : cut + 10], main[cut + 10 :]]
    opt = rewrite_copy(model, lambda gm: plan)
    assert "layer2_0_downsample_0" in opt.segment_1.code
    assert_same_training(copy.deepcopy(model), opt, (x,), steps=1)


def test_resnet50_eight_segments_where_checkpoint_sequential_fails():
    """The fact from design.md: checkpoint_sequential over resnet50 crashes in backward (a segment
    starts with an in-place ReLU that overwrites its saved input); an 8-segment plan cut at the
    same kind of place trains exactly like the original."""
    torch.manual_seed(0)
    model = torchvision.models.resnet50()
    x = torch.randn(2, 3, 64, 64)
    seq = torch.nn.Sequential(
        model.conv1, model.bn1, model.relu, model.maxpool,
        *model.layer1, *model.layer2, *model.layer3, *model.layer4,
    )
    with pytest.raises(RuntimeError, match="inplace"):
        checkpoint_sequential(copy.deepcopy(seq), 8, x, use_reentrant=False).sum().backward()
    names = compute_names(fx.symbolic_trace(model))
    plan = chunks(names, 8)
    plan[0], plan[1] = names[:2], [v for v in plan[0] + plan[1] if v not in names[:2]]  # cut at relu
    opt = rewrite_copy(model, lambda gm: plan)
    assert len(opt.segment_modules()) == 8
    # the in-place ReLU runs between segments 0 and 1, not recomputed, so segment 1 keeps its result
    assert re.search(r"relu = self\.relu\(\w+\)", opt.code) and "clone" not in opt.segment_1.code
    assert_same_training(copy.deepcopy(model), opt, (x,))


def test_resnet50_other_plans_bitwise():
    torch.manual_seed(0)
    model = torchvision.models.resnet50()
    x = torch.randn(2, 3, 32, 32)
    rng = random.Random(1)
    for plan_fn in (lambda gm: chunks(compute_names(gm), 3), lambda gm: random_plan(gm, rng, 5)):
        opt = rewrite_copy(model, plan_fn)
        assert_same_training(copy.deepcopy(model), opt, (x,), steps=1)


def test_densenet_block_plans_bitwise():
    torch.manual_seed(0)
    model = DenseNetBlock()
    x = torch.randn(2, 3, 12, 12)
    for k in (4, 9):
        opt = rewrite_copy(model, lambda gm, k=k: chunks(compute_names(gm), k))
        assert_same_training(copy.deepcopy(model), opt, (x,))


def test_plain_checkpoint_updates_batchnorm_twice():
    """Control for the guard: torch's checkpoint alone updates running stats in the recomputation."""
    bn = torch.nn.BatchNorm1d(3)
    x = torch.randn(4, 3, requires_grad=True)
    checkpoint(bn, x, use_reentrant=False).sum().backward()
    assert int(bn.num_batches_tracked) == 2


def test_batchnorm_updated_once_per_step():
    torch.manual_seed(0)
    model = BNNet()
    ref = copy.deepcopy(model)
    x = torch.randn(3, 3, 8, 8)
    names = compute_names(fx.symbolic_trace(model))
    opt = rewrite_copy(model, lambda gm: [[v] for v in names])  # every node recomputed alone
    for s in range(3):
        step(ref, (x,), seed=s)
        step(opt, (x,), seed=s)
        assert int(opt.bn.num_batches_tracked) == s + 1
        assert int(opt.shared.num_batches_tracked) == 2 * (s + 1)  # called twice per step
        for key, value in ref.state_dict().items():
            assert torch.equal(value, opt.state_dict()[key]), key


def test_recomputed_batchnorm_output_is_bitwise_the_forward_output():
    """Capture the BN output in the forward and in the recomputation: they must be equal."""
    torch.manual_seed(0)
    model = BNNet()
    names = compute_names(fx.symbolic_trace(model))
    opt = rewrite_copy(model, lambda gm: [names[:4], names[4:]])
    seen = []
    handle = opt.bn.register_forward_hook(lambda m, i, o: seen.append(o.detach().clone()))
    step(opt, (torch.randn(3, 3, 8, 8),))
    handle.remove()
    assert len(seen) == 2  # forward + recomputation
    assert torch.equal(seen[0], seen[1])


def test_dropout_draws_match_original_and_recomputation():
    torch.manual_seed(0)
    model = RandomNet()
    x = torch.randn(5, 8)
    names = compute_names(fx.symbolic_trace(model))
    masks = {}

    def record(tag):
        return lambda m, i, o: masks.setdefault(tag, []).append((o == 0).clone())

    ref = copy.deepcopy(model)
    ref.drop.register_forward_hook(record("ref"))
    opt = rewrite_copy(model, lambda gm: [names[:4], names[4:]])
    opt.drop.register_forward_hook(record("opt"))
    step(ref, (x,), seed=7)
    step(opt, (x,), seed=7)
    assert len(masks["ref"]) == 1 and len(masks["opt"]) == 2  # forward + recomputation
    assert masks["ref"][0].any()
    assert torch.equal(masks["ref"][0], masks["opt"][0])
    assert torch.equal(masks["opt"][0], masks["opt"][1])
    # the global generator continues as after a plain step
    assert torch.equal(torch.rand(3), (torch.manual_seed(7), ref(x), torch.rand(3))[2])


def test_autocast_cpu_bfloat16_bitwise():
    torch.manual_seed(0)
    model = DenseNetBlock()
    x = torch.randn(2, 3, 12, 12)
    opt = rewrite_copy(model, lambda gm: chunks(compute_names(gm), 4))
    ref = copy.deepcopy(model)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out_r = step(ref, (x,))
        out_o = step(opt, (x,))
    assert out_r.dtype == torch.bfloat16
    assert torch.equal(out_r, out_o)
    for p, q in zip(ref.parameters(), opt.parameters()):
        assert torch.equal(p.grad, q.grad)


def test_float64_model_bitwise():
    torch.manual_seed(0)
    model = DenseNetBlock().double()
    x = torch.randn(2, 3, 12, 12, dtype=torch.float64)
    opt = rewrite_copy(model, lambda gm: chunks(compute_names(gm), 5))
    assert_same_training(copy.deepcopy(model), opt, (x,))
