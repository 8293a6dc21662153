"""Quantized matmul weights for CPU decode (--quantization int4 / int8).

Decoding a few sequences reads every weight once per step for very little arithmetic, so its speed is
set by weight bytes and by the instructions it takes to use them. A quantized layer keeps its bf16
weight too, for the steps where its kernel is slower than oneDNN's bf16 matmul, and picks per step by
token count: up to `max_tokens`, measured per CPU and shape (nanoserve.model.matmul_choice) or, with the
fixed choice, the limits below.

Both formats take groups of 32 inputs with a float16 scale and offset each (GroupCodes), which holds
llama.cpp's Q4_0, Q4_1 and Q8_0 blocks exactly: a GGUF file's codes load as they are, and the bundled
Q4_1 model requantizes from bf16 to the values it was shipped with. 8-bit codes whose offset is -128
times their scale (symmetric: Q8_0, and the lm_head's) are packed with the scale alone, 34 bytes a group
instead of 36. Two kernels run them:
- the C++ quant_matmul (AVX-512 VNNI, or AVX2 where the CPU has no AVX-512), which also quantizes
  activations to int8 per group of 32, 4- or 8-bit weight codes, faster than bf16 at every step size
  measured without AMX; the lm_head gets 8-bit codes (logits are where 4-bit error shows most);
- torch's CPU int4 kernel (bf16 activations) where the C++ kernels are not available: int4 only.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Protocol, TypeGuard

import torch
from torch import Tensor

from nanoserve.model.huge_pages import huge_page_copies

GROUP_SIZE = 32
FLOAT16_TINY = 2.0**-24
"""The smallest float16 above zero: the scale of a group whose weights are all equal."""
QUANT_MATMUL_MAX_TOKENS = sys.maxsize
"""The fixed choice: quant_matmul serves steps of every size (measured over all 30 layers of SmolLM2-135M
on a 2-core AVX-512 Zen without AMX, int4 takes 0.2x bf16's time at 1 token, 0.4x at 8, 0.7x at 32,
0.8x at 512; on AMX, bf16 wins large steps: measure there)."""
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

    @property
    def nbytes(self) -> int:
        """What a matmul reads of it."""
        ...


@dataclass
class GroupQuantWeight:
    """Weights for the C++ quant_matmul (nanoserve/model/kernels/quant_matmul.cpp): unsigned codes in
    tiles of 16 output columns, a float16 scale and offset per group, or for symmetric 8-bit codes the
    scale alone."""

    codes: Tensor
    scales: Tensor
    bits: int
    kernel: Callable[[Tensor, Tensor, Tensor, int], Tensor]
    max_tokens: int = QUANT_MATMUL_MAX_TOKENS

    def matmul(self, x: Tensor) -> Tensor:
        return self.kernel(x, self.codes, self.scales, self.bits)

    @property
    def nbytes(self) -> int:
        return self.codes.nbytes + self.scales.nbytes

    @property
    def in_features(self) -> int:
        """K, from the codes' layout [N / 16, K * 16 * bits / 8]."""
        return self.codes.shape[1] * 8 // (16 * self.bits)

    @property
    def symmetric(self) -> bool:
        """8-bit codes packed with their scales alone (offset -128 * scale)."""
        return self.bits == 8 and self.scales.numel() * GROUP_SIZE == self.codes.numel()


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

    @property
    def nbytes(self) -> int:
        return self.packed.nbytes + self.scales_and_zeros.nbytes


def move_to_huge_pages(weights: Sequence[QuantizedWeight]) -> None:
    """Give the weights' tensors (codes, scales) one buffer in 2 MiB pages (nanoserve.model.huge_pages),
    in place."""
    fields = [(w, name) for w in weights for name, value in vars(w).items() if isinstance(value, Tensor)]
    if not fields:
        return
    copies, _ = huge_page_copies([getattr(w, name) for w, name in fields])
    for (weight, name), copy in zip(fields, copies, strict=True):
        setattr(weight, name, copy)


def fast_kernels(kernels: ModuleType | None) -> TypeGuard[ModuleType]:
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
    if method in ("int4", "auto") and hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu"):
        return None  # auto: a file's 8-bit codes then stay unquantized
    return (
        f"quantization {method!r} needs the C++ CPU kernels with AVX-512 VNNI or AVX2 (not available here: "
        "no compiler, --cpu-kernels off, or an older CPU)"
        + (" or torch's CPU int4 kernel." if method == "int4" else ".")
    )


