"""Phi-3 / Phi-3.5 / Phi-4-mini: Llama's layers with q/k/v and gate/up already fused in the checkpoint,
LongRoPE ("su") scaling with short and long factors, a sliding window over every layer (Phi-3-mini-4k:
2047), and partial rotation (Phi-4-mini rotates the first 3/4 of each head)."""

from __future__ import annotations

import math
from typing import Any

from nanoserve.model.config import GGUFInfo, ModelConfig, gguf_base, hf_base, hf_sliding_windows
from nanoserve.model.family import GGUF_NAMES, ModelFamily
from nanoserve.model.layers.causal_lm import CausalLM
from nanoserve.model.layers.decoder import DecoderLayer


class Phi3ForCausalLM(CausalLM):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config, [DecoderLayer(config, i) for i in range(config.num_layers)])


def config_from_hf(hf: dict[str, Any], architecture: str, name: str) -> ModelConfig:
    windows = hf_sliding_windows(hf, hf["num_hidden_layers"], lambda layer: True)
    return hf_base(hf, architecture, name, sliding_windows=windows)


def config_from_gguf(info: GGUFInfo, name: str) -> ModelConfig:
    """llama.cpp keeps the LongRoPE factors as two tensors and the pretraining length beside them."""
    key, factors = info.key, info.config_tensors
    context = key("context_length")
    scaling = None
    if "rope_factors_long" in factors:
        original = key("rope.scaling.original_context_length") or context
        scale = context / original
        default_factor = math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1 else 1.0
        scaling = {
            "rope_type": "longrope",
            "long_factor": factors["rope_factors_long"],
            "short_factor": factors["rope_factors_short"],
            "original_max_position_embeddings": original,
            "attention_factor": key("rope.scaling.attn_factor") or default_factor,
        }
    window = key("attention.sliding_window")
    windows = (window if window and window < context else None,) * key("block_count")
    return gguf_base(info, "Phi3ForCausalLM", name, rope_scaling=scaling, sliding_windows=windows)


FAMILY = ModelFamily(
    architectures=("Phi3ForCausalLM",),
    model_types={"phi3": "Phi3ForCausalLM"},
    build=Phi3ForCausalLM,
    config_from_hf=config_from_hf,
    gguf_architectures=("phi3",),
    config_from_gguf=config_from_gguf,
    gguf_names={**GGUF_NAMES, "ffn_up": "mlp.gate_up_proj"},  # llama.cpp keeps gate/up fused as ffn_up
)
