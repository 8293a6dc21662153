"""Prompts attended by PyTorch's own flash attention, where the engine measured it faster than the C++
prefill kernel.

The C++ kernel (kernels/prefill_attention.cpp) serves every prefill: chunks after a long cached prefix,
sliding windows, soft-capped scores, many short prompts in one call. A prompt attended whole (its query
is its entire context) with none of those needs only causal attention over its own new keys, which
`scaled_dot_product_attention(is_causal=True)` computes. On a CPU with AMX, torch runs it on the bf16
tiles; before the kernel had a tile path of its own, SDPA took 0.40x its time at 512 tokens (Xeon, 2
cores), and now 1.6x. Which one wins depends on the CPU, so the first engine to start on a CPU
with a given head shape and dtype times both, and each sequence of a prefill whose context is at least
`min_query_len` long goes to SDPA, on its own: the shortest measured length from which SDPA won at every
longer one. The choice is cached beside the matmul choice and keyed the same way: the two paths round
differently, and engines started with the same options on one machine must give the same tokens.

A prompt whose first tokens were already cached (a prefix-cache hit, or the chunk after a first one) is
attended as the whole prompt too, when the cached tokens are no more than the new ones: the cached rows
get zero queries and their outputs are dropped. Each row attends only to its own keys, so the new rows
come out as the whole prompt's would over the same cached K/V, bit for bit; it costs the cached rows'
work, which is why a long prefix before a short chunk stays on the kernel (64 tokens after 2048 cached:
8.9 ms against the pair-dot kernel's 2.4, Xeon with AMX).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType

import torch
import torch.nn.functional as F

from nanoserve.model.kernels import cpu_identity, library_name
from nanoserve.model.kv_rows import decode, encode
from nanoserve.model.matmul_choice import cache_file, dtypes_key, read_cache, write_cache

logger = logging.getLogger(__name__)

QUERY_LENS = (64, 128, 256, 512, 1024, 2048)
"""Prompt lengths timed. The crossover can lie past 512: on a Zen 3 (AVX2, float32) the kernel took 0.55-0.7x
SDPA's time at 512 tokens, 0.8-0.85x at 1024 and 1.06x at 2048, where SDPA's larger matrix products pay off."""
PASSES = 3


@dataclass(frozen=True)
class WholePrompt:
    """One sequence of a prefill attended as its whole prompt: its new tokens after `cached` ones."""

    start: int
    """its first row of the step's queries"""
    length: int
    """its new tokens"""
    blocks: torch.Tensor
    """int64 [ceil((cached + length) / block_size)] its KV blocks"""
    cached: int = 0
    """tokens before the new ones, their K/V already in the cache"""


@dataclass(frozen=True)
class PrefillSplit:
    """A prefill's sequences, each to the path its own length and context choose (never its batch-mates':
    the two paths round differently, and a sequence's tokens must not depend on what it was batched with).
    """

    prompts: list[WholePrompt]
    """the sequences SDPA attends"""
    flash: list[bool]
    """per sequence of the group, in order: whether it is the next of `prompts`"""
    rest: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None
    """the other sequences' block table, query starts, query lengths and sequence lengths, for the kernel"""


def attend_whole_prompts(
    q: torch.Tensor, kv_cache: torch.Tensor, prompts: list[WholePrompt], scale: float
) -> list[torch.Tensor]:
    """q: [T, H, D] with each prompt's K/V already in the cache -> [length, H * D] per prompt."""
    _, num_kv_heads, num_blocks, block_size, row = kv_cache.shape
    outputs = []
    for prompt in prompts:
        context = prompt.cached + prompt.length
        # [2, Hkv, context, D]: the prompt's blocks gathered, its padding cut
        gathered = kv_cache.index_select(2, prompt.blocks).view(2, num_kv_heads, -1, row)[:, :, :context]
        kv = decode(gathered, q.dtype)
        query = q[prompt.start : prompt.start + prompt.length]
        if prompt.cached:
            query = torch.cat([query.new_zeros(prompt.cached, *query.shape[1:]), query])
        out = F.scaled_dot_product_attention(
            query.transpose(0, 1).unsqueeze(0), kv[0:1], kv[1:2], is_causal=True, scale=scale, enable_gqa=True
        )
        outputs.append(out[0, :, prompt.cached :].transpose(0, 1).reshape(prompt.length, -1))
    return outputs


