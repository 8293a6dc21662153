"""The decoder layers: DecoderLayer, the pre-norm block of the Llama lineage, x + attn(norm(x)), then
x + mlp(norm(x)), its MLP a GatedMLP or a SparseMoE; GemmaDecoderLayer, which also norms each block's
output before adding it (Gemma 2 and 3)."""

from __future__ import annotations

from torch import Tensor, nn

from nanoserve.model.attention import AttentionMetadata
from nanoserve.model.config import ModelConfig
from nanoserve.model.layers.mlp import GatedMLP
from nanoserve.model.layers.moe import SparseMoE
from nanoserve.model.layers.norm import RMSNorm
from nanoserve.model.layers.self_attention import SelfAttention


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = SelfAttention(config, layer)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = (
            SparseMoE(config)
            if config.moe is not None and layer not in config.moe.dense_layers
            else GatedMLP(config.hidden_size, config.intermediate_size, config.hidden_act)
        )

    def forward(self, x: Tensor, cos_sin: Tensor, kv_cache: Tensor, attn: AttentionMetadata) -> Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos_sin, kv_cache, attn)
        return x + self.mlp(self.post_attention_layernorm(x))


class GemmaDecoderLayer(nn.Module):
    """x + post_norm(attn(norm(x))), then x + post_norm(mlp(pre_norm(x))) (Gemma 2 and 3)."""

    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = RMSNorm(hidden, eps)
        self.self_attn = SelfAttention(config, layer)
        self.post_attention_layernorm = RMSNorm(hidden, eps)
        self.pre_feedforward_layernorm = RMSNorm(hidden, eps)
        self.mlp = GatedMLP(hidden, config.intermediate_size, config.hidden_act)
        self.post_feedforward_layernorm = RMSNorm(hidden, eps)

    def forward(self, x: Tensor, cos_sin: Tensor, kv_cache: Tensor, attn: AttentionMetadata) -> Tensor:
        x = x + self.post_attention_layernorm(
            self.self_attn(self.input_layernorm(x), cos_sin, kv_cache, attn)
        )
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))
