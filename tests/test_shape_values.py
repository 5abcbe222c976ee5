"""Values known from shapes alone are evaluated on fake tensors; values of data are refused, naming the line.

A fake step knows the values of small CPU tensors that factory ops make from numbers (``torch.arange(2, x.dim())``)
and of what is computed from them alone, so ``.tolist()`` and ``.item()`` of them work as in eager code (MONAI's
``DiceCELoss``). An ``.item()`` of a model's output, input or parameter has no value on fake tensors: every entry
point raises an :class:`FxplanError` that names the line.
"""

from __future__ import annotations

import copy
import types

import pytest
import torch

import fxplan
from fxplan import cli
from fxplan.capture.fakes import FakeMode, to_fake


def test_a_fake_step_knows_values_made_from_numbers_only():
    mode = FakeMode(allow_non_fake_inputs=True)
    data = to_fake(torch.arange(6.0), mode)
    with mode:
        dims = torch.arange(2, 5)
        assert dims.tolist() == [2, 3, 4]
        assert (torch.tensor([3, 4]) * dims[:2]).tolist() == [6, 12]
        assert torch.ones(3).sum().item() == 3.0
        for unknown in (torch.randn(3), torch.empty(3), torch.zeros(4096), data, data[:3] + dims):
            assert unknown.constant is None
        written = torch.zeros(3)
        written.add_(torch.randn(3))  # a value it does not know written in: the value is forgotten
        assert written.constant is None


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(8, 32), torch.nn.Linear(32, 4)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


def data_loss(out):
    return out.sum() / out.abs().max().item()  # the line every refusal names


ENTRY_POINTS = {
    "rewrite": lambda m, x: fxplan.rewrite(m, None, example_inputs=(x,), loss_fn=data_loss),
    "plan": lambda m, x: fxplan.plan(m, (x,), loss_fn=data_loss),
    "min_budget_bytes": lambda m, x: fxplan.min_budget_bytes(m, (x,), loss_fn=data_loss),
    "auto_checkpoint": lambda m, x: fxplan.auto_checkpoint(m, example_inputs=(x,), loss_fn=data_loss),
    "rewrite without inputs": lambda m, x: fxplan.rewrite(m, None, loss_fn=data_loss)(x),
}


@pytest.mark.parametrize("entry", list(ENTRY_POINTS))
def test_a_loss_that_reads_its_data_is_refused_naming_the_line_on_every_entry_point(entry):
    with pytest.raises(fxplan.FxplanError, match=r"test_shape_values.py:\d+: return out.sum\(\) / out.abs\(\)"):
        ENTRY_POINTS[entry](Net(), torch.randn(4, 8))


def test_the_command_line_refuses_a_loss_that_reads_its_data_naming_the_line(monkeypatch, capsys):
    monkeypatch.setattr(cli, "load_model", lambda *a, **k: (types.SimpleNamespace(loss=data_loss), Net(),
                                                             (torch.randn(4, 8),)))
    assert cli.main(["plan", "net", "--quiet"]) == 1
    assert "test_shape_values.py" in capsys.readouterr().err


class ShapeCounted(torch.nn.Module):
    """Scales by a number its forward computes from the input's shape through tensors, then reads data."""

    def __init__(self, read_data: bool = False):
        super().__init__()
        self.a, self.b = torch.nn.Linear(8, 32), torch.nn.Linear(32, 8)
        self.read_data = read_data

    def forward(self, x):
        h = torch.relu(self.a(x))
        n = torch.tensor(h.shape).prod().item()
        if self.read_data:
            n = h.max().item()  # the line the refusal names
        return self.b(h) / n


def test_a_forward_computing_numbers_from_shapes_is_planned_exactly():
    torch.manual_seed(0)
    model, x = ShapeCounted(), torch.randn(4, 6, 8)
    opt = fxplan.rewrite(model, None, example_inputs=(x,))
    ref = copy.deepcopy(model)
    out, expected = opt(x), ref(x)
    assert torch.equal(out, expected)
    out.sum().backward()
    expected.sum().backward()
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(ref.parameters(), opt.parameters()))


def test_a_forward_reading_its_data_is_refused_naming_the_line():
    with pytest.raises(fxplan.FxplanError, match=r"test_shape_values.py:\d+: n = h.max\(\).item\(\)"):
        fxplan.rewrite(ShapeCounted(read_data=True), None, example_inputs=(torch.randn(4, 6, 8),))
