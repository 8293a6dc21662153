"""`kv_cache_dtype="bfloat16"` under a float32 model: K and V are rounded to bfloat16 as they are written,
and every attention path reads back the float32 values they round to.

So the kernels over a bf16 cache must give what they give over a float32 cache holding those values (to
float32 rounding: under -ffast-math each instantiation may order a sum its own way); an engine's fused, unfused and PyTorch paths must give the same greedy tokens over it; and a cache
budget must hold twice the blocks.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from families import VOCAB, build_family

from nanoserve.config import EngineOptions
from nanoserve.entrypoints.cli import build_parser, engine_options_from_args
from tests.core.engine_steps import request, run_to_completion, tiny_engine

DECODE_CASES = {  # query heads, KV heads, context lengths
    "batch": (6, 2, [1, 16, 17, 95, 300]),
    "one-sequence-in-parts": (9, 3, [96]),
    "wide-groups": (14, 2, [33, 200]),
}


def _caches(num_kv_heads: int, head_dim: int, num_blocks: int = 160, block_size: int = 16):
    """A bf16 cache of random values and a float32 cache of the same values."""
    rounded = (torch.randn(2, num_kv_heads, num_blocks, block_size, head_dim) * 2).to(torch.bfloat16)
    return rounded, rounded.float()


@pytest.mark.parametrize("case", DECODE_CASES)
@pytest.mark.parametrize("head_dim", [64, 24, 80, 128])
@pytest.mark.parametrize("window, softcap", [(0, 0.0), (40, 2.0)], ids=["plain", "window-softcap"])
def test_decode_attention_reads_a_bf16_cache_as_its_float32_values(
    kernels, two_threads, case, head_dim, window, softcap
):
    torch.manual_seed(head_dim + window)
    num_heads, num_kv_heads, lengths = DECODE_CASES[case]
    rounded, widened = _caches(num_kv_heads, head_dim)
    q = torch.randn(len(lengths), num_heads, head_dim)
    block_table = torch.stack([torch.randperm(160)[:64] for _ in lengths]).int()
    seq_lens = torch.tensor(lengths, dtype=torch.int64)
    scale = 1 / math.sqrt(head_dim)

    out = kernels.paged_decode_attention(q, rounded, block_table, seq_lens, scale, window, softcap)

    assert out.dtype == torch.float32
    expected = kernels.paged_decode_attention(q, widened, block_table, seq_lens, scale, window, softcap)
    torch.testing.assert_close(out, expected, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("head_dim", [64, 24, 80])
@pytest.mark.parametrize("window, softcap", [(0, 0.0), (7, 3.0)], ids=["plain", "window-softcap"])
def test_prefill_attention_reads_a_bf16_cache_as_its_float32_values(
    kernels, two_threads, head_dim, window, softcap
):
    torch.manual_seed(head_dim + window)
    shapes = [(5, 40), (1, 17), (30, 30), (3, 200)]  # (new tokens, context)
    query_lens = [n for n, _ in shapes]
    rounded, widened = _caches(2, head_dim)
    q = torch.randn(sum(query_lens), 6, head_dim)
    block_table = torch.stack([torch.randperm(160)[:24] for _ in shapes]).int()
    starts = torch.tensor([0] + query_lens[:-1]).cumsum(0)
    args = (block_table, starts, torch.tensor(query_lens), torch.tensor([c for _, c in shapes]))

    out = kernels.paged_prefill_attention(q, rounded, *args, 0.2, window, softcap)

    expected = kernels.paged_prefill_attention(q, widened, *args, 0.2, window, softcap)
    torch.testing.assert_close(out, expected, atol=1e-6, rtol=1e-6)


def test_rope_write_kv_rounds_k_and_v_into_a_bf16_cache(kernels):
    torch.manual_seed(0)
    num_heads, num_kv_heads, head_dim, tokens = 6, 2, 64, 5
    qkv = torch.randn(tokens, (num_heads + 2 * num_kv_heads) * head_dim)
    cos_sin = torch.randn(tokens, 2, 1, head_dim)
    slots = torch.tensor([3, 17, 0, 40, 41])
    rounded = torch.zeros(2, num_kv_heads, 8, 16, head_dim, dtype=torch.bfloat16)
    widened = torch.zeros(2, num_kv_heads, 8, 16, head_dim)

    q = kernels.rope_write_kv(qkv, cos_sin, rounded, slots, num_heads, num_kv_heads)

    expected_q = kernels.rope_write_kv(qkv, cos_sin, widened, slots, num_heads, num_kv_heads)
    torch.testing.assert_close(q, expected_q, atol=1e-6, rtol=1e-6)
    # rounded to nearest (even), as torch rounds: within half a bf16 step of the float32 values
    torch.testing.assert_close(rounded.float(), widened, atol=0, rtol=2**-8)
    torch.testing.assert_close(rounded, widened.to(torch.bfloat16), atol=0, rtol=2**-7)
    assert rounded.view(2, num_kv_heads, -1, head_dim)[:, :, slots].abs().sum() > 0


def test_kernels_refuse_a_float32_cache_under_bf16_activations(kernels):
    q = torch.randn(1, 4, 64, dtype=torch.bfloat16)
    cache = torch.zeros(2, 2, 4, 16, 64)
    table, lens = torch.zeros(1, 4, dtype=torch.int32), torch.tensor([3])
    refusal = "float32 over bfloat16; got BFloat16 over Float"
    with pytest.raises(RuntimeError, match=refusal):
        kernels.paged_decode_attention(q, cache, table, lens, 0.1, 0, 0.0)
    with pytest.raises(RuntimeError, match=refusal):
        kernels.paged_prefill_attention(
            q, cache, table, torch.tensor([0]), torch.tensor([1]), lens, 0.1, 0, 0.0
        )
    qkv, cos_sin = (
        torch.zeros(1, 8 * 64, dtype=torch.bfloat16),
        torch.zeros(1, 2, 1, 64, dtype=torch.bfloat16),
    )
    with pytest.raises(RuntimeError, match=refusal):
        kernels.rope_write_kv(qkv, cos_sin, cache, torch.tensor([0]), 4, 2)


def _greedy(engine, prompts: list[list[int]]) -> list[list[int]]:
    for i, prompt in enumerate(prompts):
        engine.add_request(request(f"r{i}", prompt, max_tokens=12))
    results = run_to_completion(engine)
    return [results[f"r{i}"][0] for i in range(len(prompts))]


@pytest.mark.parametrize(
    "shape, flash",
    [("qwen3-gqa-tied", False), ("qwen3-gqa-tied", True), ("mistral-window", False), ("gemma2-gqa", False)],
)
def test_every_attention_path_gives_the_same_tokens_over_a_bf16_cache(shape, flash, tmp_path, monkeypatch):
    """Fused decode steps (Llama-shaped families), the modules calling the kernels, and PyTorch alone;
    prompts of 6 to 40 tokens in blocks of 4, past the sliding window, with Gemma 2's soft-capping; with
    `flash`, whole prompts attended by torch's SDPA over the cache's rounded K/V."""
    from nanoserve.model import flash_prefill
    from nanoserve.model.kernels import cpu_kernels

    if cpu_kernels() is None:
        pytest.skip("the C++ kernels cannot be built on this machine")
    whole_prompts = []
    attend_whole_prompts = flash_prefill.attend_whole_prompts

    def counted(*args):
        whole_prompts.append(len(args[2]))
        return attend_whole_prompts(*args)

    model_dir = build_family(shape, tmp_path)
    rng = np.random.default_rng(3)
    prompts = [rng.integers(3, VOCAB, n).tolist() for n in (6, 40, 17, 23)]
    tokens = {}
    for mode in ("auto", "unfused", "off"):
        engine = tiny_engine(model_dir, cpu_kernels=mode, kv_cache_dtype="bfloat16")
        assert {cache.dtype for cache in engine.runner.kv_caches} == {torch.bfloat16}
        if flash and mode != "off":
            engine.runner.flash_min_query_len = 2
        monkeypatch.setattr(flash_prefill, "attend_whole_prompts", counted)  # after the start's own timing
        tokens[mode] = _greedy(engine, prompts)
    assert tokens["auto"] == tokens["unfused"] == tokens["off"]
    assert (sum(whole_prompts) > 0) == flash


def test_a_bf16_cache_holds_twice_the_blocks_of_a_float32_one(tmp_path):
    model_dir = build_family("qwen3-gqa-tied", tmp_path)
    budget = dict(num_kv_blocks=None, kv_cache_memory_bytes=1 << 20, cpu_kernels="off")
    float32 = tiny_engine(model_dir, **budget)
    bf16 = tiny_engine(model_dir, kv_cache_dtype="bfloat16", **budget)
    assert bf16.num_kv_blocks == 2 * float32.num_kv_blocks
    assert (
        bf16.runner.kv_caches[0].dtype == torch.bfloat16
        and float32.runner.kv_caches[0].dtype == torch.float32
    )


def test_a_bf16_cache_under_a_float16_model_is_refused(tmp_path):
    with pytest.raises(ValueError, match="kv_cache_dtype='bfloat16' under a float16 model"):
        tiny_engine(build_family("qwen3-gqa-tied", tmp_path), dtype="float16", kv_cache_dtype="bfloat16")


def test_kv_cache_dtype_is_an_option_and_a_flag():
    args = build_parser().parse_args(["generate", "hi", "--kv-cache-dtype", "bfloat16"])
    assert engine_options_from_args(args).kv_cache_dtype == "bfloat16"
    assert EngineOptions().kv_cache_dtype == "auto"
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        EngineOptions(kv_cache_dtype="fp8")
