"""Every zoo network and tiny zoo transformer, rewritten by fxplan.rewrite at two budgets, trains like the
original and fits.

Real CPU steps at a small batch and input size (``ZooEntry.quick_input_size``); budgets are whole-step
peaks measured on fake tensors. Outputs, parameter gradients and buffers are compared bitwise when the
plan keeps program order; a plan that defers a branch (the DP does on GoogLeNet) may change the order
in which autograd sums three or more gradient contributions, so there they are compared to 1e-5 of
each tensor's largest magnitude.
"""

from __future__ import annotations

import copy
import gc

import pytest
import torch
from torch.utils._pytree import tree_leaves

import fxplan
import models_zoo
from fxplan.capture.effects import COMPUTE_OPS
from fxplan.measure.meter import GiB, measure_step

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def keeps_program_order(module) -> bool:
    original = [n.name for n in module._fxplan_graph.nodes if n.op in COMPUTE_OPS]
    planned = [name for segment in module.fxplan_plan.segments for name in segment]
    return original == planned


def train_step(model, inputs, loss_fn, seed: int):
    torch.manual_seed(seed)
    out = model(*inputs)
    loss_fn(out).backward()
    return out


def assert_same(a: torch.Tensor, b: torch.Tensor, exact: bool, what: str) -> None:
    if exact:
        assert torch.equal(a, b), what
    elif a.is_floating_point():
        # Summation order changes the last bits; relative to the tensor's scale, not elementwise.
        assert (a - b).abs().max() <= 1e-5 * a.abs().max() + 1e-12, what
    else:
        assert torch.equal(a, b), what


@pytest.mark.parametrize("name", models_zoo.paper_names()
                         + [f"tiny:{n}" for n in models_zoo.transformer_names()])
def test_zoo_network_rewritten_at_two_budgets(name):
    if name.startswith("tiny:"):
        pytest.importorskip("transformers")
        entry = models_zoo.hf.tiny_entry(name.removeprefix("tiny:"))
    else:
        entry = models_zoo.get(name)
    torch.manual_seed(0)
    original = entry.build()
    inputs = entry.example_inputs(batch_size=max(2, entry.min_batch), input_size=entry.quick_input_size)
    vanilla = measure_step(original, inputs, fake=True, loss_fn=entry.loss).peak_bytes

    # Every model below shares the original's Parameter objects (own buffers and modules), and one rewritten
    # copy lives at a time: VGG-19's 548 MiB of parameters are held once, with two sets of gradients.
    reference = sharing_copy(original)
    out_r = train_step(reference, inputs, entry.loss, seed=1)
    grads_r = {pname: p.grad for pname, p in reference.named_parameters()}
    state_r = reference.state_dict()
    original.zero_grad(set_to_none=True)
    smallest_peak = None
    for budget_name in ("smallest", "middle"):
        budget = None if smallest_peak is None else (smallest_peak + vanilla) // 2
        optimized = fxplan.rewrite(sharing_copy(original), None if budget is None else budget / GiB,
                                   example_inputs=inputs, loss_fn=entry.loss)
        if budget is None:
            smallest_peak = optimized.fxplan_measured_peak_bytes
            assert smallest_peak <= vanilla
        else:
            assert measure_step(optimized, inputs, fake=True, loss_fn=entry.loss).peak_bytes <= budget
        exact = keeps_program_order(optimized)
        out_o = train_step(optimized, inputs, entry.loss, seed=1)
        for a, b in zip(tree_leaves(out_r), tree_leaves(out_o), strict=True):
            assert_same(a, b, exact, f"{name}, {budget_name}: output")
        params_o = dict(optimized.named_parameters())
        assert params_o.keys() == grads_r.keys()
        for pname, grad in grads_r.items():
            assert_same(grad, params_o[pname].grad, exact, f"{name}, {budget_name}: gradient of {pname}")
        state_o = optimized.state_dict()
        assert state_o.keys() == state_r.keys()
        for key, value in state_r.items():
            assert_same(value, state_o[key], exact, f"{name}, {budget_name}: {key}")
        original.zero_grad(set_to_none=True)
        del optimized, out_o, params_o, state_o
        gc.collect()


def sharing_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of ``model`` with its own modules and buffers but the very same Parameter objects."""
    return copy.deepcopy(model, {id(p): p for p in model.parameters()})
