"""Weight-only int4 (--quantization int4): the kernel's layout, the per-step choice between int4 and bf16
weights, and the quality cost on the bundled model."""

from __future__ import annotations

import math

import pytest
import torch
from paged_driver import PagedDriver

from nanoserve.model.llama import Linear
from nanoserve.model.loader import load_model, load_model_config
from nanoserve.model.quant import INT4_GROUP_SIZE, INT4_MAX_TOKENS, int4_linear, int4_supported, quantize_int4

pytestmark = pytest.mark.skipif(not int4_supported(torch.device("cpu")), reason="no CPU int4 kernel")

CPU = torch.device("cpu")


def snap_to_int4_grid(weight: torch.Tensor) -> torch.Tensor:
    """The nearest weight that int4 with groups of 32 represents exactly (bf16 scales aside)."""
    n, k = weight.shape
    groups = weight.float().view(n, k // INT4_GROUP_SIZE, INT4_GROUP_SIZE)
    low, high = groups.amin(-1, keepdim=True), groups.amax(-1, keepdim=True)
    scale = (high - low) / 15
    return ((groups - low) / scale).round().mul(scale).add(low).view(n, k).to(weight.dtype)


def test_int4_linear_reproduces_weights_on_its_grid():
    torch.manual_seed(0)
    weight = snap_to_int4_grid(torch.randn(96, 128) * 0.05)
    for tokens in (1, 5, INT4_MAX_TOKENS):
        x = torch.randn(tokens, 128)
        out = int4_linear(x.bfloat16(), quantize_int4(weight)).float()
        torch.testing.assert_close(out, x @ weight.T, atol=0.02, rtol=0.02)


def test_int4_needs_whole_groups():
    assert quantize_int4(torch.randn(16, 48)) is None


def _bf16_model(path: str, quantize: bool, snap: bool):
    model = load_model(path, load_model_config(path), torch.bfloat16, CPU)
    if snap:
        for layer in model.layers:
            for module in layer.modules():
                if isinstance(module, Linear):
                    module.weight.copy_(snap_to_int4_grid(module.weight))
        model.prepack_for_cpu()
    if quantize:
        model.quantize_int4()
    return model


def _step_logits(model, prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits of one prefill step bigger than INT4_MAX_TOKENS, then of three decode steps."""
    driver = PagedDriver(model, prompts)
    driver.step({i: len(p) for i, p in enumerate(prompts)})
    prefill = torch.stack([rows[-1] for rows in driver.logits])
    for _ in range(3):
        driver.step({i: 1 for i in range(len(prompts))})
    return prefill, torch.stack([r for rows in driver.logits for r in rows[-3:]])


@pytest.mark.parametrize("snap", [True, False], ids=["weights-on-int4-grid", "arbitrary-weights"])
def test_int4_serves_small_steps_and_bf16_large_ones(tiny_gqa_dir, snap):
    prompts = [list(range(5, 25)), list(range(100, 107))]
    assert sum(map(len, prompts)) > INT4_MAX_TOKENS
    path = str(tiny_gqa_dir)
    bf16_prefill, bf16_decode = _step_logits(_bf16_model(path, quantize=False, snap=snap), prompts)
    int4_prefill, int4_decode = _step_logits(_bf16_model(path, quantize=True, snap=snap), prompts)
    torch.testing.assert_close(int4_prefill, bf16_prefill, atol=0, rtol=0)  # a large step: bf16 weights
    decode_error = (int4_decode - bf16_decode).abs().max().item()
    scale = bf16_decode.abs().max().item()
    if snap:
        assert decode_error < 0.03 * scale  # the same weights: bf16 rounding only
    else:
        assert decode_error > 0.03 * scale  # 4-bit weights: decode steps really use them


QUALITY_TEXT = (
    "The river rose through the night, and by morning the lower fields were under water. Farmers moved "
    "their animals to the hill behind the church, where the ground stayed dry. The mayor opened the "
    "school as a shelter, and volunteers brought blankets, bread and hot soup. When the rain stopped "
    "two days later, people began to clean the mud from their houses. Engineers came to inspect the "
    "old bridge, which had lost part of its railing but still stood. Within a month the market was "
    "open again, and children were back in their classrooms."
)
PERPLEXITY_BOUND = 1.03
"""int4 may raise the bundled model's perplexity on QUALITY_TEXT by at most 3%."""


def _perplexity(model, token_ids: list[int]) -> float:
    """Teacher-forced, in INT4_MAX_TOKENS-token steps, so an int4 model runs every step on int4."""
    driver = PagedDriver(model, [token_ids], num_blocks=64)
    for start in range(0, len(token_ids), INT4_MAX_TOKENS):
        driver.step({0: min(INT4_MAX_TOKENS, len(token_ids) - start)})
    logits = torch.stack(driver.logits[0][:-1])
    nll = torch.nn.functional.cross_entropy(logits, torch.tensor(token_ids[1:]))
    return math.exp(nll.item())


def test_int4_perplexity_on_bundled_model(bundled_gguf_path):
    from nanoserve.model.loader import load_tokenizer

    token_ids = load_tokenizer(bundled_gguf_path).encode(QUALITY_TEXT)
    bf16 = _perplexity(_bf16_model(bundled_gguf_path, quantize=False, snap=False), token_ids)
    int4 = _perplexity(_bf16_model(bundled_gguf_path, quantize=True, snap=False), token_ids)
    print(f"perplexity bf16 {bf16:.3f}, int4 {int4:.3f} ({int4 / bf16:.4f}x)")
    assert int4 < PERPLEXITY_BOUND * bf16
