"""Reach: models beyond symbolic_trace and beyond torch.nn's own modules, rewritten exactly.

Hugging Face transformers (captured by torch.export), timm models (BatchNorm subclasses, drop-path,
shape assertions) and hand-written modules that update their own buffers: each is rewritten at the
smallest budget fxplan reaches and halfway to the vanilla peak, and checked by
:func:`reach_checks.assert_rewrite_exact` (bitwise outputs, gradients and buffers in train mode, outputs
in eval mode, the original's state_dict keys and output type, the user's model untouched, the measured
peak within the budget). Configs are tiny so that each model takes seconds.
"""

from __future__ import annotations

import copy
import functools
import io
import random

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from reach_checks import assert_rewrite_exact, assert_rewrite_exact_at_two_budgets, loss_of

import fxplan
from fxplan.capture.capturers import capture
from fxplan.solvers import subplans

transformers = pytest.importorskip("transformers")
timm = pytest.importorskip("timm")

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# ----------------------------------------------------------------------------------------------
# state, modes and interfaces, on hand-written modules


class MyBN(nn.BatchNorm2d):
    """A BatchNorm subclass: symbolic_trace traces into it (it is not a torch.nn leaf)."""


class RunningStats(nn.Module):
    """A user module keeping its own statistics in registered buffers, updated in place in training."""

    def __init__(self, channels: int):
        super().__init__()
        self.register_buffer("mean", torch.zeros(channels))
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))
        self.register_buffer("scale", torch.full((channels,), 2.0), persistent=False)

    def forward(self, x):
        if self.training:
            self.mean.mul_(0.9).add_(0.1 * x.detach().mean((0, 2, 3)))
            self.steps.add_(1)
        return x * self.scale[:, None, None] - self.mean[:, None, None]


class HeadDropout(nn.Module):
    """Dropout outside torch.nn, whose flag symbolic_trace would freeze."""

    def forward(self, x):
        return F.dropout(x, 0.5, training=self.training)


class StatefulNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.bn1 = MyBN(8)
        self.stats = RunningStats(8)
        self.conv2 = nn.Conv2d(8, 8, 3, padding=1)
        self.bn2 = MyBN(8)
        self.conv3 = nn.Conv2d(8, 8, 3, padding=1)
        self.drop = HeadDropout()
        self.fc = nn.Linear(8, 4)

    def forward(self, x, *, scale: float = 1.0):
        x = torch.relu(self.stats(self.bn1(self.conv1(x))))
        x = torch.relu(self.bn2(self.conv2(x))) * scale
        x = torch.relu(self.conv3(x))
        return {"logits": self.fc(self.drop(x.mean((2, 3)))), "features": x}


def test_buffers_updated_once_whatever_the_module_class():
    model = StatefulNet()
    x = (torch.randn(4, 3, 16, 16),)
    opt = assert_rewrite_exact_at_two_budgets(model, x)
    # more than two segments (a nested segment counts as the sub-segments it runs): buffers updated in recomputation
    assert len(subplans.leaves(subplans.tree(opt.fxplan_segments, opt.fxplan_children))) > 2


def test_keyword_inputs_and_other_calls_run_the_original():
    model = StatefulNet()
    x = torch.randn(4, 3, 16, 16)
    opt = fxplan.rewrite(model, None, example_inputs={"x": x, "scale": 0.5}, loss_fn=loss_of)
    ref = StatefulNet()
    ref.load_state_dict(model.state_dict())
    for inputs in ({"x": x, "scale": 0.5}, {"x": x[:2], "scale": 0.5}, {"x": x}):
        torch.manual_seed(0)
        a = ref(**inputs)
        torch.manual_seed(0)
        b = opt(**inputs)
        assert torch.equal(a["logits"], b["logits"])


def test_planning_on_fake_inputs_with_a_loss_that_uses_real_labels():
    model = StatefulNet()
    labels = torch.tensor([0, 1, 2, 3])
    x = torch.randn(4, 3, 16, 16)
    opt = fxplan.rewrite(model, None, example_inputs=(x,), loss_fn=lambda out: F.cross_entropy(out["logits"], labels))
    assert opt.fxplan_measured_peak_bytes > 0


