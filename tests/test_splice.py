"""Graphs with some recomputed regions: spliced cost graphs are the traced ones (``fxplan.planner.splice``), and
``fxplan.rewrite`` takes the cheapest plan over the captured graph, every region and the subsets of
``fxplan.planner.variants.REGION_SUBSETS``, exactly."""

from __future__ import annotations

import copy
import random

import pytest
import torch
import torchvision
from test_regions import assert_same_step
from torch._subclasses.fake_tensor import FakeTensorMode

import fxplan
from fxplan.capture.regions import find_regions, with_regions
from fxplan.costs.trace import trace
from fxplan.measure.meter import measure_step
from fxplan.planner import splice
from fxplan.planner.plan_meter import PlanMeter, code_of
from fxplan.planner.variants import REGION_SUBSETS, Searches
from fxplan.rewriter.codegen import segment_module

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def densenet() -> torch.nn.Module:
    torch.manual_seed(0)  # two dense blocks whose concatenations the subsets pay for in part
    return torchvision.models.DenseNet(growth_rate=16, block_config=(4, 4), num_init_features=32, bn_size=4).train()


def node_facts(cg) -> dict:
    return {v: dict(cg.nodes[v]) for v in cg.nodes}


def edges(cg) -> set:
    return {(u, v, bool(d.get("order_only"))) for u, v, d in cg.edges(data=True)}


def marks(gm) -> dict:
    return {n.name: (n.meta.get("fxplan_mutates"), n.meta.get("fxplan_fresh_output")) for n in gm.graph.nodes}


@pytest.mark.parametrize("make", [densenet, lambda: torchvision.models.resnet18().train()],
                         ids=["densenet", "resnet18"])
def test_a_spliced_graph_is_the_traced_one(make):
    model = make()
    with FakeTensorMode():
        x = torch.randn(2, 3, 64, 64)
    plain = trace(model, (x,))
    regions = find_regions(plain.graph["captured"].gm)
    every = trace(model, (x,), captured=with_regions(plain.graph["captured"], regions))
    for seed in range(2):
        subset = sorted(random.Random(seed).sample(regions, len(regions) // 2), key=regions.index)
        got = splice.spliced(plain, every, regions, subset)
        want = trace(model, (x,), captured=with_regions(plain.graph["captured"], subset))
        assert list(got.nodes) == list(want.nodes)
        assert node_facts(got) == node_facts(want)  # T, M, what backward saves, rises, aliases, writes
        assert edges(got) == edges(want)
        assert got.graph["gradients"] == want.graph["gradients"]
        assert marks(got.graph["gm"]) == marks(want.graph["gm"])
        assert marks(got.graph["fake"][0]) == marks(want.graph["fake"][0])
        names = list(got.nodes)
        segments = [names[:len(names) // 3], names[len(names) // 3:]]
        measured = [PlanMeter(cg, (x,), None).measure(segments, {}) for cg in (got, want)]
        assert measured[0] == measured[1]  # the same peak, the same generated code
        assert code_of(segment_module(got.graph["gm"], segments)) == measured[0][1]


def test_a_graph_that_does_not_line_up_is_traced(monkeypatch, caplog):
    model = densenet()
    x = torch.randn(4, 3, 64, 64)
    searches = Searches(trace(model, (x,)), model, (x,), solver="approx")
    subset = searches.region_subsets()[0]

    def misaligned(*args):
        raise splice.SpliceError("node x does not line up")

    monkeypatch.setattr(splice, "_aligned", misaligned)
    with caplog.at_level("INFO", logger="fxplan"):
        variant = searches.with_subset(subset)
    assert "recomputed in backward instead of splicing it" in caplog.text and variant.regions == subset
    assert node_facts(variant.search.cg) == node_facts(trace(model, (x,), captured=with_regions(
        searches.plain.search.cg.graph["captured"], subset)))


def test_rewrite_takes_the_cheapest_graph_of_all_subsets():
    model = densenet()
    x = torch.randn(8, 3, 64, 64)
    vanilla = measure_step(model, (x,), fake=True).peak_bytes
    searches = Searches(trace(model, (x,)), model, (x,), solver="approx")
    lowest = searches.lowest()
    subsets = searches.region_subsets()
    assert 1 < len(subsets) <= len(REGION_SUBSETS)
    assert all(0 < len(a) < len(b) < len(searches._regions) for a, b in zip(subsets, subsets[1:]))
    every = [searches.plain, searches.with_regions(), *(searches.with_subset(s) for s in subsets)]
    chosen, took_subset = [], False
    for k in (8, 9, 14, 17):  # budgets where a subset wins and where the captured graph does
        budget = lowest + (vanilla - lowest) * k // 20
        reference = copy.deepcopy(model)
        module = fxplan.rewrite(model, budget_bytes=budget, example_inputs=(x,))
        plan = module.fxplan_plan
        assert plan.measured_peak_bytes <= budget
        costs = [v.recomputed_T(c) for v in every for c in [v.search.least_recompute(budget)] if c is not None]
        assert plan.recompute_fraction * plan.total_T == pytest.approx(min(costs), rel=1e-9)  # brute force
        if 0 < len(plan.regions) < len(searches._regions):
            took_subset = True
            assert_same_step(reference, module, x, steps=1)
        model = reference
        model.zero_grad(set_to_none=True)
        chosen.append(plan.recompute_fraction)
    assert took_subset
    assert chosen == sorted(chosen, reverse=True)  # a larger budget never recomputes more


def test_graphs_with_regions_are_made_only_where_they_could_win():
    model = densenet()
    x = torch.randn(8, 3, 64, 64)
    vanilla = measure_step(model, (x,), fake=True).peak_bytes
    searches = Searches(trace(model, (x,)), model, (x,), solver="approx")
    chosen = searches.choose(vanilla, "time")  # met without recomputation: nothing beats it
    assert chosen.variant is searches.plain and chosen.candidate.recompute == 0
    assert searches.variants == [searches.plain] and searches.steps == 1
    order = [c.recompute for c in searches.plain.search.by_recompute()]  # non-decreasing, to the last bit or so
    assert all(b >= a * (1 - 1e-12) for a, b in zip(order, order[1:])) and len(order) > 2
