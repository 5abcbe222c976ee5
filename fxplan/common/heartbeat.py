"""Progress of long planning on the ``fxplan`` logger: a line at INFO at least every ``HEARTBEAT_S`` seconds.

Planning a large model takes minutes, most of it inside one search that logs nothing until it ends. The entry
points run their planning inside :func:`beating`; the stages inside call :func:`stage` to say what they are doing
and :func:`measured` for each plan measured, and a background thread logs, whenever ``HEARTBEAT_S`` seconds
pass, ``fxplan: planning MambaForCausalLM, 20 s so far: searching nested plans (12 plans measured on fake
tensors)``. Outside :func:`beating` both calls do nothing; a :func:`beating` inside another adds no second line.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Iterator

logger = logging.getLogger("fxplan")

#: Most seconds between two progress lines of one planning call.
HEARTBEAT_S = 10.0


class _Beat:
    """What one planning call is doing now (written by the planning thread, read by the beating one)."""

    def __init__(self, what: str):
        self.what, self.stage, self.measured = what, "starting", 0
        self.start = time.perf_counter()

    def line(self) -> str:
        plans = f" ({self.measured} plan{'s' if self.measured != 1 else ''} measured on fake tensors)" \
            if self.measured else ""
        return f"fxplan: {self.what}, {time.perf_counter() - self.start:.0f} s so far: {self.stage}{plans}"


_local = threading.local()  # per planning thread: two threads planning at once each get their own lines


def _beats() -> list[_Beat]:
    return _local.__dict__.setdefault("beats", [])


@contextlib.contextmanager
def beating(what: str, every_s: float | None = None) -> Iterator[None]:
    """Log the planning call's stage every ``every_s`` seconds (None: ``HEARTBEAT_S``) while the block runs
    (``what``: ``planning GPT2LMHeadModel``)."""
    every_s = HEARTBEAT_S if every_s is None else every_s
    beats = _beats()
    if beats:  # planning inside planning (a part of a model): the outer call's lines go on
        yield
        return
    beat, done = _Beat(what), threading.Event()

    def run() -> None:
        while not done.wait(every_s):
            logger.info(beat.line())

    thread = threading.Thread(target=run, name="fxplan-heartbeat", daemon=True)
    beats.append(beat)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()
        beats.remove(beat)


def stage(text: str) -> None:
    """Say what the planning call is doing now (``searching nested plans``)."""
    beats = _beats()
    if beats:
        beats[-1].stage = text


def measured() -> None:
    """Count one plan measured on fake tensors."""
    beats = _beats()
    if beats:
        beats[-1].measured += 1
