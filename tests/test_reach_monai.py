"""MONAI's UNet trained with its ``DiceCELoss``, which reduces over ``torch.arange(2, len(input.shape)).tolist()``
(a list known from shapes alone): planned and rewritten exactly, its measured peak within the budget."""

from __future__ import annotations

import copy

import pytest
import torch

import fxplan

monai = pytest.importorskip("monai")


def test_monai_unet_with_dice_ce_loss_is_planned_exactly_within_its_budget():
    from monai.losses import DiceCELoss
    from monai.networks.nets import UNet

    torch.manual_seed(0)
    model = UNet(spatial_dims=2, in_channels=1, out_channels=2, channels=(4, 8, 16), strides=(2, 2),
                 num_res_units=1).train()
    x = torch.randn(2, 1, 32, 32)
    labels = torch.randint(0, 2, (2, 1, 32, 32))
    criterion = DiceCELoss(to_onehot_y=True, softmax=True)

    def loss_fn(out):
        return criterion(out, labels)

    vanilla = fxplan.measure_step(model, (x,), fake=True, loss_fn=loss_fn).peak_bytes
    smallest = fxplan.min_budget_bytes(model, (x,), loss_fn=loss_fn)
    assert smallest < vanilla
    budget = (smallest + vanilla) // 2
    ref = copy.deepcopy(model)
    opt = fxplan.rewrite(model, budget_bytes=budget, example_inputs=(x,), loss_fn=loss_fn)
    assert opt.fxplan_measured_peak_bytes <= budget
    assert fxplan.measure_step(opt, (x,), loss_fn=loss_fn).peak_bytes <= budget  # a real step
    for step in range(2):
        torch.manual_seed(step)
        out_ref = ref(x)
        torch.manual_seed(step)
        out_opt = opt(x)
        assert torch.equal(out_ref, out_opt), f"output differs at step {step}"
        loss_ref, loss_opt = loss_fn(out_ref), loss_fn(out_opt)
        assert torch.equal(loss_ref, loss_opt), f"loss differs at step {step}"
        loss_ref.backward()
        loss_opt.backward()
        for (name, p), q in zip(ref.named_parameters(), opt.parameters()):
            assert torch.equal(p.grad, q.grad), f"gradient of {name} differs at step {step}"
        for (name, a), b in zip(ref.state_dict().items(), opt.state_dict().values()):
            assert torch.equal(a, b), f"{name} differs after step {step}"
