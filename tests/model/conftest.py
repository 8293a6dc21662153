"""Fixtures of the model tests."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="module")
def kernels():
    """The C++ CPU kernels; the test is skipped where they cannot be built (a module may define its own)."""
    from nanoserve.model.kernels import cpu_kernels

    module = cpu_kernels()
    if module is None:
        pytest.skip("the C++ kernels cannot be built on this machine")
    return module


@pytest.fixture
def two_threads():
    """The split of attention into parts depends on the thread count: make it the same on every machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)
