"""Shared test fixtures."""

import ctypes
import ctypes.util
import gc

import pytest
import torch

_LIBC = ctypes.CDLL(ctypes.util.find_library("c") or None)


@pytest.fixture(scope="module")
def one_torch_thread():
    """Run a test module on one intra-op thread, restored afterwards.

    On a shared 2-core machine the thread pool costs more than it saves on the small inputs the tests
    use, and bitwise comparisons only need both sides to run with the same setting.
    """
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(autouse=True, scope="module")
def return_freed_memory():
    """After each test module, hand the heap memory its models freed back to the system.

    The suite runs in one process, and glibc keeps freed heap pages for reuse: the resident size only
    grew from module to module (zoo models built, rewritten, dropped) and reached CI's ~6 GB line.
    ``malloc_trim`` (glibc only; a no-op elsewhere) returns them.
    """
    yield
    gc.collect()
    trim = getattr(_LIBC, "malloc_trim", None)
    if trim is not None:
        trim(0)
