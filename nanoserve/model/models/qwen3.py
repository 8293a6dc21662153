"""Qwen3: Qwen2's layers with RMSNorm on each query and key head, no q/k/v bias, and an explicit head_dim
(128 for every size, so not hidden_size / num_heads)."""

from __future__ import annotations

from typing import Any

from nanoserve.model.config import GGUFInfo, ModelConfig, gguf_base, hf_base
from nanoserve.model.family import ModelFamily
from nanoserve.model.layers.causal_lm import CausalLM
from nanoserve.model.layers.decoder import DecoderLayer
from nanoserve.model.models.qwen2 import qwen_sliding_windows


class Qwen3ForCausalLM(CausalLM):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config, [DecoderLayer(config, i) for i in range(config.num_layers)])


def config_from_hf(hf: dict[str, Any], architecture: str, name: str) -> ModelConfig:
    bias = bool(hf.get("attention_bias", False))
    return hf_base(
        hf,
        architecture,
        name,
        attention_bias=bias,
        o_proj_bias=bias,
        qk_norm=True,
        sliding_windows=qwen_sliding_windows(hf),
    )


def config_from_gguf(info: GGUFInfo, name: str) -> ModelConfig:
    return gguf_base(info, "Qwen3ForCausalLM", name, qk_norm=True)


FAMILY = ModelFamily(
    architectures=("Qwen3ForCausalLM",),
    model_types={"qwen3": "Qwen3ForCausalLM"},
    build=Qwen3ForCausalLM,
    config_from_hf=config_from_hf,
    gguf_architectures=("qwen3",),
    config_from_gguf=config_from_gguf,
)
