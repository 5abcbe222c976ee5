"""Terminal output of the command line and scripts: progress lines, aligned tables, native log filtering.

Progress goes to stderr and results to stdout, so ``fxplan compare ... > table.txt`` keeps only results.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from typing import TextIO

#: Seconds of silence after which a running step prints that it is still working.
HEARTBEAT_S = 60.0


class Progress:
    """Prints ``step ... done (1.2 s)`` lines to stderr so that long work shows it is alive.

    Inside a step, :meth:`Step.update` prints an intermediate line (e.g. ``round 2/4``), and a step that
    prints nothing for ``heartbeat_s`` seconds prints ``still working`` with the time so far.
    """

    def __init__(self, quiet: bool = False, *, stream: TextIO | None = None, heartbeat_s: float = HEARTBEAT_S):
        self.quiet = quiet
        self.stream = stream
        self.heartbeat_s = heartbeat_s

    def step(self, what: str) -> Step:
        return Step(what, None if self.quiet else (self.stream or sys.stderr), self.heartbeat_s)


class Step:
    """One step of :class:`Progress` (a context manager); silent when ``stream`` is None.

    A step that raises ends with ``failed``, or with the exception's ``progress_status`` attribute
    (``not applicable``, ``timed out``): not every exception is a failure of the run.
    """

    def __init__(self, what: str, stream: TextIO | None, heartbeat_s: float):
        self.what, self.stream, self.heartbeat_s = what, stream, heartbeat_s
        self._lock = threading.Lock()
        self._line_open = False
        self._last_output = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> Step:
        self.start = self._last_output = time.perf_counter()
        if self.stream is not None:
            self._write(f"{self.what} ...", end="")
            self._line_open = True
            if self.heartbeat_s > 0:
                self._thread = threading.Thread(target=self._heartbeat, daemon=True)
                self._thread.start()
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if self.stream is not None:
            status = "done" if exc_type is None else getattr(exc, "progress_status", "failed")
            with self._lock:
                prefix = " " if self._line_open else f"{self.what}: "
                self._write(f"{prefix}{status} ({self.elapsed():.1f} s)")
        return False

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def update(self, text: str) -> None:
        """Print an intermediate line of this step: ``  what: text (12.3 s)``."""
        if self.stream is None:
            return
        with self._lock:
            self._write(("\n" if self._line_open else "") + f"  {self.what}: {text} ({self.elapsed():.1f} s)")
            self._line_open = False

    def _heartbeat(self) -> None:
        while not self._stop.wait(min(1.0, self.heartbeat_s)):
            if time.perf_counter() - self._last_output >= self.heartbeat_s:
                self.update("still working")

    def _write(self, text: str, end: str = "\n") -> None:
        print(text, end=end, file=self.stream, flush=True)
        self._last_output = time.perf_counter()


def format_bytes(n: float) -> str:
    """A size in the unit that fits it: ``512 B``, ``3.2 KiB``, ``118.0 MiB``, ``7.71 GiB``."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            value = n / size
            return f"{value:.2f} {unit}" if unit == "GiB" else f"{value:.1f} {unit}"
    return f"{int(n)} B"


def format_count(n: int, word: str, plural: str | None = None) -> str:
    """``n`` and ``word`` in agreement: ``1 segment``, ``3 segments``; ``plural`` where adding "s" is wrong
    (``format_count(2, "child", "children")``)."""
    return f"{n} {word if n == 1 else plural or word + 's'}"


def format_table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A plain aligned text table: numeric columns right-aligned, text columns left-aligned."""
    cells = [list(map(str, header))] + [[str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    numeric = [all(_looks_numeric(row[i]) for row in cells[1:]) for i in range(len(header))]

    def line(row):
        return "  ".join(c.rjust(w) if num else c.ljust(w) for c, w, num in zip(row, widths, numeric)).rstrip()

    return "\n".join([line(cells[0]), "  ".join("-" * w for w in widths), *map(line, cells[1:])])


def _looks_numeric(cell: str) -> bool:
    try:
        float(cell.replace(",", "").rstrip("%x"))
    except ValueError:
        return cell == "-"
    return True


#: A log line of Kineto, torch.profiler's C++ back end: ``USDT:2026-11-23 12:30:38 4381:4381 File.cpp:46] ...``.
NATIVE_LOG_LINE = re.compile(r"^[A-Z]+:\d{4}-\d\d-\d\d \d\d:\d\d:\d\d \d+:\d+ \S+:\d+\] ")


@contextlib.contextmanager
def filter_native_logs() -> Iterator[None]:
    """Keep torch.profiler's native log lines (``profiler_start``, ``gpuGetDeviceCount failed``) off stderr.

    Kineto writes them from C++ straight to file descriptor 2, where no Python-level redirection can
    reach, in the middle of progress lines. Inside the block fd 2 goes to a temporary file; afterwards
    every line that is not a Kineto log line is written back to stderr, so real warnings and errors are
    still seen.
    """
    try:
        sys.stderr.flush()
        saved = os.dup(2)
    except (OSError, ValueError):  # no usable fd 2 (closed, or a replaced stderr): nothing to filter
        yield
        return
    with tempfile.TemporaryFile() as captured:
        os.dup2(captured.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            captured.seek(0)
            text = captured.read().decode(errors="replace")
            kept = [line for line in text.splitlines(keepends=True) if not NATIVE_LOG_LINE.match(line)]
            if kept:
                sys.stderr.write("".join(kept))
                sys.stderr.flush()


__all__ = ["HEARTBEAT_S", "NATIVE_LOG_LINE", "Progress", "Step", "filter_native_logs", "format_bytes", "format_count",
           "format_table"]
