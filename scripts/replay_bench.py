"""The replay's speed: every replay a rewrite makes, re-run by the current code and by an earlier revision's.

Usage: python scripts/replay_bench.py MODEL [--budget F] [--reference d8d5990] [--rounds 3]

MODEL is a name of scripts/rewrite_scale.py (``synthetic:N``, ``gpt2:L``, a zoo name). ``fxplan.rewrite(model,
None)`` runs once (and at ``--budget`` times the plain step's peak, if given) with
:func:`fxplan.planner.replay.replay_blocks` recorded: cost graph, step model, plan and cap of each call. Then the
recorded calls are replayed by the working tree's :mod:`fxplan.planner.replay` and by the one of ``--reference`` (git
revision; its other modules are the working tree's), in alternating rounds in this process, and their results
compared (peaks, per-segment peaks, stopped replays). Prints seconds per round for each, and how many results differ
(0 expected: a faster replay must predict the same peaks).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import fxplan
from fxplan.planner import near_replay, replay

sys.path.insert(0, str(Path(__file__).resolve().parent))
from reference_engine import module  # noqa: E402
from rewrite_scale import build  # noqa: E402


def recorded_replays(name: str, budget: float | None) -> list[tuple]:
    """The arguments of every replay the rewrites of ``name`` make."""
    calls, current = [], replay.replay_blocks

    def recording(cg, sm, blocks, cap=None):
        calls.append((cg, sm, blocks, cap))
        return current(cg, sm, blocks, cap)

    model, inputs, loss = build(name, 8)
    near_replay.replay_blocks = replay.replay_blocks = recording  # the nested search's replays, and the candidates'
    try:
        if budget is not None:
            peak = fxplan.measure_step(model, inputs, fake=True, loss_fn=loss).peak_bytes
            fxplan.rewrite(model, budget_bytes=int(budget * peak), example_inputs=inputs, loss_fn=loss)
        fxplan.rewrite(model, None, example_inputs=inputs, loss_fn=loss)
    finally:
        near_replay.replay_blocks = replay.replay_blocks = current
    return calls


def outcome(result) -> tuple:
    return type(result).__name__, result.peak_bytes, getattr(result, "segment_peak_bytes", None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--budget", type=float, default=None, help="also rewrite at this fraction of the plain peak")
    parser.add_argument("--reference", default="d8d5990")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    calls = recorded_replays(args.model, args.budget)
    engines = {"current": replay.replay_blocks, args.reference: module(args.reference, "replay").replay_blocks}
    seconds: dict[str, list[float]] = {label: [] for label in engines}
    results: dict[str, list[tuple]] = {}
    for _ in range(args.rounds):
        for label, run in engines.items():
            start = time.perf_counter()
            results[label] = [outcome(run(*call)) for call in calls]
            seconds[label].append(time.perf_counter() - start)
    differ = sum(a != b for a, b in zip(*results.values()))
    stopped = sum(call[3] is not None for call in calls)
    print(f"{args.model}: {len(calls)} replays ({stopped} with a cap); seconds per round, median [range]:")
    for label, xs in seconds.items():
        print(f"  {label:>10}: {statistics.median(xs):.2f} [{min(xs):.2f}-{max(xs):.2f}]")
    print(f"  results that differ: {differ}")


if __name__ == "__main__":
    main()
