"""fxplan's on-disk cache: figures measured once per machine (device speeds, kernel scratch), kept as JSON.

Each file maps a machine key (:func:`machine_key`: device, its name, CPU count, thread count, torch version)
to the figures measured there, so a cache folder shared between machines or torch versions never hands one
machine's figures to another. Writes are atomic (a temporary file, then a rename); a read-only home keeps the
figures for the process only.
"""

from __future__ import annotations

import json
import logging
import os
import platform
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger("fxplan")

#: Environment variable naming the folder of fxplan's cache files (default: ``~/.cache/fxplan``).
CACHE_DIR_ENV = "FXPLAN_CACHE_DIR"


def machine_key(device: torch.device) -> str:
    """What a figure measured on ``device`` depends on: the device and its name, CPUs, threads, torch."""
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or platform.machine()
    return f"{device} {name} cpus={os.cpu_count()} threads={torch.get_num_threads()} torch={torch.__version__}"


def cache_file(name: str) -> Path:
    folder = os.environ.get(CACHE_DIR_ENV) or Path.home() / ".cache" / "fxplan"
    return Path(folder) / name


def read_cache(name: str) -> dict[str, dict[str, Any]]:
    """The figures in cache file ``name``; empty if it is missing or unreadable."""
    try:
        return json.loads(cache_file(name).read_text())
    except (OSError, ValueError):
        return {}


def write_cache(figures: dict[str, dict[str, Any]], name: str) -> None:
    """Replace cache file ``name`` with ``figures`` (atomically; a failure to write is logged at DEBUG)."""
    path = cache_file(name)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(figures, indent=1))
        tmp.replace(path)
    except OSError as exc:
        logger.debug("could not write %s: %s", path, exc)
