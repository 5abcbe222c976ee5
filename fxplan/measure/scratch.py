"""Kernel scratch: bytes an operator's kernel allocates and frees while it runs.

A dispatch-level meter sees the storages an op returns, not the workspace its kernel takes on the way: on
a CPU, ``convolution_backward`` (oneDNN) holds tens of MiB beyond its gradients, a convolution's forward
reorders its input, BatchNorm's backward in training a second buffer the size of its input; on CUDA,
cuDNN and cuBLAS take workspaces. A plan that recomputes has its peak inside a backward, where these
kernels run, so a real step's peak (torch.profiler's allocation events, CUDA's ``max_memory_allocated``)
was 1-6% above fxplan's meter (docs/results.md), and a budget met in the meter was missed on the device.

:func:`scratch_bytes` gives, for one ATen op call (fake or real arguments), the most bytes its kernel
holds at once beyond its outputs. It runs the op once on real tensors of the same shapes, strides and
dtypes on the arguments' device, with the current thread count, under ``torch.profiler``'s memory events
(the allocations made inside the call: the highest total less what is still allocated when it returns,
its outputs), and keeps the result by op, arguments, device and threads, for the process and in
``kernel_scratch.json`` in fxplan's cache folder (``FXPLAN_CACHE_DIR``, default ``~/.cache/fxplan``; per
machine and torch version; delete it to measure again).
The meters (:class:`fxplan.measure.meter.StorageTracker`, :class:`fxplan.costs.op_census.NewStorages`) add it to the
live bytes while the op runs, so measured peaks, replays and budgets count it. The same run gives each output's
real storage size, and the meters count an output storage at the larger of that and its fake size
(:func:`output_storages`): a fake kernel may return a placeholder where the real one returns a buffer kept for
backward.

Not measured (0): ops outside the ``aten`` namespace (custom ops, collectives), ops that return views of
their inputs, ops that take a kernel's opaque state from an earlier call (:data:`OPAQUE_STATE`; warned of once)
unless an op run first makes it (:data:`STATE_MAKERS`; a forward op whose fake kernel also returns a placeholder for
what it keeps is refused on fake tensors: :data:`UNCOUNTABLE_ON_FAKE`), calls with
symbolic shapes or arguments of unknown kinds, calls on a device this process does not have (a CUDA model's
fake tensors planned on a machine without a GPU, the meta device), calls whose tensors together take more than
:data:`MAX_BYTES`, and calls made while a profiler is already running (one cannot be nested). The random
number generators are left as they were.

The replay misses the scratch of a backward kernel whose incoming gradient has another layout than the trace
gave it (the replay runs each node's backward on contiguous gradients; the default loss, a sum, hands the
output a broadcast one); the measured peak that decides has it (``tests/test_replay.py``). The CPU generator
states a recomputed segment's checkpoint keeps are made outside the dispatcher; the meter counts stand-ins
for them (:class:`fxplan.rewriter.recompute.MeteredRngStates`).
"""

from __future__ import annotations

import atexit
import contextlib
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor, unset_fake_temporarily
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils._pytree import tree_leaves, tree_map

from fxplan.common.cache import machine_key, read_cache, write_cache
from fxplan.common.console import filter_native_logs
from fxplan.errors import FxplanError

logger = logging.getLogger("fxplan")
aten = torch.ops.aten

#: A call whose argument tensors take more bytes than this is not run for its scratch (0 assumed, logged):
#: it would allocate them for real.
MAX_BYTES = 4 * 1024**3

#: Ops that read a tensor's metadata and make no storage: under a dispatch mode, autograd asks each tensor's device
#: this way (70% of the calls a meter saw in a fake step of a residual network). The meters pass them straight on.
METADATA_QUERIES = frozenset({torch.ops.prim.device.default, torch.ops.prim.layout.default})

_MEASURED: dict[tuple, Figures] = {}
_ENABLED = [True]
_MARK = "fxplan.kernel_scratch"


@dataclass(frozen=True)
class Figures:
    """What one real run of a call showed: its kernel's scratch, and the storage bytes of its tensor outputs
    (``output_bytes``, 0 for an output on the storage of an earlier one)."""

    scratch: int = 0
    output_bytes: tuple[int, ...] = ()


_NONE = Figures()


def scratch_bytes(func: Any, args: tuple, kwargs: dict) -> int:
    """The most bytes ``func(*args, **kwargs)``'s kernel holds at once beyond its outputs (module docstring)."""
    return call_figures(func, args, kwargs).scratch


