"""Up to which step size every matmul stays quantized, measured on whole fused decode steps.

nanoserve.model.matmul_choice sets each quantized weight's step-size limit from that weight alone: its
kernel against the unquantized matmul over the weights of its shape. But a decode step whose every matmul
is quantized also runs as one OpenMP region of the fused decoder (kernels/fused_decoder.cpp), and the
region saves what a step of separate kernels pays for each of its ~330 calls: waking the other thread,
and on a CPU with AMX, going from oneDNN's tiles back to the vector kernels (add_rms_norm on 64 rows took
12 µs alone and 21 µs right after a oneDNN matmul). On a two-core AMX Xeon the weights alone chose
oneDNN's bf16 above 16 rows, while a whole step of 32 rows ran 1.16-1.19x faster with every weight
quantized (and took 1.1-1.25x the time at 64). So with matmul_choice "auto", the engine times whole
decode steps at each of STEP_SIZES above the weights' smallest limit, on a scratch KV cache, as the
weights chose and with every limit raised to that size, and raises the limits to the largest size at
which the all-quantized step won, as it did at every smaller one. The limits hold for every step, so
prefills and mixed steps of those sizes run quantized too (kernel after kernel, and there the weights
alone preferred bf16): the two paths must give a step of a given size the same bits. A size the raised
step cannot run in one region (a weight on torch's int4 kernel) is not measured. The answer is cached
beside the matmul choice, keyed by the kernel build, the thread count, the dtype, the attention shape and
every decoder weight's kind, size and limit.
"""

from __future__ import annotations

import hashlib
import logging
import time
from types import ModuleType
from typing import Any

import torch

from nanoserve.model.attention import allocate_kv_cache
from nanoserve.model.kernels import cpu_identity, library_name
from nanoserve.model.layers.causal_lm import CausalLM
from nanoserve.model.matmul_choice import cache_file, dtypes_key, read_cache, write_cache
from nanoserve.model.quant import QuantizedWeight

logger = logging.getLogger(__name__)

STEP_SIZES = (32, 64)
PASSES = 5
METHOD = "whole-step"
"""Part of the cache key: answers measured another way are measured again."""
CONTEXT = 16
"""Each scratch sequence's length: short, so that the scratch cache stays small for large models."""


def largest_winning_size(times: dict[int, tuple[float, float]]) -> int:
    """times: step size -> (seconds as the weights chose, seconds all quantized); the largest size at
    which the all-quantized step was faster, as it was at every smaller size (0: none)."""
    largest = 0
    for size in sorted(times):
        chosen, quantized = times[size]
        if quantized >= chosen:
            break
        largest = size
    return largest


def _set_limits(model: CausalLM, limits: list[int]) -> None:
    for weight, limit in zip(model.decoder_quantized_weights(), limits, strict=True):
        weight.max_tokens = limit


def _fused_decoder_with_limits(model: CausalLM, kernels: ModuleType, limits: list[int]) -> Any:
    """Set the decoder's quantized weights' step-size limits and build the fused decoder over them."""
    _set_limits(model, limits)
    model.use_cpu_kernels(kernels)
    return model.fused_decoder


def measure_steps(
    model: CausalLM,
    kernels: ModuleType,
    kv_dtype: torch.dtype,
    block_size: int,
    sizes: list[int],
) -> dict[int, tuple[float, float]]:
    """Step size -> (best seconds as the weights chose, best seconds all quantized), interleaved passes
    over a scratch cache in kv_dtype."""
    config = model.config
    chosen = model.fused_decoder
    limits = [w.max_tokens for w in model.decoder_quantized_weights()]
    generator = torch.Generator().manual_seed(0)  # the engine's own random state stays as it was
    blocks_per_seq = -(-CONTEXT // block_size)
    times = {}
    try:
        with torch.inference_mode():
            for size in sizes:
                raised = _fused_decoder_with_limits(model, kernels, [max(limit, size) for limit in limits])
                if not raised.one_region_at(size):
                    break  # no region to gain (a weight on torch's int4 kernel, say): only noise to time
                caches = allocate_kv_cache(
                    config.num_layers,
                    size * blocks_per_seq,
                    block_size,
                    config.num_kv_heads,
                    config.head_dim,
                    kv_dtype,
                    torch.device("cpu"),
                )
                table = torch.arange(size * blocks_per_seq, dtype=torch.int32).view(size, blocks_per_seq)
                seq_lens = torch.full((size,), CONTEXT, dtype=torch.int64)
                ids = torch.randint(0, config.vocab_size, (size,), generator=generator)
                passes: list[tuple[float, float]] = []
                for _ in range(PASSES + 1):  # the first builds oneDNN's kernels for the size
                    timed = []
                    for decoder in (chosen, raised):
                        start = time.perf_counter()
                        decoder.forward(ids, caches, table, seq_lens)
                        timed.append(time.perf_counter() - start)
                    passes.append((timed[0], timed[1]))
                times[size] = (min(c for c, _ in passes[1:]), min(q for _, q in passes[1:]))
    finally:
        _set_limits(model, limits)
        model.fused_decoder = chosen
    return times


def step_key(
    model: CausalLM, weights: list[QuantizedWeight], dtype: torch.dtype, kv_dtype: torch.dtype | None = None
) -> str:
    """The cache key: kernel build and CPU, method, threads, dtype (and the KV cache's, if another), and a
    digest of the attention shape and every decoder weight's kind, size and limit as the weights chose."""
    c = model.config
    shape = f"{c.num_layers} {c.hidden_size} {c.num_heads}x{c.num_kv_heads}x{c.head_dim} " + ";".join(
        f"{type(w).__name__}/{w.nbytes}/{w.max_tokens}" for w in weights
    )
    digest = hashlib.sha256(shape.encode()).hexdigest()[:16]
    dtypes = dtypes_key(dtype, kv_dtype)
    return f"{library_name(cpu_identity())} {METHOD} {torch.get_num_threads()} threads {dtypes} {digest}"


def choose_quantized_steps(
    model: CausalLM,
    kernels: ModuleType,
    dtype: torch.dtype,
    block_size: int,
    kv_dtype: torch.dtype | None = None,
) -> int:
    """Raise every decoder weight's step-size limit to the largest measured size at which whole decode
    steps ran faster all quantized (measured once per machine and model shape, over a KV cache in kv_dtype,
    the model's dtype if None); returns that size, or 0."""
    weights = model.decoder_quantized_weights()
    if model.fused_decoder is None or model.config.moe is not None or not weights:
        return 0  # a mixture of experts never runs in one region: nothing to gain
    sizes = [size for size in STEP_SIZES if size > min(w.max_tokens for w in weights)]
    if not sizes:
        return 0
    key = step_key(model, weights, dtype, kv_dtype)
    path = cache_file()
    cached = read_cache(path).get(key)
    if cached is not None:
        size = int(cached["max_tokens"])
    else:
        times = measure_steps(model, kernels, kv_dtype or dtype, block_size, sizes)
        size = largest_winning_size(times)
        write_cache(path, read_cache(path) | {key: {"max_tokens": size, "times": times}})
        logger.info(
            "whole decode steps all quantized up to %d rows (ms as chosen / all quantized: %s)",
            size,
            ", ".join(f"{n}: {c * 1e3:.1f} / {q * 1e3:.1f}" for n, (c, q) in times.items()),
        )
    if size:
        _fused_decoder_with_limits(model, kernels, [max(w.max_tokens, size) for w in weights])
    return size
