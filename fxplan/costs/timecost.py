"""Node time costs in seconds on the device the model trains on: a roofline estimate or a measurement.

The time-centric DP (Kusumoto et al. 2019, section 4.4) minimises T(recomputed nodes). With FLOPs as
T, normalisations, activations and additions cost almost nothing, yet on real hardware they are bound
by memory bandwidth and take a sizeable share of a step: recomputing them is not free. This module
gives T in microseconds of forward time (a plan recomputes forward ops only; the backward runs once
whatever the plan, so its time does not enter the objective):

* ``"roofline"``: ``flops / peak FLOP/s + bytes moved / bandwidth + ATen ops × per-op overhead``. The
  three device constants are measured once per machine, device and thread count by :func:`device_speed`
  (a float32 matrix product, a large copy and a tiny addition; well under a second) and kept in a
  cache file, so every process on the machine plans with the same costs. Works on fake tensors, so
  planning a model far larger than the machine still gets seconds. Ops that run far below the copy's
  bandwidth on the device (on a 2-core CPU BatchNorm in training and pooling, by factors the user guide
  gives) would look almost free that way, and a plan would recompute them at no apparent cost: the same
  benchmark times one reference call of each such op (:data:`SLOW_OP_PROBES`) and its bytes are priced
  at the rate measured (``DeviceSpeed.op_bytes_per_s``) where that is below the copy's.
  Bytes moved are counted per ATen op (:func:`fxplan.costs.op_census.op_traffic`: the bytes of its tensor inputs
  plus the bytes of the outputs it writes; pure views move nothing), in the trace's one dispatch mode
  (:class:`fxplan.costs.op_census.NodeCensus`).
* ``"measured"``: the node's forward run on real random tensors of its shapes on its device (one
  warm-up, median of :data:`MEASURE_REPEATS`), cached per op, shapes, dtypes and device so that the
  repeated layers of a network are timed once (:func:`measure_seconds`). The user's modules are
  copied before they run, so BatchNorm statistics stay untouched.

T is kept in microseconds rather than seconds so that the solvers' absolute tolerances (1e-6) stay
far below any node's cost; :data:`T_SECONDS` converts.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import logging
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils._pytree import tree_leaves, tree_map

from fxplan.common.cache import machine_key, read_cache, write_cache
from fxplan.costs.op_census import NodeCensus

logger = logging.getLogger("fxplan")

#: Seconds per unit of T under the time models of this module (T is in microseconds).
T_SECONDS = 1e-6

#: Timed repetitions per node in the measured model (after one warm-up run).
MEASURE_REPEATS = 3

#: Cost models of :func:`fxplan.costs.trace.trace` whose T is time (seconds × 1e6), not FLOPs or the paper's units.
TIME_MODELS = ("roofline", "measured", "fused")


@dataclass(frozen=True)
class DeviceSpeed:
    """What one device sustains: float32 FLOP/s of a large matrix product, bytes/s of a large copy (read
    plus write), and the seconds one tiny ATen op costs (dispatch and launch overhead)."""

    device: str
    flops_per_s: float
    bytes_per_s: float
    op_seconds: float
    threads: int
    op_bytes_per_s: dict[str, float] = field(default_factory=dict)  # by :func:`fxplan.costs.op_census.op_kind`

    def seconds(self, flops: float, bytes_moved: float, ops: int, op_bytes: dict[str, int] | None = None) -> float:
        """The roofline time of work: compute and memory traffic, added (they rarely overlap fully on a
        CPU), plus the fixed cost of every op. ``op_bytes``: the bytes moved per op kind, of which those of
        kinds in ``op_bytes_per_s`` move at their own rate."""
        slow = {kind: n for kind, n in (op_bytes or {}).items() if kind in self.op_bytes_per_s}
        memory = (bytes_moved - sum(slow.values())) / self.bytes_per_s
        memory += sum(n / self.op_bytes_per_s[kind] for kind, n in slow.items())
        return flops / self.flops_per_s + memory + ops * self.op_seconds


_SPEEDS: dict[str, DeviceSpeed] = {}

#: The cache file of the device benchmarks (:func:`device_speed`).
SPEEDS_FILE = "device_speed.json"


def device_speed(device: torch.device | str = "cpu") -> DeviceSpeed:
    """The measured :class:`DeviceSpeed` of ``device`` at the current ``torch.get_num_threads()``.

    Benchmarked once per machine, device, thread count and torch version, and kept in
    ``device_speed.json`` in the cache folder (:data:`fxplan.common.cache.CACHE_DIR_ENV`): a benchmark taken while
    other jobs run varies by 2x or more, and roofline costs that moved between processes would make one budget get
    different plans from one run to the next. Delete the file to measure again.
    """
    device = torch.device(device)
    key = _machine_key(device)
    if key not in _SPEEDS:
        stored = read_cache(SPEEDS_FILE)
        if key in stored:
            _SPEEDS[key] = DeviceSpeed(**stored[key])
        else:
            with _random_state_kept(device):
                _SPEEDS[key] = _benchmark(device)
            write_cache({**stored, key: asdict(_SPEEDS[key])}, SPEEDS_FILE)
    return _SPEEDS[key]


def _machine_key(device: torch.device) -> str:
    return f"{machine_key(device)} benchmark={BENCHMARK_VERSION}"


def _best_seconds(fn: Callable[[], Any], device: torch.device, repeats: int) -> float:
    fn()  # warm-up
    best = float("inf")
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        fn()
        _sync(device)
        best = min(best, time.perf_counter() - start)
    return max(best, 1e-9)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _random_state_kept(device: torch.device) -> contextlib.AbstractContextManager:
    """torch's generators left as they were by a measurement on random tensors: a first use on a new machine
    (nothing cached yet) must not change the draws of the user's training."""
    return torch.random.fork_rng(devices=[device] if device.type == "cuda" else [])


