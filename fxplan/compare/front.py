"""The measured memory/step-time front of one network in ``fxplan compare``.

Every method that ran a real step is a point: its peak at the small batch against vanilla's (one meter
for all methods, torch.compile included) and its step-time ratio (median over interleaved rounds,
:mod:`fxplan.measure.timing`). fxplan's budget sweep (``approx-time@P``, ``chen@P`` and the smallest-budget
plans), torch.compile's ``activation_memory_budget`` points, ``checkpoint_sequential`` and, for
transformers, Hugging Face's checkpointing share these axes. A point is on the front when no other point
is at most as large in peak *and* at most as slow (one of the two strictly). A point whose ratio range
contains the other's median is not told apart from it by the timings: :func:`front_rows` says so.
"""

from __future__ import annotations

from collections.abc import Sequence

from fxplan.compare.driver import Row


def points(rows: Sequence[Row]) -> list[Row]:
    """The rows with both a small-batch peak and a time ratio, by increasing peak (ties: faster first)."""
    pts = [r for r in rows if r.status == "ok" and r.small_reduction is not None and r.time_ratio is not None]
    return sorted(pts, key=lambda r: (-r.small_reduction, r.time_ratio))


def dominates(a: Row, b: Row) -> bool:
    """True if ``a`` needs no more memory than ``b`` and is no slower, and is better in one of the two."""
    no_worse = a.small_reduction >= b.small_reduction and a.time_ratio <= b.time_ratio
    better = a.small_reduction > b.small_reduction or a.time_ratio < b.time_ratio
    return no_worse and better


def front(rows: Sequence[Row]) -> list[Row]:
    """The points no other point dominates, by increasing peak."""
    pts = points(rows)
    return [r for r in pts if not any(dominates(o, r) for o in pts if o is not r)]


def front_rows(rows: Sequence[Row]) -> tuple[list[str], list[list[str]]]:
    """(header, rows) of the front table: every point, whether it is on the front, and which point
    dominates it (with "within noise" when its ratio range contains the dominating point's ratio)."""
    pts = points(rows)
    on = {id(r) for r in front(rows)}
    out = []
    for r in pts:
        beaten = "-"
        if id(r) not in on:
            by = min((o for o in pts if dominates(o, r)), key=lambda o: o.time_ratio)
            close = None not in (r.ratio_low, r.ratio_high) and r.ratio_low <= by.time_ratio <= r.ratio_high
            beaten = by.method + (" (within noise)" if close else "")
        low, high = r.ratio_low, r.ratio_high
        spread = f"{low:.2f}-{high:.2f}" if low is not None and high is not None else "-"
        out.append([r.method, r.family, f"{-100 * r.small_reduction:+.0f}%", f"{r.time_ratio:.2f}x", spread,
                    "yes" if id(r) in on else "no", beaten])
    header = ["method", "family", "peak vs vanilla (small batch)", "step-time ratio", "ratio IQR", "on the front",
              "dominated by"]
    return header, out


__all__ = ["dominates", "front", "front_rows", "points"]
