"""Load the planner engine (fxplan.solvers.lowersets, family, memory_model, family_dp and dp) of an earlier commit
beside the current one.

Benchmarks print "before" and "after" from one process: ``load("35c586f")`` returns that commit's ``dp``
module, with its engine modules (:data:`ENGINE`); costgraph, plans and errors come from the working tree.
"""

from __future__ import annotations

import os
import subprocess
import sys
import types
from pathlib import Path

ROOT = Path(os.environ.get("FXPLAN_REPO", Path(__file__).resolve().parent.parent))
"""The git checkout to read earlier revisions from (``FXPLAN_REPO`` overrides, e.g. for a copied tree)."""


ENGINE = ("lowersets", "family", "memory_model", "family_dp", "dp")
"""The planner's engine modules, each importing only earlier ones (and shared modules: costgraph, plans,
errors, which come from the working tree). Those a revision lacks (family, family_dp before the family
engine) are taken from nowhere: its dp does not import them."""


def load(rev: str) -> types.ModuleType:
    """The ``fxplan.solvers.dp`` module of git revision ``rev``, with that revision's engine modules beneath it."""
    present = [short for short in ENGINE if _source(rev, short) is not None]
    mods = {}
    for short in present:  # in dependency order
        src = _source(rev, short)
        for dep in present:
            src = src.replace(f"from fxplan.{dep} ", f"from fxplan_{rev}_{dep} ")
        mods[short] = _made(rev, short, src)
    return mods["dp"]


def module(rev: str, short: str) -> types.ModuleType:
    """The module ``fxplan.<short>`` of git revision ``rev`` alone: the other fxplan modules it imports come from
    the working tree."""
    src = _source(rev, short)
    if src is None:
        raise SystemExit(f"{rev} has no fxplan/{short}.py")
    return _made(rev, short, src)


def _made(rev: str, short: str, src: str) -> types.ModuleType:
    """A module named ``fxplan_<rev>_<short>`` run from ``src``, registered (dataclasses look their module up)."""
    name = f"fxplan_{rev}_{short}"
    mod = types.ModuleType(name)
    sys.modules[name] = mod
    exec(compile(src, f"{rev}:fxplan/{short}.py", "exec"), mod.__dict__)
    return mod


def _source(rev: str, short: str) -> str | None:
    res = subprocess.run(["git", "show", f"{rev}:fxplan/{short}.py"], cwd=ROOT, capture_output=True, text=True)
    return res.stdout if res.returncode == 0 else None