@dataclass
class GroupCodes:
    """A weight in groups of 32 inputs as unsigned codes with a float16 scale and offset per group
    (w = code * scale + low), before a kernel packs it: what quantizing a float weight gives, and what
    GGUF's Q4_0, Q4_1 and Q8_0 blocks hold (nanoserve.model.gguf_codes), so that a file's own codes reach
    the kernel unchanged."""

    codes: Tensor
    """uint8 [..., N, K / 32, 32]"""
    scale: Tensor
    """float16 [..., N, K / 32]"""
    low: Tensor
    bits: int

    @property
    def shape(self) -> tuple[int, ...]:
        return (*self.codes.shape[:-2], self.codes.shape[-2] * GROUP_SIZE)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> Tensor:
        values = self.codes.float() * self.scale.float().unsqueeze(-1) + self.low.float().unsqueeze(-1)
        return values.flatten(-2).to(dtype)

    def map_rows(self, fn: Callable[[Tensor], Tensor]) -> GroupCodes:
        """fn applied to codes, scales and offsets alike (fn must move whole rows)."""
        return GroupCodes(fn(self.codes), fn(self.scale), fn(self.low), self.bits)

    def unbind(self) -> list[GroupCodes]:
        """Along the leading dimension (a GGUF's stacked experts)."""
        return [self.map_rows(lambda t, i=i: t[i]) for i in range(self.codes.shape[0])]

    @staticmethod
    def cat(parts: list[GroupCodes]) -> GroupCodes:
        """Along the rows (fused q/k/v and gate/up), all of one bit width."""
        assert len({p.bits for p in parts}) == 1
        return GroupCodes(
            *(torch.cat([getattr(p, f) for p in parts]) for f in ("codes", "scale", "low")), parts[0].bits
        )


def symmetric_codes(weight: Tensor) -> GroupCodes | None:
    """[N, K] -> 8-bit codes q + 128 with q = round(w / scale), scale = max |w| / 127 per group (Q8_0's
    scale; a float32 weight dequantized from Q8_0 gets its own codes back), offset -128 * scale; None as
    for group_codes."""
    n, k = weight.shape
    if k % GROUP_SIZE:
        return None
    groups = weight.detach().float().view(n, k // GROUP_SIZE, GROUP_SIZE)
    scale = (groups.abs().amax(-1) / 127).clamp(min=FLOAT16_TINY).to(torch.float16)
    low = scale * -128  # exact in float16 below its overflow
    if not (scale.isfinite().all() and low.isfinite().all()):
        return None
    codes = (groups / scale.float().unsqueeze(-1)).round_().clamp_(-128, 127) + 128
    return GroupCodes(codes.to(torch.uint8), scale, low, 8)


def group_codes(weight: Tensor, bits: int) -> GroupCodes | None:
    """[N, K] -> each group's min..max onto codes 0..2^bits - 1, the codes chosen against the float16
    scale and offset as stored; None when K is not in groups of 32 or a group's range is beyond float16."""
    n, k = weight.shape
    if k % GROUP_SIZE:
        return None
    groups = weight.detach().float().view(n, k // GROUP_SIZE, GROUP_SIZE)
    low, high = groups.amin(-1), groups.amax(-1)
    levels = 2**bits - 1
    scale = ((high - low) / levels).clamp(min=FLOAT16_TINY).to(torch.float16)
    low = low.to(torch.float16)
    if not (scale.isfinite().all() and low.isfinite().all()):
        return None
    codes = (groups - low.float().unsqueeze(-1)) / scale.float().unsqueeze(-1)
    return GroupCodes(codes.round_().clamp_(0, levels).to(torch.uint8), scale, low, bits)


def quantize_weight(weight: Tensor, bits: int, kernels: ModuleType | None) -> QuantizedWeight | None:
    """The weight for the best kernel available; None when its shape does not fit that kernel."""
    codes = group_codes(weight, bits)
    return None if codes is None else pack_codes(codes, kernels)


def pack_codes(codes: GroupCodes, kernels: ModuleType | None) -> QuantizedWeight | None:
    """Codes in the layout of the best kernel available; None when their shape does not fit it."""
    if fast_kernels(kernels):
        return pack_groups(codes, kernels.quant_matmul)
    if codes.bits == 4:
        return pack_torch_int4(codes)
    return None


def pack_groups(codes: GroupCodes, kernel: Callable) -> GroupQuantWeight | None:
    n, k = codes.shape
    if n % 16:
        return None
    groups = k // GROUP_SIZE
    # [tiles, 16 columns, groups, 8 quads, 4 inputs] -> [tiles, groups, quads, columns, inputs]
    tiled = codes.codes.view(n // 16, 16, groups, 8, 4).permute(0, 2, 3, 1, 4)
    if codes.bits == 4:  # quads 0-3 in the low nibbles, 4-7 in the high ones
        tiled = tiled[:, :, :4] | (tiled[:, :, 4:] << 4)
    symmetric = codes.bits == 8 and torch.equal(codes.low, codes.scale * -128)
    per_group = [codes.scale] if symmetric else [codes.scale, codes.low]
    scales = torch.stack(per_group, -1).view(n // 16, 16, groups, len(per_group)).permute(0, 2, 3, 1)
    return GroupQuantWeight(tiled.reshape(n // 16, -1).contiguous(), scales.contiguous(), codes.bits, kernel)


def pack_torch_int4(codes: GroupCodes) -> TorchInt4Weight | None:
    n, k = codes.shape
    if n % 16:
        return None
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.codes.to(torch.int32).view(n, k), 1)
    # the kernel computes (code - 8) * scale + zero, so zero is the value of code 8
    scale, low = codes.scale.float(), codes.low.float()
    scales_and_zeros = torch.stack([scale, low + 8 * scale], dim=-1).transpose(0, 1)
    return TorchInt4Weight(packed, scales_and_zeros.contiguous().to(torch.bfloat16))