def test_export_capture_keeps_names_and_non_persistent_buffers():
    model = StatefulNet()
    captured = capture(model, {"x": torch.randn(2, 3, 8, 8)})
    assert captured.method == "torch.export"  # symbolic_trace cannot take the keyword-only argument's branch
    assert list(captured.gm.state_dict()) == list(model.state_dict())
    assert captured.gm.stats.scale is model.stats.scale


def test_swin_relative_position_buffers_stay_non_persistent():
    torch.manual_seed(0)
    model = timm.create_model("swin_tiny_patch4_window7_224", pretrained=False, num_classes=3, img_size=32,
                              window_size=2, embed_dim=16, depths=(1, 1), num_heads=(1, 2))
    opt = assert_rewrite_exact(model, (torch.randn(1, 3, 32, 32),), None)
    opt.load_state_dict(model.state_dict())  # loads in both directions
    model.load_state_dict(opt.state_dict())


def test_model_no_capturer_takes_names_the_construct():
    class Gate(nn.Module):
        def forward(self, x):
            if x.sum() > 0:
                return x.relu()
            return -x

    with pytest.raises(fxplan.TraceError) as info:
        fxplan.rewrite(Gate(), None, example_inputs=(torch.randn(3),))
    message = str(info.value)
    assert "symbolic_trace" in message and "torch.export" in message and "test_reach.py" in message


class _MaskedWrite(nn.Module):
    """A boolean-mask assignment: its forward has a fixed size, its backward indexes by the mask."""

    def __init__(self):
        super().__init__()
        self.a, self.emb = nn.Linear(8, 8), nn.Parameter(torch.randn(8))

    def forward(self, x, mask):
        h = self.a(x)
        h[mask] = self.emb
        return h


class _MaskedRead(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)

    def forward(self, x, mask):
        return self.a(x)[mask].sum()


@pytest.mark.parametrize("model", [_MaskedWrite(), _MaskedRead()], ids=["in backward", "in forward"])
def test_a_data_dependent_op_is_refused_saying_what_to_change(model):
    """Fake tensors hold no values, so an op whose output size depends on them (nonzero, behind a boolean mask)
    cannot run in fxplan's fake steps, in the forward the trace runs or the backward the meter runs: an
    FxplanError says so and what to write instead, not the fake-tensor exception; a fake step of the model's own
    code says at which of its lines (Wav2Vec2ForCTC's check of its labels), autograd's backward has none."""
    inputs = (torch.randn(2, 4, 8), torch.tensor([[True, False, True, False]] * 2))
    model(*inputs).sum().backward()  # runs on real tensors
    with pytest.raises(fxplan.FxplanError, match="torch.where"):
        fxplan.rewrite(model, None, example_inputs=inputs)
    with pytest.raises(fxplan.FxplanError, match="torch.where") as info:
        fxplan.measure_step(model, inputs, fake=True)
    located = "test_reach.py:" in str(info.value) and "self.a(x)[mask].sum()" in str(info.value)
    assert located == isinstance(model, _MaskedRead)


class _NumpyMask(nn.Module):
    """Draws a mask with numpy in forward (as Wav2Vec2's SpecAugment does), with concrete shapes or not."""

    def __init__(self, traceable: bool):
        super().__init__()
        self.a, self.emb, self.traceable = nn.Linear(8, 8), nn.Parameter(torch.randn(8)), traceable

    def forward(self, x):
        h = self.a(x)
        shape = (2, 4) if self.traceable else h.shape[:2]
        m = torch.tensor(np.random.rand(*shape) < 0.3)
        return torch.where(m[..., None], self.emb, h)


@pytest.mark.parametrize("traceable", [True, False], ids=["symbolic_trace", "torch.export"])
def test_randomness_drawn_outside_torch_is_refused(traceable):
    """A captured graph would hold the mask numpy drew while capturing and repeat it: refused, with the
    generator left as it was."""
    np.random.seed(3)
    state = np.random.get_state()[1].copy()
    with pytest.raises(fxplan.TraceError, match="numpy.random's global generator"):
        fxplan.rewrite(_NumpyMask(traceable), None, example_inputs=(torch.randn(2, 4, 8),))
    assert (np.random.get_state()[1] == state).all()


