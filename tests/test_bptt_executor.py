"""fxplan.bptt.backward: same gradients as plain BPTT, the forward count of the DP, bounded memory."""

from __future__ import annotations

import weakref

import pytest
import torch
from torch import nn

import fxplan.bptt as bptt
from fxplan.errors import BudgetError, FxplanError
from fxplan.measure.tracker import track_memory

D = torch.float64


class TanhCore(nn.Module):
    """Elman core with a tensor state; y_t is a small readout."""

    def __init__(self, n_in=3, n_h=5, p_drop=0.0):
        super().__init__()
        self.ih = nn.Linear(n_in, n_h, dtype=D)
        self.hh = nn.Linear(n_h, n_h, bias=False, dtype=D)
        self.out = nn.Linear(n_h, 2, dtype=D)
        self.drop = nn.Dropout(p_drop)

    def forward(self, x, h):
        h2 = torch.tanh(self.ih(x) + self.hh(self.drop(h)))
        return self.out(h2), h2


class LSTMCore(nn.Module):
    """LSTM cell with a tuple state (h, c)."""

    def __init__(self, n_in=3, n_h=4):
        super().__init__()
        self.cell = nn.LSTMCell(n_in, n_h, dtype=D)

    def forward(self, x, hc):
        h, c = self.cell(x, hc)
        return h, (h, c)


def loss_fn(y, t):
    return ((y - 0.1 * t) ** 2).sum() * (1 + t % 3)


def plain(core, xs, h0, loss=loss_fn):
    h, total = h0, 0
    for i in range(len(xs)):
        y, h = core(xs[i], h)
        total = total + loss(y, i)
    total.backward()
    return total.detach()


def grads(*tensors):
    return [None if t.grad is None else t.grad.clone() for t in tensors]


def setup(kind, T, seed=0, h_grad=False, x_grad=False):
    torch.manual_seed(seed)
    core = TanhCore() if kind == "tanh" else LSTMCore()
    xs = torch.randn(T, 2, 3, dtype=D, requires_grad=x_grad)
    if kind == "tanh":
        h0 = torch.randn(2, 5, dtype=D, requires_grad=h_grad)
    else:
        h0 = tuple(torch.randn(2, 4, dtype=D, requires_grad=h_grad) for _ in range(2))
    return core, xs, h0


def leaves(h0):
    return list(h0) if isinstance(h0, tuple) else [h0]


CASES = [("hsm", {}), ("ism", {}), ("msm", {"alpha": 3}), ("msm", {"alpha": 4, "beta": 3}), ("msm", {})]


@pytest.mark.parametrize("kind", ["tanh", "lstm"])
@pytest.mark.parametrize("policy,kw", CASES)
def test_gradients_equal_plain_bptt(kind, policy, kw):
    for T, m in [(1, 1), (2, 1), (7, 2), (12, 3), (20, 5), (9, 100)]:
        core, xs, h0 = setup(kind, T)
        ref_loss = plain(core, xs, h0)
        ref = grads(*core.parameters())
        core.zero_grad(set_to_none=True)
        stats = bptt.BackwardStats()
        loss = bptt.backward(core, xs, h0, loss_fn, slots=m, policy=policy, stats=stats, **kw)
        got = grads(*core.parameters())
        # One backward per step in reverse time order, as autograd does: bitwise equal.
        for a, b in zip(got, ref):
            assert torch.equal(a, b), (T, m, policy)
        torch.testing.assert_close(loss, ref_loss)
        assert stats.forward_calls == bptt.optimal_cost(policy, T, m, alpha=stats.alpha, beta=stats.beta)


