"""Units of recomputed inputs (fxplan.capture.recomputed_inputs): cheap values dropped after the forward pass and made
again in the backward of the nodes that keep them, exactly, composing with checkpoint, saved and loaded."""

from __future__ import annotations

import copy
import io
import math

import pytest
import torch
import torch.nn.functional as F
from reach_checks import assert_rewrite_exact, assert_same_state, loss_of
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils.checkpoint import checkpoint

import fxplan
from fxplan.capture.recomputed_inputs import Recipe, _Slot, call_recomputing, find_units
from fxplan.capture.regions import with_regions
from fxplan.costs.trace import trace
from fxplan.errors import FxplanError
from fxplan.planner import splice
from fxplan.planner.plan_meter import PlanMeter
from fxplan.planner.step_model import step_model
from fxplan.planner.trust import NEGLIGIBLE
from fxplan.planner.variants import Searches
from fxplan.solvers.units import PREFIX, Unit

pytest.importorskip("transformers")
from models_zoo.hf import HFModel  # noqa: E402


def _gpt2(fake: bool = False):
    """A GPT-2 of 2 layers, width 64, 128 tokens (its activations, not its parameters, decide the peak), and its
    inputs (fake tensors: ``fake``)."""
    gpt = HFModel("GPT2Config", "causal-lm", dict(n_layer=2, n_embd=64, n_head=4, vocab_size=128, n_positions=128))
    entry = gpt.entry("gpt2-tiny", 4, 128, "tests", quick_input_size=128)
    torch.manual_seed(0)
    model = entry.build().train()
    if not fake:
        return model, tuple(entry.example_inputs())
    with FakeTensorMode():
        return model, tuple(entry.example_inputs())


def _norm_then_linear(x, weight, bias, w):
    """x -> layer_norm -> linear, the LayerNorm's output recomputed in the linear's backward."""
    h = F.layer_norm(x, (x.shape[-1],), weight, bias)
    return call_recomputing(F.linear, (h, w), {}, _norm_recipe(x), (x, weight, bias), (h,))


def _norm_recipe(x):
    return Recipe([(F.layer_norm, (_Slot(0), (x.shape[-1],), _Slot(1), _Slot(2)), {})], (3,))


def _leaves():
    torch.manual_seed(0)
    return [torch.randn(*shape, requires_grad=True) for shape in ((4, 8, 16), (16,), (16,), (32, 16))]


def test_a_recomputed_input_gives_autograds_gradients_bit_for_bit_and_inside_checkpoint_too():
    expected = _leaves()
    h = F.layer_norm(expected[0], (16,), expected[1], expected[2])
    F.linear(h, expected[3]).pow(2).sum().backward()
    for run in (lambda *a: _norm_then_linear(*a), lambda *a: checkpoint(_norm_then_linear, *a, use_reentrant=False)):
        leaves = _leaves()
        run(*leaves).pow(2).sum().backward()
        assert all(torch.equal(a.grad, b.grad) for a, b in zip(expected, leaves))


def test_the_saver_keeps_the_inputs_not_the_dropped_value():
    x, weight, bias, w = _leaves()
    kept = []

    def pack(t):
        kept.append(t.untyped_storage()._cdata)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        h = F.layer_norm(x, (16,), weight, bias)
        call_recomputing(F.linear, (h, w), {}, _norm_recipe(x), (x, weight, bias), (h,))
    assert h.untyped_storage()._cdata not in kept
    assert kept.count(x.untyped_storage()._cdata) == 2  # the norm's and, through fxplan's hooks, the linear's


def test_an_input_changed_in_place_before_backward_is_an_error():
    x, weight, bias, w = _leaves()
    y = _norm_then_linear(x.clone(), weight, bias, w)
    with torch.no_grad():
        weight.add_(1)
    with pytest.raises(RuntimeError, match="modified in place"):
        y.sum().backward()


