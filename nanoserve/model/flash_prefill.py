"""Whole prompts attended by PyTorch's own flash attention, where the engine measured it faster than the C++
prefill kernel.

The C++ kernel (kernels/prefill_attention.cpp) serves every prefill: chunks that follow a cached prefix,
sliding windows, soft-capped scores, many short prompts in one call. A prompt attended whole (its query
is its entire context) with none of those needs only causal attention over its own new keys, which
`scaled_dot_product_attention(is_causal=True)` computes; on a CPU with AMX, torch runs it on the bf16
tiles, and there it took 0.40x the kernel's time at 512 tokens and 0.76x at 64 (Xeon, 2 cores), where the
kernel has no tiles to use. Which one wins depends on the CPU, so the engine times both when it starts, on
its model's head shape and dtype, and sends a prefill to SDPA when every sequence in it is a whole prompt
at least `min_query_len` long: the shortest measured length from which SDPA won at every longer one.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType

import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)

QUERY_LENS = (64, 128, 256, 512)
PASSES = 3


@dataclass(frozen=True)
class WholePrompt:
    """One sequence of a prefill whose query is its whole context."""

    start: int
    """its first row of the step's queries"""
    length: int
    blocks: torch.Tensor
    """int64 [ceil(length / block_size)] its KV blocks"""


def attend_whole_prompts(
    q: torch.Tensor, kv_cache: torch.Tensor, prompts: list[WholePrompt], scale: float
) -> torch.Tensor:
    """q: [T, H, D] with each prompt's K/V already in the cache -> [sum(lengths), H * D], prompt by prompt."""
    _, num_kv_heads, num_blocks, block_size, head_dim = kv_cache.shape
    outputs = []
    for prompt in prompts:
        # [2, Hkv, length, D]: the prompt's blocks gathered, its padding cut
        kv = kv_cache.index_select(2, prompt.blocks).view(2, num_kv_heads, -1, head_dim)[
            :, :, : prompt.length
        ]
        query = q[prompt.start : prompt.start + prompt.length].transpose(0, 1)  # [H, length, D]
        out = F.scaled_dot_product_attention(
            query.unsqueeze(0), kv[0:1], kv[1:2], is_causal=True, scale=scale, enable_gqa=True
        )
        outputs.append(out[0].transpose(0, 1).reshape(prompt.length, -1))
    return outputs[0] if len(outputs) == 1 else torch.cat(outputs)


def _elapsed(fn: Callable[[], torch.Tensor]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _time_ratio(
    kernels: ModuleType, length: int, shape: tuple[int, int, int], dtype: torch.dtype, block_size: int
) -> float:
    """SDPA's time over the C++ kernel's on one whole prompt, each the best of PASSES interleaved runs."""
    num_heads, num_kv_heads, head_dim = shape
    blocks = -(-length // block_size)
    q = torch.randn(length, num_heads, head_dim).to(dtype)
    kv_cache = torch.randn(2, num_kv_heads, blocks, block_size, head_dim).to(dtype)
    prompts = [WholePrompt(0, length, torch.arange(blocks))]
    table = torch.arange(blocks, dtype=torch.int32).view(1, blocks)
    starts, lens = torch.tensor([0]), torch.tensor([length])
    scale = head_dim**-0.5

    def kernel() -> torch.Tensor:
        return kernels.paged_prefill_attention(q, kv_cache, table, starts, lens, lens, scale, 0, 0.0)

    def sdpa() -> torch.Tensor:
        return attend_whole_prompts(q, kv_cache, prompts, scale)

    kernel(), sdpa()
    times = [(_elapsed(kernel), _elapsed(sdpa)) for _ in range(PASSES)]
    return min(s for _, s in times) / min(k for k, _ in times)


def measure_min_query_len(
    kernels: ModuleType, num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, block_size: int
) -> int | None:
    """The shortest whole-prompt length from which SDPA beat the C++ kernel at every measured length
    (None: the kernel always won), timed at the engine's thread count."""
    with torch.inference_mode():
        shape = (num_heads, num_kv_heads, head_dim)
        ratios = {n: _time_ratio(kernels, n, shape, dtype, block_size) for n in QUERY_LENS}
    min_len = None
    for length in reversed(QUERY_LENS):
        if ratios[length] >= 1.0:
            break
        min_len = length
    logger.info(
        "prefill attention of whole prompts: %s (SDPA time / C++ kernel time: %s)",
        f"SDPA from {min_len} tokens" if min_len is not None else "the C++ kernel",
        ", ".join(f"{n}: {r:.2f}" for n, r in ratios.items()),
    )
    return min_len
