"""How the unquantized weights serve decode-sized steps, measured once per CPU and weight shape: for bf16,
the blocked layout oneDNN's weights are packed in; for float32, up to which step size the C++ dense_matmul
beats torch's matmul.

`torch.ops.mkldnn._reorder_linear_weight(weight, batch)` lays a weight out for the kernel oneDNN would
pick at that batch size, and every later step, whatever its size, runs on that layout. On a two-core
AMX Xeon the layout for batch 1 (64-column blocks) left a 576-column matmul split 5 blocks to 4 between
the threads; the one for batch 32 (32-column blocks) ran the model's 64-row steps 18 % faster per
layer and decoded batch 64 1.15x faster, but 512-row steps of the 576-column weights 1.5x slower,
where F.linear on the plain weight (laid out anew for each call's size) was as fast as batch 1's
layout. Which wins depends on the CPU's kernels and the thread count, so with matmul_choice "auto" each
shape's layout is measured when the engine starts: every candidate's time at decode step sizes, with
the engine's threads (the split between them is what differs), over the weights of the shape as a step
reads them (at most STREAMED_BYTES of them), best of PASSES interleaved passes; the winner has the
lowest sum of times relative to the fastest at each size. Then the winner against the plain weight at
prefill sizes, over one weight (they are compute-bound): Linear.plain_from is the smallest size from
which the plain weight stays faster. "fixed" keeps batch 1's layout at every size.

float32 weights are not packed: their small steps run on dense_matmul (nanoserve/model/kernels/
dense_matmul.cpp), which streams the weight at the memory's speed where torch's matmul reached half of it,
and Linear.plain_from is measured the same way, dense_matmul against the plain weight at decode and
prefill sizes ("fixed": DENSE_PLAIN_FROM). Both choices are cached in matmul_choice.json
(nanoserve.model.matmul_choice) under the CPU, thread count, dtype and shape.
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
from nanoserve.model.layers.linear import pack_weight, packed_linear
from nanoserve.model.matmul_choice import cache_file, read_cache, time_calls, write_cache

logger = logging.getLogger(__name__)

BATCH_HINTS = (1, 32)
"""The layouts tried: oneDNN's for these batch sizes (the first is the "fixed" one)."""
STEP_SIZES = (1, 16, 64)
PREFILL_STEP_SIZES = (128, 256, 512)
PASSES = 3
STREAMED_BYTES = 256 << 20
"""Weights of a shape timed per pass, up to this many bytes: enough to leave the caches, little enough
that two packed copies of them fit beside a large model."""
DENSE_STEP_SIZES = (1, 4, 16, 64)
DENSE_PLAIN_FROM = 64
"""The fixed choice for float32: dense_matmul for steps under 64 rows (over SmolLM2-135M's weights on a
2-core Zen 3 it took 0.58x torch's time at 1 row, 0.38x at 4, 0.63x at 16 and 0.9x at 64)."""


def pack_key(shape: tuple[int, int], dtype: torch.dtype, what: str = "layout") -> str:
    """The cache key of a shape's choice: what ("layout" or "dense"), CPU, thread count, dtype and shape."""
    threads = torch.get_num_threads()
    return f"{library_name(cpu_identity())} {what} {threads} threads {dtype} {shape[0]}x{shape[1]}"


def best_hint(times: dict[int, dict[int, float]]) -> int:
    """times: batch hint -> step size -> seconds; the hint with the lowest sum over step sizes of its
    time relative to the fastest hint's at that size."""
    sizes = next(iter(times.values())).keys()
    fastest = {size: min(by_size[size] for by_size in times.values()) for size in sizes}
    return min(times, key=lambda hint: sum(times[hint][size] / fastest[size] for size in sizes))


def plain_from(packed: dict[int, float], plain: dict[int, float]) -> int:
    """Step size -> seconds for the packed and the plain weight: the smallest size from which the plain
    one is faster at it and at every larger size; sys.maxsize where it is not faster at the largest."""
    start = sys.maxsize
    for size in sorted(plain, reverse=True):
        if plain[size] >= packed[size]:
            break
        start = size
    return start


def _packed_matmul(packed: Tensor) -> Callable[[Tensor], Tensor]:
    return functools.partial(packed_linear, packed=packed, bias=None)


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


def streamed_count(weights: Sequence[Tensor]) -> int:
    """How many of a shape's weights a decode-sized pass reads: all, up to STREAMED_BYTES."""
    count = 1
    while count < len(weights) and sum(w.nbytes for w in weights[: count + 1]) <= STREAMED_BYTES:
        count += 1
    return count


