"""Prompts through torch's flash attention: which prefills go there, and that they match the C++ kernel."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from nanoserve.model.attention import build_attention_metadata
from nanoserve.model.flash_prefill import (
    QUERY_LENS,
    WholePrompt,
    attend_split,
    attend_whole_prompts,
    choose_min_query_len,
    measure_min_query_len,
)

CPU = torch.device("cpu")


def test_each_whole_prompt_long_enough_goes_to_flash_attention_on_its_own():
    table = np.array([[3, 1, 0], [2, 5, 4]], dtype=np.int32)

    def groups(query_lens, seq_lens, min_len):
        attn = build_attention_metadata(
            np.array(query_lens), np.array(seq_lens), table, 4, CPU, None, 1, min_len
        )
        return attn.groups

    (whole,) = groups([6, 9], [6, 9], 4)
    assert whole.split is not None and whole.split.flash == [True, True] and whole.split.rest is None
    prompts = [(p.start, p.length, p.blocks.tolist(), p.cached) for p in whole.split.prompts]
    assert prompts == [(0, 6, [3, 1], 0), (6, 9, [2, 5, 4], 0)]
    assert groups([6, 9], [6, 9], None)[0].split is None  # not measured faster
    assert groups([3, 2], [3, 2], 4)[0].split is None  # too short
    # new tokens after no more cached ones are attended as the whole prompt
    (hit,) = groups([5, 9], [7, 9], 4)
    assert hit.split is not None and hit.split.flash == [True, True] and hit.split.rest is None
    assert [(p.start, p.length, p.blocks.tolist(), p.cached) for p in hit.split.prompts][0] == (
        0,
        5,
        [3, 1],
        2,
    )
    # a prompt too short, or a chunk after a longer cached prefix, goes to the kernel beside the whole prompt
    for query_lens, seq_lens, own_blocks in (([3, 9], [3, 9], [3, 3, 3]), ([4, 9], [9, 9], [3, 1, 0])):
        (group,) = groups(query_lens, seq_lens, 4)
        assert group.split is not None and group.split.flash == [False, True]
        assert group.split.rest is not None
        table_rest, starts, lens, contexts = group.split.rest
        assert (starts.tolist(), lens.tolist(), contexts.tolist()) == ([0], [query_lens[0]], [seq_lens[0]])
        assert table_rest.tolist() == [own_blocks] and [p.start for p in group.split.prompts] == [
            query_lens[0]
        ]
    decode, prefill = groups([1, 9], [7, 9], 4)
    assert decode.split is None and prefill.split is not None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_flash_attention_matches_the_prefill_kernel(kernels, dtype):
    """A whole prompt through SDPA beside a chunk after a cached prefix and a whole prompt too short,
    against the kernel over all three."""
    torch.manual_seed(0)
    num_heads, num_kv_heads, head_dim, block_size = 6, 2, 64, 4
    query_lens, seq_lens = [5, 13, 3], [11, 13, 3]
    blocks = [[1, 4, 8], [5, 0, 9, 2], [7]]
    q = torch.randn(sum(query_lens), num_heads, head_dim).to(dtype)
    kv_cache = torch.randn(2, num_kv_heads, 10, block_size, head_dim).to(dtype)
    table = np.array([row + [row[0]] * (4 - len(row)) for row in blocks], dtype=np.int32)
    attn = build_attention_metadata(
        np.array(query_lens), np.array(seq_lens), table, block_size, CPU, kernels, 1, 8
    )
    (group,) = attn.groups
    assert group.split is not None and group.split.flash == [False, True, False]
    out = attend_split(q, kv_cache, group.split, kernels, 0.125)
    t = torch.from_numpy(table)
    starts, lens, contexts = torch.tensor([0, 5, 18]), torch.tensor(query_lens), torch.tensor(seq_lens)
    expected = kernels.paged_prefill_attention(q, kv_cache, t, starts, lens, contexts, 0.125, 0, 0.0)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out, expected, atol=tolerance, rtol=tolerance)
    prompt_alone = attend_whole_prompts(q, kv_cache, group.split.prompts, 0.125)[0]
    assert torch.equal(out[5:18], prompt_alone)  # the same bits as alone: its batch-mates do not matter


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("cached", [1, 16, 40])
def test_a_prompt_after_a_cached_prefix_gets_the_whole_prompts_bits(kernels, dtype, cached):
    """New tokens after cached ones come out as the whole prompt's last rows, bit for bit (a prefix-cache
    hit gives the tokens of a miss), and match the kernel."""
    torch.manual_seed(0)
    num_heads, num_kv_heads, head_dim, block_size, length = 6, 2, 64, 16, 80
    blocks = torch.tensor([4, 0, 2, 5, 1])
    q = torch.randn(length, num_heads, head_dim).to(dtype)
    kv_cache = torch.randn(2, num_kv_heads, 6, block_size, head_dim).to(dtype)
    (whole,) = attend_whole_prompts(q, kv_cache, [WholePrompt(0, length, blocks)], 0.125)
    new = length - cached
    (after_hit,) = attend_whole_prompts(q[cached:], kv_cache, [WholePrompt(0, new, blocks, cached)], 0.125)
    assert torch.equal(after_hit, whole[cached:])
    table = blocks.to(torch.int32).view(1, -1)
    expected = kernels.paged_prefill_attention(
        q[cached:].contiguous(),
        kv_cache,
        table,
        torch.tensor([0]),
        torch.tensor([new]),
        torch.tensor([length]),
        0.125,
        0,
        0.0,
    )
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(after_hit, expected, atol=tolerance, rtol=tolerance)


def test_the_choice_is_measured_once_per_cpu_and_shape(kernels, monkeypatch, tmp_path):
    from nanoserve.model import flash_prefill

    monkeypatch.setattr(flash_prefill, "cache_file", lambda: tmp_path / "choice.json")
    measured = []

    def measure(kernels, shape, dtype, block_size, kv_dtype):
        measured.append((shape, dtype, kv_dtype))
        return 128, {n: 1.5 if n < 128 else 0.5 for n in QUERY_LENS}

    monkeypatch.setattr(flash_prefill, "measure_min_query_len", measure)
    assert [choose_min_query_len(kernels, 4, 2, 64, torch.bfloat16, 16) for _ in range(2)] == [128, 128]
    assert choose_min_query_len(kernels, 8, 2, 64, torch.bfloat16, 16) == 128
    # a float32 model over a bf16 cache is measured on such a cache, apart from one over a float32 cache
    for kv_dtype in (torch.bfloat16, torch.bfloat16, torch.float32, None):
        assert choose_min_query_len(kernels, 4, 2, 64, torch.float32, 16, kv_dtype=kv_dtype) == 128
    f32, bf16 = torch.float32, torch.bfloat16
    assert measured == [  # the second engine of a shape and dtypes reads the first's
        ((4, 2, 64), bf16, bf16),
        ((8, 2, 64), bf16, bf16),
        ((4, 2, 64), f32, bf16),
        ((4, 2, 64), f32, f32),
    ]


@pytest.mark.parametrize(
    ("ratios", "expected"),
    [
        ([1.2, 0.9, 0.8, 0.7, 0.6, 0.5], 128),
        ([0.9, 1.1, 0.8, 0.7, 0.6, 0.5], 256),
        ([1.5, 1.5, 1.4, 1.3, 1.1, 0.9], 2048),
        ([1.1] * 6, None),
    ],
)
def test_the_measured_length_is_the_shortest_from_which_sdpa_always_won(
    kernels, monkeypatch, ratios, expected
):
    from nanoserve.model import flash_prefill

    by_length = dict(zip(QUERY_LENS, ratios, strict=True))
    monkeypatch.setattr(flash_prefill, "time_ratio", lambda kernels, length, *args: by_length[length])
    assert measure_min_query_len(kernels, (4, 2, 64), torch.bfloat16, 16) == (expected, by_length)
