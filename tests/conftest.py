"""Shared test fixtures."""

import pytest
import torch


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