def _benchmark(device: torch.device) -> DeviceSpeed:
    cuda = device.type == "cuda"
    with torch.no_grad():
        flops = _matmul_flops_per_s(device, 4096 if cuda else 1024)
        bandwidth = _copy_bytes_per_s(device, (256 if cuda else 32) * 2**20)
        slow = {kind: rate for kind, rate in _probe_rates(device).items() if rate < SLOW * bandwidth}
    # a training step records autograd history for every op: the fixed cost includes it
    one = torch.ones(1, device=device, requires_grad=True)
    per_op = _best_seconds(lambda: [one + one for _ in range(100)], device, 5) / 100
    return DeviceSpeed(str(device), flops, bandwidth, per_op, torch.get_num_threads(), slow)


#: Bumped when the benchmark changes, so that cached figures of an older one are measured again.
BENCHMARK_VERSION = 2

#: An op kind is priced at its own rate where it moves bytes at less than this fraction of the copy's.
SLOW = 0.5

#: Reference calls of memory-bound ops that can run far below copy bandwidth (reductions, windows,
#: transcendentals): given an activation-sized tensor (16 MiB in float32, NCHW), the call to time.
SLOW_OP_PROBES: dict[str, Callable[[torch.Tensor], Callable[[], Any]]] = {
    "batch norm (training)": lambda x: functools.partial(
        F.batch_norm, x, torch.zeros(x.shape[1], device=x.device), torch.ones(x.shape[1], device=x.device),
        training=True),
    "max pooling": lambda x: functools.partial(F.max_pool2d, x, 3, 2, 1),
    "average pooling": lambda x: functools.partial(F.avg_pool2d, x, 2),
    "adaptive average pooling": lambda x: functools.partial(F.adaptive_avg_pool2d, x, 1),
    "concatenation": lambda x: functools.partial(torch.cat, [x, x], 1),
    "layer norm": lambda x: functools.partial(F.layer_norm, x.reshape(-1, 1024), (1024,)),
    "softmax": lambda x: functools.partial(torch.softmax, x.reshape(-1, 1024), -1),
    "gelu": lambda x: functools.partial(F.gelu, x),
    "silu": lambda x: functools.partial(F.silu, x),
}