def call_figures(func: Any, args: tuple, kwargs: dict) -> Figures:
    """The :class:`Figures` of a call. Where a fake kernel returns a placeholder for a storage its real kernel
    fills (oneDNN's LSTM and GRU return their workspace, kept for backward, as 0 bytes under fake tensors), the
    meters count the real size (:func:`output_storages`)."""
    if func in UNCOUNTABLE_ON_FAKE and any(isinstance(t, FakeTensor) for t in tree_leaves((args, kwargs))):
        raise FxplanError(
            f"fxplan cannot measure {func} on fake tensors: its fake kernel gives the buffer the real kernel keeps "
            "for backward (the RNN's reserve) 0 bytes, and the op takes the kernel's own state, so it is not run "
            "for the real size either; any peak measured or planned would be low by it. Plan and train with that "
            "kernel off (for cuDNN: `with torch.backends.cudnn.flags(enabled=False):` around fxplan.rewrite and the "
            "training steps; PyTorch's own LSTM/GRU kernels then run, and fxplan counts them), or measure on real "
            "tensors (fxplan.measure_step(..., fake=False))")
    if not _ENABLED[0] or not _measurable(func):
        if _ENABLED[0] and func in _OPAQUE and func not in _WARNED:
            _WARNED.add(func)
            logger.warning("fxplan: %s takes a kernel's state from an earlier call, so its scratch is not measured; "
                           "measured peaks may be below the real step's by it", func)
        return _NONE
    key = _key(func, args, kwargs)
    if key is None or not _runnable(key):
        return _NONE
    if key not in _MEASURED:
        stored = _stored(key)
        if stored is not None:
            _MEASURED[key] = stored
        elif torch.autograd.profiler._is_profiler_enabled:
            logger.debug("kernel scratch of %s not measured: a profiler is running", func)
            return _NONE
        else:
            _MEASURED[key] = _measure(func, args, kwargs, key)
            _store(key, _MEASURED[key])
    return _MEASURED[key]


CUDA_BLOCK_BYTES = 512