def attend_split(
    q: torch.Tensor, kv_cache: torch.Tensor, split: PrefillSplit, kernels: ModuleType, scale: float
) -> torch.Tensor:
    """The group's prefill attention, [sum(query_lens), H * D] sequence after sequence as the kernel's."""
    flash = iter(attend_whole_prompts(q, kv_cache, split.prompts, scale))
    if split.rest is None:
        return torch.cat(list(flash))
    block_table, starts, query_lens, seq_lens = split.rest
    rest = kernels.paged_prefill_attention(
        q, kv_cache, block_table, starts, query_lens, seq_lens, scale, 0, 0.0
    )
    pieces, row = [], 0
    rest_lens = iter(query_lens.tolist())
    for is_flash in split.flash:
        if is_flash:
            pieces.append(next(flash))
        else:
            n = next(rest_lens)
            pieces.append(rest[row : row + n])
            row += n
    return torch.cat(pieces)


def _elapsed(fn: Callable[[], torch.Tensor]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def time_ratio(
    kernels: ModuleType,
    length: int,
    shape: tuple[int, int, int],
    dtype: torch.dtype,
    block_size: int,
    kv_dtype: torch.dtype,
) -> float:
    """SDPA's time over the C++ kernel's on one whole prompt (a cache in kv_dtype), each the best of PASSES
    interleaved runs."""
    num_heads, num_kv_heads, head_dim = shape
    blocks = -(-length // block_size)
    generator = torch.Generator().manual_seed(0)  # the engine's own random state stays as it was
    q = torch.randn(length, num_heads, head_dim, generator=generator).to(dtype)
    kv_cache = encode(
        torch.randn(2, num_kv_heads, blocks, block_size, head_dim, generator=generator), kv_dtype
    )
    prompts = [WholePrompt(0, length, torch.arange(blocks))]
    table = torch.arange(blocks, dtype=torch.int32).view(1, blocks)
    starts, lens = torch.tensor([0]), torch.tensor([length])
    scale = head_dim**-0.5

    def kernel() -> torch.Tensor:
        return kernels.paged_prefill_attention(q, kv_cache, table, starts, lens, lens, scale, 0, 0.0)

    def sdpa() -> torch.Tensor:
        return attend_whole_prompts(q, kv_cache, prompts, scale)[0]

    kernel(), sdpa()
    times = [(_elapsed(kernel), _elapsed(sdpa)) for _ in range(PASSES)]
    return min(s for _, s in times) / min(k for k, _ in times)


def measure_min_query_len(
    kernels: ModuleType,
    shape: tuple[int, int, int],
    dtype: torch.dtype,
    block_size: int,
    kv_dtype: torch.dtype | None = None,
) -> tuple[int | None, dict[int, float]]:
    """The shortest whole-prompt length from which SDPA beat the C++ kernel at every measured length
    (None: the kernel always won), with the ratios, timed at the engine's thread count (kv_dtype: the
    cache's, if not dtype)."""
    cache_dtype = kv_dtype or dtype
    with torch.inference_mode():
        ratios = {n: time_ratio(kernels, n, shape, dtype, block_size, cache_dtype) for n in QUERY_LENS}
    min_len = None
    for length in reversed(QUERY_LENS):
        if ratios[length] >= 1.0:
            break
        min_len = length
    return min_len, ratios


def choose_min_query_len(
    kernels: ModuleType,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    block_size: int,
    kv_dtype: torch.dtype | None = None,
) -> int | None:
    """measure_min_query_len's answer for this CPU, kernel build, head shape and dtypes, measured once."""
    dtypes = dtypes_key(dtype, kv_dtype)
    key = f"{library_name(cpu_identity())} flash_prefill {dtypes} {num_heads}x{num_kv_heads}x{head_dim}/{block_size}"
    path = cache_file()
    cached = read_cache(path).get(key)
    if cached is not None:
        return cached["min_query_len"]
    shape = (num_heads, num_kv_heads, head_dim)
    min_len, ratios = measure_min_query_len(kernels, shape, dtype, block_size, kv_dtype or dtype)
    write_cache(path, read_cache(path) | {key: {"min_query_len": min_len, "ratios": ratios}})
    logger.info(
        "prefill attention of whole prompts: %s (SDPA time / C++ kernel time: %s)",
        f"SDPA from {min_len} tokens" if min_len is not None else "the C++ kernel",
        ", ".join(f"{n}: {r:.2f}" for n, r in ratios.items()),
    )
    return min_len
