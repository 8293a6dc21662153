"""Rotary position embeddings: the scaling variants (linear, llama3, yarn, LongRoPE, GGUF's per-frequency
factors), a cos/sin table built once and looked up once per step, and partial rotation (Phi-4-mini)."""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn


def rope_inv_freq(dim: int, theta: float, scaling: dict | None, max_positions: int) -> tuple[Tensor, float]:
    """Inverse frequencies [dim // 2] after rope scaling, and the factor cos/sin are scaled by.

    max_positions: the context this engine serves; LongRoPE takes its long factors when it exceeds the
    pretraining length (as llama.cpp does by context size: a cached K must keep the rotation it got).
    """
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = scaling or {"rope_type": "default"}
    rope_type = scaling["rope_type"]
    if rope_type == "default":
        return inv_freq, 1.0
    if rope_type == "freq_factors":
        return inv_freq / torch.tensor(scaling["factors"], dtype=torch.float32), 1.0
    old_ctx = scaling.get("original_max_position_embeddings") or max_positions
    if rope_type == "longrope":
        factors = scaling["long_factor"] if max_positions > old_ctx else scaling["short_factor"]
        return inv_freq / torch.tensor(factors, dtype=torch.float32), float(scaling["attention_factor"])
    factor = float(scaling["factor"])
    if rope_type == "linear":
        return inv_freq / factor, 1.0
    if rope_type == "llama3":
        low_wavelen = old_ctx / scaling["low_freq_factor"]
        high_wavelen = old_ctx / scaling["high_freq_factor"]
        wavelen = 2 * math.pi / inv_freq
        smooth = (old_ctx / wavelen - scaling["low_freq_factor"]) / (
            scaling["high_freq_factor"] - scaling["low_freq_factor"]
        )
        blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(is_medium, blended, scaled), 1.0
    # yarn: interpolate low frequencies, keep high ones, ramp in between; cos/sin get scaled up
    beta_fast, beta_slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def correction_dim(num_rotations: float) -> float:
        return dim * math.log(old_ctx / (num_rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / ((high - low) or 0.001)).clamp(0, 1)
    inv_freq = inv_freq / factor * ramp + inv_freq * (1 - ramp)

    def mscale(scale: float = 1.0) -> float:
        return 0.1 * scale * math.log(factor) + 1.0 if factor > 1 else 1.0

    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        both = scaling.get("mscale") and scaling.get("mscale_all_dim")
        attention_factor = mscale(scaling["mscale"]) / mscale(scaling["mscale_all_dim"]) if both else mscale()
    return inv_freq, float(attention_factor)


class RotaryEmbedding(nn.Module):
    def __init__(self, dim: int, theta: float, scaling: dict | None, max_positions: int) -> None:
        super().__init__()
        self.dim, self.theta, self.scaling, self.max_positions = dim, theta, scaling, max_positions
        self.table: Tensor | None = None  # [max_positions, 2, dim]: cos, and sin signed for rotate-half

    def build_table(self, dtype: torch.dtype, device: torch.device) -> Tensor:
        inv_freq, scale = rope_inv_freq(self.dim, self.theta, self.scaling, self.max_positions)
        freqs = torch.outer(torch.arange(self.max_positions, dtype=torch.float32), inv_freq)
        cos, sin = freqs.cos() * scale, freqs.sin() * scale
        table = torch.stack([torch.cat([cos, cos], -1), torch.cat([-sin, sin], -1)], dim=1)
        return table.to(device=device, dtype=dtype)

    def table_for(self, dtype: torch.dtype, device: torch.device) -> Tensor:
        """[max_positions, 2, dim] in dtype on device, built once."""
        if self.table is None or self.table.dtype != dtype or self.table.device != device:
            self.table = self.build_table(dtype, device)
        return self.table

    def forward(self, positions: Tensor, dtype: torch.dtype) -> Tensor:
        """[T] -> [T, 2, 1, dim], ready to broadcast over heads."""
        return self.table_for(dtype, positions.device)[positions].unsqueeze(2)


def apply_rope(x: Tensor, cos_sin: Tensor) -> Tensor:
    """x: [T, heads, head_dim]; the first cos_sin.shape[-1] dims of each head rotate, the rest pass.
    rotate_half(x) * sin == roll(x) * [-sin, sin], one op cheaper."""
    dim = cos_sin.shape[-1]
    if dim < x.shape[-1]:
        return torch.cat([apply_rope(x[..., :dim], cos_sin), x[..., dim:]], dim=-1)
    rolled = torch.roll(x, dim // 2, dims=-1)
    return torch.addcmul(x * cos_sin[:, 0], rolled, cos_sin[:, 1])
