"""Gemma 3 (text): Gemma 2's layers with RMSNorm on each query and key head instead of score
soft-capping, a rotary base of their own for the sliding-window (local) layers, and the sliding/global
layer pattern from the config (five local layers to one global by default)."""

from __future__ import annotations

from typing import Any

from nanoserve.model.config import GGUFInfo, ModelConfig, gguf_base, hf_base, hf_rope, hf_sliding_windows
from nanoserve.model.family import ModelFamily
from nanoserve.model.layers.causal_lm import CausalLM
from nanoserve.model.layers.decoder import GemmaDecoderLayer
from nanoserve.model.models.gemma2 import (
    GEMMA_GGUF_NAMES,
    gemma_fields,
    gguf_fields,
    norm_plus_one,
)

DEFAULT_PATTERN = 6
"""One global layer after every five local ones, where a config does not say (as transformers and llama.cpp)."""
DEFAULT_LOCAL_THETA = 10000.0


class Gemma3ForCausalLM(CausalLM):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config, [GemmaDecoderLayer(config, i) for i in range(config.num_layers)])


def config_from_hf(hf: dict[str, Any], architecture: str, name: str) -> ModelConfig:
    pattern = hf.get("sliding_window_pattern") or DEFAULT_PATTERN
    windows = hf_sliding_windows(hf, hf["num_hidden_layers"], lambda layer: (layer + 1) % pattern != 0)
    local_theta, local_scaling = hf_rope(hf, "sliding_attention")
    nested = "sliding_attention" in (hf.get("rope_parameters") or {})
    if not nested:  # transformers 4: the local base beside the global rope_theta
        local_theta, local_scaling = float(hf.get("rope_local_base_freq") or DEFAULT_LOCAL_THETA), None
    if local_scaling is not None:
        raise ValueError(f"Gemma 3 with rope scaling on its local layers ({local_scaling}) is not supported.")
    return hf_base(
        hf,
        architecture,
        name,
        qk_norm=True,
        sliding_windows=windows,
        local_rope_theta=local_theta,
        **gemma_fields(hf),
    )


def config_from_gguf(info: GGUFInfo, name: str) -> ModelConfig:
    num_layers, window = info.key("block_count"), info.key("attention.sliding_window")
    pattern = info.key("attention.sliding_window_pattern", DEFAULT_PATTERN)
    if isinstance(pattern, list):  # one flag per layer: local or not
        sliding = [bool(p) for p in pattern]
    else:
        sliding = [(layer + 1) % pattern != 0 for layer in range(num_layers)]
    return gguf_base(
        info,
        "Gemma3ForCausalLM",
        name,
        qk_norm=True,
        sliding_windows=tuple(window if s else None for s in sliding),
        local_rope_theta=float(info.key("rope.freq_base_swa", DEFAULT_LOCAL_THETA)),
        attn_softcap=info.key("attn_logit_softcapping"),
        final_softcap=info.key("final_logit_softcapping"),
        **gguf_fields(info),
    )


FAMILY = ModelFamily(
    architectures=("Gemma3ForCausalLM",),
    model_types={"gemma3_text": "Gemma3ForCausalLM"},
    build=Gemma3ForCausalLM,
    config_from_hf=config_from_hf,
    gguf_architectures=("gemma3",),
    config_from_gguf=config_from_gguf,
    gguf_names=GEMMA_GGUF_NAMES,
    adapt_hf_weight=norm_plus_one,
)
