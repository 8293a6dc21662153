"""Qwen2 / Qwen2.5: Llama's layers with biases on q/k/v (not on the output projection), and sliding
windows on the layers from max_window_layers on where use_sliding_window is set."""

from __future__ import annotations

from typing import Any

from nanoserve.model.config import GGUFInfo, ModelConfig, gguf_base, hf_base, hf_sliding_windows
from nanoserve.model.family import ModelFamily
from nanoserve.model.layers.causal_lm import CausalLM
from nanoserve.model.layers.decoder import DecoderLayer


class Qwen2ForCausalLM(CausalLM):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config, [DecoderLayer(config, i) for i in range(config.num_layers)])


def qwen_sliding_windows(hf: dict[str, Any]) -> tuple[int | None, ...]:
    """Qwen's rule where a config has no layer_types: layers from max_window_layers on slide."""
    first = hf.get("max_window_layers", 0)
    return hf_sliding_windows(hf, hf["num_hidden_layers"], lambda layer: layer >= first)


def config_from_hf(hf: dict[str, Any], architecture: str, name: str) -> ModelConfig:
    return hf_base(hf, architecture, name, attention_bias=True, sliding_windows=qwen_sliding_windows(hf))


def config_from_gguf(info: GGUFInfo, name: str) -> ModelConfig:
    return gguf_base(info, "Qwen2ForCausalLM", name, attention_bias=True)


FAMILY = ModelFamily(
    architectures=("Qwen2ForCausalLM",),
    model_types={"qwen2": "Qwen2ForCausalLM"},
    build=Qwen2ForCausalLM,
    config_from_hf=config_from_hf,
    gguf_architectures=("qwen2",),
    config_from_gguf=config_from_gguf,
)
