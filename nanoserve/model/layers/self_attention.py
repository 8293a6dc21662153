"""SelfAttention: one fused q/k/v matmul, optional per-head q/k RMSNorm, rotary embedding, the K/V write
into the paged cache, attention over it (nanoserve.model.attention), the output projection.

With the C++ kernels, the rotation (of whole heads, or of their first dims: Phi-4-mini) and the cache write
are one pass over the fused projection; q/k norms, when the family has them, run first in place.
"""

from __future__ import annotations

from torch import Tensor, nn

from nanoserve.model.attention import AttentionMetadata, paged_attention, write_kv
from nanoserve.model.config import ModelConfig
from nanoserve.model.layers.linear import Linear
from nanoserve.model.layers.norm import RMSNorm
from nanoserve.model.layers.rotary import apply_rope


class SelfAttention(nn.Module):
    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads = config.num_heads, config.num_kv_heads
        self.head_dim, self.rotary_dim = config.head_dim, config.rotary_dim
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.qkv_proj = Linear(config.hidden_size, q_size + 2 * kv_size, bias=config.attention_bias)
        self.o_proj = Linear(q_size, config.hidden_size, bias=config.o_proj_bias)
        self.q_norm = self.k_norm = None
        if config.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.window = config.sliding_windows[layer]
        self.scale = config.attn_scale or self.head_dim**-0.5
        self.softcap = config.attn_softcap

    def forward(self, x: Tensor, cos_sin: Tensor, kv_cache: Tensor, attn: AttentionMetadata) -> Tensor:
        qkv = self.qkv_proj(x)
        # [T, heads + 2 * kv_heads, head_dim], a view of qkv
        heads = qkv.view(x.shape[0], -1, self.head_dim)
        q_end, k_end = self.num_heads, self.num_heads + self.num_kv_heads
        if self.q_norm is not None and self.k_norm is not None:
            heads[:, :q_end] = self.q_norm(heads[:, :q_end].reshape(-1, self.head_dim)).view_as(
                heads[:, :q_end]
            )
            heads[:, q_end:k_end] = self.k_norm(heads[:, q_end:k_end].reshape(-1, self.head_dim)).view_as(
                heads[:, q_end:k_end]
            )
        if attn.kernels is not None:
            q = attn.kernels.rope_write_kv(
                qkv, cos_sin, kv_cache, attn.slot_mapping, self.num_heads, self.num_kv_heads
            )
        else:
            qk = apply_rope(heads[:, :k_end], cos_sin)
            q = qk[:, :q_end]
            write_kv(qk[:, q_end:], heads[:, k_end:], kv_cache, attn)
        return self.o_proj(paged_attention(q, kv_cache, attn, self.scale, self.window, self.softcap))
