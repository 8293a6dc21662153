"""Mixtral: Mistral's attention with a sparse MLP: each token runs the top-2 of 8 experts, weighted by the
router's softmax renormalized over the chosen two. In GGUF it is a `llama` file with experts."""

from __future__ import annotations

from typing import Any

from nanoserve.model.config import GGUFInfo, ModelConfig, MoEConfig, gguf_base, hf_base, hf_sliding_windows
from nanoserve.model.family import ModelFamily
from nanoserve.model.layers.causal_lm import CausalLM
from nanoserve.model.layers.decoder import DecoderLayer


class MixtralForCausalLM(CausalLM):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config, [DecoderLayer(config, i) for i in range(config.num_layers)])


def config_from_hf(hf: dict[str, Any], architecture: str, name: str) -> ModelConfig:
    moe = MoEConfig(
        num_experts=hf["num_local_experts"],
        num_experts_per_tok=hf["num_experts_per_tok"],
        intermediate_size=hf["intermediate_size"],
        norm_topk_prob=True,
    )
    windows = hf_sliding_windows(hf, hf["num_hidden_layers"], lambda layer: True)
    return hf_base(hf, architecture, name, moe=moe, sliding_windows=windows)


def config_from_gguf(info: GGUFInfo, name: str) -> ModelConfig:
    moe = MoEConfig(
        num_experts=info.key("expert_count"),
        num_experts_per_tok=info.key("expert_used_count"),
        intermediate_size=info.key("expert_feed_forward_length") or info.key("feed_forward_length"),
        norm_topk_prob=True,
    )
    return gguf_base(info, "MixtralForCausalLM", name, moe=moe)


FAMILY = ModelFamily(
    architectures=("MixtralForCausalLM",),
    model_types={"mixtral": "MixtralForCausalLM"},
    build=MixtralForCausalLM,
    config_from_hf=config_from_hf,
    gguf_architectures=("llama",),
    config_from_gguf=config_from_gguf,
    gguf_accepts=lambda info: bool(info.key("expert_count")),
    gguf_permutes_qk=True,
    hf_renames=(
        (r"\.block_sparse_moe\.", ".mlp."),
        (r"\.experts\.(\d+)\.w1\.", r".experts.\1.gate_proj."),
        (r"\.experts\.(\d+)\.w2\.", r".experts.\1.down_proj."),
        (r"\.experts\.(\d+)\.w3\.", r".experts.\1.up_proj."),
    ),
)
