"""Qwen2-MoE (Qwen1.5-MoE, Qwen2-57B-A14B) and Qwen3-MoE (Qwen3-30B-A3B ...): top-k of many small
experts. Qwen2-MoE keeps Qwen2's q/k/v biases, leaves the top-k weights unnormalized unless
norm_topk_prob, and adds a shared expert behind a sigmoid gate; Qwen3-MoE has Qwen3's q/k norms. Both can
keep dense MLPs on some layers (mlp_only_layers, decoder_sparse_step)."""

from __future__ import annotations

from typing import Any

from nanoserve.model.config import GGUFInfo, ModelConfig, MoEConfig, gguf_base, hf_base
from nanoserve.model.family import ModelFamily
from nanoserve.model.layers.causal_lm import CausalLM
from nanoserve.model.layers.decoder import DecoderLayer
from nanoserve.model.models.qwen2 import qwen_sliding_windows

QWEN2_MOE, QWEN3_MOE = "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM"


class QwenMoeForCausalLM(CausalLM):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config, [DecoderLayer(config, i) for i in range(config.num_layers)])


def config_from_hf(hf: dict[str, Any], architecture: str, name: str) -> ModelConfig:
    qwen2 = architecture == QWEN2_MOE
    step, num_layers = hf.get("decoder_sparse_step") or 1, hf["num_hidden_layers"]
    dense = {layer for layer in range(num_layers) if (layer + 1) % step} | set(
        hf.get("mlp_only_layers") or ()
    )
    moe = MoEConfig(
        num_experts=hf.get("num_experts") or hf["num_local_experts"],
        num_experts_per_tok=hf["num_experts_per_tok"],
        intermediate_size=hf["moe_intermediate_size"],
        norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
        shared_expert_intermediate_size=hf.get("shared_expert_intermediate_size", 0) if qwen2 else 0,
        dense_layers=tuple(sorted(dense)),
    )
    bias = bool(hf.get("qkv_bias", True)) if qwen2 else bool(hf.get("attention_bias", False))
    return hf_base(
        hf,
        architecture,
        name,
        attention_bias=bias,
        o_proj_bias=bias and not qwen2,
        qk_norm=not qwen2,
        moe=moe,
        sliding_windows=qwen_sliding_windows(hf),
    )


def config_from_gguf(info: GGUFInfo, name: str) -> ModelConfig:
    """llama.cpp runs Qwen2-MoE with unnormalized top-k weights and Qwen3-MoE with normalized ones."""
    qwen2 = info.architecture == "qwen2moe"
    moe = MoEConfig(
        num_experts=info.key("expert_count"),
        num_experts_per_tok=info.key("expert_used_count"),
        intermediate_size=info.key("expert_feed_forward_length"),
        norm_topk_prob=bool(info.key("expert_weights_norm", not qwen2)),
        shared_expert_intermediate_size=info.key("expert_shared_feed_forward_length", 0) if qwen2 else 0,
    )
    architecture = QWEN2_MOE if qwen2 else QWEN3_MOE
    return gguf_base(info, architecture, name, attention_bias=qwen2, qk_norm=not qwen2, moe=moe)


FAMILY = ModelFamily(
    architectures=(QWEN2_MOE, QWEN3_MOE),
    model_types={"qwen2_moe": QWEN2_MOE, "qwen3_moe": QWEN3_MOE},
    build=QwenMoeForCausalLM,
    config_from_hf=config_from_hf,
    gguf_architectures=("qwen2moe", "qwen3moe"),
    config_from_gguf=config_from_gguf,
)
