"""Which blocked layout oneDNN's bf16 weights are packed in, measured once per CPU and weight shape.

`torch.ops.mkldnn._reorder_linear_weight(weight, batch)` lays a weight out for the kernel oneDNN would
pick at that batch size, and every later step, whatever its size, runs on that layout. On a two-core
AMX Xeon the layout for batch 1 (64-column blocks) left a 576-column matmul split 5 blocks to 4 between
the threads; the one for batch 32 (32-column blocks) ran the model's 64-row steps 18 % faster per
layer and decoded batch 64 1.15x faster, with batch 1 and a 512-token prefill unchanged. Which layout
wins depends on the CPU's kernels and the thread count, so with matmul_choice "auto" each shape's is
measured when the engine starts: every candidate layout's time at decode step sizes, with the engine's
threads (the split between them is what differs), over the weights of the shape as a step reads them
(at most STREAMED_BYTES of them), best of PASSES interleaved passes. The winner, the lowest sum of
times relative to the fastest at each size, is cached in matmul_choice.json (nanoserve.model.matmul_choice)
under the CPU, thread count, dtype and shape. "fixed" keeps batch 1's layout.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

import torch
from torch import Tensor

from nanoserve.model.kernels import cpu_identity, library_name
from nanoserve.model.layers.linear import pack_weight, packed_linear
from nanoserve.model.matmul_choice import cache_file, read_cache, write_cache

logger = logging.getLogger(__name__)

BATCH_HINTS = (1, 32)
"""The layouts tried: oneDNN's for these batch sizes (the first is the "fixed" one)."""
STEP_SIZES = (1, 16, 64)
PASSES = 3
STREAMED_BYTES = 256 << 20
"""Weights of a shape timed per pass, up to this many bytes: enough to leave the caches, little enough
that two packed copies of them fit beside a large model."""


def pack_key(shape: tuple[int, int], dtype: torch.dtype) -> str:
    return (
        f"{library_name(cpu_identity())} pack {torch.get_num_threads()} threads {dtype} {shape[0]}x{shape[1]}"
    )


def best_hint(times: dict[int, dict[int, float]]) -> int:
    """times: batch hint -> step size -> seconds; the hint with the lowest sum over step sizes of its
    time relative to the fastest hint's at that size."""
    sizes = next(iter(times.values())).keys()
    fastest = {size: min(by_size[size] for by_size in times.values()) for size in sizes}
    return min(times, key=lambda hint: sum(times[hint][size] / fastest[size] for size in sizes))


def _time(packed: Sequence[Tensor], x: Tensor) -> float:
    start = time.perf_counter()
    for weight in packed:
        packed_linear(x, weight, None)
    return time.perf_counter() - start


def measure_times(weights: Sequence[Tensor]) -> dict[int, dict[int, float]]:
    """Batch hint -> step size -> the best pass's seconds over the (first STREAMED_BYTES of) weights."""
    count = 1
    while count < len(weights) and sum(w.nbytes for w in weights[: count + 1]) <= STREAMED_BYTES:
        count += 1
    packed = {hint: [pack_weight(w, hint) for w in weights[:count]] for hint in BATCH_HINTS}
    generator = torch.Generator().manual_seed(0)  # the engine's own random state stays as it was
    times: dict[int, dict[int, float]] = {hint: {} for hint in BATCH_HINTS}
    with torch.inference_mode():
        for size in STEP_SIZES:
            x = torch.randn(size, weights[0].shape[1], generator=generator).to(weights[0].dtype)
            for hint in BATCH_HINTS:
                _time(packed[hint], x)  # oneDNN builds its kernel for a new size
            for _ in range(PASSES):
                for hint in BATCH_HINTS:
                    elapsed = _time(packed[hint], x)
                    times[hint][size] = min(times[hint].get(size, elapsed), elapsed)
    return times


def choose_batch_hints(weights_by_shape: dict[tuple[int, int], list[Tensor]]) -> dict[tuple[int, int], int]:
    """Each shape's batch hint for pack_weight, from the cache or measured (then cached)."""
    path = cache_file()
    cached = read_cache(path)
    keys = {shape: pack_key(shape, weights[0].dtype) for shape, weights in weights_by_shape.items()}
    missing = [shape for shape, key in keys.items() if key not in cached]
    if missing:
        start = time.perf_counter()
        for shape in missing:
            times = measure_times(weights_by_shape[shape])
            cached[keys[shape]] = {"batch_hint": best_hint(times), "times": times}
        logger.info(
            "measured the packed layout of %d weight shapes in %.1f s",
            len(missing),
            time.perf_counter() - start,
        )
        write_cache(path, read_cache(path) | {keys[shape]: cached[keys[shape]] for shape in missing})
    return {shape: cached[key]["batch_hint"] for shape, key in keys.items()}