def test_each_capturer_is_pointed_at_its_own_line():
    class TwoGates(nn.Module):
        def forward(self, x):
            if x.size(1) > 2:  # symbolic_trace stops here; export knows the shape
                x = x * 2
            if x.sum() > 0:  # export stops here
                x = x + 1
            return x

    with pytest.raises(fxplan.TraceError) as info:
        fxplan.rewrite(TwoGates(), None, example_inputs=(torch.randn(2, 4),))
    export_part = str(info.value).split("- torch.export")[-1]
    assert "if x.sum() > 0:" in export_part and "x.size(1)" not in export_part


class _CheckpointsItself(nn.Module):
    """Checkpoints its middle with torch.utils.checkpoint, as torchvision's memory-efficient DenseNet does."""

    def __init__(self, norm: type[nn.Module], reentrant: bool = False):
        super().__init__()
        self.a, self.b, self.c = nn.Conv2d(3, 8, 3, padding=1), nn.Conv2d(8, 8, 3, padding=1), nn.Conv2d(8, 4, 3)
        self.norm, self.reentrant = norm(8) if norm is nn.BatchNorm2d else norm([8, 8, 8]), reentrant

    def middle(self, h):
        return self.b(torch.relu(self.norm(h)))

    def forward(self, x):
        h = torch.utils.checkpoint.checkpoint(self.middle, self.a(x), use_reentrant=self.reentrant)
        return self.c(h)


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_a_model_checkpointing_buffer_updates_itself_is_refused(reentrant):
    """Its checkpoint updates the BatchNorm statistics twice per step (once more when it recomputes), a graph
    of its forward once: fxplan cannot keep its buffers, and says to turn its checkpointing off."""
    x = torch.randn(2, 3, 8, 8)
    with pytest.raises(fxplan.FxplanError, match="checkpointing off"):
        fxplan.rewrite(_CheckpointsItself(nn.BatchNorm2d, reentrant), None, example_inputs=(x,))
    assert_rewrite_exact(_CheckpointsItself(nn.LayerNorm, reentrant), (x,), None)  # no buffer updates: exact


