"""torchvision's RAFT (small; iterative refinement over a correlation pyramid, a list of flows out): the smallest
plan's real step, read by torch.profiler, peaks within the bytes fxplan reported, and the rewrite is exact.

RAFT's encoders normalize with InstanceNorm (a batch norm of a view) followed by an in-place ReLU on that view. On real
tensors autograd records such a view as an ``as_strided`` of its base, whose backward makes a zeroed copy of the base
(fake tensors replay the view op instead): a real step held a base-sized buffer more than the fake step measured,
until the rewritten module replayed its views as well (:func:`fxplan.rewriter.recompute.views_replayed`).
"""

from __future__ import annotations

import copy

import pytest
import torch

import fxplan
from fxplan.measure.meter import measure_step_profiler

optical_flow = pytest.importorskip("torchvision.models.optical_flow")


def flow_sum(flows):
    return sum(f.sum() for f in flows)


def test_raft_smallest_plan_peaks_within_what_fxplan_reported_and_is_exact():
    torch.manual_seed(0)
    model = optical_flow.raft_small().train()
    inputs = {"image1": torch.randn(1, 3, 128, 128), "image2": torch.randn(1, 3, 128, 128), "num_flow_updates": 2}
    ref = copy.deepcopy(model)
    opt = fxplan.rewrite(model, None, example_inputs=inputs, loss_fn=flow_sum)
    reported = opt.fxplan_measured_peak_bytes
    vanilla = fxplan.measure_step(model, inputs, fake=True, loss_fn=flow_sum).peak_bytes
    assert reported < vanilla
    assert measure_step_profiler(opt, inputs, loss_fn=flow_sum).peak_bytes <= reported
    assert fxplan.measure_step(opt, inputs, loss_fn=flow_sum).peak_bytes <= reported  # the live-storage meter too

    out_ref, out_opt = ref(**inputs), opt(**inputs)
    assert len(out_ref) == len(out_opt) == 2
    assert all(torch.equal(a, b) for a, b in zip(out_ref, out_opt))
    flow_sum(out_ref).backward()
    flow_sum(out_opt).backward()
    for (name, p), q in zip(ref.named_parameters(), opt.parameters()):
        assert (p.grad is None) == (q.grad is None), name
        assert p.grad is None or torch.equal(p.grad, q.grad), f"gradient of {name} differs"
    for (name, a), b in zip(ref.state_dict().items(), opt.state_dict().values()):
        assert torch.equal(a, b), f"{name} differs after the step"
