"""Weight-only int4 for CPU decode: groupwise asymmetric 4-bit weights, bf16 activations.

Decoding a few sequences reads every weight once per step for very little arithmetic, so its speed is
set by weight bytes: a quarter of bf16's. For steps of many tokens (prefill, large batches) the work is
arithmetic, where oneDNN's bf16 matmul is faster than the int4 kernel, so a quantized layer keeps its
bf16 weight for those and picks per step by token count.

The format is the one llama.cpp's Q4_1 uses (per group of 32: a scale and an offset), so the bundled
Q4_1 model requantizes to the values it was shipped with, up to the bf16 rounding of the scales.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

INT4_GROUP_SIZE = 32
INT4_MAX_TOKENS = 16
"""Steps of up to this many tokens use int4 weights; bigger ones the bf16 weights (measured crossover on
a 2-core AVX-512 machine: int4 is 3.7x faster than bf16 at 1 token, even at 8, 1.7x slower at 32)."""


@dataclass
class Int4Weight:
    packed: Tensor
    """uint8 [N, K / 2], in the layout of torch's CPU int4 kernel."""
    scales_and_zeros: Tensor
    """[K / group, N, 2]: per group, the scale and the value of the middle code (8)."""
    group_size: int


def int4_supported(device: torch.device) -> bool:
    return device.type == "cpu" and hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu")


def quantize_int4(weight: Tensor, group_size: int = INT4_GROUP_SIZE) -> Int4Weight | None:
    """[N, K] float weight -> int4, each group of `group_size` inputs mapped min..max onto codes 0..15.
    None when K does not split into groups."""
    n, k = weight.shape
    if k % group_size:
        return None
    groups = weight.detach().float().view(n, k // group_size, group_size)
    low, high = groups.amin(-1, keepdim=True), groups.amax(-1, keepdim=True)
    scale = ((high - low) / 15).clamp(min=torch.finfo(torch.float32).tiny)
    codes = ((groups - low) / scale).round_().clamp_(0, 15).to(torch.int32).view(n, k)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
    # the kernel computes (code - 8) * scale + zero, so zero is the value of code 8
    zeros = low + 8 * scale
    scales_and_zeros = torch.stack([scale.squeeze(-1), zeros.squeeze(-1)], dim=-1).transpose(0, 1)
    return Int4Weight(packed, scales_and_zeros.contiguous().to(weight.dtype), group_size)


def int4_linear(x: Tensor, weight: Int4Weight) -> Tensor:
    """x: [T, K] -> [T, N], in x's dtype."""
    return torch.ops.aten._weight_int4pack_mm_for_cpu(
        x.contiguous(), weight.packed, weight.group_size, weight.scales_and_zeros.to(x.dtype)
    )
