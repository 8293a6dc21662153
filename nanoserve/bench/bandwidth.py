"""This machine's memory read bandwidth, measured the way STREAM's read kernels do: a sum over a buffer
far larger than the caches, on every thread torch uses, best of several passes. A decode step cannot
take less time than the weight bytes it reads divided by this, so it is the roofline `bench throughput`
puts beside each engine's achieved rate."""

from __future__ import annotations

import time

import torch

BUFFER_MIB = 512
PASSES = 7


def read_bandwidth(mib: int = BUFFER_MIB, passes: int = PASSES) -> float:
    """Bytes per second."""
    buffer = torch.ones(mib * 2**20 // 4, dtype=torch.float32)
    buffer.sum()  # first touch
    best = float("inf")
    for _ in range(passes):
        start = time.perf_counter()
        buffer.sum()
        best = min(best, time.perf_counter() - start)
    return buffer.nbytes / best
