"""segment_module: structure of the rewritten module, plan validation, modes, copies, memory."""

from __future__ import annotations

import copy
import io
import re
import warnings

import pytest
import torch
import torch.fx as fx
import torchvision
from models_awkward import (
    BNNet,
    InplaceZoo,
    RunningMean,
    StepCounter,
    assert_same_training,
    chunks,
    compute_names,
    step,
)
from torch import nn
from torch.nn import functional as F

import fxplan.rewriter.recompute
from fxplan.capture.capturers import capture
from fxplan.capture.effects import ordering_edges
from fxplan.errors import FxplanError
from fxplan.rewriter.codegen import SegmentedModule, segment_module

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def rewrite(model, plan_fn):
    gm = fx.symbolic_trace(model)
    return segment_module(gm, plan_fn(gm))


# ---------------------------------------------------------------------------------------------
# structure


def test_top_level_code_reads_like_hand_written_code():
    model = torchvision.models.resnet18()
    opt = rewrite(model, lambda gm: chunks(compute_names(gm), 4))
    code = opt.code
    calls = re.findall(r"self\.(segment_\d+)\(", code)
    assert calls == ["segment_0", "segment_1", "segment_2", "segment_3"]
    assert re.search(r"= self\.segment_0\(x\)", code)
    inline = [line for line in code.splitlines() if "getattr(self.layer" in line]
    assert all(".relu(" in line for line in inline)  # the blocks live in the segments, but for in-place
    # ReLUs that open a recomputed segment: they run between segments, not recomputed (no copy needed)
    assert "self.conv1(x)" in opt.segment_0.code  # with the original names
    assert "self.fc(" in opt.segment_3.code
    text = opt.readable()
    assert text.count("recomputed in backward") == 3 and text.count("kept for backward") == 1
    assert isinstance(opt, fx.GraphModule) and isinstance(opt, SegmentedModule)


def test_values_are_freed_after_last_use():
    model = torchvision.models.resnet18()
    opt = rewrite(model, lambda gm: chunks(compute_names(gm), 4))
    # FX code generation drops each name after its last use, in the top level and in segments.
    assert "x = None" in opt.code
    assert "layer1_0_conv1 = None" in opt.segment_0.code or "layer1_0_conv1 = None" in opt.segment_1.code


def test_boundary_values_only_cross_segments():
    model = torchvision.models.resnet18()
    gm = fx.symbolic_trace(model)
    names = compute_names(gm)
    plan = chunks(names, 3)
    opt = segment_module(gm, plan)
    for i, seg in enumerate(opt.segment_modules()):
        inputs = [n.name for n in seg.graph.nodes if n.op == "placeholder"]
        earlier = {v for s in plan[:i] for v in s} | {"x"}
        assert set(inputs) <= earlier
        users_later = {
            u.name
            for n in gm.graph.nodes
            if n.name in set(plan[i])
            for u in n.users
            if u.name not in set(plan[i])
        }
        assert users_later  # something crosses
        out = next(n for n in seg.graph.nodes if n.op == "output").args[0]
        outs = [o.name for o in (out if isinstance(out, tuple) else (out,))]
        for o in outs:  # every output is used later
            producer = next(n for n in gm.graph.nodes if n.name == o)
            assert any(u.name not in set(plan[i]) for u in producer.users)


def test_state_dict_keys_and_parameters_are_the_originals():
    model = torchvision.models.resnet18()
    keys = list(model.state_dict())
    names = [n for n, _ in model.named_parameters()]
    opt = rewrite(model, lambda gm: chunks(compute_names(gm), 5))
    assert list(opt.state_dict()) == keys
    assert [n for n, _ in opt.named_parameters()] == names
    assert all(p is q for p, q in zip(model.parameters(), opt.parameters()))  # shared, not copied
    for seg in opt.segment_modules():
        assert list(seg.parameters()) == [] and list(seg.buffers()) == [] and seg.state_dict() == {}
    opt.load_state_dict(torchvision.models.resnet18().state_dict())


def test_attribute_parameters_buffers_and_constants():
    class WithAttrs(nn.Module):
        def __init__(self):
            super().__init__()
            self.scale = nn.Parameter(torch.tensor(1.5))
            self.register_buffer("offset", torch.ones(4))
            self.l1 = nn.Linear(4, 4)
            self.l2 = nn.Linear(4, 4)

        def forward(self, x):
            h = torch.tanh(self.l1(x) * self.scale + self.offset)
            return self.l2(h) * self.scale, self.scale

    torch.manual_seed(0)
    model = WithAttrs()
    opt = rewrite(copy.deepcopy(model), lambda gm: chunks(compute_names(gm), 3))
    assert list(opt.state_dict()) == ["scale", "offset", "l1.weight", "l1.bias", "l2.weight", "l2.bias"]
    assert_same_training(copy.deepcopy(model), opt, (torch.randn(3, 4),))


