"""Shared test fixtures."""

import os

import pytest
import torch


def pytest_configure(config):
    """Under pytest-xdist, the cores shared among the workers: torch's thread pools would contend otherwise."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // workers))


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
