"""The candidate plans of a graph from either end of the frontier (``fxplan.planner.frontier``), and the search for the
smallest peak that looks at its bottom only (``fxplan.planner.candidates.Candidates.bottom``)."""

from __future__ import annotations

import pytest
import torch
import torchvision
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from fxplan.costs.trace import trace
from fxplan.planner.frontier import Frontier
from fxplan.planner.search import Search

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def graph():
    torch.manual_seed(0)
    model = torchvision.models.mobilenet_v2(weights=None).train()  # 63 positions, 28 plans
    with FakeTensorMode():
        x = (torch.randn(16, 3, 64, 64),)
    return model, x, trace(model, x)


@pytest.fixture(scope="module")
def chain():
    """A chain whose activations dwarf its parameters: its smallest peak is a fraction of its largest."""
    torch.manual_seed(0)
    model = nn.Sequential(*[m for _ in range(40) for m in (nn.Linear(64, 64), nn.Tanh())]).train()
    with FakeTensorMode():
        x = (torch.randn(512, 64),)
    return model, x, trace(model, x)


def _plans(frontier: Frontier, order) -> dict[int, tuple | None]:
    return {k: (None if (p := frontier.at(k)) is None else (p.segments, p.recompute_fraction)) for k in order}


def test_the_frontier_gives_the_same_plans_from_the_top_and_from_the_bottom(graph):
    model, _, cg = graph
    down = Frontier(cg, model, "approx")
    top_down = _plans(down, range(down.size))
    up = Frontier(cg, model, "approx")
    bottom_up = _plans(up, reversed(range(up.size)))
    assert top_down == bottom_up
    kept = [k for k, p in top_down.items() if p is not None]
    assert len(kept) > 10 and len(kept) < down.size  # a frontier with grid points passed over
    recompute = [top_down[k][1] for k in kept[:-1]]  # the memory-centric plan, last, may recompute less
    # non-decreasing; plans of equal recomputation may differ in the last bit (sums in another order)
    assert all(later >= earlier * (1 - 1e-12) for earlier, later in zip(recompute, recompute[1:]))
    assert len(down._solved) < down.size  # from the top, the points passed over are not solved


def test_the_smallest_peak_from_the_frontiers_bottom_is_the_whole_frontiers(graph):
    model, x, cg = graph
    search = Search(cg, model, x, solver="approx")
    smallest = search.smallest()
    position = next(k for k, c in search._at.items() if c is smallest)
    assert search.frontier.grid_budget(position) is not None  # a plan of the grid, not the bottom's two
    bottom = search.bottom()
    whole = search._smallest_of([*search.walk(), *search.others_smallest()])
    assert whole is smallest
    near = [c for c in search.candidates if c.replayed <= smallest.replayed * 1.01]
    assert len(near) > 1 and all(c in bottom for c in near)


def test_the_smallest_peak_search_leaves_the_top_of_a_long_frontier_unplanned(chain):
    model, x, cg = chain
    search = Search(cg, model, x, solver="approx")
    search.smallest()
    assert len(search.frontier._solved) < search.frontier.size * 2 // 3
