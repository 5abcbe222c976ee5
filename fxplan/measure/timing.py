"""Step times that can be trusted: interleaved rounds, warm-up, fixed threads, medians with their spread.

Wall-clock ratios of a few steps on a shared machine are noise (3 steps at batch 4 on 2 CPU cores gave
0.45x to 2.08x for the same plan). :func:`time_interleaved` is the one timing loop of fxplan (used by
``fxplan compare`` and ``scripts/step_time.py``):

* the thread count is fixed (``torch.set_num_threads``) for the whole measurement;
* the C allocator is made steady (:func:`steady_allocator`): freed memory stays in the process for the
  next step, as a GPU's caching allocator keeps it, whatever ran before in the process;
* warm-up rounds run every method before anything is recorded (allocator, caches, lazy init);
* each round runs every method once, in an order rotated from round to round, so that load on the
  machine and the position in the round hit every method alike;
* a method's ratio to the baseline is taken *per round* (its step over the baseline's step of the same
  round), and reported as the median and interquartile range of those ratios: a ratio whose range
  contains 1.0 is "within noise", never a speed-up or a slow-down.

:func:`batch_for_step` picks a batch at which a step takes long enough (0.5 s by default) for timer
resolution and scheduling jitter not to matter.
"""

from __future__ import annotations

import contextlib
import ctypes
import platform
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from fxplan.errors import FxplanError

#: A step shorter than this (seconds) is too short to time reliably on a shared CPU.
MIN_STEP_SECONDS = 0.5

#: glibc's ``mallopt`` parameters (``malloc.h``) and the values :func:`steady_allocator` pins them to: trim
#: the heap only when 2 GiB at its top are free, and serve every allocation up to 32 MiB (glibc's largest
#: mmap threshold) from it.
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
_TRIM_ABOVE, _LARGEST_MMAP_THRESHOLD = 2**31 - 1, 32 << 20


@dataclass
class Timing:
    """The recorded steps of one method: seconds per round and per-round ratios to the baseline."""

    name: str
    samples: list[float] = field(default_factory=list)
    ratios: list[float] = field(default_factory=list)
    error: BaseException | None = None

    @property
    def median(self) -> float | None:
        return statistics.median(self.samples) if self.samples else None

    @property
    def spread(self) -> float | None:
        """(slowest - fastest) / median of the steps: how much the machine moved the timings."""
        m = self.median
        return (max(self.samples) - min(self.samples)) / m if m else None

    @property
    def ratio(self) -> float | None:
        """Median over rounds of this method's step / the baseline's step in the same round."""
        return statistics.median(self.ratios) if self.ratios else None

    @property
    def ratio_range(self) -> tuple[float, float] | None:
        """Interquartile range of the per-round ratios (min and max with fewer than four rounds)."""
        return quartiles(self.ratios)

    @property
    def within_noise(self) -> bool | None:
        """True if the ratio's range contains 1.0: the method cannot be told from the baseline."""
        r = self.ratio_range
        return None if r is None else r[0] <= 1.0 <= r[1]


def quartiles(values: list[float]) -> tuple[float, float] | None:
    """(first, third) quartile of ``values``; (min, max) when there are fewer than four; None if empty."""
    if not values:
        return None
    if len(values) < 4:
        return min(values), max(values)
    q = statistics.quantiles(values, n=4, method="inclusive")
    return q[0], q[2]


def describe_ratio(ratio: float | None, low: float | None, high: float | None) -> str:
    """``1.12x (1.08-1.17)``, or ``1.01x (0.97-1.05), within noise`` when the range contains 1.0."""
    if ratio is None:
        return "-"
    if low is None or high is None:
        return f"{ratio:.2f}x"
    text = f"{ratio:.2f}x ({low:.2f}-{high:.2f})"
    return text + (", within noise" if low <= 1.0 <= high else "")


@contextlib.contextmanager
def fixed_threads(threads: int | None) -> Iterator[int]:
    """Run the block with ``torch.set_num_threads(threads)`` (None: keep the current count), then restore."""
    before = torch.get_num_threads()
    if threads is not None:
        if threads < 1:
            raise FxplanError(f"threads must be a positive number, got {threads}")
        torch.set_num_threads(threads)
    try:
        yield torch.get_num_threads()
    finally:
        torch.set_num_threads(before)