class _Blocks(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.Sequential(*[nn.Sequential(nn.Linear(16, 16), nn.ReLU()) for _ in range(4)])
        self.head = nn.Linear(16, 4)

    def forward(self, x):
        return self.head(self.blocks(x))


def _doubling(module, grad_input, grad_output):
    return tuple(None if g is None else 2 * g for g in grad_input)


def test_backward_hooks_the_graph_would_lose_are_refused_and_others_kept():
    """A module the graph runs without calling it (traced into) would not run its backward hooks: the gradients
    would differ, so fxplan refuses; on a module the graph calls (a leaf) the hook runs, exactly."""
    x = torch.randn(32, 16)
    inner = _Blocks()
    inner.blocks[1].register_full_backward_hook(_doubling)
    with pytest.raises(fxplan.TraceError, match=r"backward hook on blocks\.1\b"):
        fxplan.rewrite(inner, None, example_inputs=(x,))
    leaf = _Blocks()
    leaf.blocks[1][0].register_full_backward_hook(_doubling)
    assert_rewrite_exact(leaf, (x,), None)


def test_forward_hooks_with_side_effects_are_warned_of(caplog):
    """What a forward hook returns is captured; what it stores is not: a hook of the user's is named in a
    warning (the list it fills gets nothing from the rewritten module's calls)."""
    model, stored = _Blocks(), []
    model.blocks[2].register_forward_hook(lambda module, args, output: stored.append(output))
    with caplog.at_level("WARNING", logger="fxplan"):
        optimized = fxplan.rewrite(model, None, example_inputs=(torch.randn(32, 16),))
    assert "forward hook on blocks.2" in caplog.text
    stored.clear()
    optimized(torch.randn(32, 16))
    assert not stored  # what the warning says


class _Chain(nn.Module):
    """Linear layers with ReLU, ``after(i, x)`` applied to each layer's output: the models below differ there.
    ``traceable=False`` adds a shape test that symbolic_trace cannot take, so torch.export captures the model."""

    def __init__(self, width: int, depth: int, traceable: bool = True):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(width, width) for _ in range(depth)])
        self.traceable = traceable

    def forward(self, x):
        for i, layer in enumerate(self.layers):
            x = torch.relu(layer(x))
            if self.traceable or x.shape[0] > 1:
                x = self.after(i, x)
        return x

    def after(self, i: int, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


class _OwnGenerator(_Chain):
    """Masks drawn from a torch.Generator of its own, which checkpoint does not keep (only the default ones)."""

    def __init__(self, traceable: bool):
        super().__init__(32, 6, traceable)
        self.gen = torch.Generator().manual_seed(0)

    def after(self, i, x):
        return x * (torch.rand(x.shape, generator=self.gen) > 0.2)


@pytest.mark.parametrize("traceable", [True, False], ids=["symbolic_trace", "torch.export"])
def test_a_generator_of_the_models_own_draws_the_same_in_recomputation(traceable):
    """Each recomputed segment draws from the model's generator the numbers its forward drew, and the generator
    goes on as the original's (the same object, not a copy made while capturing): exact over two steps, at the
    smallest peak and halfway to the vanilla one."""
    model, x = _OwnGenerator(traceable), torch.randn(64, 32)
    optimized = assert_rewrite_exact_at_two_budgets(model, (x,))
    assert optimized.fxplan_plan.num_segments > 1


class _NoGradRegion(_Chain):
    """A statistic taken under torch.no_grad() in forward: symbolic_trace would record its ops with grad."""

    def __init__(self):
        super().__init__(32, 6)

    def after(self, i, x):
        if i != 2:
            return x
        with torch.no_grad():
            scale = x.abs().mean() + 1
        return x / scale


def test_a_no_grad_region_in_forward_is_captured_with_its_grad_mode():
    """symbolic_trace runs the region's context manager while tracing and records nothing of it (the gradient
    would flow through the statistic): fxplan refuses that graph and captures with torch.export, exactly."""
    assert_rewrite_exact(_NoGradRegion(), (torch.randn(64, 32),), None)


class _TensorHook(_Chain):
    def __init__(self):
        super().__init__(32, 4)

    def after(self, i, x):
        if i == 1 and x.requires_grad:
            x.register_hook(lambda g: g * 3)
        return x


def test_a_hook_registered_on_a_tensor_in_forward_is_refused():
    """Neither capturer records Tensor.register_hook (export drops it: the gradients differed)."""
    with pytest.raises(fxplan.TraceError, match="register_hook"):
        fxplan.rewrite(_TensorHook(), None, example_inputs=(torch.randn(64, 32),))


class _ReverseGradient(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return -grad


class _WithOwnBackward(_Chain):
    def __init__(self, traceable: bool):
        super().__init__(16, 6, traceable)

    def after(self, i, x):
        return _ReverseGradient.apply(x) if i == 2 else x


@pytest.mark.parametrize("traceable", [True, False], ids=["symbolic_trace", "torch.export"])
def test_an_autograd_function_with_its_own_backward_is_called_by_the_graph(traceable):
    """Both capturers' graphs call a custom autograd.Function as one node, so its own backward runs: a gradient
    reversal (a view of its input, the gradient's sign flipped) is exact at two budgets, and the module pickles.
    torch.export alone traces through the forward and loses the backward (the gradients came back with the wrong
    sign before fxplan.capture.functions)."""
    x, model = torch.randn(64, 16), _WithOwnBackward(traceable)
    assert "apply_function" in capture(model, (x,)).gm.code
    optimized = assert_rewrite_exact_at_two_budgets(model, (x,))
    buffer = io.BytesIO()
    torch.save(optimized, buffer)
    buffer.seek(0)
    assert torch.equal(torch.load(buffer, weights_only=False)(x), optimized(x))


class _ScaledPair(torch.autograd.Function):
    """Two outputs and constant arguments; its backward is not its forward's (a straight-through gradient for
    the rounded output)."""

    @staticmethod
    def forward(ctx, x, scale, offset):
        ctx.scale = scale
        return torch.round(x * scale) + offset, x * 2

    @staticmethod
    def backward(ctx, g_round, g_double):
        return g_round * ctx.scale + 2 * g_double, None, None


class _WithPairs(_Chain):
    def __init__(self, scale):
        super().__init__(16, 6, traceable=False)
        self.scale = scale

    def after(self, i, x):
        if i not in (1, 3):
            return x
        rounded, doubled = _ScaledPair.apply(x, self.scale, 0.5)
        return rounded + doubled


def test_an_exported_autograd_function_keeps_its_constants_and_outputs():
    """The exported graph calls the function with its constant arguments and unpacks its two outputs:
    exact at two budgets (the rounding's own gradient is zero: only the function's backward passes any)."""
    model, x = _WithPairs(4.0), torch.randn(64, 16)
    assert capture(model, (x,)).gm.code.count("apply_function_flat") == 2
    assert_rewrite_exact_at_two_budgets(model, (x,))


def test_an_exported_autograd_function_with_an_argument_fxplan_cannot_record_is_refused():
    """A constant a graph node cannot hold as text (here a tensor dtype) is refused, naming the function."""
    with pytest.raises(fxplan.TraceError, match="_ScaledPair.*dtype"):
        fxplan.rewrite(_WithPairs(torch.float32), None, example_inputs=(torch.randn(64, 16),))


def test_torchscript_modules_are_refused_by_name():
    model = nn.Sequential(torch.jit.script(nn.Sequential(nn.Linear(8, 8), nn.Tanh())), nn.Linear(8, 2))
    with pytest.raises(fxplan.TraceError, match=r"TorchScript modules \(0\)"):
        fxplan.rewrite(model, None, example_inputs=(torch.randn(4, 8),))


class _LayerDropAtZero(nn.Module):
    """Draws from Python's generator for a LayerDrop that drops nothing (as some Hugging Face models do)."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(16, 16) for _ in range(4)])

    def forward(self, x):
        for layer in self.layers:
            if self.training and random.uniform(0, 1) < 0.0:
                continue
            x = torch.relu(layer(x))
        return x


def test_draws_that_change_no_graph_are_let_through_with_a_warning(caplog):
    """Two captures give the same graph: planned exactly, the generator left as it was, and a warning that the
    rewritten module does not draw."""
    random.seed(5)
    state = random.getstate()
    with caplog.at_level("WARNING", logger="fxplan"):
        fxplan.rewrite(_LayerDropAtZero(), None, example_inputs=(torch.randn(8, 16),))
    assert random.getstate() == state
    assert "two captures gave the same graph" in caplog.text
    assert_rewrite_exact(_LayerDropAtZero(), (torch.randn(8, 16),), None)


@pytest.mark.parametrize("generators", ["default", "own"])
def test_a_gradient_penalty_backpropagates_twice_through_recomputed_segments_exactly(generators):
    """A double backward (WGAN-GP's gradient penalty) recomputes each segment once per backward: the buffer
    guard's and the generators' recomputation contexts are entered twice (the default generators', and those
    of a model's own), and the gradients equal the model's."""
    torch.manual_seed(0)
    if generators == "default":
        model = nn.Sequential(*[nn.Sequential(nn.Linear(32, 32), nn.BatchNorm1d(32), nn.Tanh(), nn.Dropout(0.1))
                                for _ in range(5)], nn.Linear(32, 1)).train()
    else:
        model = _OwnGenerator(traceable=True)
    reference, x = copy.deepcopy(model), torch.randn(64, 32)
    optimized = fxplan.rewrite(model, None, example_inputs=(x,))
    assert optimized.fxplan_plan.num_segments > 1
    grads = []
    for module in (reference, optimized):
        torch.manual_seed(1)
        xi = x.clone().requires_grad_(True)
        out = module(xi).sum()
        (g,) = torch.autograd.grad(out, xi, create_graph=True)
        (out + (g.norm(2, dim=1) - 1).pow(2).mean()).backward()
        grads.append([p.grad for p in module.parameters()] + list(module.state_dict().values()))
    assert all(torch.equal(a, b) for a, b in zip(*grads))


def test_sparse_gradients_are_refused_clearly():
    """nn.Embedding(sparse=True) makes its weight's gradient a sparse tensor, which the meters cannot count."""
    model = nn.Sequential(nn.Embedding(100, 16, sparse=True), nn.Flatten(), nn.Linear(80, 4))
    with pytest.raises(fxplan.FxplanError, match="sparse=False"):
        fxplan.rewrite(model, None, example_inputs=(torch.randint(0, 100, (8, 5)),))


class _CallCounter(_Chain):
    """Counts its calls in a Python attribute and scales its output by a warm-up schedule of it."""

    def __init__(self):
        super().__init__(16, 4)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return super().forward(x) * min(1.0, self.calls / 10)

    def after(self, i, x):
        return x


class _BufferRebound(_Chain):
    """Counts its calls, in training and in eval mode, in a buffer it rebinds (not updated in place)."""

    def __init__(self):
        super().__init__(16, 4)
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x):
        self.calls = self.calls + 1
        return super().forward(x) * torch.clamp(self.calls / 10, max=1.0)

    def after(self, i, x):
        return x


class _ScratchAttribute(_Chain):
    """Sets an attribute before reading it in every call (as Hugging Face's Funnel does): no state across calls."""

    def __init__(self):
        super().__init__(16, 4)
        self.scale = 1.0

    def forward(self, x):
        self.scale = 2.0
        x = super().forward(x)
        self.scale = 1.0
        return x

    def after(self, i, x):
        return x * self.scale


def test_state_the_forward_keeps_outside_tensors_is_refused_and_buffers_rebound_are_captured():
    """A graph would freeze a Python attribute the forward changes (the output's schedule stopped at its first
    value): two captures differ, refused, the attribute put back. One the forward sets before it reads it gives
    the same graph twice: exact. A buffer the forward rebinds is captured by torch.export, which records the
    new value (symbolic_trace froze it and left the model's buffer changed): exact, in eval mode too (the
    original forward that eval calls run would rebind the original's buffer alone)."""
    x = torch.randn(8, 16)
    assert_rewrite_exact(_ScratchAttribute(), (x,), None)
    counter = _CallCounter()
    with pytest.raises(fxplan.TraceError, match=r"_CallCounter\.calls \(from 0\)"):
        fxplan.rewrite(counter, None, example_inputs=(x,))
    assert counter.calls == 0
    assert_rewrite_exact(_BufferRebound(), (x,), None)


@pytest.mark.filterwarnings("ignore:.*weight_norm.*deprecated")
def test_weight_norm_kept_as_a_computed_tensor_is_refused_and_its_parametrization_is_exact():
    """The old torch.nn.utils.weight_norm keeps the weight as a tensor computed from parameters, which
    copy.deepcopy refuses with a RuntimeError of its own: an FxplanError names it and the way out, the
    parametrizations API (spectral_norm's power-iteration buffers included), which fxplan rewrites exactly."""
    from torch.nn.utils.parametrizations import spectral_norm, weight_norm

    x = torch.randn(8, 16)
    old = nn.Sequential(nn.utils.weight_norm(nn.Linear(16, 16)), nn.ReLU(), nn.Linear(16, 4))
    with pytest.raises(fxplan.FxplanError, match=r"0\.weight is a tensor computed .*parametrizations"):
        fxplan.rewrite(old, None, example_inputs=(x,))
    torch.manual_seed(0)
    model = nn.Sequential(weight_norm(nn.Linear(16, 16)), nn.ReLU(), spectral_norm(nn.Linear(16, 16)), nn.ReLU(),
                          nn.Linear(16, 4))
    assert_rewrite_exact_at_two_budgets(model, (x,))


class _CachedTable(nn.Module):
    """Adds a table that a ``functools.lru_cache`` outside the module makes once per size, as Hugging Face's BEiT
    makes its relative position index."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    @staticmethod
    @functools.lru_cache(maxsize=4)
    def table(rows: int) -> torch.Tensor:
        return torch.arange(rows * 8, dtype=torch.float32).view(rows, 8)

    def forward(self, x):
        if x.dim() != 2:  # control flow symbolic_trace cannot follow: captured by torch.export, on fake tensors
            raise ValueError("rows of 8 features expected")
        return torch.relu(self.fc(x)) * self.table(4)


@pytest.mark.parametrize("plan_with", ["measure_step", "rewrite"])
def test_a_cache_outside_the_model_keeps_no_fake_tensor(plan_with):
    """A fake step filled the cache with a fake tensor, and the user's next real step computed on it (BEiT: a
    real forward returned a fake loss). A cache that gained entries while fxplan ran is cleared on the way out."""
    torch.manual_seed(0)
    model, x = _CachedTable(), torch.randn(4, 8)
    _CachedTable.table.cache_clear()
    if plan_with == "measure_step":
        fxplan.measure_step(model, (x,), fake=True)
    else:
        assert_rewrite_exact(model, (x,), None)
    out = model(x)
    assert type(out) is torch.Tensor
    assert torch.equal(out, torch.relu(model.fc(x)) * torch.arange(32.0).view(4, 8))
