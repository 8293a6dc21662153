"""Which matmul serves a step of each size: a weight's quantized kernel or the unquantized one (oneDNN's
bf16 matmul over the pre-packed weight, on AMX tiles where the CPU has them; in float32, the C++
dense_matmul).

A decode step reads every weight for little arithmetic, so a 4- or 8-bit kernel wins by reading fewer
bytes; a long prefill is compute-bound, and there the winner depends on the CPU: on an AVX-512 Zen
without AMX, quant_matmul's VNNI dot products beat oneDNN's bf16 at every size measured, while AMX's bf16
tiles beat them from some step size up. So each quantized weight carries `max_tokens`, the largest step
it serves, and with matmul_choice "auto" that limit is measured when the engine starts: for each weight
shape, both kernels' times over step sizes of 1 to 512 rows (the lm_head: up to 64 rows of logits). They
are timed on one thread, interleaved, best of several: with two threads, the other processes of a shared
machine stretched single passes by 2-6x (a thread descheduled mid-barrier), which no statistic over a
few passes undid, while the ratio itself barely depends on the thread count (both kernels split the
same columns). Steps of decode size pass over every weight of the shape, as a step of the model does:
a weight timed alone stays in the caches from pass to pass, where the model's step reads it from
memory, and on an AMX Xeon that made bf16 look 1.1x faster than int4 at 32 rows where, in the model,
int4 at 32 rows decoded 1.2x faster. The limits are cached in matmul_choice.json beside the kernel
builds, keyed by the kernel build (source, flags, torch version, CPU model and flags), the method, dtype
and shape, so later starts on the same machine read them. "fixed" keeps the built-in limits of nanoserve.model.quant.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from nanoserve.model.kernels import build_dir, cpu_identity, library_name
from nanoserve.model.quant import GroupQuantWeight, QuantizedWeight

logger = logging.getLogger(__name__)

STEP_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
LM_HEAD_STEP_SIZES = STEP_SIZES[:7]
"""Rows of logits are one per sampled sequence; at 64 the 8-bit head was 2x slower than bf16 here."""
PASSES = 5
STREAMED_STEP = 64
"""Steps of up to this many rows (decode batches) are timed over every weight of the shape; larger ones,
compute-bound, over one."""
METHOD = "streamed-layout"
"""Part of the cache key: entries measured another way (here: against bf16 weights in batch 1's layout,
before nanoserve.model.pack_choice) are measured again."""


@dataclass
class WeightShape:
    """The quantized weights of one shape, each beside its unquantized matmul."""

    key: str
    quantized: list[QuantizedWeight]
    unquantized: list[Callable[[Tensor], Tensor]]
    in_features: int
    dtype: torch.dtype
    step_sizes: Sequence[int]


def cache_file() -> Path:
    return build_dir() / "matmul_choice.json"


def dtypes_key(dtype: torch.dtype, kv_dtype: torch.dtype | None) -> str:
    """The dtypes part of a cache key for a measurement that reads a KV cache: the model's dtype, and the
    cache's where it differs (so that answers measured before the KV dtype was an option keep their keys)."""
    return f"{dtype}" if kv_dtype in (None, dtype) else f"{dtype} kv {kv_dtype}"


def shape_key(role: str, quantized: QuantizedWeight, shape: tuple[int, int], dtype: torch.dtype) -> str:
    if isinstance(quantized, GroupQuantWeight):
        kind = f"int{quantized.bits}" + ("-symmetric" if quantized.symmetric else "")
    else:
        kind = type(quantized).__name__
    return f"{library_name(cpu_identity())} {METHOD} {dtype} {role} {kind} {shape[0]}x{shape[1]}"


def max_tokens_from_ratios(ratios: dict[int, float]) -> int:
    """The largest step size the quantized kernel serves: every size below the one from which the
    unquantized matmul stays faster (quantized time / unquantized > 1 there and at every larger size)."""
    sizes = sorted(ratios)
    first_slower = len(sizes)
    while first_slower > 0 and ratios[sizes[first_slower - 1]] > 1.0:
        first_slower -= 1
    if first_slower == len(sizes):
        return sys.maxsize
    return sizes[first_slower - 1] if first_slower > 0 else 0


def time_calls(fns: Sequence[Callable[[Tensor], Tensor]], x: Tensor) -> float:
    """Seconds to call every fn on x, one after another (a pass over a shape's weights)."""
    start = time.perf_counter()
    for fn in fns:
        fn(x)
    return time.perf_counter() - start


def measure_ratios(shape: WeightShape) -> dict[int, float]:
    """Step size -> quantized time / unquantized time, each the best of PASSES interleaved passes."""
    ratios = {}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    generator = torch.Generator().manual_seed(0)  # the engine's own random state stays as it was
    try:
        with torch.inference_mode():
            for size in shape.step_sizes:
                count = len(shape.quantized) if size <= STREAMED_STEP else 1
                quantized = [w.matmul for w in shape.quantized[:count]]
                unquantized = shape.unquantized[:count]
                x = torch.randn(size, shape.in_features, generator=generator).to(shape.dtype)
                (
                    time_calls(quantized, x),
                    time_calls(unquantized, x),
                )  # oneDNN builds its kernel for a new size
                times = [(time_calls(quantized, x), time_calls(unquantized, x)) for _ in range(PASSES)]
                ratios[size] = min(q for q, _ in times) / min(u for _, u in times)
    finally:
        torch.set_num_threads(threads)
    return ratios


def read_cache(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def write_cache(path: Path, entries: dict) -> None:
    """Written whole under a temporary name, then renamed: engines starting together never read half a file."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".matmul_choice")
        with os.fdopen(fd, "w") as f:
            json.dump(entries, f, indent=1, sort_keys=True)
        os.replace(tmp, path)
    except OSError as e:
        logger.warning("could not cache the matmul choice in %s (%s)", path, e)


def choose_max_tokens(shapes: list[WeightShape]) -> dict[str, dict]:
    """Set every quantized weight's max_tokens from the cache, measuring the shapes it lacks; returns
    each shape's entry ({"max_tokens", "ratios"})."""
    path = cache_file()
    cached = read_cache(path)
    missing = [s for s in shapes if s.key not in cached]
    if missing:
        start = time.perf_counter()
        for shape in missing:
            ratios = measure_ratios(shape)
            cached[shape.key] = {"max_tokens": max_tokens_from_ratios(ratios), "ratios": ratios}
        logger.info(
            "measured the matmul choice of %d weight shapes in %.1f s",
            len(missing),
            time.perf_counter() - start,
        )
        write_cache(path, read_cache(path) | {s.key: cached[s.key] for s in missing})
    for shape in shapes:
        for weight in shape.quantized:
            weight.max_tokens = cached[shape.key]["max_tokens"]
    return {s.key: cached[s.key] for s in shapes}
