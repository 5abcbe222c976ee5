"""fxplan.auto_checkpoint inside training stacks: FSDP2 sharded per layer and DDP (2 gloo processes),
torch.compile, PEFT, bf16 autocast.

Each check trains the planned model beside an unplanned copy wrapped the same way and compares losses and
gradients bit for bit; peaks come from meters that see what the wrapper runs (torch.profiler's allocation
events, for sharded and compiled code alike).
"""

from __future__ import annotations

import copy

import pytest
import torch
from dist_helpers import assert_ranks_agree
from tiny_models import hf_loss, tiny_gpt2, token_batch

import fxplan
from fxplan.errors import FxplanError
from fxplan.measure.meter import profiled_step_peak

transformers = pytest.importorskip("transformers")


def _gpt2_and_batch(batch_size: int = 4):
    return tiny_gpt2(), token_batch(batch_size)  # the same weights on every rank


def _shard_per_layer(model) -> None:
    """As torchtitan shards a decoder: each block, then the root."""
    from torch.distributed.fsdp import fully_shard

    for block in model.transformer.h:
        fully_shard(block)
    fully_shard(model)


def _planned_at_07():
    """A tiny GPT-2 planned at 0.7 of its unplanned peak, an unplanned copy, the batch, and what went wrong so far."""
    model, batch = _gpt2_and_batch()
    reference = copy.deepcopy(model)
    vanilla = fxplan.measure_step(model, batch, fake=True, loss_fn=hf_loss).peak_bytes
    fxplan.auto_checkpoint(model, example_inputs=batch, loss_fn=hf_loss, budget_bytes=int(0.7 * vanilla))
    return model, reference, batch, [] if model.fxplan_plan.regions else ["no region planned"]


def _profiled_from_no_grads(module, batch, rank: int) -> int:
    """The real peak of a step from no gradients, as fxplan measures one. The least of several is compared: gloo
    allocates for its collectives on threads of its own, and where those allocations fall among the step's (by time)
    varies from step to step (here by up to 1 MiB, 6% of the rank's peak), outside what the fake step counts."""
    module.zero_grad(set_to_none=True)
    torch.manual_seed(rank)
    return profiled_step_peak(module, batch, hf_loss)


def _check_per_layer_fsdp2(rank: int) -> list[str]:
    model, batch = _gpt2_and_batch()
    reference = copy.deepcopy(model)
    batch = {k: v.roll(rank, 0) for k, v in batch.items()}  # each rank its own batch order
    per_rank = fxplan.measure_step(model, batch, fake=True, loss_fn=hf_loss, shard=_shard_per_layer)
    budget = int(0.75 * per_rank.peak_bytes)
    fxplan.auto_checkpoint(model, example_inputs=batch, loss_fn=hf_loss, budget_bytes=budget, shard=_shard_per_layer)
    plan = model.fxplan_plan
    mismatches = [] if plan.regions and plan.per_rank else [f"no per-rank plan: {plan.summary()}"]
    for module in (reference, model):
        _shard_per_layer(module)
    try:
        fxplan.auto_checkpoint(reference, example_inputs=batch, loss_fn=hf_loss)
        mismatches.append("a sharded model was planned")
    except FxplanError as exc:
        if "before fully_shard" not in str(exc):
            mismatches.append(f"refusal without its remedy: {exc}")
    peaks, losses = [], []
    for module in (reference, model):
        for _ in range(2):  # a second step accumulates into the first's gradients
            torch.manual_seed(rank)  # the same dropout draws for both models
            loss = module(**batch).loss
            loss.backward()
            losses.append(loss.detach())
        grads = [p.grad for p in module.parameters()]
        peaks.append(min(_profiled_from_no_grads(module, batch, rank) for _ in range(3)))
        for p, g in zip(module.parameters(), grads):
            p.grad = g
    if not all(torch.equal(a, b) for a, b in zip(losses[:2], losses[2:])):
        mismatches.append("loss")
    for (name, p), q in zip(reference.named_parameters(), model.parameters()):
        if not torch.equal(p.grad.full_tensor(), q.grad.full_tensor()):
            mismatches.append(f"grad {name}")
    unplanned, planned = peaks
    print(f"rank {rank}: real peak planned {planned} B (measured sharded {plan.measured_peak_bytes} B, budget "
          f"{budget} B), unplanned {unplanned} B (measured sharded {per_rank.peak_bytes} B)")
    if abs(unplanned - per_rank.peak_bytes) > 1e-3 * unplanned:
        mismatches.append(f"the sharded step measured {per_rank.peak_bytes} B, a real rank peaks at {unplanned} B")
    if not planned <= budget < unplanned:
        mismatches.append(f"rank peak {planned} B not within the per-rank budget {budget} B")
    return mismatches