def charged_bytes(nbytes: int, device: torch.device | None) -> int:
    """The bytes a device's allocator takes for a request of ``nbytes``. CUDA's caching allocator rounds every
    request up to a multiple of :data:`CUDA_BLOCK_BYTES` (its smallest block) and ``max_memory_allocated``
    counts the rounded blocks: on a 2-layer Qwen2 of width 32 that was 7.7% above the requested bytes (H100).
    The CPU's allocator is charged the request itself (torch.profiler reports requests there)."""
    if device is not None and device.type == "cuda" and nbytes:
        return -(-nbytes // CUDA_BLOCK_BYTES) * CUDA_BLOCK_BYTES
    return nbytes


def storage_bytes(t: torch.Tensor) -> int:
    """What ``t``'s storage takes on ``t``'s device (:func:`charged_bytes`; a fake tensor's storage is on the
    meta device, the tensor on the one it stands for)."""
    return charged_bytes(t.untyped_storage().nbytes(), t.device)


def output_storages(figures: Figures, outputs: list[torch.Tensor]) -> list[tuple[torch.UntypedStorage, int]]:
    """The storages of a call's tensor outputs (in order, once each) with the bytes to count for each: its own,
    or, where larger, what the real kernel's outputs on it held (a fake kernel may return one storage for two
    outputs the real one makes apart: oneDNN's LSTM backward, its two bias gradients), as the device's
    allocator charges them (:func:`charged_bytes`)."""
    refuse_unstrided(outputs)
    counted: dict[int, tuple[torch.UntypedStorage, int, torch.device]] = {}
    for i, t in enumerate(outputs):
        storage = t.untyped_storage()
        _, real, _ = counted.get(storage._cdata, (storage, 0, t.device))
        counted[storage._cdata] = (storage, real + (figures.output_bytes[i] if i < len(figures.output_bytes) else 0),
                                   t.device)
    return [(storage, charged_bytes(max(real, storage.nbytes()), device))
            for storage, real, device in counted.values()]


def refuse_unstrided(tensors: list[torch.Tensor]) -> None:
    """:class:`FxplanError` for a sparse (or other non-strided) tensor: the meters count storages, which such
    a tensor does not have as one (``nn.Embedding(sparse=True)`` makes its weight's gradient sparse)."""
    odd = next((t for t in tensors if t.layout != torch.strided), None)
    if odd is not None:
        raise FxplanError(f"the step makes a {odd.layout} tensor (of shape {tuple(odd.shape)}), which fxplan's "
                          "meters cannot count: they measure strided storages. Plan the model with dense tensors "
                          "(nn.Embedding and nn.EmbeddingBag with sparse=False)")


@contextlib.contextmanager
def not_counted() -> Iterator[None]:
    """Meters inside the block count what ops' storages alone hold: no kernel scratch, and not the generator
    states checkpoint keeps either (:class:`fxplan.rewriter.recompute.MeteredRngStates`); the replay likewise."""
    held, _ENABLED[0] = _ENABLED[0], False
    try:
        yield
    finally:
        _ENABLED[0] = held


def counted() -> bool:
    """False inside :func:`not_counted`."""
    return _ENABLED[0]


#: Arguments that carry a kernel's own state from an earlier call (an RNN's workspace or reserve, its packed
#: weights, cuDNN's dropout state, the random-number seed and offset of fused attention's dropout): random
#: bytes there crash the kernel (segmentation faults: ``mkldnn_rnn_layer_backward`` on a CPU,
#: ``_scaled_dot_product_efficient_attention_backward`` on an H100), so ops taking them are not run, except on the
#: state an earlier op makes from the same arguments (:data:`STATE_MAKERS`).
OPAQUE_STATE = ("workspace", "reserve", "weight_buf", "dropout_state", "philox", "rng_state", "seed")


def _rnn_layer_state(bound: dict[str, Any]) -> dict[str, Any]:
    """oneDNN's LSTM/GRU layer backward with the workspace (and outputs) its forward makes from the same inputs."""
    with torch.enable_grad():  # the forward makes its workspace only with grad on
        output, hy, cy, workspace = aten.mkldnn_rnn_layer.default(*(bound[name] for name in (
            "input", "weight1", "weight2", "weight3", "weight4", "hx_", "cx_tmp", "reverse", "batch_sizes", "mode",
            "hidden_size", "num_layers", "has_biases", "bidirectional", "batch_first", "train")))
    return {**bound, "output": output, "hy_": hy, "cy_": cy, "workspace": workspace}


def _efficient_attention_state(bound: dict[str, Any]) -> dict[str, Any]:
    """Memory-efficient attention's backward (CUDA) with the output, log-sum-exp and dropout seed and offset its
    forward makes from the same query, key, value and bias. Its scratch is a float32 workspace: 51 MB on a ViT-B
    at batch 64 on an H200, where the smallest plan peaks."""
    out, logsumexp, seed, offset = aten._scaled_dot_product_efficient_attention.default(
        bound["query"], bound["key"], bound["value"], bound["attn_bias"], True, bound["dropout_p"],
        bound["is_causal"], scale=bound.get("scale"))
    return {**bound, "out": out, "logsumexp": logsumexp, "philox_seed": seed, "philox_offset": offset}


def _flash_attention_state(bound: dict[str, Any]) -> dict[str, Any]:
    """Flash attention's backward with what its forward makes from the same query, key and value."""
    return _with_packed_state(bound, aten._scaled_dot_product_flash_attention.default(
        bound["query"], bound["key"], bound["value"], bound["dropout_p"], bound["is_causal"], False,
        scale=bound.get("scale")))


def _cudnn_attention_state(bound: dict[str, Any]) -> dict[str, Any]:
    """cuDNN attention's backward with what its forward makes from the same query, key, value and bias."""
    return _with_packed_state(bound, aten._scaled_dot_product_cudnn_attention.default(
        bound["query"], bound["key"], bound["value"], bound["attn_bias"], True, bound["dropout_p"],
        bound["is_causal"], False, scale=bound.get("scale")))


def _with_packed_state(bound: dict[str, Any], made: tuple) -> dict[str, Any]:
    """A flash or cuDNN attention backward's arguments with what its forward returned (the same nine values)."""
    out, logsumexp, cum_q, cum_k, max_q, max_k, seed, offset, _ = made
    return {**bound, "out": out, "logsumexp": logsumexp, "cum_seq_q": cum_q, "cum_seq_k": cum_k, "max_q": max_q,
            "max_k": max_k, "philox_seed": seed, "philox_offset": offset}


#: Ops taking opaque state (``OPAQUE_STATE``) that an op run first on the same (random) arguments makes: measured
#: on that state, not on random bytes. Maps the op to what rebuilds its arguments, by schema name.
STATE_MAKERS: dict[Any, Callable[[dict[str, Any]], dict[str, Any]]] = {
    aten.mkldnn_rnn_layer_backward.default: _rnn_layer_state,
    aten._scaled_dot_product_efficient_attention_backward.default: _efficient_attention_state,
    aten._scaled_dot_product_flash_attention_backward.default: _flash_attention_state,
    aten._scaled_dot_product_cudnn_attention_backward.default: _cudnn_attention_state,
}

#: Ops whose fake kernel returns a buffer kept for backward as a placeholder and that take opaque state
#: (``OPAQUE_STATE``), so no real run gives its size: torch's meta kernels of cuDNN's and MIOpen's RNN make
#: their reserve 0 bytes. A fake-tensor meter cannot count them, and refuses them (:class:`FxplanError`).
UNCOUNTABLE_ON_FAKE = {aten._cudnn_rnn.default, aten.miopen_rnn.default}

_MEASURABLE: dict[Any, bool] = {}
_OPAQUE: set[Any] = set()  # ATen ops not measured for taking opaque state: warned of once (_WARNED)
_WARNED: set[Any] = set()


def _measurable(func: Any) -> bool:
    """An ATen op whose outputs are not views of its inputs and that takes no opaque state (``OPAQUE_STATE``)."""
    if func not in _MEASURABLE:
        schema = getattr(func, "_schema", None)
        aten = isinstance(func, torch._ops.OpOverload) and func.namespace == "aten"
        opaque = aten and func not in STATE_MAKERS and any(word in a.name for a in schema.arguments
                                                          for word in OPAQUE_STATE)
        if opaque:
            _OPAQUE.add(func)
        _MEASURABLE[func] = (
            aten and not opaque
            and not any(r.alias_info is not None and not r.alias_info.is_write for r in schema.returns)
        )
    return _MEASURABLE[func]


_UNRUNNABLE: set[str] = set()


def _runnable(key: tuple) -> bool:
    """Whether this process can run the call's kernels: fake tensors of a CUDA model planned on a machine
    without a GPU (or on the meta device) cannot be measured; their scratch counts as none (logged once)."""
    for device in _devices(key):
        module = getattr(torch, device, None)
        usable = device == "cpu" or (device != "meta" and module is not None and module.is_available())
        if not usable:
            if device not in _UNRUNNABLE:
                _UNRUNNABLE.add(device)
                logger.info("fxplan: kernel scratch on %s is not measured here (no such device in this process); "
                            "counted as none", device)
            return False
    return True


def _key(func: Any, args: tuple, kwargs: dict) -> tuple | None:
    """The call's key: op, a flat description of its arguments (structure included), the thread count and grad mode;
    None for symbolic shapes or an argument of no known kind. Made for every op of every measured step, so
    written without pytree (its spec's repr cost 15% of a fake ResNet-50 step)."""
    described: list[Any] = []
    try:
        _describe((args, kwargs), described)
    except (TypeError, RuntimeError):
        return None
    return func, tuple(described), torch.get_num_threads(), torch.is_grad_enabled()


_PLAIN = (bool, int, float, str, torch.dtype, torch.device, torch.layout, torch.memory_format)


def _describe(x: Any, out: list[Any]) -> None:
    """Append ``x``'s description to ``out``: a tensor's shape, strides, offset, dtype and device type, a
    container's kind and size before its items, plain values as they are."""
    if isinstance(x, torch.Tensor):
        out.append(("T", tuple(x.shape), x.stride(), x.storage_offset(), x.dtype, x.device.type))
    elif isinstance(x, (list, tuple)):
        out.append(("[" if isinstance(x, list) else "(", len(x)))
        for item in x:
            _describe(item, out)
    elif isinstance(x, dict):
        out.append(("{", tuple(x)))
        for item in x.values():
            _describe(item, out)
    elif x is None or isinstance(x, _PLAIN):  # symbolic sizes (SymInt...) are none of these
        out.append(x)
    else:
        raise TypeError(type(x).__name__)


CACHE_NAME = "kernel_scratch.json"
_FILE: dict[str, dict[str, int]] | None = None  # the cache file's figures, by machine and repr of the key
_UNSAVED = [0]


def _devices(key: tuple) -> set[str]:
    """The device types of the call's tensors (:func:`_key`)."""
    return {leaf[5] for leaf in key[1] if isinstance(leaf, tuple) and leaf[:1] == ("T",)}


def _machine(key: tuple) -> str:
    return machine_key(torch.device(min(_devices(key) or {"cpu"})))


def _stored(key: tuple) -> Figures | None:
    """The figures kept in the cache file (``kernel_scratch.json`` in the folder of
    :data:`fxplan.common.cache.CACHE_DIR_ENV`) for ``key`` on this machine, torch and thread count; None if none
    (or a bare number, the scratch alone, written before output sizes were compared: measured again)."""
    global _FILE
    if _FILE is None:
        _FILE = read_cache(CACHE_NAME)
        atexit.register(_save)
    got = _FILE.get(_machine(key), {}).get(repr(key))
    if not isinstance(got, list):
        return None
    return Figures(got[0], tuple(got[1]))


def _store(key: tuple, figures: Figures) -> None:
    _FILE.setdefault(_machine(key), {})[repr(key)] = [figures.scratch, list(figures.output_bytes)]
    _UNSAVED[0] += 1
    if _UNSAVED[0] >= 256:
        _save()


def _save() -> None:
    """Write the figures measured here into the cache file, beside those other processes wrote."""
    if _UNSAVED[0] and _FILE is not None:
        merged = read_cache(CACHE_NAME)
        for machine, figures in _FILE.items():
            merged[machine] = {**merged.get(machine, {}), **figures}
        write_cache(merged, CACHE_NAME)
        _UNSAVED[0] = 0


def _measure(func: torch._ops.OpOverload, args: tuple, kwargs: dict, key: tuple) -> Figures:
    tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
    total = sum(t.untyped_storage().nbytes() for t in tensors)
    if total > MAX_BYTES:
        logger.info("fxplan: kernel scratch of %s not measured (%d bytes of arguments); counted as none", func, total)
        return _NONE
    devices = sorted({t.device.index or 0 for t in tensors if t.device.type == "cuda"})
    from torch.profiler import ProfilerActivity, profile, record_function

    # grad mode as the call had it (the key holds it): oneDNN's RNN layer makes its workspace only with grad on
    with _disable_current_modes(), unset_fake_temporarily(), torch.random.fork_rng(devices=devices), \
            torch.set_grad_enabled(key[3]):
        real_args, real_kwargs = tree_map(_real_like, (args, kwargs))
        try:
            if func in STATE_MAKERS:
                real_args, real_kwargs = with_state_made(func, real_args, real_kwargs)
            with filter_native_logs(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
                with record_function(_MARK):
                    real_out = func(*real_args, **real_kwargs)
            sizes, seen = [], set()
            for t in (t for t in tree_leaves(real_out) if isinstance(t, torch.Tensor)):
                storage = t.untyped_storage()
                sizes.append(0 if storage._cdata in seen else storage.nbytes())
                seen.add(storage._cdata)
            del real_out
        except Exception as exc:  # noqa: BLE001 (an op that needs values these random ones are not: no figure)
            logger.debug("kernel scratch of %s not measured: %s", func, exc)
            return _NONE
    return Figures(_scratch_in(prof), tuple(sizes))


def with_state_made(func: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """``func``'s arguments with the opaque state its :data:`STATE_MAKERS` entry makes from the others, every
    argument bound by name (defaults included: a dispatched call leaves out those it does not set)."""
    schema = func._schema.arguments
    bound = {a.name: a.default_value for a in schema if a.has_default_value()}
    bound.update(zip((a.name for a in schema), args))
    bound.update(kwargs)
    bound = STATE_MAKERS[func](bound)
    return (tuple(bound[a.name] for a in schema if not a.kwarg_only),
            {a.name: bound[a.name] for a in schema if a.kwarg_only})


def _real_like(x: Any) -> Any:
    """A real tensor with ``x``'s shape, strides, dtype and device (random floats, zeros otherwise: zero is a
    valid index for any gather or embedding); other values unchanged."""
    if not isinstance(x, torch.Tensor):
        return x
    storage = torch.empty(x.untyped_storage().nbytes() // x.element_size(), dtype=x.dtype, device=x.device)
    if x.dtype.is_floating_point or x.dtype.is_complex:
        storage.normal_()
    else:
        storage.zero_()
    return storage.as_strided(tuple(x.shape), x.stride(), x.storage_offset())


def _scratch_in(prof: Any) -> int:
    """The highest total of the allocations inside the marked range less what they still hold at its end."""
    from torch._C._profiler import _EventType

    events: list[tuple[int, int]] = []

    def allocations(node: Any) -> None:
        if node.tag == _EventType.Allocation:
            events.append((node.start_time_ns, node.extra_fields.alloc_size))
        for child in node.children:
            allocations(child)

    def marked(node: Any) -> None:
        if node.name == _MARK:
            allocations(node)
            return
        for child in node.children:
            marked(child)

    for root in prof.profiler.kineto_results.experimental_event_tree():
        marked(root)
    current = highest = 0
    for _, size in sorted(events):
        current += size
        highest = max(highest, current)
    return max(0, highest - current)
