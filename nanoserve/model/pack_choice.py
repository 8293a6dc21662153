"""How oneDNN's bf16 weights are laid out, measured once per CPU and weight shape.

`torch.ops.mkldnn._reorder_linear_weight(weight, batch)` lays a weight out for the kernel oneDNN would
pick at that batch size, and every later step, whatever its size, runs on that layout. On a two-core
AMX Xeon the layout for batch 1 (64-column blocks) left a 576-column matmul split 5 blocks to 4 between
the threads; the one for batch 32 (32-column blocks) ran the model's 64-row steps 18 % faster per
layer and decoded batch 64 1.15x faster, but 512-row steps of the 576-column weights 1.5x slower,
where F.linear on the plain weight (laid out anew for each call's size) was as fast as batch 1's
layout. Which wins depends on the CPU's kernels and the thread count, so with matmul_choice "auto" each
shape's layout is measured when the engine starts, over the steps it serves: every candidate's time at
the decode step sizes its weights serve and at prefill sizes, with the engine's threads (the split
between them is what differs), over the weights of the shape as a step reads them (at most
STREAMED_BYTES of them: one weight repeated stays in the caches and hides what a layout costs to read),
best of PASSES interleaved passes; the winner has the lowest sum of times relative to the fastest at
each size. Where a quantized copy serves the small steps (--quantization int4, up to its limit), only the
larger ones count: on the Xeon above, gate_up's batch-1 layout won by a hair over 1, 16 and 64 rows, but
batch 32's decoded batch 64 of an int4 engine 1.1x faster, since int4 serves the first two. Then the
winner against the plain weight at prefill sizes: Linear.plain_from is the smallest size from which the
plain weight stays faster. With the C++ kernels, the winner also runs by rows at those sizes (each thread
its own share of the rows on oneDNN alone, nanoserve/model/kernels/packed_linear.cpp): Linear.split_from is
the smallest size from which that stays faster than both. All three are cached in matmul_choice.json
(nanoserve.model.matmul_choice) under the CPU, thread count, dtype, shape and smallest size served.
"fixed" keeps batch 1's layout at every size.
"""

from __future__ import annotations

import functools
import logging
import sys
import time
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from nanoserve.model.kernels import cpu_identity, library_name
from nanoserve.model.layers.linear import RowsMatmul, pack_weight, packed_linear
from nanoserve.model.matmul_choice import cache_file, read_cache, time_calls, write_cache

logger = logging.getLogger(__name__)

BATCH_HINTS = (1, 32)
"""The layouts tried: oneDNN's for these batch sizes (the first is the "fixed" one)."""
STEP_SIZES = (1, 16, 64)
PREFILL_STEP_SIZES = (128, 256, 512)
PASSES = 3
METHOD = "served-sizes"
"""Part of the cache key: answers measured another way are measured again."""
STREAMED_BYTES = 256 << 20
"""Weights of a shape timed per pass, up to this many bytes: enough to leave the caches, little enough
that two packed copies of them fit beside a large model."""


def pack_key(shape: tuple[int, int], dtype: torch.dtype, served_from: int = 1, by_rows: bool = False) -> str:
    """by_rows: whether the shape's steps may run by rows (measured with the kernels)."""
    threads = torch.get_num_threads()
    return (
        f"{library_name(cpu_identity())} layout {threads} threads {dtype} {shape[0]}x{shape[1]}"
        f" from {served_from} rows {METHOD} {'by rows' if by_rows else 'whole'}"
    )


def best_hint(times: dict[int, dict[int, float]]) -> int:
    """times: batch hint -> step size -> seconds; the hint with the lowest sum over step sizes of its
    time relative to the fastest hint's at that size."""
    sizes = next(iter(times.values())).keys()
    fastest = {size: min(by_size[size] for by_size in times.values()) for size in sizes}
    return min(times, key=lambda hint: sum(times[hint][size] / fastest[size] for size in sizes))


def faster_from(current: dict[int, float], candidate: dict[int, float]) -> int:
    """Step size -> seconds for the current way and a candidate: the smallest size from which the
    candidate is faster at it and at every larger size; sys.maxsize where it is not faster at the largest."""
    start = sys.maxsize
    for size in sorted(candidate, reverse=True):
        if candidate[size] >= current[size]:
            break
        start = size
    return start


def _packed_matmul(packed: Tensor) -> Callable[[Tensor], Tensor]:
    return functools.partial(packed_linear, packed=packed, bias=None)


def _by_rows_matmul(by_rows: RowsMatmul, packed: Tensor, out_features: int) -> Callable[[Tensor], Tensor]:
    return lambda x: by_rows(x, packed, None, out_features)