def test_segment_without_outputs_and_single_segment_plan():
    class Dead(nn.Module):
        def __init__(self):
            super().__init__()
            self.l = nn.Linear(3, 3)

        def forward(self, x):
            torch.sigmoid(x)  # traced, never used
            return self.l(x).relu()

    torch.manual_seed(0)
    model = Dead()
    names = compute_names(fx.symbolic_trace(model))
    assert names[0] == "sigmoid"
    opt = rewrite(copy.deepcopy(model), lambda gm: [names[:1], names[1:]])
    assert "return ()" in opt.segment_0.code
    assert_same_training(copy.deepcopy(model), opt, (torch.randn(2, 3),))
    single = rewrite(copy.deepcopy(model), lambda gm: [names])
    assert not single.segment_0.fxplan_recompute
    assert_same_training(copy.deepcopy(model), single, (torch.randn(2, 3),))


# ---------------------------------------------------------------------------------------------
# modes: recomputation only when training with grad


def _count_checkpoints(monkeypatch):
    calls = []
    real = fxplan.rewriter.recompute.checkpoint

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(fxplan.rewriter.recompute, "checkpoint", counting)
    return calls


def test_recomputation_only_in_training_with_grad(monkeypatch):
    calls = _count_checkpoints(monkeypatch)
    model = BNNet()
    opt = rewrite(model, lambda gm: chunks(compute_names(gm), 3))
    runs = []
    opt.conv.register_forward_hook(lambda *a: runs.append("conv"))  # segment 0: recomputed
    opt.bn1d.register_forward_hook(lambda *a: runs.append("bn1d"))  # last segment: kept
    x = torch.randn(3, 3, 8, 8)
    step(opt, (x,))
    assert len(calls) == 2 and runs.count("conv") == 2 and runs.count("bn1d") == 1
    calls.clear(), runs.clear()
    with torch.no_grad():
        opt(x)
    opt.eval()
    opt(x)
    opt(x).sum()
    assert calls == [] and runs.count("conv") == 3
    opt.train()
    with torch.inference_mode():
        opt(x)
    assert calls == []


def test_eval_mode_matches_original():
    torch.manual_seed(0)
    model = BNNet()
    opt = rewrite(copy.deepcopy(model), lambda gm: chunks(compute_names(gm), 3))
    x = torch.randn(3, 3, 8, 8)
    step(model, (x,)), step(opt, (x,))  # one training step moves the running statistics
    model.eval(), opt.eval()
    assert not opt.segment_0.training and not opt.bn.training
    assert torch.equal(model(x), opt(x))


# ---------------------------------------------------------------------------------------------
# plan validation


@pytest.fixture
def small():
    model = BNNet()
    gm = fx.symbolic_trace(model)
    return gm, compute_names(gm)


def test_rejects_missing_duplicate_unknown_and_non_compute(small):
    gm, names = small
    with pytest.raises(FxplanError, match="leaves out"):
        segment_module(gm, [names[:-1]])
    with pytest.raises(FxplanError, match="appears in segments 0 and 1"):
        segment_module(gm, [names[:3], names[2:]])
    with pytest.raises(FxplanError, match="not a node"):
        segment_module(gm, [names + ["nope"]])
    with pytest.raises(FxplanError, match="placeholder"):
        segment_module(gm, [["x"] + names])
    with pytest.raises(FxplanError, match="empty"):
        segment_module(gm, [names, []])
    with pytest.raises(FxplanError, match="no segments"):
        segment_module(gm, [])
    with pytest.raises(FxplanError, match="list of lists"):
        segment_module(gm, "conv")
    with pytest.raises(FxplanError, match="GraphModule"):
        segment_module(BNNet(), [names])


def test_rejects_segments_out_of_execution_order(small):
    gm, names = small
    with pytest.raises(FxplanError, match="uses 'conv' from later segment 1"):
        segment_module(gm, [names[1:], names[:1]])


