"""Nested recomputation: plans below the canonical floor, found by measured local search.

The canonical strategy (Kusumoto et al., section 3) computes each node at most twice and keeps every
segment's inputs from the forward pass until that segment's backward. Two things it cannot do set its
floor (docs/rewrite.md): drop a value *inside* a segment's backward and recompute it again when it is
needed (VGG-19: the ``conv1_1`` activation, live through the next ReLU's backward only because
``conv1_2``'s backward needs it right after), and avoid holding a segment's input that only a much
later segment reads again (U-Net: the first level's skip activation, held by the segment that pools
it until the end of backward). Nested plans (:mod:`fxplan.solvers.subplans`, the recursion of Chen et al.
section 4.4 with any lower-set sequence as the inner plan) do both: a segment runs as sub-segments,
every one but the last checkpointed again inside it, so their inputs are kept only while the segment
is recomputed and its backward runs.

The search starts from a canonical plan (the flat search's smallest measured peak) and applies two
moves, measuring results exactly on fake tensors (:func:`fxplan.measure_step`) and taking the move that
lowers the peak most, at most ``ROUNDS`` rounds, until no move lowers it; the plan returned is the last
one that lowered the peak by ``MIN_GAIN`` from the one kept before it (so a move that gains less is
taken on the way, not kept at the end). Where two segments' backwards peak within ``MIN_GAIN`` of each
other, no one move gains ``MIN_GAIN``: the first lowers one of them, the next the other (ResNet-50 at
batch 8, 224²: from Chen's √n plan, 413.9 MiB to 362.9, where a move had to gain 1% at once and none did):

* **split** a segment (at any level) by a plan of its own subgraph: the DP of Kusumoto et al. run on
  the segment's nodes, whose boundary inputs are sources outside the subgraph; the sub-plans taken are
  its time-centric frontier and its memory-centric plan (its memory model does not see the gradients
  arriving at the segment, which is why every candidate is measured instead of predicted);
* **merge** a run of consecutive segments into one segment whose sub-plan is that run, so the inputs
  of the later ones are no longer held from the forward pass.

Moves are generated in order of the base plan's replayed per-segment peaks (segments whose backward is
near the peak first), at most ``MOVES_PER_ROUND`` per round. Each is replayed (:func:`fxplan.planner.replay.replay`
follows nested plans too; a move inside one checkpointed top-level block of a plan of many, from the recorded
replay of the tree it moves: :class:`fxplan.planner.near_replay.NearReplays`) and they are measured lowest replayed
peak first (equal peaks: least recomputation first), only while the replayed peak is within ``TOLERANCE`` of the
measured peak to beat and predicts a gain (``RELATIVE_TOLERANCE``), and until ``PATIENCE`` in a row have not
lowered the round's best, at most ``MEASUREMENTS`` measurements per starting plan (fewer on large graphs), so
planning time stays bounded on graphs with many segments.

Where the replay has predicted every plan measured so far to within ``fxplan.planner.trust.TRUST``, the search
trusts it (``trusted``): moves are ranked by their replayed peaks alone, with the same rules and counts,
and none is measured; the caller measures the plan it takes (:meth:`fxplan.planner.search.Search.lowest`). Each
measurement is a fake step of a rewritten module and its code generation; a replay is a fraction of one.

Once the lowest plan (peak P) is found, :meth:`NestedSearch.cheapen` descends in recomputation at peak
at most P: it undoes the moves that P does not need, hands a checkpointed block's trailing nodes to the
level's last block (which is not recomputed) and gives a split block a cheaper sub-plan, each tree
ranked by its replay (at most ``CHEAPEN`` measurements, ``CHEAPEN_REPLAY_WORK`` replayed nodes). Every
nested plan measured is kept with its peak and recompute fraction, so the planner returns the least
recomputation among those that fit (:meth:`NestedSearch.cheapest`) rather than the lowest one.
"""

from __future__ import annotations

import itertools
import logging
import math
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, replace

from fxplan.common.console import format_count
from fxplan.errors import BudgetError, FxplanError
from fxplan.planner.plan_meter import PlanMeter
from fxplan.planner.trust import RELATIVE_TOLERANCE, TOLERANCE
from fxplan.solvers import dp, subplans
from fxplan.solvers.costgraph import CostGraph
from fxplan.solvers.plans import Plan
from fxplan.solvers.subplans import Block
from fxplan.solvers.sweep_model import SweepModel

logger = logging.getLogger("fxplan")