def _best_of_passes(candidates: dict, sizes: Sequence[int], in_features: int, dtype: torch.dtype) -> dict:
    """candidates: name -> the matmuls of one pass; name -> step size -> the best pass's seconds."""
    generator = torch.Generator().manual_seed(0)  # the engine's own random state stays as it was
    times: dict = {name: {} for name in candidates}
    with torch.inference_mode():
        for size in sizes:
            x = torch.randn(size, in_features, generator=generator).to(dtype)
            for matmuls in candidates.values():
                time_calls(matmuls, x)  # oneDNN builds its kernel for a new size
            for _ in range(PASSES):
                for name, matmuls in candidates.items():
                    elapsed = time_calls(matmuls, x)
                    times[name][size] = min(times[name].get(size, elapsed), elapsed)
    return times


def measure_layout(
    weights: Sequence[Tensor], prefill: bool = True, served_from: int = 1, by_rows: RowsMatmul | None = None
) -> dict:
    """The entry cached for a shape: {"batch_hint", "plain_from", "split_from", "times"} (times: per layout
    at the decode and prefill sizes it serves, the plain weight's and each layout's by rows at those prefill
    sizes). served_from: the smallest step the layout serves (a quantized copy takes the smaller ones; past
    every prefill size, the largest stands in); prefill False: a weight that never sees prefill-sized
    steps, whose plain_from and split_from are left at sys.maxsize; by_rows: the kernels'
    packed_linear_by_rows (None: no step runs by rows)."""
    count = 1
    while count < len(weights) and sum(w.nbytes for w in weights[: count + 1]) <= STREAMED_BYTES:
        count += 1
    out_features, in_features, dtype = weights[0].shape[0], weights[0].shape[1], weights[0].dtype
    packed_weights = {hint: [pack_weight(w, hint) for w in weights[:count]] for hint in BATCH_HINTS}
    packed = {hint: [_packed_matmul(p) for p in packed_weights[hint]] for hint in BATCH_HINTS}
    decode_sizes = [size for size in STEP_SIZES if size >= served_from]
    by_hint = _best_of_passes(packed, decode_sizes, in_features, dtype) if decode_sizes else {}
    if not prefill:
        hint = best_hint(by_hint) if by_hint else BATCH_HINTS[0]
        return {
            "batch_hint": hint,
            "plain_from": sys.maxsize,
            "split_from": sys.maxsize,
            "times": {"decode": by_hint},
        }
    prefill_sizes = [size for size in PREFILL_STEP_SIZES if size >= served_from] or [PREFILL_STEP_SIZES[-1]]
    plain = [functools.partial(F.linear, weight=w) for w in weights[:count]]
    split = {}
    if by_rows is not None:
        split = {
            f"rows {hint}": [_by_rows_matmul(by_rows, p, out_features) for p in packed_weights[hint]]
            for hint in BATCH_HINTS
        }
    large = _best_of_passes(packed | {"plain": plain} | split, prefill_sizes, in_features, dtype)
    winner = best_hint({hint: by_hint.get(hint, {}) | large[hint] for hint in BATCH_HINTS})
    unsplit = {size: min(large[winner][size], large["plain"][size]) for size in prefill_sizes}
    return {
        "batch_hint": winner,
        "plain_from": faster_from(large[winner], large["plain"]),
        "split_from": faster_from(unsplit, large[f"rows {winner}"]) if split else sys.maxsize,
        "times": {
            "decode": by_hint,
            "prefill": {hint: large[hint] for hint in BATCH_HINTS},
            "plain": large["plain"],
            "by_rows": {hint: large[f"rows {hint}"] for hint in BATCH_HINTS} if split else {},
        },
    }


def choose_layouts(
    weights_by_shape: dict[tuple[int, int], list[Tensor]],
    decode_only: frozenset[tuple[int, int]] = frozenset(),
    served_from: dict[tuple[int, int], int] | None = None,
    by_rows: RowsMatmul | None = None,
) -> dict[tuple[int, int], dict]:
    """Each shape's entry ({"batch_hint", "plain_from", "split_from", ...}), from the cache or measured
    (then cached); decode_only: shapes measured at decode sizes only; served_from: per shape, the smallest
    step its packed weights serve (default 1); by_rows: the kernels' packed_linear_by_rows, or None (see
    measure_layout)."""
    served = served_from or {}
    path = cache_file()
    cached = read_cache(path)
    keys = {
        shape: pack_key(shape, weights[0].dtype, served.get(shape, 1), by_rows is not None)
        for shape, weights in weights_by_shape.items()
    }
    missing = [shape for shape, key in keys.items() if key not in cached]
    if missing:
        start = time.perf_counter()
        for shape in missing:
            cached[keys[shape]] = measure_layout(
                weights_by_shape[shape], shape not in decode_only, served.get(shape, 1), by_rows
            )
        logger.info(
            "measured the layout of %d bf16 weight shapes in %.1f s",
            len(missing),
            time.perf_counter() - start,
        )
        write_cache(path, read_cache(path) | {keys[shape]: cached[keys[shape]] for shape in missing})
    return {shape: cached[key] for shape, key in keys.items()}