def test_rejects_reordered_random_ops():
    class TwoDropouts(nn.Module):
        def __init__(self):
            super().__init__()
            self.d1 = nn.Dropout(0.5)
            self.d2 = nn.Dropout(0.5)

        def forward(self, x, y):
            return self.d1(x) + self.d2(y)

    gm = fx.symbolic_trace(TwoDropouts())
    assert ("d1", "d2") in ordering_edges(gm)
    with pytest.raises(FxplanError, match="random op 'd2'.*before 'd1'"):
        segment_module(gm, [["d2"], ["d1", "add"]])
    segment_module(gm, [["d1"], ["d2", "add"]])  # program order is fine


def test_rejects_read_moved_before_the_inplace_op_it_follows():
    class ReadAfterWrite(nn.Module):
        def __init__(self):
            super().__init__()
            self.l1 = nn.Linear(3, 3)
            self.l2 = nn.Linear(3, 3)

        def forward(self, x):
            h = self.l1(x)
            h.add_(1.0)
            return self.l2(h)  # reads h after add_ overwrote it

    gm = fx.symbolic_trace(ReadAfterWrite())
    assert ("add_", "l2") in ordering_edges(gm)
    with pytest.raises(FxplanError, match="reads 'l1' after in-place op 'add_'"):
        segment_module(gm, [["l1", "l2"], ["add_"]])


def test_read_moved_after_inplace_op_gets_a_copy():
    """Anti-dependence: a reader of the old value that the plan runs after the in-place op."""

    class ReadBeforeWrite(nn.Module):
        def __init__(self):
            super().__init__()
            self.l1 = nn.Linear(3, 3)

        def forward(self, x):
            h = self.l1(x)
            s = h * 3.0
            h.add_(1.0)
            return s + h

    torch.manual_seed(0)
    model = ReadBeforeWrite()
    opt = rewrite(copy.deepcopy(model), lambda gm: [["l1", "add_"], ["mul", "add"]])
    assert "l1_copy = l1.clone()" in opt.segment_0.code
    assert_same_training(copy.deepcopy(model), opt, (torch.randn(2, 3),))


def test_inplace_op_opening_a_recomputed_segment_moves_to_its_operands_segment():
    """F.relu(u, inplace=True) would start segment 1 with u from segment 0: rather than copy u (kept as
    segment 1's input), the relu runs at the end of segment 0, which then keeps its result."""
    torch.manual_seed(0)
    model = InplaceZoo()
    gm = fx.symbolic_trace(copy.deepcopy(model))
    names = compute_names(gm)
    cut = names.index("relu")
    opt = segment_module(gm, [names[:cut], names[cut : cut + 3], names[cut + 3 :]])
    assert "clone" not in opt.code + opt.segment_1.code and "functional.relu" not in opt.segment_1.code
    assert re.search(r"relu = torch.nn.functional.relu\(\w+, inplace = True\)", opt.code)  # inline, not recomputed
    assert_same_training(copy.deepcopy(model), opt, (torch.randn(5, 6),))


def test_inplace_op_that_cannot_move_is_made_out_of_place():
    """The same relu cannot move to segment 0 when segment 1 reads the old u before it: it gets a copy."""

    class ReadThenRelu(nn.Module):
        def __init__(self):
            super().__init__()
            self.l1 = nn.Linear(6, 6)

        def forward(self, x):
            u = self.l1(x)
            s = u * 2.0  # reads u before the relu overwrites it
            v = torch.nn.functional.relu(u, inplace=True)
            return s + v

    torch.manual_seed(0)
    model = ReadThenRelu()
    opt = segment_module(fx.symbolic_trace(copy.deepcopy(model)), [["l1"], ["mul", "relu"], ["add"]])
    assert "l1_copy = l1.clone()" in opt.segment_1.code
    assert "inplace = True" in opt.segment_1.code  # still the in-place op, on a private copy
    assert_same_training(copy.deepcopy(model), opt, (torch.randn(5, 6),))


class _CounterLeaf(fx.Tracer):
    def is_leaf_module(self, m, qualname):
        return isinstance(m, StepCounter) or super().is_leaf_module(m, qualname)


def test_buffer_mutated_by_a_recomputed_module_is_updated_once():
    class Counted(nn.Module):
        def __init__(self):
            super().__init__()
            self.counter = StepCounter()
            self.l = nn.Linear(3, 3)

        def forward(self, x):
            return torch.tanh(self.l(self.counter(x))).sum()

    root = Counted()
    gm = fx.GraphModule(root, _CounterLeaf().trace(root))
    opt = segment_module(gm, [["counter", "l"], ["tanh", "sum_1"]])
    x = torch.randn(2, 3)
    with pytest.warns(RuntimeWarning, match="mutated buffers \\['counter.steps'\\]"):
        step(opt, (x,))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # learned: from now on replayed from the saved value
        step(opt, (x,))
        step(opt, (x,))
    assert int(opt.counter.steps) == 3