def steady_allocator() -> bool:
    """Make glibc's malloc keep freed memory for reuse, so a step's time does not depend on the process's
    history; True if it was done (glibc), False elsewhere.

    On the CPU, tensors come from the C library's ``malloc``. glibc adapts its mmap and trim thresholds
    as the process runs and, depending on what was freed before, returns the top of the heap to the
    system when a backward pass frees the activations; the next step then page-faults that memory back in.
    Whether it does so depends on what ran earlier in the process: one vanilla DenseNet-161 step
    (batch 4, 224²) took 1.51 s in one process and 1.17-1.26 s in others, and the cost grows with the
    bytes a step allocates, so it flatters plans with smaller peaks. Pinned thresholds (trim only above
    2 GiB free; heap up to 32 MiB per allocation) keep freed memory in the process, as a GPU's caching
    allocator does.
    Allocations above 32 MiB are still mapped and unmapped each time. The change is process-wide and lasts
    (glibc cannot go back to adaptive thresholds); it changes speed, never results.
    """
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    libc = ctypes.CDLL(None)
    return bool(libc.mallopt(_M_TRIM_THRESHOLD, _TRIM_ABOVE)) and bool(
        libc.mallopt(_M_MMAP_THRESHOLD, _LARGEST_MMAP_THRESHOLD))


def training_step(module: torch.nn.Module, inputs: tuple, loss_fn: Callable[[Any], torch.Tensor],
                  device: torch.device | str = "cpu") -> Callable[[], float]:
    """A function that runs one forward + backward of ``module`` and returns its wall seconds (gradients
    cleared before, the device synchronised around it)."""
    device = torch.device(device)

    def step() -> float:
        module.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        loss_fn(module(*inputs)).backward()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter() - start

    return step


def time_interleaved(steps: dict[str, Callable[[], float]], *, baseline: str | None, rounds: int, warmup: int = 1,
                     threads: int | None = None, on_round: Callable[[str], None] | None = None,
                     ) -> dict[str, Timing]:
    """Time every step function of ``steps`` (name -> function returning its seconds) over ``rounds``
    interleaved rounds after ``warmup`` rounds; module docstring. A step that raises is dropped from
    later rounds and its :class:`Timing` keeps the exception in ``error``. Ratios are to ``baseline``
    (None: no ratios).
    """
    if baseline is not None and baseline not in steps:
        raise FxplanError(f"the baseline {baseline!r} is not among the timed steps ({', '.join(steps)})")
    if rounds < 1 or warmup < 0:
        raise FxplanError(f"need rounds >= 1 and warmup >= 0, got rounds={rounds}, warmup={warmup}")
    timings = {name: Timing(name) for name in steps}
    names = list(steps)
    steady_allocator()
    with fixed_threads(threads):
        for rnd in range(warmup + rounds):
            if on_round:
                on_round("warm-up round" if rnd < warmup else f"round {rnd - warmup + 1}/{rounds}")
            shift = rnd % len(names)
            seconds: dict[str, float] = {}
            for name in names[shift:] + names[:shift]:
                t = timings[name]
                if t.error is not None:
                    continue
                try:
                    seconds[name] = steps[name]()
                except Exception as exc:  # one method failing must not stop the others' timing
                    t.error = exc
            if rnd < warmup:
                continue
            for name, s in seconds.items():
                timings[name].samples.append(s)
                if baseline in seconds and seconds[baseline] > 0:
                    timings[name].ratios.append(s / seconds[baseline])
    return timings


def batch_for_step(step_at: Callable[[int], float], start: int, *, most: int,
                   target: float = MIN_STEP_SECONDS) -> tuple[int, float]:
    """The smallest batch of ``start``, 2·start, 4·start, ... (at most ``most``) whose step, as timed by
    ``step_at(batch)`` (seconds of one step, after a warm-up step), takes at least ``target`` seconds;
    ``most`` if none does. Returns (batch, seconds of its step)."""
    batch = max(1, min(start, most))
    steady_allocator()
    while True:
        step_at(batch)  # warm-up
        seconds = step_at(batch)
        if seconds >= target or batch >= most:
            return batch, seconds
        batch = min(most, batch * 2)


__all__ = ["MIN_STEP_SECONDS", "Timing", "batch_for_step", "describe_ratio", "fixed_threads", "quartiles",
           "steady_allocator", "time_interleaved", "training_step"]
