"""Fixtures of the model tests."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def kernels():
    """The C++ CPU kernels; the test is skipped where they cannot be built (a module may define its own)."""
    from nanoserve.model.kernels import cpu_kernels

    module = cpu_kernels()
    if module is None:
        pytest.skip("the C++ kernels cannot be built on this machine")
    return module
