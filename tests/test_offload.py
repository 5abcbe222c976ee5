"""Offloading: values kept for backward in host memory instead of on the device, planned for a device budget.

The copies' time model is checked on hand-computed schedules; the runtime on real autograd (two training steps
bitwise equal to the original's, BatchNorm buffers and in-place ReLUs included); the planner on a Llama whose
offloading plan peaks below the smallest peak recomputation alone reaches, measured on fake tensors and on a real
CPU step alike.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torchvision.models.resnet import BasicBlock

import fxplan
from fxplan.capture import effects
from fxplan.capture.capturers import capture
from fxplan.errors import BudgetError, FxplanError
from fxplan.rewriter.codegen import segment_module
from fxplan.solvers.offload import Offloadable, copy_schedule, fewest_fitting, offload_order
from fxplan.solvers.plans import Plan

transformers = pytest.importorskip("transformers")


def test_on_the_cpu_every_copy_is_exposed():
    values = [Offloadable("a", 100, 0, 2), Offloadable("b", 300, 1, 2)]
    schedule = copy_schedule(values, [1.0, 1.0, 1.0], 100.0, overlapped=False)
    assert schedule.host_bytes == 400
    assert schedule.copy_seconds == pytest.approx(8.0)  # 400 bytes out and back at 100 bytes/s
    assert schedule.exposed_seconds == schedule.copy_seconds


def test_beside_enough_compute_only_the_first_copy_back_is_exposed():
    # Forward: nodes of 10 s each; "a" is made by node 0, "b" by node 1, both read last by node 3.
    # Copies take 1 s each way. Backward reaches node 3 at 40 s: "b", saved last, is fetched then (1 s exposed) and
    # "a" is prefetched at once behind it, arriving at 42 s, before backward needs it (also at node 3, after "b").
    values = [Offloadable("a", 100, 0, 3), Offloadable("b", 100, 1, 3)]
    schedule = copy_schedule(values, [10.0, 10.0, 10.0, 10.0], 100.0, overlapped=True)
    assert schedule.copy_seconds == pytest.approx(4.0)
    assert schedule.exposed_seconds == pytest.approx(2.0)  # b's copy back, then a's right behind it
    spread = [Offloadable("a", 100, 0, 1), Offloadable("b", 100, 1, 3)]
    later = copy_schedule(spread, [10.0, 10.0, 10.0, 10.0], 100.0, overlapped=True)
    # "a" is read at node 1, 40 s of backward after "b": its prefetch, started when "b" was read, has arrived
    assert later.exposed_seconds == pytest.approx(1.0)
    assert later.hidden_seconds == pytest.approx(3.0)


def test_a_slow_link_exposes_what_compute_cannot_cover():
    values = [Offloadable("a", 1000, 0, 0)]
    schedule = copy_schedule(values, [1.0], 100.0, overlapped=True)
    # the copy out ends at 11 s, 10 s after the forward; the copy back starts there and ends at 21 s
    assert schedule.exposed_seconds == pytest.approx(20.0)


def test_values_are_offloaded_in_the_order_the_forward_makes_them():
    values = [Offloadable("late", 8, 5, 6), Offloadable("early", 8, 0, 9), Offloadable("mid", 8, 2, 3)]
    assert [v.name for v in offload_order(values)] == ["early", "mid", "late"]


def _sgd_steps(model: torch.nn.Module, x: torch.Tensor, loss_fn, steps: int = 2) -> list[torch.Tensor]:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for _ in range(steps):
        optimizer.zero_grad()
        loss = loss_fn(model(x))
        loss.backward()
        optimizer.step()
        losses.append(loss.detach())
    return losses


def test_the_fewest_values_offloaded_that_fit_are_found_by_bisection():
    peaks = [100, 90, 80, 70, 60, 60, 60]  # the device peak with the first k values offloaded
    asked = []

    def measure(k):
        asked.append(k)
        return k, peaks[k]

    def fewest(bar, measure=measure):
        return fewest_fitting((6, peaks[6]), 6, measure, lambda step: step[1] <= bar)[0]

    assert [fewest(bar) for bar in (100, 85, 80, 60)] == [0, 2, 2, 4]
    assert len(asked) <= 4 * 3  # at most log2 of the count, plus one, each
    assert fewest(59) == 6  # nothing fewer fits: all of them, as measured before
    # a plan the rewriter rejects (None) counts as not fitting: the bisection looks above it
    assert fewest(80, lambda k: None if k == 3 else (k, peaks[k])) == 4


def test_every_value_offloaded_trains_residual_blocks_exactly_batchnorm_buffers_and_inplace_relus_included():
    torch.manual_seed(0)
    original = torch.nn.Sequential(
        torch.nn.Conv2d(3, 16, 3, padding=1, bias=False), torch.nn.BatchNorm2d(16), torch.nn.ReLU(inplace=True),
        *[BasicBlock(16, 16) for _ in range(4)], torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(),
        torch.nn.Linear(16, 10))
    x = torch.randn(8, 3, 32, 32)
    planned_model = copy.deepcopy(original)
    gm = capture(planned_model, (x,)).gm
    nodes = [n.name for n in gm.graph.nodes if effects.is_compute(n)]
    offloading = segment_module(gm, [nodes], None, nodes)
    loss_fn = torch.Tensor.sum
    vanilla = fxplan.measure_step(original, (x,), fake=True).peak_bytes
    stats = fxplan.measure_step(offloading, (x,), fake=True)
    assert stats.peak_bytes < 0.7 * vanilla
    assert stats.host_peak_bytes > 0.3 * vanilla

    assert torch.equal(torch.stack(_sgd_steps(original, x, loss_fn)), torch.stack(_sgd_steps(offloading, x, loss_fn)))
    for (name, a), b in zip(original.state_dict().items(), planned_model.state_dict().values()):
        assert torch.equal(a, b), name
    for a, b in zip(original.parameters(), planned_model.parameters()):
        assert torch.equal(a.grad, b.grad)


def _llama(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=8,
                                      num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=256,
                                      use_cache=False)
    return transformers.LlamaForCausalLM(config)


def _logits_sum(output) -> torch.Tensor:
    return output.logits.float().sum()


@pytest.fixture(scope="module")
def llama_offload_plan():
    ids = torch.randint(0, 256, (4, 128), generator=torch.Generator().manual_seed(0))
    model = _llama()
    plan = fxplan.plan(model, (ids,), offload=True, loss_fn=_logits_sum)
    return model, ids, plan


def test_an_offloading_plan_peaks_below_the_smallest_recomputation_reaches(llama_offload_plan):
    model, ids, plan = llama_offload_plan
    recomputation_alone = fxplan.min_budget_bytes(model, (ids,), loss_fn=_logits_sum)
    assert plan.offloaded and plan.host_peak_bytes > 0
    assert plan.measured_peak_bytes < recomputation_alone
    summary = plan.summary()
    assert "offloaded to host memory" in summary and "hidden behind compute" in summary


def test_an_offloading_plan_goes_through_json_to_a_fresh_model_and_trains_it_exactly(llama_offload_plan):
    _, ids, plan = llama_offload_plan
    fresh = _llama(seed=1)
    reference = copy.deepcopy(fresh)
    module = fxplan.rewrite(fresh, plan=Plan.from_json(plan.to_json()), example_inputs=(ids,), loss_fn=_logits_sum)
    assert module.fxplan_plan.offloaded == plan.offloaded
    assert module.fxplan_measured_peak_bytes == plan.measured_peak_bytes
    real = fxplan.measure_step(module, (ids,), loss_fn=_logits_sum)  # a real CPU step, its storages metered
    assert real.peak_bytes == plan.measured_peak_bytes
    assert real.host_peak_bytes == module.fxplan_plan.host_peak_bytes

    for _ in range(2):
        for m in (reference, module):
            m.zero_grad()
            _logits_sum(m(ids)).backward()
        for (name, a), b in zip(reference.named_parameters(), fresh.parameters()):
            assert torch.equal(a.grad, b.grad), name
        with torch.no_grad():
            for a, b in zip(reference.parameters(), fresh.parameters()):
                a -= 0.1 * a.grad
                b -= 0.1 * b.grad


def test_a_device_budget_is_held_with_the_host_copies_within_their_limit(llama_offload_plan):
    model, ids, full = llama_offload_plan
    vanilla = fxplan.measure_step(model, (ids,), fake=True, loss_fn=_logits_sum).peak_bytes
    limit = full.host_peak_bytes // 2
    plan = fxplan.plan(model, (ids,), offload=True, host_bytes=limit, budget_bytes=int(0.6 * vanilla),
                       loss_fn=_logits_sum)
    assert plan.measured_peak_bytes <= int(0.6 * vanilla)
    assert plan.host_peak_bytes <= limit
    with pytest.raises(BudgetError, match="offloading included"):
        fxplan.plan(model, (ids,), offload=True, host_bytes=0, budget_bytes=full.measured_peak_bytes,
                    loss_fn=_logits_sum)


def test_a_host_limit_without_offloading_is_refused():
    with pytest.raises(FxplanError, match="offload=True"):
        fxplan.plan(torch.nn.Linear(2, 2), (torch.randn(1, 2),), host_bytes=1000)


def test_auto_checkpoint_offloads_what_its_modules_save_and_trains_exactly():
    ids = torch.randint(0, 256, (4, 128), generator=torch.Generator().manual_seed(0))
    model = _llama()
    reference = copy.deepcopy(model)
    vanilla = fxplan.measure_step(model, (ids,), fake=True, loss_fn=_logits_sum).peak_bytes
    recomputation_alone = fxplan.auto_checkpoint(copy.deepcopy(model), example_inputs=(ids,),
                                                 loss_fn=_logits_sum).fxplan_plan
    fxplan.auto_checkpoint(model, example_inputs=(ids,), loss_fn=_logits_sum, offload=True)
    applied = model.fxplan_plan
    assert applied.offloaded_calls > 0 and applied.host_peak_bytes > 0
    assert applied.measured_peak_bytes < min(recomputation_alone.measured_peak_bytes, vanilla)
    assert "offloaded to host memory" in applied.summary()
    # A real CPU step, device and host apart. The model's own forward runs there, whose attention mask takes a
    # shortcut on real values that a fake step cannot take: the fake peak is an upper bound.
    real = fxplan.measure_step(model, (ids,), loss_fn=_logits_sum)
    assert real.peak_bytes <= applied.measured_peak_bytes and real.host_peak_bytes == applied.host_peak_bytes
    again = type(applied).from_json(applied.to_json())
    assert again.regions == applied.regions and again.host_peak_bytes == applied.host_peak_bytes

    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (reference, model)]
    for _ in range(2):
        losses = []
        for m, optimizer in zip((reference, model), optimizers):
            optimizer.zero_grad()
            loss = _logits_sum(m(ids))
            loss.backward()
            optimizer.step()
            losses.append(loss.detach())
        assert torch.equal(*losses)
        for (name, a), b in zip(reference.named_parameters(), model.parameters()):
            assert torch.equal(a, b), name


def test_an_offloading_plan_trains_under_hugging_face_trainer_with_the_unplanned_losses(tmp_path):
    """Trainer with default arguments runs the model's own forward: the offloading hooks copy what the checkpointed
    modules save in every step it takes, and the losses are the unplanned model's."""
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    from tiny_models import hf_loss, tiny_gpt2, trainer_losses

    from fxplan.rewriter import offload

    ids = torch.randint(0, 1000, (8, 64), generator=torch.Generator().manual_seed(0))
    rows = [{"input_ids": row, "labels": row} for row in ids]

    def train(model, out):
        return trainer_losses(model, rows, str(out), max_steps=2)[0]

    planned = tiny_gpt2()
    batch = {"input_ids": ids[:4], "labels": ids[:4]}
    fxplan.auto_checkpoint(planned, example_inputs=batch, loss_fn=hf_loss, offload=True)
    assert planned.fxplan_plan.offloaded_calls > 0
    with offload.recording() as copied:
        losses = train(planned, tmp_path / "planned")
    assert copied  # the host copies were made during the Trainer's steps
    assert len(losses) == 2 and losses == train(tiny_gpt2(), tmp_path / "reference")
