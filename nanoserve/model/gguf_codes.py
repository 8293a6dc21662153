"""GGUF's Q4_0, Q4_1 and Q8_0 blocks as GroupCodes, without dequantizing: the file's codes, scales and
offsets reach the quantized matmul as they are, so a quantized file loads in its own format (no bf16
copy, no second rounding).

Each block covers 32 consecutive inputs of one row and starts with its float16 scale d:
- Q4_1: then the float16 offset m and 16 bytes of 4-bit codes q; w = q * d + m.
- Q4_0: 16 bytes of codes; w = (q - 8) * d, which is code q with offset -8 d.
- Q8_0: 32 signed bytes q; w = q * d, which is code q + 128 with offset -128 d.
Both offsets are exact in float16 (a power-of-two multiple of d). 4-bit codes: input j of the block sits
in the low nibble of byte j, input j + 16 in its high nibble.
"""

from __future__ import annotations

import numpy as np
import torch

from nanoserve.model.quant import GROUP_SIZE, GroupCodes

BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}
"""The GGUF types loaded as codes, and the bytes of one block of 32 weights."""


def gguf_codes(data: np.ndarray, type_name: str, shape: tuple[int, ...]) -> GroupCodes | None:
    """data: the tensor's raw blocks; shape: [..., rows, inputs] in numpy order. None when an offset
    overflows float16 (a scale beyond 511 in Q8_0: the caller dequantizes instead)."""
    *outer, inputs = shape
    blocks = np.asarray(data, dtype=np.uint8).reshape(*outer, inputs // GROUP_SIZE, BLOCK_BYTES[type_name])
    scale = blocks[..., 0:2].copy().view(np.float16)[..., 0]
    if type_name == "Q8_0":
        codes = (blocks[..., 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
        with np.errstate(over="ignore"):
            low, bits = scale * np.float16(-128), 8
    else:
        nibbles = blocks[..., 4:] if type_name == "Q4_1" else blocks[..., 2:]
        codes = np.concatenate([nibbles & 0x0F, nibbles >> 4], axis=-1)
        with np.errstate(over="ignore"):
            low = (
                blocks[..., 2:4].copy().view(np.float16)[..., 0]
                if type_name == "Q4_1"
                else scale * np.float16(-8)
            )
        bits = 4
    if not np.isfinite(low).all():
        return None
    return GroupCodes(torch.from_numpy(codes), torch.from_numpy(scale), torch.from_numpy(low), bits)
