"""The paged Llama forward against transformers on tiny random models, fp32.

Each step is scheduled like the engine does it: several requests in one flat batch, prompts possibly
split into chunks, decodes fed back with the greedy token, blocks handed out in shuffled order.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from paged_driver import PagedDriver

from nanoserve.model.attention import allocate_kv_cache, build_attention_metadata, kv_cache_bytes_per_block
from nanoserve.model.loader import load_model, load_model_config


@pytest.fixture(scope="module")
def models(tiny_model_dir):
    from transformers import LlamaForCausalLM as HFLlama

    path = str(tiny_model_dir)
    ours = load_model(path, load_model_config(path), torch.float32, torch.device("cpu"))
    ref = HFLlama.from_pretrained(path, dtype=torch.float32).eval()
    return ours, ref


@pytest.fixture(params=["torch", "cpp"])
def kernels(request, models):
    """PyTorch ops (None), or the C++ kernels: cache writes, decode attention reading the paged cache in
    place, and RMSNorm, switched on for this test only."""
    if request.param == "torch":
        yield None
        return
    from nanoserve.model.kernels import cpu_kernels

    module = cpu_kernels()
    if module is None:
        pytest.skip("the C++ kernels cannot be built on this machine")
    ours = models[0]
    ours.use_cpu_kernels(module)
    yield module
    for norm in ours.modules():
        norm.__dict__.pop("kernel", None)
    ours.fused_decoder = None


def _prompts(lengths: list[int], seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 49152, n).tolist() for n in lengths]


def test_batched_prefill_then_decode(models, kernels):
    ours, ref = models
    lengths = [5, 1, 11, 8]
    driver = PagedDriver(ours, _prompts(lengths), kernels=kernels)
    driver.step({i: n for i, n in enumerate(lengths)})  # one prefill batch of uneven prompts
    for _ in range(4):
        driver.step({i: 1 for i in range(len(lengths))})  # decode-only steps
    driver.check_against(ref)


def test_chunked_prefill_mixed_with_decode(models, kernels):
    ours, ref = models
    driver = PagedDriver(ours, _prompts([13, 6, 3], seed=1), kernels=kernels)
    driver.step({0: 7, 1: 6})  # first chunk of prompt 0, all of prompt 1
    driver.step({1: 1, 0: 6, 2: 3})  # a decode, the rest of prompt 0, a new prompt: both groups at once
    driver.step({0: 1, 1: 1, 2: 1})
    driver.step({2: 1, 0: 1})
    driver.check_against(ref)


def test_uniform_prefill_then_single_sequence_decode(models, kernels):
    ours, ref = models
    driver = PagedDriver(ours, _prompts([6, 6], seed=2), kernels=kernels)
    driver.step({0: 6, 1: 6})  # equal lengths: the no-padding path
    for _ in range(3):
        driver.step({1: 1})
    driver.check_against(ref)


def test_kv_cache_size():
    caches = allocate_kv_cache(3, 5, 4, 2, 8, torch.bfloat16, torch.device("cpu"))
    assert len(caches) == 3
    assert sum(c.numel() * c.element_size() for c in caches) == 5 * kv_cache_bytes_per_block(
        3, 4, 2, 8, torch.bfloat16
    )


def test_qwen2_with_qkv_bias(tmp_path):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    ref = Qwen2ForCausalLM(
        Qwen2Config(
            vocab_size=49152,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            tie_word_embeddings=True,
        )
    ).eval()
    with torch.no_grad():
        for p in ref.parameters():
            p.normal_(0.0, 0.2)
    ref.save_pretrained(tmp_path)
    config = load_model_config(str(tmp_path))
    assert config.architecture == "Qwen2ForCausalLM" and config.attention_bias and not config.o_proj_bias
    driver = PagedDriver(
        load_model(str(tmp_path), config, torch.float32, torch.device("cpu")), _prompts([7, 3])
    )
    driver.step({0: 7, 1: 3})
    driver.step({0: 1, 1: 1})
    driver.check_against(ref)


@pytest.mark.parametrize(
    "rope",
    [
        {"rope_type": "linear", "factor": 4.0},
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128},
        {
            "rope_type": "yarn",
            "factor": 8.0,
            "original_max_position_embeddings": 256,
            "beta_fast": 16,
            "mscale": 1.0,
            "mscale_all_dim": 0.5,
        },
    ],
)
def test_rope_scaling_matches_transformers(rope):
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from nanoserve.model.layers.rotary import rope_inv_freq
    from nanoserve.model.models.llama import config_from_hf

    hf = dict(
        vocab_size=10,
        hidden_size=256,
        num_hidden_layers=1,
        num_attention_heads=4,
        intermediate_size=16,
        max_position_embeddings=1024,
        rope_theta=50000.0,
        rope_scaling=dict(rope),
    )
    ref_inv_freq, ref_factor = ROPE_INIT_FUNCTIONS[rope["rope_type"]](LlamaConfig(**hf), torch.device("cpu"))
    config = config_from_hf(hf, "LlamaForCausalLM", "x")
    inv_freq, factor = rope_inv_freq(
        config.rotary_dim, config.rope_theta, config.rope_scaling, config.max_position_embeddings
    )
    torch.testing.assert_close(inv_freq, ref_inv_freq.float(), atol=0, rtol=1e-6)
    assert factor == pytest.approx(ref_factor)


def test_whole_prompts_through_flash_attention(models, kernels):
    """Prefills of whole prompts through torch's flash attention (as where the engine measured it faster),
    and a chunk after no more cached tokens than its own; a chunk after a longer prefix and the decodes stay
    on their own paths."""
    ours, ref = models
    lengths = [5, 11, 8]
    driver = PagedDriver(ours, _prompts(lengths + [14, 16], seed=4), kernels=kernels, flash_min_query_len=2)
    driver.step({0: 5, 1: 11, 2: 8})
    driver.step({3: 6, 4: 10})
    driver.step({3: 8, 4: 6, 0: 1, 1: 1, 2: 1})
    for _ in range(2):
        driver.step({i: 1 for i in range(5)})
    driver.check_against(ref)


def test_attention_metadata_groups():
    block_table = np.array([[3, 1, 0], [2, 5, 4], [6, 0, 0]], dtype=np.int32)
    decode = build_attention_metadata(
        np.array([1, 1, 1]), np.array([5, 9, 2]), block_table, 4, torch.device("cpu")
    )
    assert decode.slot_mapping.tolist() == [1 * 4 + 0, 4 * 4 + 0, 6 * 4 + 1]
    (group,) = decode.groups
    assert group.is_decode and group.token_index is None and group.context_len == 12
    # a request's blocks past its length point at its first block (masked out)
    assert group.block_index.view(3, 3).tolist() == [[3, 1, 3], [2, 5, 4], [6, 6, 6]]

    mixed = build_attention_metadata(
        np.array([3, 1, 2]), np.array([3, 9, 6]), block_table, 4, torch.device("cpu")
    )
    assert mixed.num_tokens == 6 and [g.is_decode for g in mixed.groups] == [True, False]
    assert mixed.groups[0].out_index.tolist() == [3]
    prefill = mixed.groups[1]
    assert prefill.token_index.tolist() == [0, 1, 2, 4, 5, 5] and prefill.out_index.tolist() == [
        0,
        1,
        2,
        4,
        5,
    ]
    # request 2 has 4 cached tokens: its queries see keys 0..4 and 0..5
    assert prefill.visible(None)[1, :2, :7].tolist() == [[True] * 5 + [False] * 2, [True] * 6 + [False]]


def test_a_decode_with_drafts_is_attended_as_decode_rows():
    block_table = np.array([[3, 1, 0], [2, 5, 4], [6, 0, 0]], dtype=np.int32)
    # request 0 decodes with 2 drafts (positions 6..8), request 1 decodes plainly, request 2 with 1 draft
    verify = build_attention_metadata(
        np.array([3, 1, 2]), np.array([9, 9, 3]), block_table, 4, torch.device("cpu"), None, 4
    )
    assert verify.slot_mapping.tolist() == [1 * 4 + 2, 1 * 4 + 3, 0 * 4 + 0, 4 * 4 + 0, 6 * 4 + 1, 6 * 4 + 2]
    group = verify.decode_only
    assert group is not None and group.num_seqs == 6 and group.token_index is None
    # each row is a sequence ending at its own token: the causal mask
    assert group.seq_lens.tolist() == [7, 8, 9, 9, 2, 3]
    assert group.block_table.tolist() == [[3, 1, 0]] * 3 + [[2, 5, 4]] + [[6, 0, 0]] * 2
    assert group.visible(None)[:3, 0, :10].sum(dim=1).tolist() == [7, 8, 9]

    # beside a prefill the rows keep their flat token rows; a query over the limit stays a prefill
    mixed = build_attention_metadata(
        np.array([2, 5]), np.array([6, 5]), block_table[:2], 4, torch.device("cpu"), None, 4
    )
    decode, prefill = mixed.groups
    assert decode.out_index is not None and prefill.out_index is not None and not prefill.is_decode
    assert decode.out_index.tolist() == [0, 1] and decode.seq_lens.tolist() == [5, 6]
    assert prefill.out_index.tolist() == [2, 3, 4, 5, 6]


def test_bf16_prepacked_linears_match_plain(tiny_gqa_dir):
    from nanoserve.model.layers.linear import Linear, cpu_prepack_supported

    path = str(tiny_gqa_dir)
    model = load_model(path, load_model_config(path), torch.bfloat16, torch.device("cpu"))
    if not cpu_prepack_supported(torch.bfloat16, torch.device("cpu")):
        pytest.skip("this CPU has no native bf16: weights are not pre-packed")
    assert model.packed_embed is not None
    packed = PagedDriver(model, _prompts([9, 4], seed=3))
    packed.step({0: 9, 1: 4})
    packed.step({0: 1, 1: 1})
    for module in model.modules():
        if isinstance(module, Linear):
            module.packed = None
    model.packed_embed = None
    plain = PagedDriver(model, _prompts([9, 4], seed=3))
    plain.step({0: 9, 1: 4})
    plain.step({0: 1, 1: 1})
    for a, b in zip(packed.logits, plain.logits, strict=True):
        torch.testing.assert_close(torch.stack(a), torch.stack(b), atol=0.05, rtol=0.02)
