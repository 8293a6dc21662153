"""Whole prompts through torch's flash attention: which prefills go there, and that they match the C++ kernel."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from nanoserve.model.attention import build_attention_metadata
from nanoserve.model.flash_prefill import QUERY_LENS, WholePrompt, attend_whole_prompts, measure_min_query_len

CPU = torch.device("cpu")


def test_only_prefills_of_whole_prompts_long_enough_go_to_flash_attention():
    table = np.array([[3, 1, 0], [2, 5, 4]], dtype=np.int32)

    def groups(query_lens, seq_lens, min_len):
        attn = build_attention_metadata(
            np.array(query_lens), np.array(seq_lens), table, 4, CPU, None, 1, min_len
        )
        return attn.groups

    (whole,) = groups([6, 9], [6, 9], 4)
    assert whole.whole_prompts is not None
    assert [(p.start, p.length, p.blocks.tolist()) for p in whole.whole_prompts] == [
        (0, 6, [3, 1]),
        (6, 9, [2, 5, 4]),
    ]
    assert groups([6, 9], [6, 9], None)[0].whole_prompts is None  # not measured faster
    assert groups([6, 3], [6, 3], 4)[0].whole_prompts is None  # one prompt too short
    assert groups([6, 5], [6, 9], 4)[0].whole_prompts is None  # a chunk after a cached prefix
    decode, prefill = groups([1, 9], [7, 9], 4)
    assert decode.whole_prompts is None and prefill.whole_prompts is not None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_flash_attention_matches_the_prefill_kernel(kernels, dtype):
    torch.manual_seed(0)
    num_heads, num_kv_heads, head_dim, block_size = 6, 2, 64, 4
    lengths, blocks = [13, 7], [[5, 0, 9, 2], [7, 3]]
    q = torch.randn(sum(lengths), num_heads, head_dim).to(dtype)
    kv_cache = torch.randn(2, num_kv_heads, 10, block_size, head_dim).to(dtype)
    table = torch.tensor([blocks[0], blocks[1] + [0, 0]], dtype=torch.int32)
    starts, lens = torch.tensor([0, 13]), torch.tensor(lengths)
    expected = kernels.paged_prefill_attention(q, kv_cache, table, starts, lens, lens, 0.125, 0, 0.0)
    prompts = [WholePrompt(0, 13, torch.tensor(blocks[0])), WholePrompt(13, 7, torch.tensor(blocks[1]))]
    out = attend_whole_prompts(q, kv_cache, prompts, 0.125)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out, expected, atol=tolerance, rtol=tolerance)


def test_the_measured_choice_is_a_measured_length_or_none(kernels):
    assert measure_min_query_len(kernels, 4, 2, 64, torch.bfloat16, 16) in (None, *QUERY_LENS)
