"""Growth table of the approximate DP on synthetic residual networks, before and after, in one run.

Usage: python scripts/planner_scale.py [--nodes 1000,3000,10000,30000] [--repeats 3]
                                       [--reference 35c586f] [--reference-max-nodes 3000]

The network is ``blocks`` residual blocks LayerNorm → Linear → GELU → Linear → add (5 nodes each, width
64, hidden 256), batch 8, sequence 128, traced on fake tensors (nothing allocated). Each solve runs in a
fresh child process, so its time includes building the planner's index and its peak RSS is its own;
"current" and "reference" (the engine of git revision ``--reference``, loaded by reference_engine.py)
alternate, and the median and range over ``--repeats`` runs are printed. Peak RSS includes torch, which
``import fxplan`` loads (about 700 MB) and the loaded graph; "+N" is the peak RSS during the solve minus
the RSS before it (the kernel's peak mark is reset just before the solve). Solves: min budget
(``dp.min_activation_bytes``), the memory-centric plan, and the time-centric plan at the minimum budget and
at 30% and 50% of the single-segment peak.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SOLVES = ("min", "mc", "tc_min", "tc_30", "tc_50")


def residual_net(nodes: int):
    """The synthetic network of ``nodes`` compute nodes (module docstring) and its fake input."""
    import torch
    from torch import nn
    from torch._subclasses.fake_tensor import FakeTensorMode

    class Block(nn.Module):
        def __init__(self, d: int):
            super().__init__()
            self.ln, self.fc1, self.act, self.fc2 = nn.LayerNorm(d), nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d)

        def forward(self, x):
            return x + self.fc2(self.act(self.fc1(self.ln(x))))

    net = nn.Sequential(*[Block(64) for _ in range(nodes // 5)])
    with FakeTensorMode():
        return net, torch.randn(8, 128, 64)


def build_graph(nodes: int, path: Path) -> float:
    """Trace the synthetic network with ``nodes`` compute nodes into ``path`` (pickle); returns seconds."""
    from fxplan.costs.trace import trace

    net, x = residual_net(nodes)
    t0 = time.perf_counter()
    cg = trace(net, [x])
    seconds = time.perf_counter() - t0
    for key in list(cg.graph):  # the captured module, its fake copy, the example output: not the planner's
        try:
            pickle.dumps(cg.graph[key])
        except Exception:
            del cg.graph[key]
    path.write_bytes(pickle.dumps(cg))
    return seconds


def child(graph: str, engine: str, solve: str) -> None:
    """Run one solve and print {"seconds", "rss_mb", "peak", "segments"} as JSON."""
    cg = pickle.loads(Path(graph).read_bytes())
    if engine == "current":
        from fxplan.solvers import dp
    else:
        sys.path.insert(0, str(ROOT / "scripts"))
        from reference_engine import load

        dp = load(engine)
    vanilla = None
    if solve.startswith("tc_") and solve != "tc_min":
        vanilla = dp.solve(cg, None).predicted_peak_bytes
        if hasattr(dp, "forget_context"):  # time the solve from scratch
            dp.forget_context(cg)
        elif hasattr(dp, "_CONTEXTS"):  # a reference engine from before contexts were kept on the graph
            dp._CONTEXTS.clear()
    base_rss = _reset_peak_rss()
    t0 = time.perf_counter()
    if solve == "min":
        out = {"peak": dp.min_activation_bytes(cg), "segments": None}
    else:
        if solve == "mc":
            plan = dp.solve(cg, None, strategy="memory")
        elif solve == "tc_min":
            plan = dp.solve(cg, dp.min_activation_bytes(cg))
        else:
            plan = dp.solve(cg, int(int(solve[3:]) / 100 * vanilla))
        out = {"peak": plan.predicted_peak_bytes, "segments": plan.num_segments}
    out["seconds"] = time.perf_counter() - t0
    out["rss_mb"] = _status_mb("VmHWM")
    out["added_mb"] = out["rss_mb"] - base_rss
    print(json.dumps(out))


def _status_mb(field: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _reset_peak_rss() -> float:
    """Reset the kernel's peak-RSS mark (Linux clear_refs 5), so VmHWM afterwards is the solve's; current RSS."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass
    return _status_mb("VmRSS")


def run_child(graph: Path, engine: str, solve: str, timeout: float) -> dict:
    cmd = [sys.executable, __file__, "--child", str(graph), engine, solve]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)
    except subprocess.TimeoutExpired:
        return {"error": f">{timeout:.0f}s"}
    if res.returncode:
        return {"error": res.stderr.strip().splitlines()[-1][:80]}
    return json.loads(res.stdout.strip().splitlines()[-1])


def cell(runs: list[dict]) -> str:
    if any("error" in r for r in runs):
        return next(r["error"] for r in runs if "error" in r)
    secs = [r["seconds"] for r in runs]
    rng = f" [{min(secs):.2f}-{max(secs):.2f}]" if len(secs) > 1 else ""
    return (f"{statistics.median(secs):.2f}s{rng}, {max(r['rss_mb'] for r in runs):.0f} MB "
            f"(+{max(r['added_mb'] for r in runs):.0f})")


def main(argv: list[str]) -> None:
    if argv[:1] == ["--child"]:
        child(*argv[1:4])
        return
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nodes", default="1000,3000,10000,30000")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--reference", default="35c586f", help="git revision of the 'before' engine")
    p.add_argument("--reference-max-nodes", type=int, default=3000, help="skip the reference above this")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per child process")
    args = p.parse_args(argv)
    print("| nodes | trace s | solve | current: median s [range], peak RSS (+ added by the solve) | "
          "reference: the same | same result |")
    print("|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for nodes in [int(x) for x in args.nodes.split(",")]:
            graph = Path(tmp) / f"g{nodes}.pkl"
            trace_s = build_graph(nodes, graph)
            for solve in SOLVES:
                engines = ["current"] + ([args.reference] if nodes <= args.reference_max_nodes else [])
                runs: dict[str, list[dict]] = {e: [] for e in engines}
                for _ in range(args.repeats):
                    for e in engines:  # alternate, so load changes hit both alike
                        runs[e].append(run_child(graph, e, solve, args.timeout))
                ref = runs.get(args.reference)
                same = "n/a" if ref is None or "error" in ref[0] or "error" in runs["current"][0] else \
                    str(all((r["peak"], r["segments"]) == (ref[0]["peak"], ref[0]["segments"])
                            for r in runs["current"]))
                print(f"| {nodes} | {trace_s:.1f} | {solve} | {cell(runs['current'])} | "
                      f"{cell(ref) if ref else 'not run'} | {same} |", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
