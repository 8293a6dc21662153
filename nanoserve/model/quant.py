"""Quantized matmul weights for CPU decode (--quantization int4 / int8).

Decoding a few sequences reads every weight once per step for very little arithmetic, so its speed is
set by weight bytes and by the instructions it takes to use them. A quantized layer keeps its bf16
weight too, for the steps where its kernel is slower than oneDNN's bf16 matmul (torch's int4 kernel
beyond 16 tokens, the 8-bit lm_head beyond 4 rows), and picks per step by token count.

Both formats take groups of 32 inputs with a scale and an offset each, the format of llama.cpp's Q4_1:
the bundled Q4_1 model requantizes to the values it was shipped with, up to the bf16 rounding of the
scales. Two kernels run them:
- the C++ quant_matmul (AVX-512 VNNI), which also quantizes activations to int8 per group of 32, 4- or
  8-bit weight codes, faster than bf16 at every step size measured; the lm_head gets 8-bit codes
  (logits are where 4-bit error shows most);
- torch's CPU int4 kernel (bf16 activations) where the C++ kernels are not available: int4 only.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Protocol

import torch
from torch import Tensor

GROUP_SIZE = 32
QUANT_MATMUL_MAX_TOKENS = sys.maxsize
"""quant_matmul serves steps of every size: measured over all 30 layers of SmolLM2-135M on a 2-core
AVX-512 machine, int4 takes 0.2x bf16's time at 1 token, 0.4x at 8, 0.7x at 32, 0.8x at 512."""
LM_HEAD_QUANT_MAX_ROWS = 4
"""Rows of logits up to which the 8-bit lm_head is used (49152 x 576, same machine: 2.6x faster than bf16
at 1 row, 1.4x at 4, about even at 8, 0.7x at 32)."""
TORCH_INT4_MAX_TOKENS = 16
"""Steps of up to this many tokens use torch's int4 kernel (3.7x faster than bf16 at 1 token, even at 8,
1.7x slower at 32)."""


class QuantizedWeight(Protocol):
    max_tokens: int
    """Steps with more rows than this use the bf16 weight instead."""

    def matmul(self, x: Tensor) -> Tensor:
        """x: [T, K] -> [T, N], in x's dtype."""
        ...


@dataclass
class GroupQuantWeight:
    """Weights for the C++ quant_matmul (nanoserve/model/kernels/quant_matmul.cpp): unsigned codes in
    tiles of 16 output columns, a bfloat16 scale and offset per group."""

    codes: Tensor
    scales: Tensor
    bits: int
    kernel: Callable[[Tensor, Tensor, Tensor, int], Tensor]
    max_tokens: int = QUANT_MATMUL_MAX_TOKENS

    def matmul(self, x: Tensor) -> Tensor:
        return self.kernel(x, self.codes, self.scales, self.bits)


@dataclass
class TorchInt4Weight:
    """Weights for torch's CPU int4 kernel."""

    packed: Tensor
    """uint8 [N, K / 2], in the kernel's layout."""
    scales_and_zeros: Tensor
    """[K / group, N, 2]: per group, the scale and the value of the middle code (8)."""
    max_tokens: int = TORCH_INT4_MAX_TOKENS

    def matmul(self, x: Tensor) -> Tensor:
        return torch.ops.aten._weight_int4pack_mm_for_cpu(
            x.contiguous(), self.packed, GROUP_SIZE, self.scales_and_zeros.to(x.dtype)
        )


def fast_kernels(kernels: ModuleType | None) -> bool:
    """Whether the C++ kernels are built here with quant_matmul's vector instructions."""
    return kernels is not None and kernels.quant_matmul_supported()


def quantization_error(method: str, device: torch.device, kernels: ModuleType | None) -> str | None:
    """Why `method` cannot run here, or None when it can."""
    if method == "none":
        return None
    if device.type != "cpu":
        return f"quantization {method!r} is for CPU decode; the device is {device}."
    if fast_kernels(kernels):
        return None
    if method == "int4" and hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu"):
        return None
    return (
        f"quantization {method!r} needs the C++ CPU kernels with AVX-512 VNNI (not available here: "
        "no compiler, --cpu-kernels off, or an older CPU)"
        + (" or torch's CPU int4 kernel." if method == "int4" else ".")
    )


def quantize_weight(weight: Tensor, bits: int, kernels: ModuleType | None) -> QuantizedWeight | None:
    """The weight for the best kernel available; None when its shape does not fit that kernel."""
    if kernels is not None and fast_kernels(kernels):
        return quantize_groups(weight, bits, kernels.quant_matmul)
    if bits == 4:
        return quantize_torch_int4(weight)
    return None


def _group_codes(weight: Tensor, bits: int) -> tuple[Tensor, Tensor, Tensor]:
    """[N, K] -> codes [N, K / 32, 32] mapping each group's min..max onto 0..2^bits - 1, scale, low."""
    n, k = weight.shape
    groups = weight.detach().float().view(n, k // GROUP_SIZE, GROUP_SIZE)
    low, high = groups.amin(-1, keepdim=True), groups.amax(-1, keepdim=True)
    levels = 2**bits - 1
    scale = ((high - low) / levels).clamp(min=torch.finfo(torch.float32).tiny)
    codes = ((groups - low) / scale).round_().clamp_(0, levels)
    return codes, scale, low


def quantize_groups(weight: Tensor, bits: int, kernel: Callable) -> GroupQuantWeight | None:
    n, k = weight.shape
    if n % 16 or k % GROUP_SIZE:
        return None
    codes, scale, low = _group_codes(weight, bits)
    # [tiles, 16 columns, groups, 8 quads, 4 inputs] -> [tiles, groups, quads, columns, inputs]
    codes = codes.to(torch.uint8).view(n // 16, 16, k // GROUP_SIZE, 8, 4).permute(0, 2, 3, 1, 4)
    if bits == 4:  # quads 0-3 in the low nibbles, 4-7 in the high ones
        codes = codes[:, :, :4] | (codes[:, :, 4:] << 4)
    scales = torch.cat([scale, low], -1).view(n // 16, 16, k // GROUP_SIZE, 2).permute(0, 2, 3, 1)
    return GroupQuantWeight(
        codes.reshape(n // 16, -1).contiguous(), scales.to(torch.bfloat16).contiguous(), bits, kernel
    )


def quantize_torch_int4(weight: Tensor) -> TorchInt4Weight | None:
    n, k = weight.shape
    if k % GROUP_SIZE:
        return None
    codes, scale, low = _group_codes(weight, 4)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32).view(n, k), 1)
    # the kernel computes (code - 8) * scale + zero, so zero is the value of code 8
    zeros = low + 8 * scale
    scales_and_zeros = torch.stack([scale.squeeze(-1), zeros.squeeze(-1)], dim=-1).transpose(0, 1)
    return TorchInt4Weight(packed, scales_and_zeros.contiguous().to(weight.dtype))
