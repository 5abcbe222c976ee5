"""Scaffolding for the tests that train a rewritten model under torch.distributed: CPU processes, gloo.

:func:`assert_ranks_agree` spawns :data:`WORLD` processes joined by a file-initialised gloo group; each
runs ``check(rank)``, which trains the original and the rewritten model side by side and returns what
differed between them. The test fails, naming the rank and the differences, unless every rank returns
nothing.
"""

from __future__ import annotations

import faulthandler
import os
import sys
import tempfile
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

WORLD = 2


def _run_rank(rank: int, check: Callable[[int], list[str]], init_file: str, result_dir: str) -> None:
    faulthandler.enable(all_threads=True)  # an abort in C++ names the Python frames it came from
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    try:
        mismatches = check(rank)
        with open(os.path.join(result_dir, f"rank{rank}.txt"), "w") as f:
            f.write("\n".join(mismatches) if mismatches else "ok")
    finally:
        dist.destroy_process_group()
    # Interpreter finalisation can abort (SIGABRT, "terminate called without an active exception", about one
    # run in ten) while gloo's threads still hold tensors; the result is written, so skip it.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def assert_ranks_agree(check: Callable[[int], list[str]]) -> None:
    """Run ``check(rank)`` on every rank of a gloo group; fail unless each returns no mismatches.

    ``check`` must be a module-level function (it is pickled into the spawned processes).
    """
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "init")
        mp.spawn(_run_rank, args=(check, init_file, tmp), nprocs=WORLD, join=True)
        for rank in range(WORLD):
            with open(os.path.join(tmp, f"rank{rank}.txt")) as f:
                result = f.read()
            assert result == "ok", f"rank {rank}: {result}"
