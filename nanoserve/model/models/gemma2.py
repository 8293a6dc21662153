"""Gemma 2: GeGLU (tanh gelu), RMSNorms that scale by (1 + w) (stored as 1 + w at load), a norm before and
after both attention and MLP, embeddings scaled by sqrt(hidden_size), queries by query_pre_attn_scalar,
attention scores and final logits soft-capped, and a sliding window on every other layer."""

from __future__ import annotations

from typing import Any

from torch import Tensor

from nanoserve.model.config import GGUFInfo, ModelConfig, gguf_base, hf_base, hf_sliding_windows
from nanoserve.model.family import GGUF_NAMES, ModelFamily
from nanoserve.model.layers.causal_lm import CausalLM
from nanoserve.model.layers.decoder import GemmaDecoderLayer


class Gemma2ForCausalLM(CausalLM):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config, [GemmaDecoderLayer(config, i) for i in range(config.num_layers)])


def gemma_fields(hf: dict[str, Any]) -> dict[str, Any]:
    """What Gemma 2 and 3 read alike."""
    return dict(
        embed_scale=hf["hidden_size"] ** 0.5,
        attn_scale=hf.get("query_pre_attn_scalar", 256) ** -0.5,
        attn_softcap=hf.get("attn_logit_softcapping"),
        final_softcap=hf.get("final_logit_softcapping"),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", True)),
    )


def config_from_hf(hf: dict[str, Any], architecture: str, name: str) -> ModelConfig:
    windows = hf_sliding_windows(hf, hf["num_hidden_layers"], lambda layer: layer % 2 == 0)
    return hf_base(hf, architecture, name, sliding_windows=windows, **gemma_fields(hf))


def gguf_attn_scale(info: GGUFInfo, head_dim: int) -> float:
    """llama.cpp stores no query_pre_attn_scalar: it scales by head_dim, except for the 27B models
    (46 / 62 layers) by hidden / heads."""
    scale = info.key("attention.scale")
    if scale:
        return scale
    hidden, heads = info.key("embedding_length"), info.key("attention.head_count")
    return (hidden // heads if info.key("block_count") in (46, 62) else head_dim) ** -0.5


def gguf_fields(info: GGUFInfo) -> dict[str, Any]:
    head_dim = info.key("attention.key_length")
    return dict(
        embed_scale=info.key("embedding_length") ** 0.5,
        attn_scale=gguf_attn_scale(info, head_dim),
        hidden_act="gelu_tanh",
    )


def config_from_gguf(info: GGUFInfo, name: str) -> ModelConfig:
    window = info.key("attention.sliding_window")
    windows = tuple(window if layer % 2 == 0 else None for layer in range(info.key("block_count")))
    return gguf_base(
        info,
        "Gemma2ForCausalLM",
        name,
        sliding_windows=windows,
        attn_softcap=info.key("attn_logit_softcapping"),
        final_softcap=info.key("final_logit_softcapping"),
        **gguf_fields(info),
    )


def norm_plus_one(name: str, tensor: Tensor) -> Tensor:
    """Gemma's RMSNorm multiplies by 1 + w; storing 1 + w lets the shared RMSNorm (and its kernel) serve."""
    return tensor + 1 if name.endswith("norm.weight") else tensor


GEMMA_GGUF_NAMES = {
    **GGUF_NAMES,
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
"""llama.cpp's converter already stored 1 + w in every Gemma norm."""

FAMILY = ModelFamily(
    architectures=("Gemma2ForCausalLM",),
    model_types={"gemma2": "Gemma2ForCausalLM"},
    build=Gemma2ForCausalLM,
    config_from_hf=config_from_hf,
    gguf_architectures=("gemma2",),
    config_from_gguf=config_from_gguf,
    gguf_names=GEMMA_GGUF_NAMES,
    adapt_hf_weight=norm_plus_one,
)
