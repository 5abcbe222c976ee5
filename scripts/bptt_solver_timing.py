"""BPTT solver times, current against an earlier commit's, side by side in one process.

Usage: python scripts/bptt_solver_timing.py [--reference 30ff967] [--repeats 3] [--sizes 1000x100,10000x200]

For each (t, m) and policy (HSM; ISM; MSM with alpha = 5, beta = 4) the full tables C, D, H are solved by
both implementations (``_solve_dp`` with its default method), alternating, with a warm-up; the median and
range of ``--repeats`` wall-clock runs are printed, and whether the tables are identical. The default
reference, 30ff967, is the engine before :mod:`fxplan.bptt.hull_dp` (MSM scanned every position).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
import types
from pathlib import Path

import numpy as np

from fxplan.bptt import solvers

sys.path.insert(0, str(Path(__file__).resolve().parent))
from reference_engine import ROOT  # noqa: E402  (the git checkout, FXPLAN_REPO overrides)

POLICIES = {"hsm": (True, None, None), "ism": (False, 1, 1), "msm": (True, 5, 4)}


def load(rev: str) -> types.ModuleType:
    src = subprocess.run(["git", "show", f"{rev}:fxplan/bptt/solvers.py"], cwd=ROOT, check=True,
                         capture_output=True, text=True).stdout
    name = f"fxplan_bptt_solvers_{rev}"
    mod = types.ModuleType(name)
    sys.modules[name] = mod
    exec(compile(src, f"{rev}:fxplan/bptt/solvers.py", "exec"), mod.__dict__)
    return mod


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--reference", default="30ff967")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--sizes", default="1000x100,10000x200")
    args = p.parse_args(argv)
    old = load(args.reference)
    solvers._solve_dp(50, 10, True, 5, 4)  # warm-up
    old._solve_dp(50, 10, True, 5, 4)
    print("| t | m | policy | current s (median [range]) | reference s | same tables |")
    print("|---|---|---|---|---|---|")
    for size in args.sizes.split(","):
        t, m = (int(x) for x in size.split("x"))
        for name, pargs in POLICIES.items():
            times: dict[str, list[float]] = {"new": [], "old": []}
            out = {}
            for _ in range(args.repeats):
                for key, fn in (("new", solvers._solve_dp), ("old", old._solve_dp)):
                    t0 = time.perf_counter()
                    out[key] = fn(t, m, *pargs)
                    times[key].append(time.perf_counter() - t0)
            same = all(np.array_equal(a, b) for a, b in zip(out["new"], out["old"]))
            cells = [f"{statistics.median(v):.3f} [{min(v):.3f}-{max(v):.3f}]" for v in (times["new"], times["old"])]
            print(f"| {t} | {m} | {name} | {cells[0]} | {cells[1]} | {same} |", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