def measure_layout(weights: Sequence[Tensor], prefill: bool = True) -> dict:
    """The entry cached for a shape: {"batch_hint", "plain_from", "times"} (times: the decode sizes'
    per hint, the prefill sizes' of the winner and of the plain weight; prefill False: a weight that
    never sees prefill-sized steps, whose plain_from is left at sys.maxsize)."""
    count = streamed_count(weights)
    in_features, dtype = weights[0].shape[1], weights[0].dtype
    packed = {hint: [_packed_matmul(pack_weight(w, hint)) for w in weights[:count]] for hint in BATCH_HINTS}
    by_hint = _best_of_passes(packed, STEP_SIZES, in_features, dtype)
    hint = best_hint(by_hint)
    if not prefill:
        return {"batch_hint": hint, "plain_from": sys.maxsize, "times": {"decode": by_hint}}
    large = _best_of_passes(
        {"packed": packed[hint][:1], "plain": [functools.partial(F.linear, weight=weights[0])]},
        PREFILL_STEP_SIZES,
        in_features,
        dtype,
    )
    return {
        "batch_hint": hint,
        "plain_from": plain_from(large["packed"], large["plain"]),
        "times": {"decode": by_hint, "prefill": large},
    }


def measure_dense(weights: Sequence[Tensor], kernel: Callable, prefill: bool = True) -> dict:
    """The entry cached for a float32 shape: {"plain_from", "times"}, dense_matmul (kernel) against the
    plain weight at decode sizes over the weights a step reads and, with prefill, at prefill sizes over one."""
    count = streamed_count(weights)
    in_features, dtype = weights[0].shape[1], weights[0].dtype

    def candidates(weights: Sequence[Tensor]) -> dict:
        return {
            "dense": [functools.partial(kernel, weight=w, bias=None) for w in weights],
            "plain": [functools.partial(F.linear, weight=w) for w in weights],
        }

    times = _best_of_passes(candidates(weights[:count]), DENSE_STEP_SIZES, in_features, dtype)
    if prefill:
        large = _best_of_passes(candidates(weights[:1]), PREFILL_STEP_SIZES, in_features, dtype)
        times = {name: times[name] | large[name] for name in times}
    return {"plain_from": plain_from(times["dense"], times["plain"]), "times": times}


def _cached_choices(
    weights_by_shape: dict[tuple[int, int], list[Tensor]],
    what: str,
    measure: Callable[[tuple[int, int]], dict],
) -> dict[tuple[int, int], dict]:
    """Each shape's entry from the cache, or measure(shape) (then cached)."""
    path = cache_file()
    cached = read_cache(path)
    keys = {shape: pack_key(shape, weights[0].dtype, what) for shape, weights in weights_by_shape.items()}
    missing = [shape for shape, key in keys.items() if key not in cached]
    if missing:
        start = time.perf_counter()
        for shape in missing:
            cached[keys[shape]] = measure(shape)
        logger.info(
            "measured the %s choice of %d weight shapes in %.1f s",
            what,
            len(missing),
            time.perf_counter() - start,
        )
        write_cache(path, read_cache(path) | {keys[shape]: cached[keys[shape]] for shape in missing})
    return {shape: cached[key] for shape, key in keys.items()}


def choose_layouts(
    weights_by_shape: dict[tuple[int, int], list[Tensor]],
    decode_only: frozenset[tuple[int, int]] = frozenset(),
) -> dict[tuple[int, int], dict]:
    """Each bf16 shape's entry ({"batch_hint", "plain_from", ...}), from the cache or measured (then
    cached); decode_only: shapes measured at decode sizes only (see measure_layout)."""
    return _cached_choices(
        weights_by_shape,
        "layout",
        lambda shape: measure_layout(weights_by_shape[shape], shape not in decode_only),
    )


def choose_dense_limits(
    weights_by_shape: dict[tuple[int, int], list[Tensor]],
    kernel: Callable,
    decode_only: frozenset[tuple[int, int]] = frozenset(),
) -> dict[tuple[int, int], dict]:
    """Each float32 shape's entry ({"plain_from", "times"}), from the cache or measured (then cached)."""
    return _cached_choices(
        weights_by_shape,
        "dense",
        lambda shape: measure_dense(weights_by_shape[shape], kernel, shape not in decode_only),
    )