@pytest.mark.parametrize("kind", ["tanh", "lstm"])
def test_gradients_into_h0_and_inputs(kind):
    core, xs, h0 = setup(kind, 11, h_grad=True, x_grad=True)
    plain(core, xs, h0)
    ref = grads(*core.parameters(), xs, *leaves(h0))
    for t in [*core.parameters(), xs, *leaves(h0)]:
        t.grad = None
    bptt.backward(core, xs, h0, loss_fn, slots=3, policy="msm", alpha=2)
    got = grads(*core.parameters(), xs, *leaves(h0))
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-14)
    # A non-leaf h0 passes its gradient on upstream.
    w = torch.randn(2, 5, dtype=D, requires_grad=True)
    core, xs, _ = setup("tanh", 6)
    plain(core, xs, w * 2)
    ref = w.grad.clone()
    w.grad = None
    bptt.backward(core, xs, w * 2, loss_fn, slots=2, policy="hsm")
    torch.testing.assert_close(w.grad, ref)


def test_chen_baselines_run():
    core, xs, h0 = setup("tanh", 16)
    plain(core, xs, h0)
    ref = grads(*core.parameters())
    for policy, kw, slots in [("chen_sqrt", {"alpha": 2}, 100), ("chen_recursive", {}, 10)]:
        core.zero_grad(set_to_none=True)
        stats = bptt.BackwardStats()
        bptt.backward(core, xs, h0, loss_fn, slots=slots, policy=policy, stats=stats, **kw)
        assert all(torch.equal(a, b) for a, b in zip(grads(*core.parameters()), ref))
        assert stats.forward_calls == bptt.solve(policy, 16, **kw).cost()


class Counting(nn.Module):
    """Counts calls and how many hidden states and step graphs produced by the core are alive."""

    def __init__(self, core):
        super().__init__()
        self.core = core
        self.calls = 0
        self.live_states = 0
        self.max_live_states = 0
        self.live_graphs = 0
        self.max_live_graphs = 0

    def _dec_states(self):
        self.live_states -= 1

    def _dec_graphs(self):
        self.live_graphs -= 1

    def forward(self, x, h):
        self.calls += 1
        # Count before this call's outputs exist: states held while the core runs.
        self.max_live_states = max(self.max_live_states, self.live_states)
        y, h2 = self.core(x, h)
        self.live_states += 1
        weakref.finalize(h2.untyped_storage(), self._dec_states)
        if torch.is_grad_enabled():
            self.live_graphs += 1
            self.max_live_graphs = max(self.max_live_graphs, self.live_graphs)
            # y * 1 keeps `one` alive exactly as long as this step's autograd graph (MulBackward saves it).
            one = torch.ones((), dtype=y.dtype)
            y = y * one
            weakref.finalize(one.untyped_storage(), self._dec_graphs)
        return y, h2


