"""Load the planner engine (fxplan.lowersets, memory_model and dp) of an earlier commit beside the current one.

Benchmarks print "before" and "after" from one process: ``load("35c586f")`` returns that commit's ``dp``
module, with its lowersets and memory_model; costgraph, plans and errors come from the working tree.
"""

from __future__ import annotations

import os
import subprocess
import sys
import types
from pathlib import Path

ROOT = Path(os.environ.get("FXPLAN_REPO", Path(__file__).resolve().parent.parent))
"""The git checkout to read earlier revisions from (``FXPLAN_REPO`` overrides, e.g. for a copied tree)."""


def load(rev: str) -> types.ModuleType:
    """The ``fxplan.dp`` module of git revision ``rev`` (its lowersets and memory_model alongside)."""
    mods = {}
    for short in ("lowersets", "memory_model", "dp"):
        name = f"fxplan_{rev}_{short}"
        src = subprocess.run(["git", "show", f"{rev}:fxplan/{short}.py"], cwd=ROOT, check=True,
                             capture_output=True, text=True).stdout
        for dep in ("lowersets", "memory_model"):
            src = src.replace(f"from fxplan.{dep} ", f"from fxplan_{rev}_{dep} ")
        mod = types.ModuleType(name)
        sys.modules[name] = mod
        exec(compile(src, f"{rev}:fxplan/{short}.py", "exec"), mod.__dict__)
        mods[short] = mod
    return mods["dp"]
