"""How far ahead quant_matmul prefetches the weights it streams, measured once per CPU.

A batch-1 decode step reads every quantized weight once, and the tile loops ask for the codes a fixed
distance ahead of the group they multiply (prefetch_group_ahead, kernels/kernels.h). Which distance pays
best depends on the CPU: on a Zen 1, 4096 bytes made the batch-1 step faster than 2048 or 8192, while on
a two-core AMD EPYC Zen 3 the step took 0.95x the time with 1024 (three runs in one process, switching
every 128-token generate: 0.949, 0.950, 0.951x) and 0.96-0.985x with 2048. So with matmul_choice "auto"
the engine times passes of one row over the model's quantized weights, in the order a step reads them (up
to STREAMED_BYTES), with each of DISTANCES in ROUNDS interleaved rounds, and keeps the distance whose time
over its round's mean has the lowest median: the memory bandwidth of a shared machine moves from minute to
minute, so each round is compared within itself. The answer is cached in matmul_choice.json under the
kernel build (CPU model and flags included) and the thread count. The distance holds for the whole
process (the engine started last sets it for all), and it changes no result, only how soon the codes
arrive; "fixed" keeps DEFAULT_DISTANCE.
"""

from __future__ import annotations

import logging
import statistics
import time
from pathlib import Path
from types import ModuleType

import torch

from nanoserve.model.kernels import cpu_identity, library_name
from nanoserve.model.layers.causal_lm import CausalLM
from nanoserve.model.matmul_choice import cache_file, read_cache, write_cache
from nanoserve.model.quant import GroupQuantWeight

logger = logging.getLogger(__name__)

DEFAULT_DISTANCE = 4096
DISTANCES = (1024, 2048, DEFAULT_DISTANCE)
ROUNDS = 31
STREAMED_BYTES = 256 << 20
"""Weights timed per pass, up to this many bytes: enough to leave the caches on a small model's step."""
MIN_STREAMED_BYTES = 64 << 20
"""Fewer weight bytes than this, or than twice the largest cache (a test's tiny model; a mid-sized one on a
CPU with hundreds of MB of L3), would stay in the caches from pass to pass and time nothing of memory:
such a model is not measured, and runs at the distance a larger one measured on this machine, or at
DEFAULT_DISTANCE."""
CPU0_CACHES = Path("/sys/devices/system/cpu/cpu0/cache")
METHOD = "batch-1 passes"
"""Part of the cache key: answers measured another way are measured again."""


def prefetch_key() -> str:
    """The cache key: kernel build and CPU, method and threads (the model's weights only need to stream)."""
    return f"{library_name(cpu_identity())} weight prefetch {METHOD} {torch.get_num_threads()} threads"


def streamed_weights(model: CausalLM) -> list[GroupQuantWeight]:
    """The model's quant_matmul weights as a decode step reads them (the layers', then the lm_head's), up to
    STREAMED_BYTES."""
    weights, total = [], 0
    for weight in model.quantized_weights():
        if not isinstance(weight, GroupQuantWeight):
            continue
        if total + weight.nbytes > STREAMED_BYTES:
            break
        weights.append(weight)
        total += weight.nbytes
    return weights


def largest_cache_bytes(caches: Path = CPU0_CACHES) -> int:
    """The largest of the caches Linux lists for CPU 0 (0 where it lists none)."""
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    sizes = []
    for index in caches.glob("index*"):
        try:
            size = (index / "size").read_text().strip()
            sizes.append(int(size[:-1]) * units[size[-1]] if size[-1] in units else int(size))
        except (OSError, ValueError, IndexError):
            continue
    return max(sizes, default=0)


def measure_distances(
    weights: list[GroupQuantWeight], kernels: ModuleType, dtype: torch.dtype
) -> dict[int, float]:
    """Distance -> the median over rounds of its pass's time over the round's mean pass time."""
    generator = torch.Generator().manual_seed(0)  # the engine's own random state stays as it was
    rows = {k: torch.randn(1, k, generator=generator).to(dtype) for k in {w.in_features for w in weights}}
    inputs = [rows[w.in_features] for w in weights]
    before = kernels.weight_prefetch_bytes()
    relative: dict[int, list[float]] = {distance: [] for distance in DISTANCES}
    try:
        with torch.inference_mode():
            for weight, x in zip(weights, inputs, strict=True):  # first touch
                weight.matmul(x)
            for round_index in range(ROUNDS):
                shift = round_index % len(DISTANCES)
                times = {}
                for distance in DISTANCES[shift:] + DISTANCES[:shift]:
                    kernels.set_weight_prefetch_bytes(distance)
                    start = time.perf_counter()
                    for weight, x in zip(weights, inputs, strict=True):
                        weight.matmul(x)
                    times[distance] = time.perf_counter() - start
                mean = statistics.fmean(times.values())
                for distance, seconds in times.items():
                    relative[distance].append(seconds / mean)
    finally:
        kernels.set_weight_prefetch_bytes(before)
    return {distance: statistics.median(ratios) for distance, ratios in relative.items()}


def choose_weight_prefetch(model: CausalLM, kernels: ModuleType, dtype: torch.dtype) -> int:
    """Set the kernels' prefetch distance to this machine's best for streaming weights (measured once per
    CPU and thread count, on a model whose weights leave the caches); returns it."""
    weights = streamed_weights(model)
    key = prefetch_key()
    path = cache_file()
    cached = read_cache(path).get(key)
    if cached is not None:
        distance = int(cached["bytes"])
    elif sum(w.nbytes for w in weights) < max(MIN_STREAMED_BYTES, 2 * largest_cache_bytes()):
        distance = DEFAULT_DISTANCE
    else:
        relative = measure_distances(weights, kernels, dtype)
        distance = min(relative, key=relative.__getitem__)
        write_cache(path, read_cache(path) | {key: {"bytes": distance, "relative": relative}})
        logger.info(
            "weights prefetched %d bytes ahead (pass time over the round's mean, median of %d rounds: %s)",
            distance,
            ROUNDS,
            ", ".join(f"{d}: {r:.3f}" for d, r in relative.items()),
        )
    kernels.set_weight_prefetch_bytes(distance)
    return distance
