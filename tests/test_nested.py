"""Nested plans (fxplan.solvers.subplans, fxplan.planner.nested): sub-segments checkpointed inside segments, exactly."""

from __future__ import annotations

import copy
import logging
import pickle
import random
import types

import pytest
import torch
import torch.fx as fx
from models_awkward import AWKWARD, assert_same_training, random_plan
from reach_checks import assert_rewrite_exact
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import fxplan
from fxplan.errors import FxplanError
from fxplan.measure import scratch
from fxplan.measure.meter import measure_step
from fxplan.rewriter.codegen import segment_module
from fxplan.solvers import subplans
from fxplan.solvers.plans import Plan

pytestmark = pytest.mark.usefixtures("one_torch_thread", "storages_only")


@pytest.fixture
def storages_only():
    """The small models here peak inside a convolution's backward kernel, whose scratch (fxplan.measure.scratch) no
    plan lowers; these tests are about what nesting does to the storages, so the meter counts those alone."""
    with scratch.not_counted():
        yield


def nest(segments, rng, depth):
    """Random sub-plans: each segment of 2+ nodes split into contiguous chunks, down to ``depth`` levels."""
    children = {}
    for i, seg in enumerate(segments):
        if depth == 0 or len(seg) < 2:
            continue
        k = rng.randint(2, min(3, len(seg)))
        cuts = sorted(rng.sample(range(1, len(seg)), k - 1))
        bounds = [0, *cuts, len(seg)]
        sub = [seg[a:b] for a, b in zip(bounds, bounds[1:])]
        children[str(i)] = {"segments": sub, "children": nest(sub, rng, depth - 1)}
    return children


@pytest.mark.parametrize("name", sorted(AWKWARD))
@pytest.mark.parametrize("seed", [0, 1])
def test_nested_plans_train_exactly(name, seed):
    """Outputs, gradients and buffers bitwise equal over two steps, BatchNorm and dropout included, for
    random plans nested two levels deep (so values are recomputed up to three times)."""
    make, make_inputs = AWKWARD[name]
    inputs = make_inputs()
    torch.manual_seed(seed)
    model = make()
    gm = fx.symbolic_trace(model)
    rng = random.Random(seed)
    segments = random_plan(gm, rng, min(3, sum(1 for n in gm.graph.nodes if n.op.startswith("call"))))
    children = nest(segments, rng, 2)
    assert children, "the random plan must nest something"
    ref = copy.deepcopy(model)
    opt = segment_module(gm, segments, children)
    assert subplans.depth(subplans.tree(segments, children)) >= 2
    assert_same_training(ref, opt, inputs)


def traced(name):
    """(model, inputs, traced module, compute node names) of an awkward model."""
    make, make_inputs = AWKWARD[name]
    model = make()
    gm = fx.symbolic_trace(model)
    return model, make_inputs(), gm, [n.name for n in gm.graph.nodes if n.op.startswith("call")]


