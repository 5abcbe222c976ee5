"""Kernel scratch (fxplan.measure.scratch): the meter counts what kernels hold inside themselves, so fxplan's peaks and
budgets agree with an independent meter of the real step (torch.profiler's allocation events)."""

from __future__ import annotations

import copy

import pytest
import torch
import torchvision
from torch._subclasses.fake_tensor import FakeTensorMode

import fxplan
from fxplan.measure import scratch
from fxplan.measure.meter import measure_step, measure_step_profiler

pytestmark = pytest.mark.usefixtures("one_torch_thread")
aten = torch.ops.aten


@pytest.fixture(scope="module")
def resnet():
    torch.manual_seed(0)
    return torchvision.models.resnet18(weights=None).train(), (torch.randn(4, 3, 64, 64),)


@pytest.fixture
def measured_afresh(monkeypatch, tmp_path):
    """No figure kept from before, in the process or in a cache file."""
    monkeypatch.setenv("FXPLAN_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(scratch, "_MEASURED", {})
    monkeypatch.setattr(scratch, "_FILE", None)


def test_batch_norm_backward_holds_a_buffer_the_size_of_its_input(measured_afresh):
    x = torch.randn(4, 8, 16, 16)
    stats = [torch.ones(8), torch.zeros(8), torch.ones(8), torch.zeros(8), torch.ones(8)]
    call = (x, x, *stats, True, 1e-5, [True, True, True])
    assert scratch.scratch_bytes(aten.native_batch_norm_backward.default, call, {}) >= x.nbytes
    assert scratch.scratch_bytes(aten.view.default, (x, [4, -1]), {}) == 0  # a view allocates nothing


def test_measuring_a_random_op_leaves_the_generator_as_it_was(measured_afresh):
    x = torch.randn(64, 64)
    state = torch.random.get_rng_state()
    scratch.scratch_bytes(aten.native_dropout.default, (x, 0.5, True), {})
    assert torch.equal(state, torch.random.get_rng_state())


def test_fake_meter_equals_the_profilers_peak_of_a_real_step(resnet):
    model, inputs = resnet
    # the rewritten model peaks inside a backward, where BatchNorm and convolution kernels hold scratch
    # and each recomputed segment's checkpoint keeps the CPU generator's state, made outside the dispatcher
    optimized = fxplan.rewrite(copy.deepcopy(model), None, example_inputs=inputs)
    assert any(s.fxplan_recompute for s in optimized.segment_modules())
    for module in (model, optimized):
        fake = measure_step(module, inputs, fake=True).peak_bytes
        with scratch.not_counted():
            storages = measure_step(module, inputs, fake=True).peak_bytes
        assert measure_step_profiler(module, inputs).peak_bytes == fake
        assert storages <= fake
    assert storages < fake  # the rewritten model: its peak is in a kernel that holds scratch


def test_a_budget_holds_on_the_profilers_meter(resnet):
    model, inputs = resnet
    vanilla = measure_step(model, inputs, fake=True).peak_bytes
    smallest = fxplan.rewrite(copy.deepcopy(model), None, example_inputs=inputs).fxplan_measured_peak_bytes
    budget = (vanilla + smallest) // 2
    optimized = fxplan.rewrite(copy.deepcopy(model), budget_bytes=budget, example_inputs=inputs)
    assert measure_step_profiler(optimized, inputs).peak_bytes <= budget


def test_figures_are_kept_in_the_cache_file(measured_afresh, tmp_path, monkeypatch):
    call = (torch.randn(4, 8, 16, 16), torch.randn(8, 8, 3, 3), None, [1, 1], [1, 1], [1, 1], False, [0, 0], 1)
    first = scratch.scratch_bytes(aten.convolution.default, call, {})
    scratch._save()
    assert (tmp_path / scratch.CACHE_NAME).exists()
    scratch._MEASURED.clear()
    monkeypatch.setattr(scratch, "_FILE", None)
    monkeypatch.setattr(scratch, "_measure", None)  # read back from the file, not measured again
    assert scratch.scratch_bytes(aten.convolution.default, call, {}) == first


def test_an_lstm_step_measures_on_fake_tensors_what_it_holds_for_real(measured_afresh):
    """oneDNN's LSTM layer returns its workspace, kept for backward, as 0 bytes under fake tensors (1.5 MB real
    here): the fake meter counted a third of the real step. Now outputs count at the real kernel's sizes, and the
    backward (which takes that workspace, never run on random bytes) is measured on the workspace its forward
    makes from the same inputs (``scratch.STATE_MAKERS``), and the storage the backward's fake kernel returns both
    bias gradients on counts what the real kernel's two hold: the three meters agree to the byte."""

    class Lstm(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lstm = torch.nn.LSTM(32, 64, 2, batch_first=True)

        def forward(self, x):
            return self.lstm(x)[0]

    torch.manual_seed(0)
    model, x = Lstm().train(), (torch.randn(8, 48, 32),)
    fake = measure_step(model, x, fake=True).peak_bytes
    # before (two threads): fake 1,099,768 bytes, real 4,139,000, profiler 4,492,864
    assert fake == measure_step(model, x).peak_bytes == measure_step_profiler(model, x).peak_bytes


@pytest.mark.skipif(torch.cuda.is_available(), reason="planning for a device this machine lacks")
def test_fake_tensors_of_a_device_the_machine_lacks_count_no_scratch(measured_afresh):
    with FakeTensorMode():
        x = torch.randn(4, 8, 16, 16, device="cuda")  # a CUDA model planned on a machine without a GPU
    assert scratch.scratch_bytes(aten.relu.default, (x,), {}) == 0


@pytest.mark.parametrize("op", [
    aten._efficient_attention_backward.default,  # philox seed and offset from an earlier call, no state maker
    aten._flash_attention_backward.default,
])
def test_ops_taking_a_kernels_own_state_are_never_run(op, measured_afresh, monkeypatch):
    monkeypatch.setattr(scratch, "_measure", lambda *a: pytest.fail(f"{op} was run for its scratch"))
    assert op not in scratch.STATE_MAKERS
    assert scratch.scratch_bytes(op, (torch.randn(2, 2),), {}) == 0


def test_an_op_whose_state_an_earlier_op_makes_runs_on_that_state_only(measured_afresh):
    """mkldnn_rnn_layer_backward on random bytes for its workspace segfaulted on this CPU: it runs only on the
    workspace its forward makes (``STATE_MAKERS``), and arguments that do not bind give no figure, not a crash."""
    assert aten.mkldnn_rnn_layer_backward.default in scratch.STATE_MAKERS
    assert scratch.scratch_bytes(aten.mkldnn_rnn_layer_backward.default, (torch.randn(2, 2),), {}) == 0


@pytest.mark.parametrize("backward, args", [
    (aten._scaled_dot_product_efficient_attention_backward.default,
     lambda q, lse, seed: (q, q, q, q, None, q, lse, seed, seed, 0.1, [True, True, True, False])),
    (aten._scaled_dot_product_flash_attention_backward.default,
     lambda q, lse, seed: (q, q, q, q, q, lse, None, None, 32, 32, 0.1, True, seed, seed)),
    (aten._scaled_dot_product_cudnn_attention_backward.default,
     lambda q, lse, seed: (q, q, q, q, q, lse, seed, seed, None, None, None, 32, 32, 0.1, True)),
])
def test_fused_attention_backward_runs_on_the_state_its_forward_makes(backward, args):
    """A fused attention backward's scratch (on an H200, memory-efficient attention's float32 workspace: 51 MB
    of ViT-B's 1.66 GB smallest peak, the whole gap between the meter and the allocator) is measured on the
    output, log-sum-exp and dropout seed its forward makes from the same query, key and value. The call as the
    dispatcher makes it leaves out arguments left at their defaults (``is_causal``, ``scale``): binding them
    failed on the device, silently (no figure). Meta tensors here: the kernels are CUDA's."""
    q = torch.randn(2, 4, 32, 16, device="meta")
    lse = torch.empty(2, 4, 32, device="meta")
    seed = torch.empty((), dtype=torch.int64, device="meta")
    made_args, made_kwargs = scratch.with_state_made(backward, args(q, lse, seed), {})
    assert made_kwargs == {"scale": None}
    out = [a.name for a in backward._schema.arguments].index("out")
    assert made_args[1] is q and made_args[out] is not q  # the forward's output replaces the random one
    grads = backward(*made_args, **made_kwargs)
    assert [tuple(g.shape) for g in grads[:3]] == [(2, 4, 32, 16)] * 3


class _CudnnLstmCall(torch.nn.Module):
    """Calls cuDNN's RNN op as nn.LSTM does on a GPU (this machine may have none: only the fake step runs)."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(64, 8))

    def forward(self, x):
        h = x.new_zeros(1, 2, 16)
        return aten._cudnn_rnn.default(x, [self.w], 1, None, h, h, 2, 16, 0, 1, False, 0.0, True, False, [], None)[0]


def test_an_op_whose_kept_buffer_a_fake_meter_cannot_size_is_refused():
    """cuDNN's LSTM keeps a reserve for backward that its fake kernel makes 0 bytes and that no real run can size
    (the op takes cuDNN's own state): a fake meter refuses it, saying how to plan such a model, rather than give
    a peak low by the reserve."""
    with pytest.raises(fxplan.FxplanError, match="cudnn.flags"):
        measure_step(_CudnnLstmCall(), (torch.randn(5, 2, 8),), fake=True)


def test_the_refusal_reaches_a_rewrite_whole():
    """Planning meets the op in the trace's fake step: the refusal's whole message, the way out at its end, reaches
    the caller (an H100 run showed it cut at 300 characters inside a TraceError about the example inputs)."""
    with pytest.raises(fxplan.FxplanError, match=r"fake=False\)\)"):
        fxplan.rewrite(_CudnnLstmCall(), None, example_inputs=(torch.randn(5, 2, 8),))


def test_the_physical_floor_counts_kernel_scratch_and_stays_below_the_peaks(resnet):
    from fxplan.measure.floor import physical_floor

    model, inputs = resnet
    floor = physical_floor(model, inputs)
    with scratch.not_counted():
        bare = physical_floor(model, inputs)
    assert floor.bytes > bare.bytes and floor.scratch_bytes > 0
    assert floor.bytes <= measure_step(model, inputs, fake=True).peak_bytes
    assert floor.bytes <= measure_step(fxplan.rewrite(model, None, example_inputs=inputs), inputs, fake=True).peak_bytes


def test_the_generator_states_checkpoint_keeps_are_metered_and_replayed():
    """Small activations, so the 5,056-byte CPU generator state each recomputed segment with a dropout keeps
    (and the copy fork_rng takes while it recomputes) weighs: both meters and the replay see the same bytes;
    segments that draw no random numbers keep none."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[m for _ in range(12) for m in (torch.nn.Linear(32, 32), torch.nn.Tanh(),
                                                                   torch.nn.Dropout(0.1))])
    inputs = (torch.randn(64, 32),)
    optimized = fxplan.rewrite(model, None, example_inputs=inputs)
    recomputed = [s for s in optimized.segment_modules() if s.fxplan_recompute]
    assert recomputed and all(s.may_draw_random() for s in recomputed)
    peak = measure_step(optimized, inputs, fake=True).peak_bytes
    assert measure_step_profiler(optimized, inputs).peak_bytes == peak
    assert abs(optimized.fxplan_plan.predicted_peak_bytes - peak) <= 16
    for m in model[2::3]:
        m.p = 0.0
    assert not any(s.may_draw_random() for s in recomputed)
