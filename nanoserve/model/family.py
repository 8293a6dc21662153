"""ModelFamily: everything nanoserve knows about one family of models, defined once in its module under
nanoserve/model/models/ and listed in nanoserve/model/registry.py.

A family maps a config (HF config.json or GGUF metadata) to a ModelConfig, names its weights (the HF
names it renames, the GGUF names where llama.cpp's differ from the common ones) and builds its nn.Module.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from nanoserve.model.config import GGUFInfo, ModelConfig

if TYPE_CHECKING:
    from torch import Tensor

    from nanoserve.model.layers.causal_lm import CausalLM

GGUF_NAMES: Mapping[str, str] = {
    "token_embd": "embed_tokens",
    "output_norm": "norm",
    "output": "lm_head",
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_qkv": "self_attn.qkv_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.experts.{}.gate_proj",
    "ffn_up_exps": "mlp.experts.{}.up_proj",
    "ffn_down_exps": "mlp.experts.{}.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
}
"""llama.cpp tensor names (blk.N.<name>.weight) -> HF names (model.layers.N.<name>.weight), as most
architectures use them; "{}" is the expert of a stacked [experts, rows, cols] tensor."""


def _any_gguf(info: GGUFInfo) -> bool:
    return True


@dataclass(frozen=True)
class ModelFamily:
    architectures: tuple[str, ...]
    """The HF `architectures[0]` names it serves."""
    build: Callable[[ModelConfig], CausalLM]
    config_from_hf: Callable[[dict[str, Any], str, str], ModelConfig]
    """(config.json, architecture, model name) -> ModelConfig."""
    model_types: Mapping[str, str] = field(default_factory=dict)
    """HF model_type -> architecture, for a config.json without `architectures`."""
    gguf_architectures: tuple[str, ...] = ()
    """The GGUF `general.architecture` names it serves."""
    config_from_gguf: Callable[[GGUFInfo, str], ModelConfig] | None = None
    gguf_accepts: Callable[[GGUFInfo], bool] = _any_gguf
    """For a GGUF architecture two families share (llama: dense Llama, or Mixtral's experts)."""
    gguf_names: Mapping[str, str] = field(default_factory=lambda: GGUF_NAMES)
    gguf_permutes_qk: bool = False
    """llama.cpp's converter reorders q/k rows for its interleaved RoPE (Llama and Mixtral only)."""
    hf_renames: tuple[tuple[str, str], ...] = ()
    """(regex, replacement) pairs taking the family's HF weight names to the common ones."""
    adapt_hf_weight: Callable[[str, Tensor], Tensor] | None = None
    """(name, tensor) -> tensor as the model wants it (Gemma: norm weights w -> 1 + w)."""
