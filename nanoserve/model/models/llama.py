"""The Llama family: Llama 2 / 3.x, SmolLM, TinyLlama and Mistral (with its sliding window), from an HF
folder or a `llama` GGUF (without experts: those are Mixtral's)."""

from __future__ import annotations

from typing import Any

from nanoserve.model.config import GGUFInfo, ModelConfig, gguf_base, hf_base, hf_sliding_windows
from nanoserve.model.family import ModelFamily
from nanoserve.model.layers.causal_lm import CausalLM
from nanoserve.model.layers.decoder import DecoderLayer


class LlamaForCausalLM(CausalLM):
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
        sliding_windows=hf_sliding_windows(hf, hf["num_hidden_layers"], lambda layer: True),
    )


def config_from_gguf(info: GGUFInfo, name: str) -> ModelConfig:
    return gguf_base(info, "LlamaForCausalLM", name)


FAMILY = ModelFamily(
    architectures=("LlamaForCausalLM", "MistralForCausalLM"),
    model_types={"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM"},
    build=LlamaForCausalLM,
    config_from_hf=config_from_hf,
    gguf_architectures=("llama",),
    config_from_gguf=config_from_gguf,
    gguf_accepts=lambda info: not info.key("expert_count"),
    gguf_permutes_qk=True,
)