def test_gpt2_units_drop_the_norms_and_the_gelus_values_and_the_replay_sees_it():
    model, fake = _gpt2(fake=True)
    cg = trace(model, fake, probe_units=True)
    units = find_units(cg)
    dropped = {cg.nodes[v]["target"] for u in units for v in u.dropped}
    assert {"layer_norm.default", "mul.Tensor", "add.Tensor"} <= dropped, dropped
    assert not any(cg.nodes[v]["flops"] for u in units for v in u.recomputed)  # no matrix product runs again
    searches = Searches(cg, model, fake, solver="approx", loss_fn=loss_of)
    peaks = []
    for variant in (searches.plain, searches.with_regions()):
        first = next(variant.search.by_recompute(True))
        assert first.recompute == 0
        peaks.append((variant.search.measure(first), first.replayed))
    (plain, _), (with_units, replayed) = peaks
    assert with_units < 0.9 * plain
    assert abs(replayed - with_units) <= 0.001 * with_units


def _residual_blocks(blocks: int):
    """LayerNorm -> Linear -> GELU -> Linear, residual (a synthetic network), and a fake input."""
    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.ln, self.fc1, self.fc2 = torch.nn.LayerNorm(16), torch.nn.Linear(16, 64), torch.nn.Linear(64, 16)

        def forward(self, x):
            return x + self.fc2(F.gelu(self.fc1(self.ln(x))))

    with FakeTensorMode():
        return torch.nn.Sequential(*[Block() for _ in range(blocks)]), (torch.randn(4, 32, 16),)


