"""BPTT solver times, current against an earlier commit's, side by side in one process.

Usage: python scripts/bptt_solver_timing.py [--reference 1228fce] [--repeats 3] [--sizes 1000x100,10000x200]

For each (t, m) and policy (HSM; ISM; MSM with alpha = 5, beta = 4) the full tables C, D, H are solved by
both implementations (``_solve_dp``), alternating, after a warm-up; the median and range of ``--repeats``
wall-clock runs are printed, the current engine's CPU seconds (median), and whether the tables are
identical. The default reference, 1228fce, is the numpy engine before the compiled kernel.

The current engine's kernel is compiled by numba on its first call and cached on disk; that one-off cost is
measured first, in fresh processes, beside the first solve by the NumPy scan a process runs until it has the
kernel: importing the solver and solving a small table with an empty cache (compile) and then with that cache
(load).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
import types
from pathlib import Path

import numpy as np

from fxplan.bptt import solvers

sys.path.insert(0, str(Path(__file__).resolve().parent))
from reference_engine import ROOT  # noqa: E402  (the git checkout, FXPLAN_REPO overrides)

POLICIES = {"hsm": (True, None, None), "ism": (False, 1, 1), "msm": (True, 5, 4)}

FIRST_CALL = """import time
from fxplan.bptt.solvers import _solve_dp  # fxplan and torch: not counted
w0, c0 = time.perf_counter(), time.process_time()
_solve_dp(1000, 50, False, 1, 1)  # the NumPy scan: no kernel in this process yet
w1, c1 = time.perf_counter(), time.process_time()
import fxplan.bptt.hull_dp  # numba
w2, c2 = time.perf_counter(), time.process_time()
fxplan.bptt.hull_dp.solve_tables(50, 10, True, 5, 4)
w3, c3 = time.perf_counter(), time.process_time()
print(f"first solve of ism 1000x50 (scan) {w1 - w0:.2f} s ({c1 - c0:.2f} s CPU); import numba and the kernel's "
      f"module {w2 - w1:.2f} s ({c2 - c1:.2f} s CPU), its first solve {w3 - w2:.2f} s ({c3 - c2:.2f} s CPU)")
"""


def load(rev: str) -> types.ModuleType:
    """The ``fxplan.bptt.solvers`` module of git revision ``rev``, with that revision's ``hull_dp``."""
    mods = {}
    for short in ("hull_dp", "solvers"):
        src = subprocess.run(["git", "show", f"{rev}:fxplan/bptt/{short}.py"], cwd=ROOT, check=True,
                             capture_output=True, text=True).stdout
        src = src.replace("from fxplan.bptt.hull_dp ", f"from fxplan_bptt_{rev}_hull_dp ")
        name = f"fxplan_bptt_{rev}_{short}"
        mod = types.ModuleType(name)
        sys.modules[name] = mod
        exec(compile(src, f"{rev}:fxplan/bptt/{short}.py", "exec"), mod.__dict__)
        mods[short] = mod
    return mods["solvers"]


def first_call() -> None:
    """Print import and first-solve seconds in fresh processes: empty numba cache, then that cache."""
    with tempfile.TemporaryDirectory() as cache:
        env = dict(os.environ, NUMBA_CACHE_DIR=cache)
        for what in ("empty cache (compile)", "cached"):
            out = subprocess.run([sys.executable, "-c", FIRST_CALL], env=env, check=True, capture_output=True,
                                 text=True).stdout.strip()
            print(f"first call, {what}: {out}")


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--reference", default="1228fce")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--sizes", default="1000x100,10000x200")
    args = p.parse_args(argv)
    first_call()
    old = load(args.reference)
    solvers._solve_dp(50, 10, True, 5, 4)  # warm-up
    from fxplan.bptt.hull_dp import solve_tables

    solve_tables(50, 10, True, 5, 4)  # the kernel in this process: _solve_dp runs it at every size
    old._solve_dp(50, 10, True, 5, 4)
    print("| t | m | policy | current s (median [range]) | current CPU s | reference s | same tables |")
    print("|---|---|---|---|---|---|---|")
    for size in args.sizes.split(","):
        t, m = (int(x) for x in size.split("x"))
        for name, pargs in POLICIES.items():
            times: dict[str, list[float]] = {"new": [], "old": [], "cpu": []}
            out = {}
            for _ in range(args.repeats):
                for key, fn in (("new", solvers._solve_dp), ("old", old._solve_dp)):
                    t0, c0 = time.perf_counter(), time.process_time()
                    out[key] = fn(t, m, *pargs)
                    times[key].append(time.perf_counter() - t0)
                    if key == "new":
                        times["cpu"].append(time.process_time() - c0)
            same = all(np.array_equal(a, b) for a, b in zip(out["new"], out["old"]))
            new, ref = (f"{statistics.median(v):.3f} [{min(v):.3f}-{max(v):.3f}]" for v in (times["new"], times["old"]))
            print(f"| {t} | {m} | {name} | {new} | {statistics.median(times['cpu']):.3f} | {ref} | {same} |",
                  flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