def test_rejects_a_buffer_update_split_from_the_recomputed_segment_that_reads_it():
    # segment 0 is the first in-place update alone; recomputed segment 1 takes the buffer from it and updates it
    # again in place: checkpoint would hold a value the step then overwrites (autograd fails in backward)
    torch.manual_seed(0)
    model, x = RunningMean(), (torch.randn(4, 3),)
    reference = copy.deepcopy(model)
    gm = capture(model, x).gm  # torch.export: symbolic_trace would run the first update in Python
    names = compute_names(gm)
    assert names[0] == "mul_"
    cut = names.index("add_")
    with pytest.raises(FxplanError, match="module attribute"):
        segment_module(gm, [names[:1], names[1:cut + 1], names[cut + 1:]])
    opt = segment_module(gm, [names[:cut + 1], names[cut + 1:]])  # the updates in one segment: accepted
    assert_same_training(reference, opt, x)


# ---------------------------------------------------------------------------------------------
# copies


def test_deepcopy_and_pickle_give_independent_equivalent_modules():
    torch.manual_seed(0)
    model = BNNet()
    opt = rewrite(copy.deepcopy(model), lambda gm: chunks(compute_names(gm), 3))
    opt.fxplan_note = "kept"
    twin = copy.deepcopy(opt)
    assert isinstance(twin, SegmentedModule) and twin.bn is not opt.bn
    assert twin.fxplan_segments == opt.fxplan_segments and twin.fxplan_note == "kept"
    assert list(twin.state_dict()) == list(opt.state_dict())
    assert twin.segment_0.code == opt.segment_0.code
    assert_same_training(opt, twin, (torch.randn(3, 3, 8, 8),))
    buffer = io.BytesIO()
    torch.save(opt, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    assert isinstance(loaded, SegmentedModule) and loaded._get_name() == "BNNet"
    assert_same_training(opt, loaded, (torch.randn(3, 3, 8, 8),))


class _FunctionalPooling(nn.Module):
    """Calls F.max_pool2d, which torch makes with boolean_dispatch: a function pickle cannot find by name."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Conv2d(3, 4, 3, padding=1), nn.Conv2d(4, 4, 3, padding=1)

    def forward(self, x):
        return self.b(F.max_pool2d(torch.relu(self.a(x)), 2)).relu()


def test_a_module_calling_functions_torch_makes_inside_others_pickles():
    opt = rewrite(_FunctionalPooling(), lambda gm: chunks(compute_names(gm), 3))
    assert any(n.target is F.max_pool2d for seg in (opt.segment_0, opt.segment_1) for n in seg.graph.nodes)
    buffer = io.BytesIO()
    torch.save(opt, buffer)
    buffer.seek(0)
    assert_same_training(opt, torch.load(buffer, weights_only=False), (torch.randn(2, 3, 8, 8),))


def test_segments_cannot_be_copied_alone():
    opt = rewrite(BNNet(), lambda gm: chunks(compute_names(gm), 2))
    with pytest.raises(TypeError, match="deep-copy the module"):
        copy.deepcopy(opt.segment_0)


# ---------------------------------------------------------------------------------------------
# memory, measured with fxplan.measure.meter


def test_eight_segment_resnet_has_lower_measured_peak():
    from fxplan.measure.meter import measure_step

    model = torchvision.models.resnet50()
    x = torch.randn(8, 3, 224, 224)  # fake tensors: nothing of this size is allocated
    base = measure_step(model, (x,), fake=True).peak_bytes
    opt = rewrite(copy.deepcopy(model), lambda gm: chunks(compute_names(gm), 8))
    peak = measure_step(opt, (x,), fake=True).peak_bytes
    assert peak < 0.6 * base  # 444 vs 801 MiB on torch 2.14.1


def test_checkpointed_model_fake_measure_equals_real_measure():
    """Under fake tensors (parameters converted to fake) the recomputing model measures the same
    peak as the real CPU run."""
    from fxplan.measure.meter import measure_step

    torch.manual_seed(0)
    model = torchvision.models.resnet18()
    x = torch.randn(2, 3, 64, 64)
    opt = rewrite(model, lambda gm: chunks(compute_names(gm), 4))
    fake = measure_step(opt, (x,), fake=True)
    real = measure_step(opt, (x,), fake=False)
    assert fake.peak_bytes == real.peak_bytes
    assert int(opt.bn1.num_batches_tracked) == 0  # measuring leaves the model untouched


# ---------------------------------------------------------------------------------------------
# effects classification


def test_inplace_and_random_ops_are_recognised():
    from fxplan.capture import effects

    class Spellings(nn.Module):
        def __init__(self):
            super().__init__()
            self.act = nn.ReLU(inplace=True)
            self.act_out = nn.ReLU()
            self.drop = nn.Dropout(0.1)

        def forward(self, x):
            a = x * 1.0
            a.add_(1.0)
            b = torch.relu_(a * 1.0)
            c = torch.nn.functional.relu(b * 1.0, True)
            d = torch.nn.functional.relu(c * 1.0, inplace=True)
            e = self.act(d * 1.0)
            f = self.act_out(e)
            g = self.drop(torch.rand_like(f) + f)
            return g.view(-1)

    gm = fx.symbolic_trace(Spellings())
    inplace = {n.name for n in gm.graph.nodes if effects.mutated_arg(n, gm) is not None}
    assert inplace == {"add_", "relu_", "relu", "relu_1", "act"}
    random_ops = {n.name for n in gm.graph.nodes if effects.is_random(n, gm)}
    assert random_ops == {"rand_like", "drop"}
    roots = effects.alias_roots(gm.graph, gm)
    by_name = {n.name: n for n in gm.graph.nodes}
    assert roots[by_name["view"]] is by_name["add"]  # a view of dropout, which may return its input
    assert roots[by_name["add_"]] is by_name["mul"]


def test_operator_iadd_on_a_segment_input_gets_a_copy():
    """symbolic_trace turns ``a += b`` on proxies into ``operator.add``; other front ends (or
    hand-written graphs) keep ``operator.iadd``, which overwrites a real tensor."""
    import operator

    graph = fx.Graph()
    x = graph.placeholder("x")
    a = graph.call_function(operator.mul, (x, 2.0))
    b = graph.call_function(operator.iadd, (a, graph.call_function(torch.cos, (x,))))  # cos: segment 1
    c = graph.call_function(torch.sin, (b,))
    graph.output(graph.call_function(operator.add, (c, a)))  # reads a after the iadd
    gm = fx.GraphModule(nn.Module(), graph)
    opt = segment_module(gm, [["mul"], ["cos", "iadd", "sin"], ["add"]])
    assert "mul_copy = fxplan_rewriter_codegen_copy_for_inplace(mul)" in opt.segment_1.code
    x1 = torch.randn(4, requires_grad=True)
    x2 = x1.detach().clone().requires_grad_()
    out1, out2 = gm(x1), opt(x2)
    assert torch.equal(out1, out2)
    out1.sum().backward(), out2.sum().backward()
    assert torch.equal(x1.grad, x2.grad)


@pytest.mark.parametrize("where", ["top", "nested", "alone"])
def test_inplace_module_opening_a_sub_segment_runs_inline_in_the_closest_common_parent(where):
    """``self.act`` (ReLU(inplace=True)) opens a leaf whose operand ``l2`` comes from another leaf: it runs
    inline at the level where both leaves meet — the top level, or inside segment 0 between its two
    sub-segments; alone in a segment, that segment is inlined — and nothing is copied; training stays
    bitwise the same."""
    torch.manual_seed(0)
    model = InplaceZoo()
    gm = fx.symbolic_trace(copy.deepcopy(model))
    names = compute_names(gm)
    cut = names.index("act")
    if where == "top":
        segments = [names[:cut], names[cut:]]
        children = {"1": {"segments": [names[cut : cut + 3], names[cut + 3 :]]}}
    elif where == "nested":
        segments = [names[: cut + 3], names[cut + 3 :]]
        children = {"0": {"segments": [names[:cut], names[cut : cut + 3]]}}
    else:  # a segment of its own
        segments, children = [names[:cut], [names[cut]], names[cut + 1 :]], {}
    opt = segment_module(gm, segments, children)
    parent = opt.segment_0 if where == "nested" else opt
    assert "act = self.act(" in parent.code
    assert not any("l2_copy" in s.code for s in opt.modules() if isinstance(s, fx.GraphModule))
    assert opt.fxplan_segments == tuple(tuple(s) for s in segments)  # the plan as given
    assert_same_training(copy.deepcopy(model), opt, (torch.randn(5, 6),))
