"""Terminal output: progress lines (updates, heartbeat), native profiler log lines kept off stderr."""

from __future__ import annotations

import io
import os
import time

import torch

from fxplan.common.console import NATIVE_LOG_LINE, Progress, filter_native_logs
from fxplan.compare.driver import real_step_peak


def test_progress_step_on_one_line():
    out = io.StringIO()
    with Progress(stream=out).step("tracing"):
        pass
    assert out.getvalue().startswith("tracing ... done (") and out.getvalue().count("\n") == 1


def test_progress_updates_and_heartbeat_during_a_long_step():
    out = io.StringIO()
    with Progress(stream=out, heartbeat_s=0.3).step("timing") as step:
        step.update("round 1/2")
        time.sleep(1.6)
    lines = out.getvalue().splitlines()
    assert lines[0] == "timing ..." and lines[1].startswith("  timing: round 1/2 (")
    assert any("timing: still working" in line for line in lines[2:-1])
    assert lines[-1].startswith("timing: done (")


def test_quiet_progress_prints_nothing(capsys):
    with Progress(quiet=True, heartbeat_s=0.1).step("x") as step:
        step.update("y")
    assert capsys.readouterr().err == ""


def test_native_log_lines_are_dropped_and_other_stderr_kept(capfd):
    with filter_native_logs():
        os.write(2, b"USDT:2026-11-23 12:30:38 4381:4381 SyncActivityProfilerHandler.cpp:46] profiler_stop\n")
        os.write(2, b"a real warning\n")
    err = capfd.readouterr().err
    assert err == "a real warning\n"


def test_profiled_real_step_prints_no_profiler_lines(capfd):
    model = torch.nn.Linear(4, 4)
    peak, meter = real_step_peak(model, (torch.randn(2, 4),), lambda out: out.sum(), torch.device("cpu"))
    assert peak > 0 and meter == "torch.profiler allocation events"
    assert not any(NATIVE_LOG_LINE.match(line) for line in capfd.readouterr().err.splitlines())


def test_a_step_ended_by_an_exception_says_how():
    from fxplan.compare.peers import NotApplicable

    out = io.StringIO()
    for exc in (NotApplicable("not applicable: no chain"), RuntimeError("boom")):
        try:
            with Progress(stream=out).step("preparing"):
                raise exc
        except Exception:
            pass
    assert [line.split(" (")[0] for line in out.getvalue().splitlines()] == [
        "preparing ... not applicable", "preparing ... failed"]