#: Most rounds of moves, and most moves measured per round.
ROUNDS, MOVES_PER_ROUND = 6, 12

#: A round ends once this many of its moves in a row have not lowered its best peak. Each measurement is a
#: fake step of a rewritten module, which on large graphs takes seconds, and a round that gains nothing
#: (the last one, always) measured all MOVES_PER_ROUND. On VGG-19 and U-Net every gain came within a
#: round's first 6 moves, and the plans found are the same (docs/planner.md).
PATIENCE = 6

#: Most candidates one search from one starting plan measures: MEASUREMENTS, and fewer on graphs of more
#: than MEASUREMENT_WORK / MEASUREMENTS nodes (each measurement is a fake step of a rewritten module, whose
#: time grows with the graph: :func:`measurement_budget`). Counts, not seconds, so that results do not
#: depend on the machine's load; per starting plan, so that a search from Chen's smallest plan ends where
#: ``solver="chen"``'s own does whatever other plans were searched before it. ResNet-50 at batch 96 uses
#: 11, 23 and 13 from its three starting plans; a 1,000-node GPT-2 took over 50 and 5 minutes uncapped.
MEASUREMENTS, MEASUREMENT_WORK = 48, 24_000

#: A plan is kept only if it lowers the measured peak by at least this fraction from the plan kept before it:
#: smaller gains cost a recomputation and minutes of search each (ResNet-50 at batch 96: 2.4% in 5 rounds,
#: 405 s). Moves that gain less are taken on the way to one that does (module docstring).
MIN_GAIN = 0.01

#: Most measurements spent, once the smallest peak P is found, on trees that recompute less at peak at most P
#: (:meth:`NestedSearch.cheapen`), and most replays, counted in nodes replayed (a replay's time grows with the
#: graph): ResNet-50 at batch 16, 112² (175 nodes) took 229 replays, 0.5 s, to go from 1.53 to 1.02 forward
#: passes recomputed at the same peak.
CHEAPEN, CHEAPEN_REPLAY_WORK = 16, 200_000

#: How many trailing nodes of a checkpointed block a cheapening move hands to its level's last block.
SHIFTS = (1, 2, 4, 8, 16)

#: PATIENCE when moves are measured lowest replayed peak first: the moves that lower the peak come first.
REPLAYED_PATIENCE = 2

#: The searches from one solver's starting plans together measure at most this many times one search's budget.
#: Where a local search ends depends on where it starts (ResNet-50 at batch 8: 363.1 MB from one of
#: Chen's plans, 395.4 MB from another that measures the same), so every starting plan is searched, not
#: only the first that lowers anything, within this budget.
SEEDS_MEASUREMENTS = 1

#: Sub-plans taken from a segment's DP frontier (besides its memory-centric plan), longest merged run, and
#: most two-segment cuts tried per segment.
SUB_PLANS, MERGE_RUN, CUTS = 6, 3, 8


