"""Load the planner engine (fxplan.dp and fxplan.memory_model) of an earlier commit beside the current one.

Benchmarks print "before" and "after" from one process: ``load("35c586f")`` returns that commit's ``dp``
module, importing the rest of fxplan (lowersets, plans, errors) from the working tree, whose interfaces
those modules use are unchanged.
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
    """The ``fxplan.dp`` module of git revision ``rev`` (its memory_model alongside)."""
    mods = {}
    for short in ("memory_model", "dp"):
        name = f"fxplan_{rev}_{short}"
        src = subprocess.run(["git", "show", f"{rev}:fxplan/{short}.py"], cwd=ROOT, check=True,
                             capture_output=True, text=True).stdout
        src = src.replace("from fxplan.memory_model", f"from fxplan_{rev}_memory_model")
        mod = types.ModuleType(name)
        sys.modules[name] = mod
        exec(compile(src, f"{rev}:fxplan/{short}.py", "exec"), mod.__dict__)
        mods[short] = mod
    return mods["dp"]