def test_planned_for_a_per_rank_budget_then_sharded_per_layer_trains_exactly_within_it():
    assert_ranks_agree(_check_per_layer_fsdp2)


def _check_ddp(rank: int) -> list[str]:
    from torch.nn.parallel import DistributedDataParallel as DDP

    model, reference, batch, mismatches = _planned_at_07()
    try:
        fxplan.auto_checkpoint(DDP(reference), example_inputs=batch, loss_fn=hf_loss)
        mismatches.append("a DDP-wrapped model was planned")
    except FxplanError as exc:
        if "before wrapping" not in str(exc):
            mismatches.append(f"refusal without its remedy: {exc}")
    wrapped = [(DDP(m), torch.optim.SGD(m.parameters(), lr=0.1)) for m in (reference, model)]
    batch = {k: v.roll(rank, 0) for k, v in batch.items()}  # each rank its own batch order
    for step in range(2):  # the second step starts from weights the first one's all-reduced gradients moved
        losses = []
        for ddp, sgd in wrapped:
            sgd.zero_grad(set_to_none=True)
            torch.manual_seed(10 * step + rank)  # dropout draws differ per rank, the same per model
            loss = ddp(**batch).loss
            loss.backward()
            losses.append(loss.detach())
        if not torch.equal(*losses):
            mismatches.append(f"step {step}: loss")
        for (name, p), q in zip(reference.named_parameters(), model.parameters()):
            if not torch.equal(p.grad, q.grad):
                mismatches.append(f"step {step}: grad {name}")
        for _, sgd in wrapped:
            sgd.step()
    return mismatches


def test_planned_then_wrapped_in_ddp_trains_exactly():
    assert_ranks_agree(_check_ddp)


@pytest.fixture(scope="module")
def planned_and_reference():
    model, batch = _gpt2_and_batch()
    for dropout in ("attn_pdrop", "resid_pdrop", "embd_pdrop"):  # compiled and eager dropout draw differently
        setattr(model.config, dropout, 0.0)
    model = type(model)(model.config)
    reference = copy.deepcopy(model)
    vanilla = fxplan.measure_step(model, batch, fake=True, loss_fn=hf_loss).peak_bytes
    fxplan.auto_checkpoint(model, example_inputs=batch, loss_fn=hf_loss, budget_bytes=int(0.7 * vanilla))
    assert model.fxplan_plan.regions
    return model, reference, batch


def _graph_breaks(module, batch) -> int:
    torch._dynamo.reset()
    return torch._dynamo.explain(module)(**batch).graph_break_count


def test_the_planned_model_compiles_with_no_graph_break_of_its_own(planned_and_reference):
    model, reference, batch = planned_and_reference
    assert _graph_breaks(model, batch) == _graph_breaks(reference, batch)


def test_compiled_planned_and_compiled_unplanned_steps_are_bitwise_equal(planned_and_reference):
    model, reference, batch = planned_and_reference
    results = []
    for module in (reference, model):
        torch._dynamo.reset()
        module.zero_grad(set_to_none=True)
        loss = torch.compile(module, backend="aot_eager")(**batch).loss
        loss.backward()
        results.append((loss.detach(), [p.grad for p in module.parameters()]))
    (ref_loss, ref_grads), (loss, grads) = results
    assert torch.equal(loss, ref_loss)
    assert all(torch.equal(g, r) for g, r in zip(grads, ref_grads))


def test_a_compiled_module_is_measured_compiled_and_planned_only_before_compiling(planned_and_reference):
    model, reference, batch = planned_and_reference
    torch._dynamo.reset()
    compiled = torch.compile(reference, backend="aot_eager")
    with pytest.raises(FxplanError, match="then compile"):
        fxplan.auto_checkpoint(compiled, example_inputs=batch, loss_fn=hf_loss)
    with pytest.raises(FxplanError, match="fake=False"):
        fxplan.measure_step(compiled, batch, fake=True, loss_fn=hf_loss)
    measured = fxplan.measure_step(compiled, batch, loss_fn=hf_loss)
    assert "compiled" in measured.meter
    parameter_bytes = sum(p.numel() * p.element_size() for p in reference.parameters())
    assert measured.peak_bytes > 2 * parameter_bytes  # parameters and the gradients the step makes, at least