def _probe_rates(device: torch.device) -> dict[str, float]:
    """Bytes per second the main op kind of each of :data:`SLOW_OP_PROBES` moves (the whole call's bytes over
    its best time of several)."""
    x = torch.randn(16, 64, 64, 64, device=device)
    rates: dict[str, float] = {}
    for probe in SLOW_OP_PROBES.values():
        call = probe(x)
        with NodeCensus({}) as census:
            call()
        main = max(census.op_bytes, key=census.op_bytes.__getitem__)  # not the allocations around it
        rates.setdefault(main, sum(census.op_bytes.values()) / _best_seconds(call, device, 5))
    return rates


def _matmul_flops_per_s(device: torch.device, n: int) -> float:
    a, b = torch.randn(n, n, device=device), torch.randn(n, n, device=device)
    return 2 * n**3 / _best_seconds(lambda: torch.mm(a, b), device, 20)


def _copy_bytes_per_s(device: torch.device, nbytes: int) -> float:
    src = torch.empty(nbytes // 4, device=device).uniform_()
    dst = torch.empty_like(src)
    return 2 * nbytes / _best_seconds(lambda: dst.copy_(src), device, 20)


# ---------------------------------------------------------------------------------------- measuring


_MEASURED: dict[tuple, float] = {}


def op_key(op: Any, args: tuple, kwargs: dict, device: torch.device) -> tuple:
    """The cache key of one node's forward: what runs (a module's repr and mode, or a function's name),
    tensor shapes and dtypes, the other arguments, device and thread count. Equal layers share it."""
    def describe(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            return ("T", tuple(x.shape), str(x.dtype), x.requires_grad)
        return repr(x)

    if isinstance(op, torch.nn.Module):
        what = (type(op).__qualname__, repr(op), op.training)
    else:
        what = (getattr(op, "__module__", ""), getattr(op, "__qualname__", None) or repr(op))
    leaves = tuple(describe(x) for x in tree_leaves((args, kwargs)))
    return (what, leaves, str(device), torch.get_num_threads())


def real_like(x: Any, device: torch.device) -> Any:
    """A real tensor of ``x``'s shape, dtype and ``requires_grad`` on ``device`` (random floats, zeros
    otherwise: zero is a valid index for any gather or embedding); other values unchanged."""
    if not isinstance(x, torch.Tensor):
        return x
    if x.dtype.is_floating_point or x.dtype.is_complex:
        t = torch.randn(tuple(x.shape), dtype=x.dtype, device=device)
    else:
        t = torch.zeros(tuple(x.shape), dtype=x.dtype, device=device)
    return t.requires_grad_(x.requires_grad and (x.dtype.is_floating_point or x.dtype.is_complex))


def measure_seconds(op: Callable[..., Any], fake_args: tuple, fake_kwargs: dict,
                    device: torch.device) -> float:
    """Median forward seconds of ``op(*args, **kwargs)`` on real tensors shaped like the (fake) arguments,
    with autograd recording as in a training step; cached by :func:`op_key`. A module is deep-copied
    first, so its parameters and buffers (BatchNorm statistics) are left as they were."""
    key = op_key(op, fake_args, fake_kwargs, device)
    if key not in _MEASURED:
        if isinstance(op, torch.nn.Module):
            op = copy.deepcopy(op).to(device)
        with _random_state_kept(device):
            _MEASURED[key] = _median_seconds(op, fake_args, fake_kwargs, device)
    return _MEASURED[key]


def _median_seconds(op: Callable[..., Any], fake_args: tuple, fake_kwargs: dict, device: torch.device) -> float:
    args = tree_map(lambda x: real_like(x, device), fake_args)
    kwargs = tree_map(lambda x: real_like(x, device), fake_kwargs)
    samples = []
    with torch.enable_grad():
        for i in range(MEASURE_REPEATS + 1):
            _sync(device)
            start = time.perf_counter()
            out = op(*args, **kwargs)
            _sync(device)
            if i:
                samples.append(time.perf_counter() - start)
            del out
    return statistics.median(samples)


__all__ = ["DeviceSpeed", "MEASURE_REPEATS", "SLOW_OP_PROBES", "TIME_MODELS", "T_SECONDS", "device_speed",
           "measure_seconds", "op_key", "real_like"]