@pytest.mark.parametrize("policy,kw", [("hsm", {}), ("ism", {}), ("msm", {"alpha": 2})])
def test_calls_and_states_held(policy, kw):
    T = 25
    for m in (1, 2, 4, 7):
        core, xs, h0 = setup("tanh", T)
        counting = Counting(core)
        bptt.backward(counting, xs, h0, loss_fn, slots=m, policy=policy, **kw)
        assert counting.calls == bptt.optimal_cost(policy, T, m, **kw)
        # Hidden states produced by the core that are alive when it runs: HSM/MSM count them (h0 is one
        # of the m, the cursor takes its place; an MSM internal state holds at most 2 <= alpha of them).
        # ISM counts internal states, each holding its input and output hidden states.
        limit = 2 * m + 1 if policy == "ism" else m
        assert counting.max_live_states <= limit
        graphs = {"hsm": 1, "ism": m, "msm": 1 + (m - 1) // kw.get("alpha", 1)}[policy]
        assert counting.max_live_graphs <= graphs


def test_memory_measured_with_budget():
    # Hidden state 32 x 64 float64 = 16 KiB; a step saves about two of those.
    torch.manual_seed(0)
    lin = nn.Linear(64, 64, dtype=D)

    def step(x, h):
        h2 = torch.tanh(lin(h) + x)
        return h2, h2

    T = 24
    xs = torch.randn(T, 32, 64, dtype=D)
    h0 = torch.zeros(32, 64, dtype=D)
    hid = 32 * 64 * 8
    peaks = {}
    for budget in (None, 12 * hid, 6 * hid):
        lin.zero_grad(set_to_none=True)
        # Inputs, h0 and parameters exist before; views of them must not count as new storage.
        existing = (xs, h0, *lin.parameters())
        base = sum(t.untyped_storage().nbytes() for t in existing)
        with track_memory(*existing) as tr:
            if budget is None:
                plain(step, xs, h0, lambda y, t: y.sum())
            else:
                stats = bptt.BackwardStats()
                bptt.backward(step, xs, h0, lambda y, t: y.sum(), budget_bytes=budget, policy="msm",
                              stats=stats)
                assert stats.hidden_bytes == hid
                assert stats.peak_units * hid + stats.internal_bytes <= budget
        peaks[budget] = tr.peak_bytes - base
    # Besides the planned states: the parameter gradients (and their per-step temporaries), the carried
    # gradient and one step's backward temporaries (gradients of its output and input hidden states).
    param_bytes = sum(p.numel() * p.element_size() for p in lin.parameters())
    slack = 2 * param_bytes + 4 * hid
    assert peaks[12 * hid] <= 12 * hid + slack
    assert peaks[6 * hid] <= 6 * hid + slack
    assert peaks[None] > T * hid  # plain BPTT keeps every step's graph
    assert peaks[6 * hid] < peaks[None] / 2


def test_dropout_is_replayed():
    # A recomputed step must see the same dropout mask as its first computation: the schedule that
    # recomputes a lot and the one that computes every step once give the same gradients.
    results = []
    for policy, m in (("hsm", 1), ("msm", 1000), ("ism", 3)):
        torch.manual_seed(0)
        core = TanhCore(p_drop=0.5)
        xs = torch.randn(15, 2, 3, dtype=D)
        h0 = torch.randn(2, 5, dtype=D)
        torch.manual_seed(123)
        bptt.backward(core, xs, h0, loss_fn, slots=m, policy=policy, alpha=2)
        results.append(grads(*core.parameters()))
    for other in results[1:]:
        for a, b in zip(results[0], other):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-12)
    assert any(p.abs().sum() > 0 for p in results[0])


def test_bad_arguments():
    core, xs, h0 = setup("tanh", 8)
    with pytest.raises(FxplanError, match="slots must be an integer >= 1"):
        bptt.backward(core, xs, h0, loss_fn, slots=0)
    with pytest.raises(FxplanError, match="exactly one of"):
        bptt.backward(core, xs, h0, loss_fn)
    with pytest.raises(FxplanError, match="exactly one of"):
        bptt.backward(core, xs, h0, loss_fn, slots=2, budget_bytes=10**6)
    with pytest.raises(FxplanError, match="unknown BPTT policy"):
        bptt.backward(core, xs, h0, loss_fn, slots=2, policy="fast")
    with pytest.raises(BudgetError, match="needs") as e:
        bptt.backward(core, xs, h0, loss_fn, slots=2, policy="chen_sqrt", alpha=2)
    with pytest.raises(BudgetError, match="at least") as e:
        bptt.backward(core, xs, h0, loss_fn, budget_bytes=100)
    assert e.value.min_feasible_bytes > 100
    bptt.backward(core, xs, h0, loss_fn, budget_bytes=e.value.min_feasible_bytes)  # the least that works
    with pytest.raises(FxplanError, match="Check that h0"):
        bptt.backward(core, xs, torch.zeros(2, 4, dtype=D), loss_fn, slots=2, policy="hsm")
    with pytest.raises(FxplanError, match="shaped like h0"):
        bptt.backward(lambda x, h: (h, h[:1]), xs, h0, loss_fn, slots=2, policy="hsm")
    with pytest.raises(FxplanError, match="scalar"):
        bptt.backward(core, xs, h0, lambda y, t: y, slots=2, policy="hsm")
    with pytest.raises(FxplanError, match="empty"):
        bptt.backward(core, xs[:0], h0, loss_fn, slots=2)
    with pytest.raises(FxplanError, match="pair"):
        bptt.backward(lambda x, h: h, xs, h0, loss_fn, slots=2, policy="hsm")