def _inductor_peak(model, batch, **compile_config) -> int:
    import torch._functorch.config as functorch_config

    torch._dynamo.reset()
    with functorch_config.patch(**compile_config):
        peak = fxplan.measure_step(torch.compile(model, backend="inductor"), batch, loss_fn=hf_loss).peak_bytes
    torch._dynamo.reset()
    return peak


def test_under_inductor_a_budget_below_what_compile_reaches_alone_is_held():
    """Planned for the compiled step (compile_backend), the inductor-compiled planned step peaks within a budget
    below the peak compile reaches with its own activation_memory_budget, and its loss is the compiled
    original's (inductor fuses differently in the checkpointed regions: close, not bitwise)."""
    model, batch = _gpt2_and_batch(batch_size=16)
    for dropout in ("attn_pdrop", "resid_pdrop", "embd_pdrop"):
        setattr(model.config, dropout, 0.0)
    model = type(model)(model.config)
    compile_alone = _inductor_peak(model, batch, activation_memory_budget=0.5)
    budget = int(0.95 * compile_alone)
    planned = copy.deepcopy(model)
    fxplan.auto_checkpoint(planned, budget_bytes=budget, example_inputs=batch, loss_fn=hf_loss,
                           compile_backend="inductor")
    plan = planned.fxplan_plan
    assert plan.regions and plan.compile_backend == "inductor" and plan.measured_peak_bytes <= budget
    assert "compiled with torch.compile(backend='inductor')" in plan.summary()
    losses = []
    for module in (model, planned):
        torch._dynamo.reset()
        losses.append(torch.compile(module, backend="inductor")(**batch).loss.detach())
    torch.testing.assert_close(*losses)
    with pytest.raises(FxplanError, match="real tensors"):
        from torch._subclasses.fake_tensor import FakeTensorMode
        with FakeTensorMode(allow_non_fake_inputs=True) as mode:
            fake = {k: mode.from_tensor(v) for k, v in batch.items()}
        fxplan.auto_checkpoint(copy.deepcopy(model), example_inputs=fake, loss_fn=hf_loss, compile_backend="inductor")


def test_a_peft_lora_model_is_planned_and_trains_exactly():
    peft = pytest.importorskip("peft")
    model, batch = _gpt2_and_batch()
    model = peft.get_peft_model(model, peft.LoraConfig(r=8, target_modules=["c_attn", "c_proj"], lora_dropout=0.1,
                                                       fan_in_fan_out=True))
    reference = copy.deepcopy(model)
    assert fxplan.auto_checkpoint(model, example_inputs=batch, loss_fn=hf_loss) is model
    assert model.fxplan_plan.measured_peak_bytes < model.fxplan_plan.vanilla_peak_bytes
    for seed in (1, 2):  # LoRA dropout draws, gradients accumulated
        results = []
        for module in (reference, model):
            torch.manual_seed(seed)
            loss = module(**batch).loss
            loss.backward()
            results.append(loss.detach())
        assert torch.equal(*results)
    trained = [(p.grad, q.grad) for p, q in zip(model.parameters(), reference.parameters()) if p.requires_grad]
    assert trained and all(torch.equal(g, r) for g, r in trained)


def test_a_llama_planned_and_trained_under_bf16_autocast_is_exact():
    torch.manual_seed(0)
    config = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                                      num_key_value_heads=2, vocab_size=1000, use_cache=False, attention_dropout=0.1)
    model = transformers.LlamaForCausalLM(config)
    reference = copy.deepcopy(model)
    ids = torch.randint(0, 1000, (4, 32), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "labels": ids}
    with torch.autocast("cpu", dtype=torch.bfloat16):
        vanilla = fxplan.measure_step(model, batch, fake=True, loss_fn=hf_loss).peak_bytes
        fxplan.auto_checkpoint(model, example_inputs=batch, loss_fn=hf_loss, budget_bytes=int(0.85 * vanilla))
    assert model.fxplan_plan.regions and model.fxplan_plan.measured_peak_bytes <= 0.85 * vanilla
    for seed in (1, 2):
        losses = []
        for module in (reference, model):
            torch.manual_seed(seed)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = module(**batch).loss
            loss.backward()
            losses.append(loss.detach())
        assert torch.equal(*losses)
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(model.parameters(), reference.parameters()))
