"""Tracing into a CostGraph: structure, costs, saved tensors, set helpers and errors."""

import pytest
import torch
import torch.nn as nn
import torchvision
from models_awkward import RunningMean, StepCounter
from reach_checks import assert_rewrite_exact
from torch._subclasses.fake_tensor import FakeTensorMode

import fxplan
from fxplan import CostGraph, TraceError
from fxplan.costs.trace import trace


class Residual(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(4, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.relu = nn.ReLU(inplace=True)

    def forward(self, x):
        y = self.relu(self.bn(self.conv(x)))
        return torch.flatten(y + x, 1)


class DataDependent(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = Gate()

    def forward(self, x):
        return self.inner(x)


class Gate(nn.Module):
    def forward(self, x):
        if x.sum() > 0:
            return x
        return -x


def test_residual_block_graph_and_costs():
    x = torch.randn(2, 4, 8, 8)
    cg = trace(Residual(), (x,), cost_model="flops")
    assert cg.graph["T_seconds"] is None
    assert list(cg.nodes) == ["conv", "bn", "relu", "add", "flatten"]
    assert set(cg.edges) == {("conv", "bn"), ("bn", "relu"), ("relu", "add"), ("add", "flatten")}
    out_bytes = 2 * 4 * 8 * 8 * 4
    assert all(cg.nodes[v]["M"] == out_bytes for v in cg.nodes)
    assert cg.nodes["conv"]["kind"] == "conv" and cg.nodes["bn"]["kind"] == "bn"
    assert cg.nodes["conv"]["T"] == 2 * 2 * 4 * 8 * 8 * 4 * 9      # 2·N·Cout·H·W·Cin·k²
    assert cg.nodes["add"]["T"] == 2 * 4 * 8 * 8                      # floor: one per output element
    # autograd: conv keeps only the (resident) input, bn keeps the conv output and its statistics,
    # in-place relu keeps its output, which is the bn output's storage.
    assert cg.nodes["conv"]["saved_inputs"] == () and not cg.nodes["conv"]["saves_output"]
    assert cg.nodes["bn"]["saved_inputs"] == ("conv",)
    assert cg.nodes["bn"]["saved"] == 2 * 4 * 4                       # save_mean and save_invstd
    assert cg.nodes["relu"]["saves_output"] and cg.nodes["relu"]["alias_of"] == "bn"
    assert cg.nodes["flatten"]["alias_of"] == "add"
    assert cg.graph["param_bytes"] == sum(p.numel() * 4 for p in Residual().parameters())
    assert cg.graph["input_bytes"] == x.numel() * 4


def test_paper_cost_model_is_ten_for_conv_one_otherwise():
    cg = trace(Residual(), (torch.randn(1, 4, 8, 8),), cost_model="paper")
    assert [cg.nodes[v]["T"] for v in cg.nodes] == [10, 1, 1, 1, 1]


def test_set_helpers_follow_section_2():
    cg = CostGraph.from_edges("abcd", [("a", "b"), ("b", "c"), ("a", "d"), ("c", "d")],
                              T=dict.fromkeys("abcd", 1), M=dict.fromkeys("abcd", 1))
    assert cg.delta_plus({"a"}) == {"b", "d"}
    assert cg.delta_minus({"d"}) == {"a", "c"}
    assert cg.is_lower_set({"a", "b"}) and not cg.is_lower_set({"b"})
    assert cg.boundary({"a", "b"}) == {"a", "b"}      # a feeds d, b feeds c
    assert cg.boundary({"a", "b", "c"}) == {"a", "c"}


def test_tracing_leaves_the_model_untouched_and_accepts_fake_inputs():
    model = torchvision.models.resnet18(weights=None)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with FakeTensorMode():
        x = torch.randn(64, 3, 224, 224)
    cg = trace(model, (x,))
    assert cg.number_of_nodes() == 69
    assert cg.nodes["conv1"]["M"] == 64 * 64 * 112 * 112 * 4
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k


def test_uncapturable_model_raises_trace_error_naming_module_and_line():
    with pytest.raises(TraceError, match="inner") as info:
        trace(DataDependent(), (torch.randn(3),))
    message = str(info.value)
    assert "test_trace.py:" in message and "if x.sum() > 0" in message  # where, for torch.export
    assert "torch.cond" in message  # what to do
    assert isinstance(info.value, fxplan.FxplanError)


def test_wrong_number_of_inputs_is_a_trace_error():
    with pytest.raises(TraceError, match="1 inputs"):
        trace(Residual(), (torch.randn(1, 4, 8, 8), torch.randn(1)))


class WithDefault(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 3)

    def forward(self, x, scale=2.0):
        return self.lin(x) * scale


def test_defaulted_arguments_may_be_omitted():
    cg = trace(WithDefault(), (torch.randn(2, 3),))
    assert list(cg.nodes) == ["lin", "mul"]
    with pytest.raises(TraceError, match="1 to 2 inputs"):
        trace(WithDefault(), ())


def test_tracing_is_deterministic():
    model = torchvision.models.resnet18(weights=None)
    with FakeTensorMode():
        x = torch.randn(8, 3, 64, 64)
    first, second = trace(model, (x,)), trace(model, (x,))
    assert list(first.nodes(data=True)) == list(second.nodes(data=True))
    assert list(first.edges(data=True)) == list(second.edges(data=True))


class ShapeFrozenUnderTrace(nn.Module):
    """symbolic_trace gives a graph that does not run (code that takes another path on a Proxy, as a shape
    baked in at trace time would): trace() falls back to torch.export."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        y = torch.relu(self.a(x))
        if isinstance(y, torch.fx.Proxy):
            y = y.view(7, -1)
        return {"out": self.b(y)}


def test_export_fallback_of_a_graph_that_does_not_run_keeps_the_call_interface():
    model, x = ShapeFrozenUnderTrace(), (torch.randn(4, 8),)
    assert trace(model, x).graph["captured"].method == "torch.export"
    # the rewrite returns the model's own output type and runs the original forward in eval mode
    assert_rewrite_exact(model, x, None)


def test_a_buffer_update_that_leaves_the_value_as_it_was_is_not_lost_by_tracing():
    # symbolic_trace runs ``mean.mul_(0.9)`` on the zeros in Python and would leave it out of the graph
    model, x = RunningMean(), (torch.randn(4, 3),)
    assert trace(model, x).graph["captured"].method == "torch.export"
    assert_rewrite_exact(model, x, None)  # the running mean decays in every step, as in the original


class BatchNormAct(nn.BatchNorm2d):
    """A BatchNorm subclass with its activation, as timm's ``BatchNormAct2d``: counts batches in Python."""

    def forward(self, x):
        if self.training:
            self.num_batches_tracked.add_(1)
        return torch.relu(nn.functional.batch_norm(x, self.running_mean, self.running_var, self.weight,
                                                   self.bias, self.training, self.momentum, self.eps))


class ScalesItsInput(StepCounter):
    """Writes its input in place, with no ``inplace=True`` that would tell the rewriter."""

    def forward(self, x):
        self.steps.add_(1)
        x.mul_(2)
        return x + 1


class BufferUpdatingLayers(nn.Module):
    def __init__(self, middle: nn.Module):
        super().__init__()
        self.conv1, self.bn, self.middle = nn.Conv2d(3, 4, 3, padding=1), BatchNormAct(4), middle
        self.conv2, self.conv3 = nn.Conv2d(4, 4, 3, padding=1), nn.Conv2d(4, 4, 3, padding=1)

    def forward(self, x):
        return self.conv3(torch.relu(self.conv2(self.bn(self.middle(self.conv1(x))))))


def test_submodules_that_update_their_own_buffers_are_traced_as_leaves():
    # tracing into them would run their buffer updates once, at trace time; as leaves they run every call
    # (activations large enough that recomputing pays for the generator state a segment of user leaves keeps)
    model, x = BufferUpdatingLayers(StepCounter()), (torch.randn(8, 3, 32, 32),)
    cg = trace(model, x)
    assert cg.graph["captured"].method == "symbolic_trace"
    assert {"bn", "middle"} <= {d["target"] for _, d in cg.nodes(data=True)}
    assert set(cg.nodes["middle"]["mutates"]) == {"middle.steps"}
    assert assert_rewrite_exact(model, x, None).fxplan_plan.num_segments > 1


def test_a_leaf_that_writes_its_input_in_place_is_captured_by_export():
    model, x = BufferUpdatingLayers(ScalesItsInput()), (torch.randn(4, 3, 8, 8),)
    assert trace(model, x).graph["captured"].method == "torch.export"
    assert_rewrite_exact(model, x, None)


_DEEP_TRACE = """
import torch
from torch import nn
from fxplan.costs.trace import trace

class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln, self.fc1, self.act, self.fc2 = nn.LayerNorm(2), nn.Linear(2, 2), nn.GELU(), nn.Linear(2, 2)

    def forward(self, x):
        return x + self.fc2(self.act(self.fc1(self.ln(x))))

cg = trace(nn.Sequential(*[Block() for _ in range(400)]), (torch.randn(1, 2, 2),))
print(cg.number_of_nodes())
"""


def test_tracing_a_deep_model_does_not_overflow_the_stack():
    """The propagation's autograd graph is as deep as the model; let go of carelessly, its destructors nest
    until the C stack overflows (a segmentation fault at 20,000 nodes before the fix, with the usual 8 MiB stack).
    Run in a child process with a 512 KiB stack, where 2,000 nodes overflowed it the same way, so that a crash fails
    this test instead of ending the suite."""
    import resource
    import subprocess
    import sys

    def small_stack():
        resource.setrlimit(resource.RLIMIT_STACK, (512 * 1024, resource.getrlimit(resource.RLIMIT_STACK)[1]))

    done = subprocess.run([sys.executable, "-c", _DEEP_TRACE], capture_output=True, text=True, timeout=600,
                          preexec_fn=small_stack)
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
    assert done.stdout.split() == ["2000"]


class TwoAlike(nn.Module):
    """Two identical conv-BatchNorm-ReLU layers and a pair of identical linear layers: calls alike."""

    def __init__(self):
        super().__init__()
        self.layers = nn.Sequential(*[nn.Sequential(nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU())
                                      for _ in range(2)])
        self.fc1, self.fc2 = nn.Linear(256, 256), nn.Linear(256, 256)

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(self.layers(x).flatten(1))))


def _node_figures(cg: CostGraph) -> dict:
    return {v: {k: d[k] for k in ("T", "flops", "forward_rise", "mutates", "saved_inputs", "saved", "M")}
            for v, d in cg.nodes(data=True)}


def test_calls_alike_are_counted_once_with_the_figures_of_counting_each(monkeypatch):
    """The propagation counts a call's forward (FLOPs, bytes moved, the storages it holds at once) once per kind of
    call (op or module, argument shapes) and gives the others the same figures; a node that writes buffers is
    counted on its own, so each BatchNorm names its own statistics."""
    import fxplan.costs.op_census as census_module
    import fxplan.costs.propagation as propagation

    model, x = TwoAlike(), (torch.randn(2, 4, 8, 8),)
    counted = []
    real_enter = census_module.NodeCensus.__enter__
    monkeypatch.setattr(census_module.NodeCensus, "__enter__", lambda self: counted.append(1) or real_enter(self))
    once = _node_figures(trace(model, x, cost_model="flops"))
    counted_once = len(counted)

    class Forgetful(dict):
        def get(self, key, default=None):
            return default

    real_init = propagation.CostPropagator.__init__

    def forgetful_init(self, *args, **kwargs):
        real_init(self, *args, **kwargs)
        self.censuses = Forgetful()

    monkeypatch.setattr(propagation.CostPropagator, "__init__", forgetful_init)
    counted.clear()
    each = _node_figures(trace(model, x, cost_model="flops"))
    assert once == each
    assert counted_once < len(counted)  # the second conv, ReLU and linear were not counted again
    assert set(once["layers_0_1"]["mutates"]) == {"layers.0.1.running_mean", "layers.0.1.running_var",
                                                  "layers.0.1.num_batches_tracked"}
    assert once["layers_1_1"]["mutates"] == tuple(n.replace(".0.", ".1.") for n in once["layers_0_1"]["mutates"])