@pytest.mark.parametrize("make", [_gpt2, lambda fake: _residual_blocks(3)], ids=["gpt2", "residual"])
def test_a_graph_with_units_derived_from_the_captured_graphs_trace_is_the_traced_one(make):
    model, fake = make(fake=True)
    plain = trace(model, fake, probe_units=True)
    units = find_units(plain)
    assert set(plain.graph["unit_savers"]) == {s for u in units for s in u.savers}
    for subset in (units, units[::2]):
        got = splice.derived(plain, subset)
        want = trace(model, fake, captured=with_regions(plain.graph["captured"], subset))
        assert list(got.nodes) == list(want.nodes)
        assert {v: dict(got.nodes[v]) for v in got} == {v: dict(want.nodes[v]) for v in want}
        assert set(got.edges(data="order_only")) == set(want.edges(data="order_only"))
        for gm in ("gm", "fake"):
            marks = [{n.name: (n.meta.get("fxplan_mutates"), n.meta.get("fxplan_fresh_output")) for n in
                      (cg.graph[gm] if gm == "gm" else cg.graph[gm][0]).graph.nodes} for cg in (got, want)]
            assert marks[0] == marks[1]
        # which inputs a node's backward gives a gradient: the captured graph's. A trace of the graph with units
        # also names a recipe's input that shares its autograd node with a value the saver keeps (GPT-2's
        # embeddings and their sum, Mistral's hidden state and its float32 copy), which no gradient reaches
        # through the saver; the replay of the derived graph is the closer to the measured peak there.
        assert got.graph["gradients"] == plain.graph["gradients"]
        names = list(got.nodes)
        segments = [names[:len(names) // 3], names[len(names) // 3:]]
        measured = [PlanMeter(cg, fake, None).measure(segments, {}) for cg in (got, want)]
        assert measured[0] == measured[1]  # the same peak, the same generated code


def test_a_savers_parameter_gradients_are_its_operators_not_its_recipes():
    model, fake = _residual_blocks(2)
    plain = trace(model, fake, probe_units=True)
    units = find_units(plain)
    with_units = splice.derived(plain, units)
    before = step_model(plain, model, fake).param_grads
    after = step_model(with_units, model, fake).param_grads
    savers = {s for u in units for s in u.savers}
    assert savers and all(after[s] == before[s] for s in savers)  # fc1 and fc2's own, not the LayerNorm's


def test_a_unit_saver_not_probed_is_traced(caplog):
    model, fake = _residual_blocks(2)
    plain = trace(model, fake)  # the savers not probed (probe_units=False)
    with pytest.raises(splice.SpliceError):
        splice.derived(plain, find_units(plain))
    searches = Searches(plain, model, fake, solver="approx")
    with caplog.at_level("INFO", logger="fxplan"):
        assert searches.with_regions() is not None
    assert "instead of deriving it" in caplog.text


def test_the_smallest_peak_is_searched_with_units_too():
    """``fxplan.rewrite(model, None)`` searched the captured graph (and convolution regions) only, while a budget
    was searched with units as well: on a ViT-B the smallest plan measured 1.489 GiB where a budget of 1.3 GiB was
    met at 1.284. The smallest peak is now the lowest of both graphs, the one the budget search and
    ``min_budget_bytes`` report; on this GPT-2 it is 1.2% below the captured graph's."""
    model, fake = _gpt2(fake=True)
    searches = Searches(trace(model, fake, probe_units=True), model, fake, solver="approx")
    captured_lowest = searches.plain.search.lowest().measured
    smallest = fxplan.rewrite(model, None, example_inputs=fake)
    assert smallest.fxplan_measured_peak_bytes < captured_lowest
    assert any(r.startswith(PREFIX) for r in smallest.fxplan_plan.regions)
    assert fxplan.min_budget_bytes(model, fake) == smallest.fxplan_measured_peak_bytes
    with pytest.raises(fxplan.BudgetError):
        fxplan.rewrite(model, None, example_inputs=fake, budget_bytes=smallest.fxplan_measured_peak_bytes - 1)


def test_the_captured_graph_costs_no_fake_step_where_its_replay_rules_it_out(monkeypatch):
    """Without a budget the graph with every unit is searched first, and the captured graph's plans are measured
    only where their replay may come within ``NEGLIGIBLE`` of that graph's choice (the replay vouched for by its
    measurements). On this GPT-2 the captured graph's lowest is 1.2% higher: none of its plans is measured, and
    the answer is the one searching both graphs in full gives."""
    model, fake = _gpt2(fake=True)
    quick = Searches(trace(model, fake, probe_units=True), model, fake, solver="approx")
    chosen = quick.choose(None, "time")
    assert quick.plain.search.meter.steps == 0 and chosen.variant is not quick.plain
    monkeypatch.setattr(Searches, "_ruled_out", lambda self, bar: False)
    full = Searches(trace(model, fake, probe_units=True), model, fake, solver="approx")
    both = full.choose(None, "time")
    assert full.plain.search.meter.steps > 0
    assert full.plain.search.lowest().measured > math.floor(both.measured * (1 + NEGLIGIBLE))
    assert (chosen.measured, chosen.cost) == (both.measured, both.cost)


def test_no_unit_runs_a_node_that_updates_buffers_again():
    """timm's MobileViTv2 is captured by torch.export, where a BatchNorm is a functional ``aten.batch_norm`` that
    updates its running statistics; such nodes joined units, so each backward updated them a second time (8 units:
    wrong buffers after one step, with bitwise equal gradients; inside a recomputed segment the version check
    raised instead). A node that updates buffers (the trace's ``mutates``) joins no unit."""
    timm = pytest.importorskip("timm")
    torch.manual_seed(0)
    model = timm.create_model("mobilevitv2_050", pretrained=False, num_classes=10).train()
    x = torch.randn(2, 3, 64, 64)
    cg = trace(model, (x,), probe_units=True)
    units = find_units(cg)
    members = {m for u in units for needs in u.needs for m in needs}
    assert units and not any(cg.nodes[m]["mutates"] for m in members)
    variant = Searches(cg, model, (x,), solver="approx").with_regions()
    first = next(variant.search.by_recompute(True))
    variant.search.measure(first)
    opt, ref = variant.result(first, None), copy.deepcopy(model)
    ref(x).sum().backward()
    opt(x).sum().backward()
    assert_same_state(ref, opt, "a training step with every unit")
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(ref.parameters(), opt.parameters()))


class _SlicedReads(torch.nn.Module):
    """A cheap value read slice by slice by ``n`` small matrix products: a scan's shape (a state-space model's)."""

    def __init__(self, n: int):
        super().__init__()
        self.n, self.weight = n, torch.nn.Parameter(torch.randn(16384, 1))

    def forward(self, x):
        h = x * 2 + 1
        return sum(h.select(1, i) @ self.weight for i in range(self.n))


def test_a_unit_whose_backward_recomputes_more_than_a_forward_pass_is_left_out():
    """Each saver's backward makes the unit's values again: read by one product they are made once, less than the
    model's forward pass, which is worth the bytes; read by 16, slice by slice, they are made 16 times, more than a
    forward pass, and checkpointing the whole model costs less."""
    from fxplan.capture import recomputed_inputs

    x = torch.randn(4, 16, 16384)
    few, many = (trace(_SlicedReads(n), (x,), probe_units=True) for n in (1, 16))
    forward = sum(d["T"] for _, d in many.nodes(data=True))
    assert [len(u.savers) for u in find_units(few)] == [1]
    assert find_units(many) == []
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(recomputed_inputs, "MAX_FORWARDS", math.inf)
        (unit,) = find_units(many)
    assert sum(many.nodes[n]["T"] for n in unit.recomputed) > forward


@pytest.mark.parametrize("fraction", [0.95, 0.7])
def test_gpt2_rewritten_with_units_is_exact_and_fits(fraction):
    model, inputs = _gpt2()
    vanilla = fxplan.measure_step(model, inputs, fake=True, loss_fn=loss_of).peak_bytes
    opt = assert_rewrite_exact(model, inputs, vanilla * fraction / 2**30)
    plan = opt.fxplan_plan
    assert any(r.startswith(PREFIX) for r in plan.regions), plan.regions
    assert "dropped after the forward pass" in plan.summary()


def test_a_module_with_units_survives_save_load_deepcopy_compile_and_its_plan_applies_again():
    model, inputs = _gpt2()
    vanilla = fxplan.measure_step(model, inputs, fake=True, loss_fn=loss_of).peak_bytes
    opt = fxplan.rewrite(model, vanilla * 0.95 / 2**30, example_inputs=inputs, loss_fn=loss_of)
    assert any(r.startswith(PREFIX) for r in opt.fxplan_plan.regions)
    buffer = io.BytesIO()
    torch.save(opt, buffer)
    buffer.seek(0)
    again = fxplan.rewrite(model, plan=fxplan.Plan.from_json(opt.fxplan_plan.to_json()), example_inputs=inputs,
                           loss_fn=loss_of)
    assert again.fxplan_measured_peak_bytes == opt.fxplan_measured_peak_bytes
    # torch.compile runs the savers eagerly (a graph break at the private _saved_tensors_hooks_is_enabled), so the
    # aot_eager backend, which runs ATen's kernels, gives the same bits
    modules = [opt, torch.load(buffer, weights_only=False), copy.deepcopy(opt), again,
               torch.compile(opt, backend="aot_eager")]
    grads = []
    for module in modules:
        module.zero_grad(set_to_none=True)
        torch.manual_seed(1)  # the same dropout masks
        loss_of(module(*inputs)).backward()
        grads.append([p.grad for p in module.parameters()])
    assert all(torch.equal(a, b) for other in grads[1:] for a, b in zip(grads[0], other))


class _NormTimesGate(torch.nn.Module):
    """A LayerNorm's value kept by a product written ``*``: in a ``symbolic_trace`` graph the saver calls
    ``operator.mul``, which FX cannot print as an argument (the saver's operator goes through an attribute)."""

    def __init__(self):
        super().__init__()
        self.norm, self.gate, self.out = torch.nn.LayerNorm(16), torch.nn.Linear(16, 16), torch.nn.Linear(16, 16)

    def forward(self, x):
        h = F.layer_norm(x, (16,))
        return self.out(h * torch.sigmoid(self.gate(x))) + self.norm(x)


def test_a_saver_calling_a_python_operator_runs_exactly_and_survives_save_load():
    torch.manual_seed(0)
    model, x = _NormTimesGate().train(), torch.randn(4, 32, 16)
    cg = trace(model, (x,), probe_units=True)
    units = find_units(cg)
    savers = {cg.nodes[s]["target"] for u in units for s in u.savers}
    assert "mul" in savers, savers
    variant = Searches(cg, model, (x,), solver="approx").with_regions()  # derived: its savers were probed
    first = next(variant.search.by_recompute(True))
    variant.search.measure(first)
    opt = variant.result(first, None)
    assert opt.fxplan_plan.regions == [u.conv for u in units]
    buffer = io.BytesIO()
    torch.save(opt, buffer)
    buffer.seek(0)
    grads = []
    for module in (model, opt, torch.load(buffer, weights_only=False)):
        module.zero_grad(set_to_none=True)
        module(x).sum().backward()
        grads.append([p.grad for p in module.parameters()])
    assert all(torch.equal(a, b) for other in grads[1:] for a, b in zip(grads[0], other))


def test_a_plan_naming_units_of_another_graph_is_refused():
    model, inputs = _gpt2()
    captured = trace(model, inputs).graph["captured"]
    unit = Unit(("no_such_node",), ("addmm",), (("no_such_node",),), (("no_such_node",),))
    with pytest.raises(FxplanError, match="another model or version"):
        with_regions(captured, [unit.conv])


def test_second_derivatives_through_a_recomputed_input_are_autograds():
    def gradient_norm(run):
        leaves = _leaves()
        grads = torch.autograd.grad(run(*leaves).pow(2).sum(), leaves, create_graph=True)
        sum(g.pow(2).sum() for g in grads).backward()
        return [t.grad for t in leaves]

    def plain(x, weight, bias, w):
        return F.linear(F.layer_norm(x, (16,), weight, bias), w)

    expected, got = gradient_norm(plain), gradient_norm(_norm_then_linear)
    assert all(torch.allclose(a, b, rtol=1e-5, atol=1e-6) for a, b in zip(expected, got))


def test_where_saved_tensor_hooks_are_disabled_the_saver_runs_as_in_the_model():
    x, weight, bias, w = _leaves()
    with torch.autograd.graph.disable_saved_tensors_hooks("fxplan must not install hooks here"):
        y = _norm_then_linear(x, weight, bias, w)
    y.pow(2).sum().backward()
    expected = _leaves()
    F.linear(F.layer_norm(expected[0], (16,), expected[1], expected[2]), expected[3]).pow(2).sum().backward()
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(expected, [x, weight, bias, w]))


def test_a_model_built_on_meta_is_planned_with_its_units(caplog):
    """Whether a unit runs plainly asked autocast about the tensors' device, and autocast raises for ``meta``
    ("unknown device type for autocast"): a Llama built on ``meta`` (as Llama-2-7B's shape is planned) was
    planned without units, with a warning. Autocast has no state on ``meta``, so the units run there."""
    import transformers

    config = transformers.LlamaConfig(vocab_size=200, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                      intermediate_size=128)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config)
        ids = torch.randint(0, 200, (2, 32))
    with caplog.at_level("WARNING", logger="fxplan"):
        opt = fxplan.rewrite(model, None, example_inputs={"input_ids": ids, "labels": ids},
                             loss_fn=lambda out: out.loss)
    assert "failed" not in caplog.text
    assert any(r.startswith(PREFIX) for r in opt.fxplan_plan.regions)
