"""How a KV cache holds one token's K (or V) for one KV head, by the cache's dtype: a row.

Float rows (float32, bfloat16, float16, float8_e5m2) are the head's values rounded to the dtype. An int8
row is the head's values as codes, then the row's float32 scale in its last 4 bytes: the row's largest
magnitude times float32(1/127), so a value is code * scale (a row too small for 1 / scale to be finite
keeps codes of 0), and one token's outlier costs no other token precision. The
C++ kernels (nanoserve/model/kernels/kernels.h) write and read the same rows with the same float32
arithmetic, so both paths hold the same codes.
"""

from __future__ import annotations

import torch

INT8_SCALE_BYTES = 4
INT8_STEP = torch.tensor(1 / 127, dtype=torch.float32)
"""A code's step is the row's largest magnitude times this (1/127 in float32, as the kernels' constant)."""


def row_width(head_dim: int, dtype: torch.dtype) -> int:
    """The elements of a row of this dtype for a head of head_dim values."""
    return head_dim + (INT8_SCALE_BYTES if dtype == torch.int8 else 0)


def encode(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """values [..., D] -> rows [..., row_width(D, dtype)] of dtype."""
    if dtype != torch.int8:
        return values.to(dtype)
    values = values.float()
    scale = values.abs().amax(-1, keepdim=True) * INT8_STEP
    inverse = torch.where(scale >= torch.finfo(torch.float32).tiny, 1 / scale, 0.0)
    codes = torch.round(values * inverse).to(torch.int8)
    return torch.cat([codes, scale.view(torch.int8)], dim=-1)


def decode(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """rows [..., row] -> the values [..., D] in dtype."""
    if rows.dtype != torch.int8:
        return rows.to(dtype)
    head_dim = rows.shape[-1] - INT8_SCALE_BYTES
    scale = rows[..., head_dim:].contiguous().view(torch.float32)
    return (rows[..., :head_dim].float() * scale).to(dtype)


def as_copyable(rows: torch.Tensor) -> torch.Tensor:
    """The same bytes in a dtype index_copy_ takes (the CPU has none for fp8)."""
    return rows.view(torch.uint8) if rows.dtype == torch.float8_e5m2 else rows
