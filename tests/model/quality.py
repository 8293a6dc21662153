"""Quality of quantized models against bf16: perplexity, teacher-forced as small-batch decode runs, and the
greedy tokens a quantized model shares with bf16 before the two diverge."""

from __future__ import annotations

import math

import torch
from paged_driver import PagedDriver

from nanoserve.model.layers.linear import Linear, cpu_prepack_supported
from nanoserve.model.loader import load_model, load_model_config
from nanoserve.model.quant import GROUP_SIZE

CPU = torch.device("cpu")


def on_grid(weight: torch.Tensor, bits: int) -> torch.Tensor:
    """The nearest weight that `bits` codes with groups of 32 represent exactly (float16 scales aside)."""
    n, k = weight.shape
    groups = weight.float().view(n, k // GROUP_SIZE, GROUP_SIZE)
    low, high = groups.amin(-1, keepdim=True), groups.amax(-1, keepdim=True)
    scale = (high - low) / (2**bits - 1)
    return ((groups - low) / scale).round().mul(scale).add(low).view(n, k).to(weight.dtype)


def bf16_model(path: str, method: str, kernels, snap: bool = False):
    model = load_model(path, load_model_config(path), torch.bfloat16, CPU)
    if snap:
        for layer in model.layers:
            for module in layer.modules():
                if isinstance(module, Linear):
                    module.weight.copy_(on_grid(module.weight, 4))
        if cpu_prepack_supported(torch.bfloat16, CPU):  # the packed copies, of the weights as loaded
            model.prepack_for_cpu()
    if method != "none":
        model.quantize(method, kernels)
    return model


def perplexity(model, token_ids: list[int], kernels=None, kv_dtype: torch.dtype | None = None) -> float:
    """Teacher-forced 4 tokens a step, as decode at small batch runs: a quantized model uses its
    quantized weights everywhere, the lm_head's included. kernels: attention on the C++ kernels (None:
    PyTorch's); kv_dtype: the KV cache's (None: the model's)."""
    driver = PagedDriver(model, [token_ids], num_blocks=160, kernels=kernels, kv_dtype=kv_dtype)
    for start in range(0, len(token_ids), 4):
        driver.step({0: min(4, len(token_ids) - start)})
    logits = torch.stack(driver.logits[0][:-1])
    nll = torch.nn.functional.cross_entropy(logits, torch.tensor(token_ids[1:]))
    return math.exp(nll.item())


def greedy(model, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    driver = PagedDriver(model, prompts, num_blocks=160)
    driver.step({i: len(p) for i, p in enumerate(prompts)})
    for _ in range(new_tokens - 1):
        driver.step({i: 1 for i in range(len(prompts))})
    return [driver.tokens[i][len(p) :] for i, p in enumerate(prompts)]


def shared_prefix_lengths(ours: list[list[int]], theirs: list[list[int]]) -> list[int]:
    """Per sequence: how many leading tokens the two agree on."""
    return [
        next((i for i, (a, b) in enumerate(zip(x, y, strict=True)) if a != b), len(x))
        for x, y in zip(ours, theirs, strict=True)
    ]
