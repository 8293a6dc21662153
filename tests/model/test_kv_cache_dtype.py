"""A KV cache narrower than the model: `kv_cache_dtype="bfloat16"` under a float32 model, "fp8_e5m2" or
"int8" (codes and a scale per row, nanoserve.model.kv_rows) under any. K and V are rounded to the cache's
rows as they are written, and every attention path reads back the values they round to.

So the kernels over a narrow cache must give what they give over a wider cache holding those values (to
float32 rounding: under -ffast-math each instantiation may order a sum its own way); the rotary kernel
must write the rows PyTorch writes; an engine's fused, unfused and PyTorch paths must give the same
greedy tokens over it; a cache budget must hold more blocks; and the bundled model's perplexity must stay
nearly where it was.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from families import VOCAB, build_family

from nanoserve.config import EngineOptions
from nanoserve.entrypoints.cli import build_parser, engine_options_from_args
from nanoserve.model import kv_rows
from nanoserve.model.layers.rotary import apply_rope
from nanoserve.model.runner import KV_CACHE_TORCH_DTYPES
from tests.core.engine_steps import request, run_to_completion, tiny_engine

DECODE_CASES = {  # query heads, KV heads, context lengths
    "batch": (6, 2, [1, 16, 17, 95, 300]),
    "one-sequence-in-parts": (9, 3, [96]),
    "wide-groups": (14, 2, [33, 200]),
}


CACHE_PAIRS = {  # activations, the narrow cache, the wider cache that holds its values exactly
    "float32-over-bf16": (torch.float32, torch.bfloat16, torch.float32),
    "float32-over-fp8": (torch.float32, torch.float8_e5m2, torch.bfloat16),
    "bf16-over-fp8": (torch.bfloat16, torch.float8_e5m2, torch.bfloat16),
    "float32-over-int8": (torch.float32, torch.int8, torch.float32),
    "bf16-over-int8": (torch.bfloat16, torch.int8, torch.bfloat16),
}
TOLERANCE = {torch.float32: 1e-6, torch.bfloat16: 1e-2}


def _caches(pair: str, num_kv_heads: int, head_dim: int, num_blocks: int = 160, block_size: int = 16):
    """A narrow cache of random values (a few thousand of them tiny: fp8's subnormals; some rows all zero:
    int8's scale 0) and a wider cache of the same values."""
    _, narrow, wide = CACHE_PAIRS[pair]
    values = torch.randn(2, num_kv_heads, num_blocks, block_size, head_dim) * 2
    values.view(-1)[::97] *= 1e-5
    values.view(-1, head_dim)[::89] = 0
    rounded = kv_rows.encode(values, narrow)
    return rounded, kv_rows.decode(rounded, wide)


@pytest.mark.parametrize("pair", CACHE_PAIRS)
@pytest.mark.parametrize("case", DECODE_CASES)
@pytest.mark.parametrize("head_dim", [64, 24, 80, 128])
@pytest.mark.parametrize("window, softcap", [(0, 0.0), (40, 2.0)], ids=["plain", "window-softcap"])
def test_decode_attention_reads_a_narrow_cache_as_its_values(
    kernels, two_threads, pair, case, head_dim, window, softcap
):
    torch.manual_seed(head_dim + window)
    dtype = CACHE_PAIRS[pair][0]
    num_heads, num_kv_heads, lengths = DECODE_CASES[case]
    rounded, widened = _caches(pair, num_kv_heads, head_dim)
    q = torch.randn(len(lengths), num_heads, head_dim).to(dtype)
    block_table = torch.stack([torch.randperm(160)[:64] for _ in lengths]).int()
    seq_lens = torch.tensor(lengths, dtype=torch.int64)
    scale = 1 / math.sqrt(head_dim)

    out = kernels.paged_decode_attention(q, rounded, block_table, seq_lens, scale, window, softcap)

    assert out.dtype == dtype
    expected = kernels.paged_decode_attention(q, widened, block_table, seq_lens, scale, window, softcap)
    torch.testing.assert_close(out, expected, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


@pytest.mark.parametrize("pair", CACHE_PAIRS)
@pytest.mark.parametrize("head_dim", [64, 24, 80, 128])
@pytest.mark.parametrize("window, softcap", [(0, 0.0), (7, 3.0)], ids=["plain", "window-softcap"])
def test_prefill_attention_reads_a_narrow_cache_as_its_values(
    kernels, two_threads, pair, head_dim, window, softcap
):
    torch.manual_seed(head_dim + window)
    dtype = CACHE_PAIRS[pair][0]
    shapes = [(5, 40), (1, 17), (30, 30), (3, 200)]  # (new tokens, context)
    query_lens = [n for n, _ in shapes]
    rounded, widened = _caches(pair, 2, head_dim)
    q = torch.randn(sum(query_lens), 6, head_dim).to(dtype)
    block_table = torch.stack([torch.randperm(160)[:24] for _ in shapes]).int()
    starts = torch.tensor([0] + query_lens[:-1]).cumsum(0)
    args = (block_table, starts, torch.tensor(query_lens), torch.tensor([c for _, c in shapes]))

    out = kernels.paged_prefill_attention(q, rounded, *args, 0.2, window, softcap)

    expected = kernels.paged_prefill_attention(q, widened, *args, 0.2, window, softcap)
    torch.testing.assert_close(out, expected, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


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


@pytest.mark.parametrize("rotary_dim", [64, 48])
def test_rope_write_kv_rotates_as_pytorch_does_whole_heads_or_their_first_dims(kernels, rotary_dim):
    """48 of 64: Phi-4-mini's partial rotation, the rest of each head passed through as it is."""
    torch.manual_seed(2)
    num_heads, num_kv_heads, head_dim, tokens = 6, 2, 64, 9
    qkv = torch.randn(tokens, (num_heads + 2 * num_kv_heads) * head_dim)
    cos_sin = torch.randn(tokens, 2, 1, rotary_dim)
    slots = torch.randperm(128)[:tokens]
    cache = torch.zeros(2, num_kv_heads, 8, 16, head_dim)

    q = kernels.rope_write_kv(qkv, cos_sin, cache, slots, num_heads, num_kv_heads)

    heads = qkv.view(tokens, -1, head_dim)
    rotated = apply_rope(heads[:, : num_heads + num_kv_heads], cos_sin)
    torch.testing.assert_close(q, rotated[:, :num_heads], atol=1e-6, rtol=1e-6)
    written = cache.view(2, num_kv_heads, -1, head_dim)[:, :, slots].transpose(
        1, 2
    )  # [2, tokens, kv heads, D]
    torch.testing.assert_close(written[0], rotated[:, num_heads:], atol=1e-6, rtol=1e-6)
    assert torch.equal(written[1], heads[:, num_heads + num_kv_heads :])
    assert torch.equal(q[..., rotary_dim:], heads[:, :num_heads, rotary_dim:])


@pytest.mark.parametrize("cache_dtype", [torch.float8_e5m2, torch.int8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_write_kv_writes_the_rows_pytorch_writes(kernels, dtype, cache_dtype):
    torch.manual_seed(1)
    num_heads, num_kv_heads, head_dim, tokens = 6, 2, 64, 37  # past the grain: several threads write
    qkv = (torch.randn(tokens, (num_heads + 2 * num_kv_heads) * head_dim) * 3).to(dtype)
    qkv[:, ::13] *= 1e-5  # subnormal in fp8
    qkv[5, (num_heads + num_kv_heads) * head_dim :][:head_dim] = 0  # a V row of zeros: int8's scale 0
    cos_sin = torch.randn(tokens, 2, 1, head_dim).to(dtype)
    slots = torch.randperm(128)[:tokens]
    narrow = torch.zeros(2, num_kv_heads, 8, 16, kv_rows.row_width(head_dim, cache_dtype), dtype=cache_dtype)
    exact = torch.zeros(2, num_kv_heads, 8, 16, head_dim, dtype=dtype)

    q = kernels.rope_write_kv(qkv, cos_sin, narrow, slots, num_heads, num_kv_heads)

    expected_q = kernels.rope_write_kv(qkv, cos_sin, exact, slots, num_heads, num_kv_heads)
    torch.testing.assert_close(q, expected_q, atol=0, rtol=0)
    # the written slots hold the rows PyTorch makes of the values a cache of the model's dtype holds
    written = narrow.view(2, num_kv_heads, -1, narrow.shape[-1])[:, :, slots]
    expected = kv_rows.encode(exact.view(2, num_kv_heads, -1, head_dim)[:, :, slots], cache_dtype)
    assert torch.equal(kv_rows.as_copyable(written), kv_rows.as_copyable(expected))
    assert kv_rows.decode(written, dtype).abs().sum() > 0


@pytest.mark.parametrize(
    "dtype, cache_dtype, refusal",
    [
        (torch.bfloat16, torch.float32, "or float32 over bfloat16; got BFloat16 over Float"),
        (torch.float32, torch.int8, "KV cache rows of 64 elements for a head size of 64"),  # no scale
    ],
    ids=["float32-cache-under-bf16", "int8-rows-without-scales"],
)
def test_kernels_refuse_a_cache_they_cannot_read(kernels, dtype, cache_dtype, refusal):
    q = torch.randn(1, 4, 64).to(dtype)
    cache = torch.zeros(2, 2, 4, 16, 64, dtype=cache_dtype)
    table, lens = torch.zeros(1, 4, dtype=torch.int32), torch.tensor([3])
    with pytest.raises(RuntimeError, match=refusal):
        kernels.paged_decode_attention(q, cache, table, lens, 0.1, 0, 0.0)
    with pytest.raises(RuntimeError, match=refusal):
        kernels.paged_prefill_attention(
            q, cache, table, torch.tensor([0]), torch.tensor([1]), lens, 0.1, 0, 0.0
        )
    qkv, cos_sin = torch.zeros(1, 8 * 64, dtype=dtype), torch.zeros(1, 2, 1, 64, dtype=dtype)
    with pytest.raises(RuntimeError, match=refusal):
        kernels.rope_write_kv(qkv, cos_sin, cache, torch.tensor([0]), 4, 2)


def _greedy(engine, prompts: list[list[int]]) -> list[list[int]]:
    for i, prompt in enumerate(prompts):
        engine.add_request(request(f"r{i}", prompt, max_tokens=12))
    results = run_to_completion(engine)
    return [results[f"r{i}"][0] for i in range(len(prompts))]


@pytest.mark.parametrize("kv_cache_dtype", ["bfloat16", "fp8_e5m2", "int8"])
@pytest.mark.parametrize(
    "shape, flash",
    [("qwen3-gqa-tied", False), ("qwen3-gqa-tied", True), ("mistral-window", False), ("gemma2-gqa", False)],
)
def test_every_attention_path_gives_the_same_tokens_over_a_narrow_cache(
    shape, flash, kv_cache_dtype, tmp_path, monkeypatch
):
    """Fused decode steps (Llama-shaped families), the modules calling the kernels, and PyTorch alone;
    prompts of 6 to 40 tokens in blocks of 4, past the sliding window, with Gemma 2's soft-capping; with
    `flash`, whole prompts attended by torch's SDPA over the cache's rounded K/V. A float32 model: under
    bf16 the rotary kernel and PyTorch's rotation may round a K value to neighbouring bf16 values (on CPUs
    without native bf16), which an 8-bit cache turns into different codes; the kernel tests above and the
    bundled model's below hold bf16 models' byte caches to their bf16 caches."""
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
        engine = tiny_engine(model_dir, cpu_kernels=mode, kv_cache_dtype=kv_cache_dtype)
        assert {cache.dtype for cache in engine.runner.kv_caches} == {KV_CACHE_TORCH_DTYPES[kv_cache_dtype]}
        if flash and mode != "off":
            engine.runner.flash_min_query_len = 2
        monkeypatch.setattr(flash_prefill, "attend_whole_prompts", counted)  # after the start's own timing
        tokens[mode] = _greedy(engine, prompts)
    assert tokens["auto"] == tokens["unfused"] == tokens["off"]
    assert (sum(whole_prompts) > 0) == flash


def test_a_narrow_cache_holds_more_blocks_in_the_same_budget(tmp_path):
    model_dir = build_family("qwen3-gqa-tied", tmp_path)
    budget = dict(num_kv_blocks=None, kv_cache_memory_bytes=1 << 20, cpu_kernels="off")
    float32 = tiny_engine(model_dir, **budget)
    bf16 = tiny_engine(model_dir, kv_cache_dtype="bfloat16", **budget)
    fp8 = tiny_engine(model_dir, kv_cache_dtype="fp8_e5m2", **budget)
    int8 = tiny_engine(model_dir, kv_cache_dtype="int8", **budget)
    assert bf16.num_kv_blocks == 2 * float32.num_kv_blocks
    assert fp8.num_kv_blocks == 4 * float32.num_kv_blocks
    # each int8 row holds its float32 scale too: 4 bytes more than fp8's
    head_dim = int8.runner.config.head_dim
    assert fp8.num_kv_blocks * head_dim / (head_dim + 4) - 1 <= int8.num_kv_blocks
    assert int8.num_kv_blocks <= fp8.num_kv_blocks * head_dim / (head_dim + 4)
    assert [engine.runner.kv_caches[0].dtype for engine in (float32, bf16, fp8, int8)] == [
        torch.float32,
        torch.bfloat16,
        torch.float8_e5m2,
        torch.int8,
    ]


def test_a_bf16_cache_under_a_float16_model_is_refused(tmp_path):
    with pytest.raises(ValueError, match="kv_cache_dtype='bfloat16' under a float16 model"):
        tiny_engine(build_family("qwen3-gqa-tied", tmp_path), dtype="float16", kv_cache_dtype="bfloat16")


def test_kv_cache_dtype_is_an_option_and_a_flag():
    for name in ("bfloat16", "fp8_e5m2", "int8"):
        args = build_parser().parse_args(["generate", "hi", "--kv-cache-dtype", name])
        assert engine_options_from_args(args).kv_cache_dtype == name
    assert EngineOptions().kv_cache_dtype == "auto"
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        EngineOptions(kv_cache_dtype="fp8")


PERPLEXITY_BOUND = 1.02
"""How much an fp8 or int8 cache may raise the bundled model's perplexity on test_quant's QUALITY_TEXT
over a cache of the model's bf16. Measured on PyTorch's attention and the C++ kernels: fp8 1.005x and
0.999x, int8 1.002x and 1.007x."""
MIN_INT8_AGREEMENT = 20
"""Greedy tokens (of 32) an int8 cache shares with a bf16 one before they part, averaged over test_quant's
AGREEMENT_PROMPTS. Measured: 26.8 on PyTorch's attention, 24.8 on the kernels, where the two paths over
the same bf16 cache share 27-28 and an fp8 cache keeps 9-12 (its two mantissa bits part the paths at the
first near-tie)."""


@pytest.fixture(scope="module")
def bundled_bf16(bundled_gguf_path):
    from quality import bf16_model

    return bf16_model(bundled_gguf_path, "none", None)


def _attention_paths():
    from nanoserve.model.kernels import cpu_kernels

    return {"torch": None} | ({"kernels": cpu_kernels()} if cpu_kernels() is not None else {})


@pytest.mark.parametrize("kv_dtype", [torch.float8_e5m2, torch.int8], ids=["fp8", "int8"])
def test_a_byte_cache_keeps_the_perplexity_of_the_bundled_model(bundled_gguf_path, bundled_bf16, kv_dtype):
    from quality import perplexity
    from test_quant import QUALITY_TEXT

    from nanoserve.model_files import load_tokenizer

    token_ids = load_tokenizer(bundled_gguf_path).encode(QUALITY_TEXT)
    for name, kernels in _attention_paths().items():
        exact = perplexity(bundled_bf16, token_ids, kernels)
        narrow = perplexity(bundled_bf16, token_ids, kernels, kv_dtype=kv_dtype)
        print(f"{name}: perplexity bf16 cache {exact:.3f}, {kv_dtype} {narrow:.3f}")
        assert narrow < PERPLEXITY_BOUND * exact


def test_an_int8_cache_keeps_the_greedy_tokens_of_the_bundled_model(bundled_gguf_path, bundled_bf16):
    from paged_driver import PagedDriver
    from quality import shared_prefix_lengths
    from test_quant import AGREEMENT_PROMPTS

    from nanoserve.model_files import load_tokenizer

    tokenizer = load_tokenizer(bundled_gguf_path)
    prompts = [tokenizer.encode(p) for p in AGREEMENT_PROMPTS]

    def greedy(kernels, kv_dtype) -> list[list[int]]:
        driver = PagedDriver(bundled_bf16, prompts, num_blocks=160, kernels=kernels, kv_dtype=kv_dtype)
        driver.step({i: len(p) for i, p in enumerate(prompts)})
        for _ in range(31):
            driver.step({i: 1 for i in range(len(prompts))})
        return [driver.tokens[i][len(p) :] for i, p in enumerate(prompts)]

    for name, kernels in _attention_paths().items():
        shared = shared_prefix_lengths(greedy(kernels, torch.int8), greedy(kernels, None))
        print(f"{name}: greedy tokens an int8 cache shares with bf16 per prompt {shared}")
        assert sum(shared) / len(shared) >= MIN_INT8_AGREEMENT