def test_nested_plan_through_rewrite_train_and_eval():
    model, inputs, gm, names = traced("densenet_block")
    segments = [names[: len(names) // 2], names[len(names) // 2:]]
    sub = {"0": {"segments": [segments[0][:2], segments[0][2:]]},
           "1": {"segments": [segments[1][:1], segments[1][1:]]}}
    plan = Plan(segments, segments, [[], []], 0, [0, 0], 0.0, 0.0, 0.0, None, "time", "approx-dp", "autograd",
                children={k: Plan([*v["segments"]], [], [], 0, [], 0.0, 0.0, 0.0, None, "time", "approx-dp",
                                  "autograd") for k, v in sub.items()})
    opt = assert_rewrite_exact(model, inputs, None, plan=plan)
    text = opt.readable()
    assert "self.segment_0.segment_0_0" in text and "checkpointed again inside" in text
    assert "self.segment_0_0(" in opt.segment_0.code
    assert "segment_1_0" in opt.segment_1.code


def test_nesting_survives_copies():
    model, inputs, gm, names = traced("bn")
    opt = segment_module(gm, [names[:3], names[3:]], {"0": {"segments": [names[:1], names[1:3]]}})
    for other in (copy.deepcopy(opt), pickle.loads(pickle.dumps(opt))):
        assert other.fxplan_children == opt.fxplan_children
        assert list(other.segment_0.fxplan_children) == ["segment_0_0", "segment_0_1"]
        assert_same_training(copy.deepcopy(model), other, inputs)


def test_bad_sub_plans_are_rejected():
    _, _, gm, names = traced("bn")
    segments = [names[:3], names[3:]]
    with pytest.raises(FxplanError, match="exactly that segment's nodes"):
        segment_module(gm, segments, {"0": {"segments": [names[:1], names[1:2]]}})
    with pytest.raises(FxplanError, match="only segments"):
        segment_module(gm, segments, {"2": {"segments": [names[:1]]}})
    with pytest.raises(FxplanError, match="uses"):  # sub-segments out of execution order
        segment_module(gm, segments, {"0": {"segments": [names[1:3], names[:1]]}})


class Chain(nn.Module):
    """``convs`` times conv-relu, pool, then a smaller block: the canonical floor keeps the first
    activation for the second conv's backward while the second ReLU's backward runs (VGG-19's first
    block)."""

    def __init__(self, convs: int = 2, width: int = 16):
        super().__init__()
        layers = []
        for i in range(convs):
            layers += [nn.Conv2d(3 if i == 0 else width, width, 3, padding=1), nn.ReLU(inplace=True)]
        self.first = nn.Sequential(*layers, nn.MaxPool2d(2))
        self.second = nn.Sequential(nn.Conv2d(width, width, 3, padding=1), nn.ReLU(inplace=True), nn.MaxPool2d(4))
        self.head = nn.Linear(width * 4 * 4, 10)

    def forward(self, x):
        return self.head(self.second(self.first(x)).flatten(1))


def test_nesting_drops_a_value_inside_a_backward():
    """Checkpointing c1-r1-c2 inside the first segment lowers the measured peak below the flat plan's."""
    model = Chain()
    x = torch.randn(4, 3, 32, 32)
    gm = fx.symbolic_trace(model)
    names = [n.name for n in gm.graph.nodes if n.op.startswith("call")]
    first, rest = names[:5], names[5:]
    flat = measure_step(segment_module(gm, [first, rest]), (x,), fake=True).peak_bytes
    nested = segment_module(gm, [first, rest], {"0": {"segments": [first[:3], first[3:]]}})
    assert measure_step(nested, (x,), fake=True).peak_bytes < flat
    assert_same_training(copy.deepcopy(model), nested, (x,))


# ---------------------------------------------------------------------------------------------
# the search and the floor


def test_search_goes_below_the_canonical_plans_and_trains_exactly():
    """On a VGG-like chain the nested search lowers the smallest measured peak; a budget between the
    nested and the canonical peaks, refused before, gets a nested plan that fits and trains exactly.
    (With two convolutions in the first block one of Chen's plans already reaches the nested peak.)"""
    model = Chain(convs=3)
    x = (torch.randn(16, 3, 32, 32),)
    from fxplan.costs.trace import trace
    from fxplan.planner.search import Search

    search = Search(trace(model, x), model, x, solver="approx")
    flat, low = search.smallest(), search.lowest()
    assert low.measured < flat.measured and low.plan.children
    assert low.recompute > flat.recompute
    budget = (low.measured + flat.measured) // 2
    opt = assert_rewrite_exact(model, x, budget / 2**30)
    assert opt.fxplan_plan.children and opt.fxplan_measured_peak_bytes <= budget
    assert "sub-plan of" in opt.fxplan_plan.summary()


def test_the_nested_search_measures_at_most_its_budget_of_candidates():
    from fxplan.costs.trace import trace
    from fxplan.planner import nested
    from fxplan.planner.plan_meter import PlanMeter
    from fxplan.planner.search import Search

    model = Chain(convs=3)
    x = (torch.randn(16, 3, 32, 32),)
    cg = trace(model, x)
    flat = Search(cg, model, x, solver="approx").smallest()
    meter = PlanMeter(cg, x, None)
    unbounded = nested.NestedSearch(cg, meter, 1000)
    unbounded.improve(flat.plan, flat.measured, flat.segment_replayed)
    assert 1000 - unbounded.measurements_left > 2  # left alone it measures more than the cap below
    capped = nested.NestedSearch(cg, meter, 2)
    capped.improve(flat.plan, flat.measured, flat.segment_replayed)
    assert capped.measurements_left == 0  # stopped after two measurements
    assert nested.NestedSearch(cg, meter, 0).improve(flat.plan, flat.measured, []) is None
    sizes = [nested.measurement_budget(n) for n in (10, 500, 1000, 10_000, 30_000)]
    assert sizes == sorted(sizes, reverse=True) and sizes[0] == nested.MEASUREMENTS and sizes[-1] == 0


def test_the_searches_stop_measuring_once_the_planning_allowance_is_spent(monkeypatch, caplog):
    """Every fake step counts its ATen calls against one allowance per planning call; once it is spent the nested
    search measures nothing more and the rewrite keeps the lowest plan measured, whose measured peak is the
    rewritten module's; a budget is still held."""
    from fxplan.costs.trace import trace
    from fxplan.planner import nested, plan_meter
    from fxplan.planner.search import Search

    model = Chain(convs=3)
    x = (torch.randn(16, 3, 32, 32),)
    cg = trace(model, x)
    flat = Search(cg, model, x, solver="approx").smallest()
    work = plan_meter.MeasuredWork(allowance=1)
    search = nested.NestedSearch(cg, plan_meter.PlanMeter(cg, x, None, work), 1000)
    with caplog.at_level(logging.INFO, logger="fxplan"):
        search.improve(flat.plan, flat.measured, flat.segment_replayed)
    assert 1000 - search.measurements_left == 1 and work.spent and work.ops > 0
    assert any("the planning allowance" in r.getMessage() for r in caplog.records)

    untrusting = Search(cg, model, x, solver="approx", trust_replay=False)
    untrusting.smallest()
    assert untrusting.meter.steps > 1  # it measures every canonical plan that may be the smallest
    spent = Search(cg, model, x, solver="approx", trust_replay=False, work=plan_meter.MeasuredWork(allowance=1))
    assert spent.smallest().measured is not None and spent.meter.steps == 1

    lowest = fxplan.rewrite(model, example_inputs=x)
    monkeypatch.setattr(plan_meter, "PLANNING_OPS", 1)
    stopped = fxplan.rewrite(model, example_inputs=x)
    assert stopped.fxplan_measured_peak_bytes == measure_step(stopped, x, fake=True).peak_bytes
    assert lowest.fxplan_measured_peak_bytes <= stopped.fxplan_measured_peak_bytes
    budget = (stopped.fxplan_measured_peak_bytes + measure_step(model, x, fake=True).peak_bytes) // 2
    held = fxplan.rewrite(model, budget_bytes=budget, example_inputs=x)
    assert held.fxplan_measured_peak_bytes <= budget


def _unit_chain(n: int):
    """A cost graph of ``n`` nodes in a chain, each of forward cost 1, and its node names in order."""
    from fxplan.solvers.costgraph import CostGraph

    cg = CostGraph()
    names = [f"n{i}" for i in range(n)]
    for v in names:
        cg.add_node(v, T=1.0)
    cg.add_edges_from(zip(names, names[1:]))
    return cg, names


def test_cheapen_undoes_the_moves_that_do_not_matter_for_the_peak(monkeypatch):
    """With a stub meter whose peak depends only on block 0 being split, the undo pass drops the other
    split and the merge, keeps block 0's split, and measures no more than its cap."""
    from fxplan.planner import nested

    cg, names = _unit_chain(8)
    B = subplans.Block
    split = [B(names[:3], [B(names[:1]), B(names[1:3])]), B(names[3:6], [B(names[3:5]), B(names[5:6])]),
             B(names[6:])]
    search = nested.NestedSearch(cg, None, 10)
    calls = []

    def measure(blocks, replayed=None):
        calls.append(blocks)
        return (100 if blocks[0].sub is not None and blocks[0].names == names[:3] else 120), None

    monkeypatch.setattr(search, "measure", measure)
    monkeypatch.setattr(nested, "sub_plans", lambda cg, names: [])  # undo moves only: see the test below
    start = nested.NestedResult(split, 100, None, nested.recompute_fraction(cg, split))
    got = search.cheapen(start, None)
    assert got.measured == 100 and got.recompute_fraction < start.recompute_fraction
    assert got.blocks[0].sub is not None and all(b.sub is None for b in got.blocks[1:])
    assert len(calls) <= nested.CHEAPEN
    monkeypatch.setattr(nested, "CHEAPEN", 1)
    calls.clear()
    search.cheapen(start, None)
    assert len(calls) == 1


def test_cheapen_hands_nodes_to_the_last_block_and_swaps_sub_plans(monkeypatch):
    """Cheapening also moves a checkpointed block's trailing nodes into its level's last block (not recomputed)
    and gives a split block a cheaper sub-plan of its segment. With a stub meter whose peak is 100 while n1
    is checkpointed alone at the second level and 120 otherwise, the descent ends at the cheapest tree that
    keeps that: [[n0] [n1 n2]] then one block of the rest, with each move's recomputation strictly lower."""
    from fxplan.planner import nested

    cg, names = _unit_chain(8)
    B = subplans.Block
    start_tree = [B(names[:3], [B(names[:2]), B(names[2:3])]), B(names[3:6]), B(names[6:])]
    # n0's split alone keeps the peak; the segment's sub-plans offer it
    monkeypatch.setattr(nested, "sub_plans", lambda cg, seg: [[seg[:1], seg[1:]]] if seg == names[:3] else [])
    search = nested.NestedSearch(cg, None, 10)

    def measure(blocks, replayed=None):
        first = blocks[0]
        ok = first.sub is not None and first.sub[0].names == names[:1] and len(blocks) > 1
        return (100 if ok else 120), None

    monkeypatch.setattr(search, "measure", measure)
    start = nested.NestedResult(start_tree, 100, None, nested.recompute_fraction(cg, start_tree))
    got = search.cheapen(start, None)
    assert got.measured == 100
    assert [b.names for b in got.blocks] == [names[:3], names[3:]]
    assert [b.names for b in got.blocks[0].sub] == [names[:1], names[1:3]]
    assert got.recompute_fraction == nested.recompute_fraction(cg, got.blocks) < start.recompute_fraction


def test_the_search_takes_a_move_that_gains_less_than_min_gain_on_the_way_to_one_that_does(monkeypatch):
    """Two segments peaking together: the first move lowers one (a gain below MIN_GAIN), the next the other. The
    search goes on through the first and keeps the plan after the second; a last move that gains too little is
    not kept."""
    from fxplan.planner import nested
    from fxplan.solvers.costgraph import CostGraph

    cg = CostGraph()
    for v in "abc":
        cg.add_node(v, T=1.0)
    B = subplans.Block
    base = types.SimpleNamespace(segments=[["a"], ["b"], ["c"]])  # all improve() reads of a plan
    peaks = {"": 1000, "a": 995, "ab": 900, "abc": 899}  # by the blocks split so far

    def tree(done: str) -> list:
        return [B([v], [B([v])]) if v in done else B([v]) for v in "abc"]

    def key(blocks) -> str:
        return "".join(b.names[0] for b in blocks if b.sub is not None)

    search = nested.NestedSearch(cg, None, 10)
    monkeypatch.setattr(search, "_moves", lambda blocks, rank: iter([tree(key(blocks) + "abc"[len(key(blocks))])]
                                                                     if len(key(blocks)) < 3 else []))
    monkeypatch.setattr(search, "measure", lambda blocks, replayed=None: (peaks[key(blocks)], None))
    found = search.improve(base, peaks[""], [1, 1, 1])
    assert found is not None and key(found.blocks) == "ab" and found.measured == 900


def test_smallest_and_in_between_budgets_take_the_cheapest_nested_plan_measured():
    """Without a budget and at a budget below every canonical plan, the plan returned is the least
    recomputation among the nested plans measured that fit, and it is the plan its module runs."""
    from fxplan.costs.trace import trace
    from fxplan.planner.search import Search

    model = Chain(convs=3)
    x = (torch.randn(16, 3, 32, 32),)
    from fxplan.planner import nested

    search = Search(trace(model, x), model, x, solver="approx")
    flat, low = search.smallest(), search.lowest()
    pool = search._nested.measured
    assert low.measured < flat.measured and pool
    # a plan of the lowest peak said to recompute less: the one every budget down to that peak must take
    best = min((m for m in pool if m.measured == low.replayed), key=lambda m: m.recompute_fraction)
    pool.append(nested.NestedResult(best.blocks, best.measured, best.code, best.recompute_fraction / 2, best.seed))
    for budget in (low.measured, (low.measured + flat.measured) // 2):
        fits = [m.recompute_fraction for m in pool if m.measured <= budget]
        chosen = search.choose(budget, "time")
        assert chosen.measured <= budget and chosen.recompute == min(fits) < low.recompute
        assert measure_step(search.result(chosen, budget), x, fake=True).peak_bytes == chosen.measured
    assert search.choose(None, "time").recompute == min(fits)
    assert search.choose(None, "memory").recompute == min(fits)


def _shape(plan) -> tuple:
    """A plan's segments and, recursively, its sub-plans' segments."""
    return plan.segments, {k: _shape(v) for k, v in (plan.children or {}).items()}


def test_trusting_the_replay_finds_the_same_plans_with_fewer_fake_steps():
    """Where the replay agrees with the measurements, the nested search ranks by replay: the same lowest
    plan and the same choices at every budget as a search that measures its moves, in fewer fake steps."""
    from fxplan.costs.trace import trace
    from fxplan.planner.search import Search

    model = Chain(convs=5)
    x = (torch.randn(16, 3, 32, 32),)
    cg = trace(model, x)
    results = {}
    for trust in (False, True):
        search = Search(cg, model, x, solver="approx", trust_replay=trust)
        low, flat = search.lowest(), search.smallest()
        assert low.plan.children and low.measured < flat.measured
        budgets = [None, low.measured, (low.measured + flat.measured) // 2]
        chosen = [search.choose(b, "time") for b in budgets]
        results[trust] = [(_shape(c.plan), c.measured, c.recompute) for c in [low, *chosen]], search.meter.steps
    assert results[True][0] == results[False][0]
    assert results[True][1] < results[False][1]


def test_a_lowest_nested_plan_measured_first_vouches_for_the_replay_in_one_fake_step():
    """With nothing measured, the lowest plan's search measures the nested plan it finds by replay first; within
    TRUST of its replay and below every canonical replay, it is the lowest plan after one fake step, the same plan
    (and the same choice without a budget) as where the canonical plan is measured first."""
    from fxplan.costs.trace import trace
    from fxplan.planner.search import Search

    model = Chain(convs=5)
    x = (torch.randn(16, 3, 32, 32),)
    cg = trace(model, x)
    first = Search(cg, model, x, solver="approx")
    low = first.lowest()
    assert low.plan.children and first.meter.steps == 1
    assert [c for c in first.measured_candidates() if not c.plan.children] == []
    canonical_first = Search(cg, model, x, solver="approx")
    flat = canonical_first.smallest()
    assert canonical_first.lowest().measured == low.measured < flat.measured
    assert _shape(canonical_first.lowest().plan) == _shape(low.plan)
    chosen = [s.choose(None, "time") for s in (first, canonical_first)]
    assert [(_shape(c.plan), c.measured, c.recompute) for c in chosen][0] == \
        [(_shape(c.plan), c.measured, c.recompute) for c in chosen][1]


def _nested_replays_under(monkeypatch, fraction: float) -> None:
    """Make the search's replay predict nested plans ``fraction`` below their peak (replayed uncapped)."""
    from fxplan.planner.search import Search

    replayed = Search._replay_tree

    def optimistic(self, blocks, cap=None, base=None):
        peak = replayed(self, blocks)
        return int(peak * (1 - fraction)) if any(b.sub for b in blocks) else peak

    monkeypatch.setattr(Search, "_replay_tree", optimistic)


def test_a_replay_that_misses_nested_plans_is_caught_by_the_measurement(monkeypatch):
    """If the replay under-predicts nested plans, the plan the replay-ranked search finds measures above its
    replay; the search is made again measuring its moves, and its answer is the measuring search's."""
    from fxplan.costs.trace import trace
    from fxplan.planner.search import Search

    model = Chain(convs=3)
    x = (torch.randn(16, 3, 32, 32),)
    cg = trace(model, x)
    honest = Search(cg, model, x, solver="approx", trust_replay=False).lowest()
    _nested_replays_under(monkeypatch, 0.05)
    search = Search(cg, model, x, solver="approx")
    low = search.lowest()
    assert not search.trust_replay  # the measurement caught it
    assert (_shape(low.plan), low.measured) == (_shape(honest.plan), honest.measured)


def test_a_lowest_nested_plan_slightly_above_its_replay_is_kept_without_searching_again(monkeypatch):
    """If the replay under-predicts nested plans by less than NESTED_SLACK, the plan the replay-ranked search finds
    is kept at its measured peak (below every canonical plan): the replay stays trusted and no move is measured."""
    from fxplan.costs.trace import trace
    from fxplan.planner.search import Search
    from fxplan.planner.trust import NESTED_SLACK, TRUST

    model = Chain(convs=3)
    x = (torch.randn(16, 3, 32, 32),)
    cg = trace(model, x)
    _nested_replays_under(monkeypatch, (TRUST + NESTED_SLACK) / 2)
    search = Search(cg, model, x, solver="approx")
    measured = []
    measure = search.meter.measure
    monkeypatch.setattr(search.meter, "measure", lambda segments, children: measured.append(bool(children))
                        or measure(segments, children))
    low = search.lowest()
    assert search.trust_replay and low.plan.children  # kept: a nested plan, the replay still trusted
    assert measured.count(True) == 1  # the nested plan itself, no move
    assert low.replayed < low.measured < search.smallest().measured
    assert low.measured == measure(low.plan.segments, low.plan.children)[0]


def test_a_cheaper_nested_plan_that_misses_its_replay_is_set_aside_and_the_replay_still_trusted():
    """A nested plan chosen by its replay for the smallest peak that measures above it is dropped for the next
    cheapest; the lowest plan, measured, still stands, so the search does not start again measuring. Made here by
    recording a plan that does not fit as if its replay had said it does."""
    from fxplan.costs.trace import trace
    from fxplan.planner.search import Search
    from fxplan.planner.trust import NEGLIGIBLE

    model = Chain(convs=5)
    x = (torch.randn(16, 3, 32, 32),)
    search = Search(model=model, example_inputs=x, cg=trace(model, x), solver="approx")
    low = search.lowest()
    limit = int(low.measured * (1 + NEGLIGIBLE))
    expected = search.choose(None, "time")
    liar = min((m for m in search._nested.measured if m.measured > limit and m.code is None),
               key=lambda m: m.recompute_fraction)
    assert liar.recompute_fraction < expected.recompute
    truth, liar.measured = liar.measured, low.measured  # "replayed" to fit; measured again below
    steps = search.meter.steps
    chosen = search.choose(None, "time")
    assert search.trust_replay and search.meter.steps == steps + 1  # the liar measured, nothing searched again
    assert liar.measured >= truth
    assert (_shape(chosen.plan), chosen.measured) == (_shape(expected.plan), expected.measured)


@pytest.mark.parametrize("name", sorted(AWKWARD))
def test_floor_is_below_every_plan(name):
    """No plan, flat or nested, measures below the physical floor; vanilla is at or above it."""
    from fxplan.measure.floor import physical_floor

    make, make_inputs = AWKWARD[name]
    model, inputs = make(), make_inputs()
    if name == "bn":
        model.shared.momentum = 0.1  # cumulative averaging reads a buffer's value: not fake-measurable
    floor = physical_floor(model, inputs).bytes
    assert measure_step(model, inputs, fake=True).peak_bytes >= floor
    gm = fx.symbolic_trace(model)
    rng = random.Random(3)
    for k in (2, 3):
        segments = random_plan(gm, rng, k)
        for children in ({}, nest(segments, rng, 2)):
            assert measure_step(segment_module(gm, segments, children), inputs, fake=True).peak_bytes >= floor


def test_floor_of_a_chain_is_its_largest_op():
    """Linear layers without bias: the floor is resident + the largest op's operands and results + held grads."""
    from fxplan.measure.floor import physical_floor

    model = nn.Sequential(nn.Linear(100, 400, bias=False), nn.Linear(400, 10, bias=False))
    x = torch.randn(50, 100)
    f = physical_floor(model, (x,))
    assert f.resident_bytes == 4 * (100 * 400 + 400 * 10 + 50 * 100)
    assert f.bytes == f.resident_bytes + f.op_bytes + f.held_bytes
    assert f.bytes <= measure_step(model, (x,), fake=True).peak_bytes
    assert f.op_bytes >= 4 * 50 * 400 * 2  # some op has the hidden activation and its gradient (or itself twice)


class _ConvChain(nn.Module):
    """Convolutions that end two blocks (they keep only their inputs) and a scalar product that keeps nothing."""

    def __init__(self):
        super().__init__()
        for name in ("conv1", "conv2", "conv3", "conv4", "conv5"):
            setattr(self, name, nn.Conv2d(4, 4, 3, padding=1))
        self.bn1, self.relu1, self.relu2 = nn.BatchNorm2d(4), nn.ReLU(), nn.ReLU()

    def forward(self, x):
        x = self.conv2(self.relu1(self.bn1(self.conv1(x))))
        x = self.conv4(self.conv3(x) * 2)
        return self.conv5(self.relu2(x))


class _KernelCount(TorchDispatchMode):
    """Kernels run, by op name (``convolution``, ``relu``, ...): a recomputation that stops before an op runs
    none of its kernel."""

    def __init__(self):
        super().__init__()
        self.calls: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        self.calls[name] = self.calls.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("nested", [False, True])
def test_early_stop_runs_what_subplans_says(nested):
    """The kernels a real step of the rewritten chain runs are the forward's plus what each checkpointed
    block's recomputation runs by fxplan.solvers.subplans.recomputation: a block ending in a convolution stops
    before it, a split block's recomputation runs its checkpointed sub-blocks; early_stop_cost is the rest."""
    from fxplan.costs.trace import trace

    model, x = _ConvChain().train(), torch.randn(2, 4, 8, 8)
    cg = trace(model, (x,))
    segments = [["conv1", "bn1", "relu1", "conv2"], ["conv3", "mul", "conv4"], ["relu2", "conv5"]]
    children = {"0": {"segments": [["conv1", "bn1"], ["relu1", "conv2"]]}} if nested else {}
    blocks = subplans.tree(segments, children)
    facts = subplans.SaveFacts.of(cg.nodes)
    recomputed = dict.fromkeys(cg.nodes, 0)

    def count(level):
        for b in level[:-1]:
            run, unrun = subplans.recomputation(b, facts)
            for v in run:
                recomputed[v] += v != unrun
        for b in level:
            if b.sub is not None:
                count(b.sub)

    count(blocks)
    assert recomputed["conv1"] == (2 if nested else 1) and recomputed["conv2"] == recomputed["conv4"] == 0
    assert recomputed["mul"] == 1 and recomputed["conv5"] == 0
    kernels = {"conv": "convolution", "bn": "native_batch_norm", "relu": "relu", "mul": "mul"}
    runs = []
    for module in (model, segment_module(fx.symbolic_trace(model), segments, children)):
        with _KernelCount() as counted:
            module(x).sum().backward()
        runs.append(counted.calls)
    for prefix, op in kernels.items():
        assert runs[1].get(op, 0) - runs[0].get(op, 0) == sum(n for v, n in recomputed.items() if v.startswith(prefix))
    T = dict.fromkeys(cg.nodes, 1.0)
    # whole blocks: every node of segments 0 and 1 once, segment 0's first sub-block once more when nested
    assert subplans.early_stop_cost(blocks, facts, T) == 7 + 2 * nested - sum(recomputed.values())


class ShiftedTokens(nn.Module):
    """BART's shift of its tokens (a new tensor written in place through two views), then layers: a plan that puts
    the in-place writes and a later read of their tensor in different segments is one the rewriter rejects."""

    def __init__(self):
        super().__init__()
        self.layers = nn.Sequential(*[nn.Sequential(nn.Linear(64, 64), nn.Tanh()) for _ in range(6)])

    def forward(self, x):
        shifted = x.new_zeros(x.shape)
        shifted[:, 1:] = x[:, :-1].clone()
        shifted[:, 0] = 1.0
        return self.layers(shifted * x)


def test_a_search_ranked_by_its_replay_moves_on_from_and_chooses_only_plans_the_rewriter_generates():
    """A search that trusts its replay measures none of its moves; a tree it ranks lowest may be one the rewriter
    rejects. It moves on only from trees the rewriter generates, and chooses among those alone."""
    import sys

    from fxplan.costs.trace import trace
    from fxplan.planner import nested, plan_meter
    from fxplan.planner.search import Search

    model, x = ShiftedTokens(), (torch.randn(32, 64),)
    cg = trace(model, x)
    flat = Search(cg, model, x, solver="approx", trust_replay=False).smallest()
    meter = plan_meter.PlanMeter(cg, x, None)

    def replayed(blocks, cap=None, base=None):  # a replay that ranks finer trees lower, whichever they are
        return int(flat.measured * (1 - 0.0005 * len(repr(blocks))))

    def generated(blocks) -> bool:
        return meter.accepts([b.names for b in blocks], subplans.as_children(blocks))

    search = nested.NestedSearch(cg, meter, 100, replayed=replayed, trusted=True)
    found = search.improve(flat.plan, flat.measured, flat.segment_replayed)
    assert found is not None and generated(found.blocks)
    assert not all(generated(m.blocks) for m in search.measured), "the replay ranked trees the rewriter rejects"
    cheapest, _ = search.cheapest(sys.maxsize - 1)
    assert generated(cheapest.blocks)
