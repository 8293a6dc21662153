"""The Llama family (Llama, Mistral without sliding window, Qwen2) over a paged KV cache.

q/k/v and gate/up are fused into single Linear layers (one matmul each); RoPE's cos/sin come from a
table built once, looked up once per step and shared by every layer.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from types import ModuleType

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from nanoserve.model.attention import AttentionMetadata, paged_attention, write_kv
from nanoserve.model.config import ModelConfig
from nanoserve.model.quant import LM_HEAD_QUANT_MAX_ROWS, QuantizedWeight, fast_kernels, quantize_weight


def rope_inv_freq(config: ModelConfig) -> tuple[Tensor, float]:
    """Inverse frequencies [head_dim // 2] after rope scaling, and the factor cos/sin are scaled by."""
    dim, base = config.head_dim, config.rope_theta
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = config.rope_scaling or {"rope_type": "default"}
    rope_type = scaling["rope_type"]
    if rope_type == "default":
        return inv_freq, 1.0
    if rope_type == "freq_factors":
        return inv_freq / torch.tensor(scaling["factors"], dtype=torch.float32), 1.0
    factor = float(scaling["factor"])
    if rope_type == "linear":
        return inv_freq / factor, 1.0
    old_ctx = scaling.get("original_max_position_embeddings") or config.max_position_embeddings
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
        return dim * math.log(old_ctx / (num_rotations * 2 * math.pi)) / (2 * math.log(base))

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
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.table: Tensor | None = None  # [max_pos, 2, head_dim]: cos, and sin signed for rotate-half

    def build_table(self, dtype: torch.dtype, device: torch.device) -> Tensor:
        inv_freq, scale = rope_inv_freq(self.config)
        freqs = torch.outer(torch.arange(self.config.max_position_embeddings, dtype=torch.float32), inv_freq)
        cos, sin = freqs.cos() * scale, freqs.sin() * scale
        table = torch.stack([torch.cat([cos, cos], -1), torch.cat([-sin, sin], -1)], dim=1)
        return table.to(device=device, dtype=dtype)

    def forward(self, positions: Tensor, dtype: torch.dtype) -> Tensor:
        """[T] -> [T, 2, 1, head_dim], ready to broadcast over heads."""
        if self.table is None or self.table.dtype != dtype or self.table.device != positions.device:
            self.table = self.build_table(dtype, positions.device)
        return self.table[positions].unsqueeze(2)


def apply_rope(x: Tensor, cos_sin: Tensor) -> Tensor:
    """x: [T, heads, head_dim]. rotate_half(x) * sin == roll(x) * [-sin, sin], one op cheaper."""
    rolled = torch.roll(x, x.shape[-1] // 2, dims=-1)
    return torch.addcmul(x * cos_sin[:, 0], rolled, cos_sin[:, 1])


def cpu_prepack_supported(dtype: torch.dtype, device: torch.device) -> bool:
    return (
        device.type == "cpu"
        and dtype == torch.bfloat16
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
        and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    )


class Linear(nn.Linear):
    """nn.Linear that can keep its weight pre-packed for oneDNN on CPU.

    F.linear in bf16 on CPU re-packs the weight into oneDNN's blocked layout on every call, which at
    decode batch sizes costs about as much as the matmul; packing once makes small batches ~1.5-4x faster.
    """

    packed: Tensor | None = None
    quantized: QuantizedWeight | None = None
    """Used for steps of up to quantized.max_tokens rows (see nanoserve.model.quant)."""

    def prepack(self) -> None:
        self.packed = _pack(self.weight)

    def forward(self, x: Tensor) -> Tensor:
        if self.quantized is not None and x.shape[0] <= self.quantized.max_tokens:
            out = self.quantized.matmul(x)
            return out if self.bias is None else out + self.bias
        if self.packed is not None:
            return _packed_linear(x, self.packed, self.bias)
        return F.linear(x, self.weight, self.bias)


def _pack(weight: Tensor) -> Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 1)  # 1: tuned for decode-sized batches


def _packed_linear(x: Tensor, packed: Tensor, bias: Tensor | None) -> Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = (
            config.num_heads,
            config.num_kv_heads,
            config.head_dim,
        )
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.qkv_proj = Linear(config.hidden_size, q_size + 2 * kv_size, bias=config.attention_bias)
        self.o_proj = Linear(q_size, config.hidden_size, bias=config.o_proj_bias)

    def forward(self, x: Tensor, cos_sin: Tensor, kv_cache: Tensor, attn: AttentionMetadata) -> Tensor:
        qkv = self.qkv_proj(x)
        if attn.kernels is not None:
            q = attn.kernels.rope_write_kv(
                qkv, cos_sin, kv_cache, attn.slot_mapping, self.num_heads, self.num_kv_heads
            )
        else:
            qkv = qkv.view(x.shape[0], -1, self.head_dim)  # [T, heads + 2 * kv_heads, head_dim]
            qk = apply_rope(qkv[:, : self.num_heads + self.num_kv_heads], cos_sin)
            q = qk[:, : self.num_heads]
            write_kv(qk[:, self.num_heads :], qkv[:, self.num_heads + self.num_kv_heads :], kv_cache, attn)
        return self.o_proj(paged_attention(q, kv_cache, attn))


class LlamaMLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.gate_up_proj = Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = Linear(config.intermediate_size, config.hidden_size, bias=False)

    kernel: Callable | None = None
    """The C++ silu_and_mul (nanoserve.model.kernels): one pass where PyTorch runs three ops."""

    def forward(self, x: Tensor) -> Tensor:
        gate_up = self.gate_up_proj(x)
        if self.kernel is not None and gate_up.dim() == 2:
            return self.down_proj(self.kernel(gate_up))
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    kernel: Callable | None = None
    """The C++ rms_norm (nanoserve.model.kernels): one op where PyTorch's CPU rms_norm runs eight."""

    def forward(self, x: Tensor) -> Tensor:
        if self.kernel is not None and x.dim() == 2:
            return self.kernel(x, self.weight, self.eps)
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = LlamaAttention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = LlamaMLP(config)

    def forward(self, x: Tensor, cos_sin: Tensor, kv_cache: Tensor, attn: AttentionMetadata) -> Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos_sin, kv_cache, attn)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaForCausalLM(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        # _weight skips the random init: the loader overwrites it, and normal_ on meta is slow to warm up
        self.embed_tokens = nn.Embedding(
            config.vocab_size, config.hidden_size, _weight=torch.empty(config.vocab_size, config.hidden_size)
        )
        self.rotary = RotaryEmbedding(config)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.packed_embed: Tensor | None = None  # the tied lm_head packed for oneDNN, see prepack_for_cpu
        self.quantized_lm_head: QuantizedWeight | None = None  # see quantize
        self.lm_head = (
            None if config.tie_word_embeddings else Linear(config.hidden_size, config.vocab_size, bias=False)
        )

    def forward(
        self, input_ids: Tensor, positions: Tensor, kv_caches: list[Tensor], attn: AttentionMetadata
    ) -> Tensor:
        """input_ids, positions: [T] -> final hidden states [T, hidden]; writes the new K/V into kv_caches."""
        x = self.embed_tokens(input_ids)
        cos_sin = self.rotary(positions, x.dtype)
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            x = layer(x, cos_sin, kv_cache, attn)
        return self.norm(x)

    def prepack_for_cpu(self) -> None:
        """Pack every matmul weight for oneDNN (CPU, bf16); the weights stay for everything else."""
        for module in self.modules():
            if isinstance(module, Linear):
                module.prepack()
        if self.lm_head is None:
            self.packed_embed = _pack(self.embed_tokens.weight)

    def use_cpu_kernels(self, kernels: ModuleType) -> None:
        """RMSNorm and the MLP's activation in C++; attention takes its kernels from AttentionMetadata."""
        for module in self.modules():
            if isinstance(module, RMSNorm):
                module.kernel = kernels.rms_norm
            elif isinstance(module, LlamaMLP):
                module.kernel = kernels.silu_and_mul

    def quantize(self, method: str, kernels: ModuleType | None) -> None:
        """Add quantized copies of the matmul weights for small steps (see nanoserve.model.quant): the
        decoder layers' in 4 or 8 bits; the lm_head's, the largest single weight of a small model, in 8
        bits, and only with the C++ kernel (4 bits there raised perplexity by 8%)."""
        bits = {"int4": 4, "int8": 8}[method]
        for layer in self.layers:
            for module in layer.modules():
                if isinstance(module, Linear):
                    module.quantized = quantize_weight(module.weight, bits, kernels)
        if fast_kernels(kernels):
            head = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
            self.quantized_lm_head = quantize_weight(head, 8, kernels)
            if self.quantized_lm_head is not None:
                self.quantized_lm_head.max_tokens = LM_HEAD_QUANT_MAX_ROWS

    def compute_logits(self, hidden: Tensor) -> Tensor:
        """[N, hidden] -> float32 [N, vocab]."""
        head = self.quantized_lm_head
        if head is not None and hidden.shape[0] <= head.max_tokens:
            return head.matmul(hidden).float()
        if self.lm_head is not None:
            return self.lm_head(hidden).float()
        if self.packed_embed is not None:
            return _packed_linear(hidden, self.packed_embed, None).float()
        return F.linear(hidden, self.embed_tokens.weight).float()
