"""The third choice for a saved value: offload it to host memory, and what the copies cost in time.

A value a plan keeps from the forward pass until backward reads it can instead be copied to host memory as soon as
it is saved and copied back before backward reads it (:mod:`fxplan.rewriter.offload` runs it). The device then
holds it only while the forward uses it and again from its prefetch to its last backward read. What it costs is
copy time the step cannot hide: on a CUDA device the copies run on a side stream beside compute, so only the part of
a copy that compute does not cover is exposed; on the CPU host and device are one memory and nothing hides a copy.

This module is the pure part: which values to offload first (:func:`offload_order`) and the time of a set of
offloads (:func:`copy_schedule`), from the cost graph's times and bytes. What is optimal and what is not: the
recomputation plan under the offloads is one of the DP's (Kusumoto et al., section 3 and 4), and how many values to
offload is found by measured search (:mod:`fxplan.planner.offloading`), but the offload choice itself is a heuristic
on top of the plan, not a third state inside the DP: the values are offloaded in the order the forward makes them
(the earliest has the longest forward after it to hide its copy out and is read last in backward, so its copy back
hides behind all the backward before it), as many as the budget needs.

The time model, a simulation of the two copy directions as one queue each (a GPU's copy engines), is this:

* the forward runs its nodes back to back, each taking its forward time; a value's copy out starts when the node
  that makes it ends and the previous copy out is done, and takes ``bytes / link bandwidth``; it delays nothing;
* backward runs the nodes in reverse, each taking ``BACKWARD_FACTOR`` times its forward time (plus its forward time
  again in a recomputed segment); a value is needed when backward reaches the last node that reads it;
* a value's copy back starts when the value is needed (the first one) or when the value offloaded after it is read
  (what the runtime does: it prefetches one value ahead), but not before its copy out is done or the previous copy
  back; backward waits for a value that has not arrived, and that wait is the exposed time.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

Step = TypeVar("Step")

#: Backward time of a node as a multiple of its forward time (two matrix products per forward one, for a linear
#: layer or a convolution: the gradients of the input and of the weight).
BACKWARD_FACTOR = 2.0


@dataclass(frozen=True)
class Offloadable:
    """A value the forward keeps for backward: its node, the bytes its host copy takes, the position in the forward
    order of the node that makes it and of the last node that reads it (backward needs it there first)."""

    name: str
    nbytes: int
    made_at: int
    last_read_at: int


@dataclass(frozen=True)
class CopySchedule:
    """What a set of offloads costs one step: the seconds of all copies (out and back), the seconds of them the step
    waits for (``exposed_seconds``), and the bytes of the host copies."""

    copy_seconds: float
    exposed_seconds: float
    host_bytes: int

    @property
    def hidden_seconds(self) -> float:
        return self.copy_seconds - self.exposed_seconds


def offload_order(values: Sequence[Offloadable]) -> list[Offloadable]:
    """The order in which to offload ``values``: the earliest made first (module docstring)."""
    return sorted(values, key=lambda v: (v.made_at, -v.last_read_at, v.name))


def fewest_fitting(most: Step, count: int, measure: Callable[[int], Step | None],
                     fits: Callable[[Step], bool]) -> Step:
    """The measured step of the fewest of the first ``count`` items (values in offload order, parts of a model)
    whose step ``fits``, found by bisection (the peak falls as more of them are offloaded or planned); ``most``, the
    step with all ``count``, fits. ``measure(k)``: the step with the first ``k``, None where it cannot be made."""
    low, high, best = 0, count, most
    while low < high:
        middle = (low + high) // 2
        step = measure(middle)
        if step is not None and fits(step):
            high, best = middle, step
        else:
            low = middle + 1
    return best


def copy_schedule(values: Sequence[Offloadable], forward_seconds: Sequence[float], link_bytes_per_s: float, *,
                  overlapped: bool, recomputed: Sequence[bool] | None = None) -> CopySchedule:
    """The time of offloading ``values`` in a step whose nodes take ``forward_seconds`` (forward order);
    ``recomputed[i]`` says node ``i`` is recomputed in backward. ``overlapped``: copies run beside compute (a CUDA
    device's side stream); otherwise every copy is exposed (the CPU)."""
    host_bytes = sum(v.nbytes for v in values)
    copy_seconds = 2 * host_bytes / link_bytes_per_s
    if not overlapped or not values:
        return CopySchedule(copy_seconds, copy_seconds, host_bytes)
    made = sorted(values, key=lambda v: v.made_at)
    out_done = _copies_out(made, forward_seconds, link_bytes_per_s)
    exposed = _backward_waits(made, out_done, forward_seconds, link_bytes_per_s, recomputed)
    return CopySchedule(copy_seconds, exposed, host_bytes)


def _copies_out(made: list[Offloadable], forward_seconds: Sequence[float], bandwidth: float) -> list[float]:
    """When each value's copy out is done (``made`` in forward order), from the start of the step."""
    ends, clock = [], 0.0
    for seconds in forward_seconds:
        clock += seconds
        ends.append(clock)
    done, free = [], 0.0
    for v in made:
        free = max(ends[v.made_at], free) + v.nbytes / bandwidth
        done.append(free)
    return done


def _backward_waits(made: list[Offloadable], out_done: list[float], forward_seconds: Sequence[float],
                    bandwidth: float, recomputed: Sequence[bool] | None) -> float:
    """The seconds backward waits for copies back, prefetching one value ahead as the runtime does."""
    clock = sum(forward_seconds)
    by_read: dict[int, list[int]] = {}
    for i, v in enumerate(made):
        by_read.setdefault(v.last_read_at, []).append(i)
    arrival: dict[int, float] = {}
    free, waited = 0.0, 0.0

    def fetch(i: int, now: float) -> None:
        nonlocal free
        if i >= 0 and i not in arrival:
            free = max(now, out_done[i], free) + made[i].nbytes / bandwidth
            arrival[i] = free

    for node in range(len(forward_seconds) - 1, -1, -1):
        for i in sorted(by_read.get(node, ()), reverse=True):
            fetch(i, clock)
            if arrival[i] > clock:
                waited += arrival[i] - clock
                clock = arrival[i]
            earlier = i - 1  # the nearest value saved before it that is not on its way back yet comes next
            while earlier in arrival:
                earlier -= 1
            fetch(earlier, clock)
        extra = forward_seconds[node] if recomputed is not None and recomputed[node] else 0.0
        clock += BACKWARD_FACTOR * forward_seconds[node] + extra
    return waited
