"""The link between a device and host memory: how fast an offloaded value's copies go, and whether they can hide.

On a CUDA device the bandwidth is measured once per machine (a large copy to and from pinned host memory, the
slower direction kept) and cached with the other device figures (:mod:`fxplan.common.cache`); the copies run on a
side stream, beside compute. On the CPU host and device are one memory: a copy is a memory copy on the thread that
computes, at the copy bandwidth of :func:`fxplan.costs.timecost.device_speed`, and nothing hides it.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

import torch

from fxplan.common.cache import machine_key, read_cache, write_cache
from fxplan.costs.timecost import device_speed

#: The cache file of the measured links.
LINKS_FILE = "host_link.json"

#: Bytes of the copies that measure a CUDA device's link.
PROBE_BYTES = 256 * 2**20

_LINKS: dict[str, HostLink] = {}


@dataclass(frozen=True)
class HostLink:
    """Bytes per second one copy between the device and host memory moves, whether copies run beside compute
    (``overlapped``), and where the figure comes from (``source``, for the plan's summary)."""

    bytes_per_s: float
    overlapped: bool
    source: str


def host_link(device: torch.device) -> HostLink:
    """The :class:`HostLink` of ``device`` (module docstring)."""
    if device.type == "cuda" and torch.cuda.is_available():
        key = machine_key(device)
        if key not in _LINKS:
            stored = read_cache(LINKS_FILE)
            if key not in stored:
                stored[key] = asdict(_measured_cuda_link(device))
                write_cache(stored, LINKS_FILE)
            _LINKS[key] = HostLink(**stored[key])
        return _LINKS[key]
    speed = device_speed("cpu")
    return HostLink(speed.bytes_per_s / 2, False, "a memory copy on the CPU, measured (nothing hides it)")


def _measured_cuda_link(device: torch.device) -> HostLink:
    on_device = torch.empty(PROBE_BYTES, dtype=torch.uint8, device=device)
    host = torch.empty(PROBE_BYTES, dtype=torch.uint8, pin_memory=True)
    seconds = []
    for target, source in ((host, on_device), (on_device, host)):
        target.copy_(source, non_blocking=True)  # warm-up
        torch.cuda.synchronize(device)
        start = time.perf_counter()
        target.copy_(source, non_blocking=True)
        torch.cuda.synchronize(device)
        seconds.append(time.perf_counter() - start)
    return HostLink(PROBE_BYTES / max(seconds), True,
                    f"{torch.cuda.get_device_name(device)} to pinned host memory, measured")