def measurement_budget(nodes: int) -> int:
    """How many candidates the nested search measures on a graph of ``nodes`` nodes (0: none)."""
    return min(MEASUREMENTS, MEASUREMENT_WORK // max(nodes, 1))


@dataclass
class NestedResult:
    """A nested plan the search found: its blocks, measured peak, generated code and recompute fraction (``code``
    None: ``measured`` is the replayed peak of a search that trusts the replay, not a measurement), and the
    canonical plan its search started from (``seed``), where the search keeps it among those it measured."""

    blocks: list[Block]
    measured: int
    code: str | None
    recompute_fraction: float
    seed: Plan | None = None

    def plan(self, cg: CostGraph, base: Plan) -> Plan:
        """``base`` with this result's segments, sub-plans (as ``children``), recomputation and measured peak."""
        return replace(_as_plan(cg, self.blocks, base, set()), recompute_fraction=self.recompute_fraction,
                       strategy=f"{base.strategy}+nested", predicted_peak_bytes=self.measured,
                       measured_peak_bytes=None if self.code is None else self.measured)


def _as_plan(cg: CostGraph, blocks: list[Block], base: Plan, before: set[str]) -> Plan:
    """A Plan of ``blocks`` (nodes in ``before`` run earlier): lower sets and boundaries within the whole graph."""
    segments, lower, boundaries, children = [], [], [], {}
    done = set(before)
    for i, b in enumerate(blocks):
        if b.sub is not None:
            children[str(i)] = _as_plan(cg, b.sub, base, done)
        done |= set(b.names)
        segments.append(b.names)
        lower.append([v for s in segments for v in s])
        boundaries.append([v for v in b.names if any(w not in done for w in cg.successors(v))])
    return replace(base, segments=segments, lower_sets=lower, boundaries=boundaries, children=children,
                   segment_peak_bytes=[], segment_T=[cg.total_T(s) for s in segments], strategy="nested",
                   memory_model="measured", predicted_peak_bytes=0, measured_peak_bytes=None)


def recompute_fraction(cg: CostGraph, blocks: list[Block], recomputed_above: int = 0,
                       T: Mapping[str, float] | None = None) -> float:
    """Forward cost recomputed per step ÷ one forward pass: each node counts once per checkpointed block
    (at any level) that contains it, since each such block re-runs it in its backward. At every level the
    last block is not checkpointed by itself (:mod:`fxplan.rewriter.codegen`). ``T``: the nodes' forward costs, read
    once from ``cg`` by a caller that prices many trees (:class:`NestedSearch`: a plain dict is read many times
    faster than the graph)."""
    T = {v: cg.nodes[v]["T"] for v in cg.nodes} if T is None else T
    return _recomputed(blocks, recomputed_above, T) / (sum(T.values()) or 1.0)


def _recomputed(blocks: list[Block], recomputed_above: int, T: Mapping[str, float]) -> float:
    cost = 0.0
    for i, b in enumerate(blocks):
        times = recomputed_above + (i < len(blocks) - 1)
        if b.sub is None:
            cost += times * sum(T[v] for v in b.names)
        else:
            cost += _recomputed(b.sub, times, T)
    return cost


def sub_plans(cg: CostGraph, names: list[str]) -> list[list[list[str]]]:
    """Plans (segment lists) of the subgraph on ``names``: two-segment cuts of its node order (``names``
    is topologically ordered, so every prefix is a lower set) at up to ``CUTS`` places, then the
    approximate DP's time-centric frontier from the largest to the smallest predicted peak and its
    memory-centric plan. Cuts come first: the DP's memory model does not see the gradients arriving at
    the segment, and a cut right after the value a backward needs next is what lowers VGG-19's floor."""
    n = len(names)
    cuts = sorted({1 + (n - 1) * j // CUTS for j in range(CUTS)} - {n})
    found: list[list[list[str]]] = [[names[:c], names[c:]] for c in cuts]
    keep = set(names)
    sub = CostGraph()
    for v in names:
        sub.add_node(v, **cg.nodes[v])
    sub.add_edges_from((u, w) for u, w in cg.edges(names) if w in keep)
    model = SweepModel()

    def add(p: Plan) -> None:
        if len(p.segments) > 1 and p.segments not in found:
            found.append(p.segments)

    try:
        lo = dp.min_activation_bytes(sub, memory_model=model)
        hi = dp.solve(sub, None, strategy="memory", memory_model=model)
        add(hi)
        top = dp.solve(sub, 2**62, strategy="time", memory_model=model).predicted_peak_bytes
        for j in range(SUB_PLANS):
            budget = int(lo + (top - lo) * j / max(1, SUB_PLANS - 1))
            add(dp.solve(sub, budget, strategy="time", memory_model=model))
    except (BudgetError, FxplanError) as exc:  # a subgraph the DP cannot plan is simply not split
        logger.debug("no sub-plan for a segment of %s: %s", format_count(len(names), "node"), exc)
    return found


def _levels(blocks: list[Block]) -> Iterator[list[Block]]:
    """Every list of sibling blocks in the tree, outermost first."""
    yield blocks
    for b in blocks:
        if b.sub is not None:
            yield from _levels(b.sub)


def _copy(blocks: list[Block]) -> list[Block]:
    return [Block(list(b.names), None if b.sub is None else _copy(b.sub)) for b in blocks]


def _edited(blocks: list[Block], li: int, edit: Callable[[list[Block]], None]) -> list[Block]:
    """A copy of ``blocks`` whose ``li``-th level (in :func:`_levels` order) ``edit`` has changed in place."""
    new = _copy(blocks)
    edit(list(_levels(new))[li])
    return new


def _simpler(blocks: list[Block]) -> Iterator[list[Block]]:
    """Trees one undo away from ``blocks``: each split block unsplit, and each split block dissolved
    into its sub-blocks (undoing a merge); both recompute less (a node leaves a checkpoint level)."""
    for li, level in enumerate(_levels(blocks)):
        for i, b in enumerate(level):
            if b.sub is None:
                continue
            yield _edited(blocks, li, lambda at, i=i: at.__setitem__(slice(i, i + 1), at[i].sub))
            yield _edited(blocks, li, lambda at, i=i: setattr(at[i], "sub", None))


def _handed_on(blocks: list[Block]) -> Iterator[list[Block]]:
    """Trees in which the level's second-to-last block, if flat, hands its last ``SHIFTS`` nodes (or all of
    them: a merge) to the level's last block, if flat: those nodes are then not recomputed at that level."""
    for li, level in enumerate(_levels(blocks)):
        if len(level) < 2 or level[-2].sub is not None or level[-1].sub is not None:
            continue
        ahead = level[-2].names
        for k in sorted({k for k in SHIFTS if k < len(ahead)} | {len(ahead)}):
            def shift(at: list[Block], k: int = k) -> None:
                moved = at[-2].names[len(at[-2].names) - k:]
                at[-1].names = moved + at[-1].names
                del at[-2].names[len(at[-2].names) - k:]
                if not at[-2].names:
                    del at[-2]
            yield _edited(blocks, li, shift)


class NestedSearch:
    """Local search over nested plans from a canonical plan (module docstring)."""

    def __init__(self, cg: CostGraph, meter: PlanMeter, max_measurements: int | None = None,
                 replayed: Callable[[list[Block], int | None], int] | None = None, trusted: bool = False):
        self.cg, self.meter = cg, meter
        #: the predicted peak of a tree (:func:`fxplan.planner.replay.replay`), or a lower bound above its cap where a
        #: cap is given (:class:`fxplan.planner.replay.AboveCap`); None: every tree is measured
        self.replayed = replayed
        #: rank trees by their replayed peaks instead of measuring them (module docstring): every peak this
        #: search reports is then a replayed one, and its results carry no code
        self.trusted = trusted and replayed is not None
        self._sub_plans: dict[tuple[str, ...], list[list[list[str]]]] = {}
        self.max_measurements = (measurement_budget(cg.number_of_nodes()) if max_measurements is None
                                 else max_measurements)
        self.measurements_left = self.max_measurements
        self.start_group()
        #: every nested plan measured, whatever its peak: the plans :meth:`cheapest` chooses from
        self.measured: list[NestedResult] = []
        self._seed: Plan | None = None  # the starting plan of the current improve()
        self._T = {v: cg.nodes[v]["T"] for v in cg.nodes}  # forward costs, read by every tree priced

    def _recompute(self, blocks: list[Block]) -> float:
        """:func:`recompute_fraction` of a tree, from the costs read once."""
        return recompute_fraction(self.cg, blocks, T=self._T)

    @property
    def spent(self) -> bool:
        """Whether the planning call's allowance of fake steps is spent
        (:data:`fxplan.planner.plan_meter.PLANNING_OPS`): this search then ends, though it may rank by replay alone
        (the replays of a graph that large take seconds too, and the plan it found would be measured)."""
        return self.meter is not None and self.meter.work.spent

    def start_group(self) -> None:
        """Give the next :meth:`improve` calls together SEEDS_MEASUREMENTS times one call's measurements (the
        budget search starts a group per solver)."""
        self.total_left = SEEDS_MEASUREMENTS * self.max_measurements

    def measure(self, blocks: list[Block], replayed: int | None = None) -> tuple[int, str | None] | None:
        """The measured peak and generated code of a tree (None if the rewriter rejects it); its replayed
        peak (``replayed`` if given) and no code where the search trusts the replay."""
        self.measurements_left -= 1
        self.total_left -= 1
        if self.trusted:
            got = self.replayed(blocks, None) if replayed is None else replayed, None
        else:
            got = self.meter.measure([b.names for b in blocks], subplans.as_children(blocks))
        if got is not None and subplans.depth(blocks) > 1:
            self.measured.append(NestedResult(blocks, got[0], got[1], self._recompute(blocks), self._seed))
        return got

    def _generated(self, blocks: list[Block]) -> bool:
        """Whether the rewriter generates the tree's module: known of a measured tree (:meth:`measure` is None
        otherwise), checked for one the search judges by its replay, before the search moves on from it."""
        return not self.trusted or self.meter.accepts([b.names for b in blocks], subplans.as_children(blocks))

    def cheapen(self, found: NestedResult, seed: Plan) -> NestedResult:
        """A plan of measured peak at most ``found``'s that recomputes less, if the cheapening moves find one.

        The local search takes the move that lowers the peak most, and some of the moves it took on the way
        lower a peak that a later move lowered further, or split a block more finely than the peak needs:
        recomputation that buys nothing. Greedy descent in recomputation: of the trees one cheapening move
        away (:meth:`_cheaper`), least recomputation first, the first whose replay may keep the peak
        (``_may_beat``) and whose measured peak (replayed where the search trusts the replay) is at most
        ``found``'s is taken, and the descent goes on from it; at most ``CHEAPEN`` measurements and
        ``CHEAPEN_REPLAY_WORK`` replayed nodes.
        """
        best, left, self._seed = found, CHEAPEN, seed
        replays_left = CHEAPEN_REPLAY_WORK // max(self.cg.number_of_nodes(), 1)
        bar = self._replayed(found.blocks)
        cap = math.floor(min(found.measured * (1 + TOLERANCE), bar * (1 + RELATIVE_TOLERANCE)))  # _may_beat's
        while left > 0 and replays_left > 0 and not self.spent:
            options = sorted((rf, n, t) for n, t in enumerate(self._cheaper(best.blocks))
                             if (rf := self._recompute(t)) < best.recompute_fraction)
            for rf, _, tree in options:
                if left <= 0 or replays_left <= 0 or self.spent:
                    break
                replays_left -= self.replayed is not None
                predicted = self._replayed(tree, cap, best.blocks)
                if not self._may_beat(predicted, found.measured, bar):
                    continue
                left -= not self.trusted
                got = self.measure(tree, predicted)
                if got is not None and got[0] <= found.measured and self._generated(tree):
                    best = NestedResult(tree, got[0], got[1], rf)
                    break
            else:
                break
        return best

    def _cheaper(self, blocks: list[Block]) -> Iterator[list[Block]]:
        """Trees one cheapening move from ``blocks``: an undo (:func:`_simpler`), nodes handed to a level's last
        block (:func:`_handed_on`), or a split block given another of its segment's sub-plans (:func:`sub_plans`)."""
        yield from _simpler(blocks)
        yield from _handed_on(blocks)
        for li, level in enumerate(_levels(blocks)):
            for i, b in enumerate(level):
                if b.sub is None:
                    continue
                for split in self._segment_plans(b.names):
                    yield _edited(blocks, li, lambda at, i=i, split=split: setattr(
                        at[i], "sub", [Block(list(s)) for s in split]))

    def _segment_plans(self, names: list[str]) -> list[list[list[str]]]:
        key = tuple(names)
        if key not in self._sub_plans:
            self._sub_plans[key] = sub_plans(self.cg, names)
        return self._sub_plans[key]

    def correct(self, blocks_repr: str, measured: int) -> None:
        """Record the measured peak of the tree whose ``repr`` is ``blocks_repr``, taken before from its replay
        (a search that trusts the replay): :meth:`cheapest` then judges it by what it measured."""
        for m in self.measured:
            if repr(m.blocks) == blocks_repr:
                m.measured = measured

    def cheapest(self, limit: int) -> tuple[NestedResult, Plan] | None:
        """The measured nested plan of least recomputation whose peak is at most ``limit`` (ties: the lower
        peak), and the plan its search started from; None if none fits."""
        for m in sorted((m for m in self.measured if m.measured <= limit),
                        key=lambda m: (m.recompute_fraction, m.measured)):
            if m.code is not None or self._generated(m.blocks):
                return m, m.seed
            m.measured = sys.maxsize  # replayed, and the rewriter rejects it
        return None

    def _replayed(self, blocks: list[Block], cap: int | None = None, base: list[Block] | None = None) -> int:
        """The replayed peak of ``blocks`` (0 without a replay); above ``cap``, a lower bound of it above ``cap``:
        a tree that cannot pass :meth:`_may_beat` need not be replayed to its end. ``base``: the tree ``blocks``
        is one move from, whose replay the move's may start from (:class:`fxplan.planner.near_replay.NearReplays`)."""
        return 0 if self.replayed is None else self.replayed(blocks, cap, base)

    def _may_beat(self, predicted: int, bar: float, replayed_bar: float, gain: bool = False) -> bool:
        """False if a tree replayed at ``predicted`` cannot measure at most ``bar`` (a measured peak to beat,
        whose plan replays at ``replayed_bar``) unless the replay errs beyond ``TOLERANCE`` or
        ``RELATIVE_TOLERANCE``; with ``gain``, also unless the replay predicts a peak below ``replayed_bar``.
        Always True without a replay."""
        if self.replayed is None:
            return True
        if gain and predicted >= replayed_bar:
            return False
        return predicted <= bar * (1 + TOLERANCE) and predicted <= replayed_bar * (1 + RELATIVE_TOLERANCE)

    def _promising(self, trees: Iterable[list[Block]], cap: int, base: list[Block]) -> list[tuple[int, list[Block]]]:
        """``trees`` (one move from ``base``) with their replayed peaks, lowest first, equal peaks least
        recomputation first (in their own order, all 0, without a replay); a peak above ``cap`` is a lower bound of
        it (above ``cap``)."""
        if self.replayed is None:
            return [(0, t) for t in trees]
        scored = [(self._replayed(t, cap, base), self._recompute(t), n, t) for n, t in enumerate(trees)]
        return [(peak, t) for peak, _, _, t in sorted(scored, key=lambda x: x[:3])]

    def _moves(self, blocks: list[Block], rank: dict[str, int]) -> Iterator[list[Block]]:
        """Trees one move away from ``blocks``, most promising first (``rank``: node -> priority, 0 best);
        a segment's sub-plans are computed only when its turn comes."""
        moves: list[tuple[int, int, int, int]] = []  # (priority, level, i, j): split i if j < 0, else merge i..j
        for li, level in enumerate(_levels(blocks)):
            prio = [min(rank.get(v, len(rank)) for v in b.names) for b in level]
            for i, b in enumerate(level):
                if b.sub is None and len(b.names) > 1:
                    moves.append((prio[i], li, i, -1))
                # a run that ends with its level's last block is not checkpointed by itself: nothing changes
                for j in range(i + 1, min(len(level) - 1, i + MERGE_RUN)):
                    moves.append((min(prio[i:j + 1]), li, i, j))
        moves.sort()
        for _, li, i, j in moves:
            if j >= 0:
                yield self._apply(blocks, li, i, j, None)
                continue
            for p in self._segment_plans(list(_levels(blocks))[li][i].names):
                yield self._apply(blocks, li, i, i, p)

    @staticmethod
    def _apply(blocks: list[Block], li: int, i: int, j: int, split: list[list[str]] | None) -> list[Block]:
        new = _copy(blocks)
        level = list(_levels(new))[li]
        if split is not None:
            level[i].sub = [Block(list(s)) for s in split]
        else:
            run = level[i:j + 1]
            level[i:j + 1] = [Block([v for b in run for v in b.names], run)]
        return new

    def improve(self, base: Plan, base_measured: int, segment_peaks: list[int]) -> NestedResult | None:
        """The nested plan of least measured peak reachable from ``base`` by the moves, if lower than
        ``base_measured``; None if no move lowers it. Each call measures at most ``max_measurements``."""
        self.measurements_left, self._seed = self.max_measurements, base
        order = sorted(range(len(base.segments)), key=lambda i: -segment_peaks[i]) if segment_peaks else []
        rank = {v: r for r, i in enumerate(order) for v in base.segments[i]}
        best_blocks = [Block(list(s)) for s in base.segments]
        best, code, kept = base_measured, None, None
        best_replayed = self._replayed(best_blocks)
        for _ in range(ROUNDS):
            round_best, idle = None, 0  # (measured, code, tree, replayed)
            patience = PATIENCE if self.replayed is None else REPLAYED_PATIENCE
            # a move must replay below the best tree's replayed peak (_may_beat's gain): replays stop above it
            moves = itertools.islice(self._moves(best_blocks, rank), MOVES_PER_ROUND)
            for predicted, cand in self._promising(moves, best_replayed - 1, best_blocks):
                bar, replayed_bar = (best, best_replayed) if round_best is None else (round_best[0], round_best[3])
                if idle == patience or min(self.measurements_left, self.total_left) <= 0 or self.spent \
                        or not self._may_beat(predicted, bar, replayed_bar, gain=True):
                    break
                got = self.measure(cand, predicted)
                idle += 1
                if got is not None and got[0] < bar and self._generated(cand):
                    round_best, idle = (got[0], got[1], cand, predicted), 0
            if round_best is None:
                break
            best, code, best_blocks, best_replayed = round_best
            logger.debug("nested: %s peak %d bytes, %d measurements left", "replayed" if self.trusted else "measured",
                         best, self.measurements_left)
            if best <= (base_measured if kept is None else kept.measured) * (1 - MIN_GAIN):
                kept = NestedResult(best_blocks, best, code, self._recompute(best_blocks))
        return kept
