"""ModelConfig: the shape of a model, as each family's config mapping fills it in (nanoserve/model/models/).

The shared layers read it: attention (biases, q/k norms, sliding windows, soft-capping, scale), rotary
embedding (base, scaling, partial rotation, a base of its own for local layers), the MLP's activation,
the MoE block. The helpers below parse what families' HF config.json and GGUF metadata have in common.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope", "freq_factors")
HF_ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh"}
"""HF hidden_act -> GatedMLP activation."""


@dataclass(frozen=True)
class MoEConfig:
    num_experts: int
    num_experts_per_tok: int
    intermediate_size: int
    norm_topk_prob: bool
    """Renormalize the top-k router weights to sum to one (Mixtral always; Qwen as configured)."""
    shared_expert_intermediate_size: int = 0
    """Qwen2-MoE's shared expert, which every token passes through (0: none)."""
    dense_layers: tuple[int, ...] = ()
    """Layers with a dense MLP of ModelConfig.intermediate_size instead of experts (Qwen's mlp_only_layers,
    decoder_sparse_step)."""


@dataclass
class ModelConfig:
    architecture: str
    """The HF architecture name (LlamaForCausalLM ...), also for GGUF files: it selects the family."""
    name: str
    """The model folder name or GGUF file stem, without a quantization suffix."""
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    """None for plain RoPE, else a dict with "rope_type" in SUPPORTED_ROPE_TYPES and its parameters
    (freq_factors: "factors", one divisor per frequency: how GGUF stores Llama 3 scaling)."""
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool = False
    """Bias on the q/k/v projections (Qwen2; Llama with attention_bias)."""
    o_proj_bias: bool = False
    """Bias on the attention output projection (Llama with attention_bias, not Qwen2)."""
    qk_norm: bool = False
    """RMSNorm over each query and key head before the rotation (Qwen3, Gemma 3)."""
    partial_rotary_factor: float = 1.0
    """The leading fraction of each head the rotation applies to (Phi-4-mini: 0.75)."""
    local_rope_theta: float | None = None
    """Rotary base of the sliding-window layers (Gemma 3); None: rope_theta, and rope_scaling, everywhere."""
    sliding_windows: tuple[int | None, ...] = ()
    """Per layer: the keys a query sees (itself and the window - 1 before it), None for all; () for none."""
    attn_scale: float | None = None
    """Query scale (Gemma: query_pre_attn_scalar ** -0.5); None: head_dim ** -0.5."""
    attn_softcap: float | None = None
    """Attention scores become cap * tanh(score / cap) (Gemma 2)."""
    final_softcap: float | None = None
    """Logits become cap * tanh(logit / cap) (Gemma 2)."""
    embed_scale: float | None = None
    """Embeddings are multiplied by this, in the model's dtype (Gemma: sqrt(hidden_size))."""
    hidden_act: str = "silu"
    """GatedMLP activation: silu or gelu_tanh."""
    moe: MoEConfig | None = None

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})."
            )
        if self.rope_scaling is not None:
            rope_type = self.rope_scaling.get("rope_type")
            if rope_type not in SUPPORTED_ROPE_TYPES:
                raise ValueError(
                    f"Unsupported rope_scaling type {rope_type!r}; supported: {SUPPORTED_ROPE_TYPES}."
                )
        if not self.sliding_windows:
            self.sliding_windows = (None,) * self.num_layers
        if len(self.sliding_windows) != self.num_layers:
            raise ValueError(
                f"sliding_windows has {len(self.sliding_windows)} entries for {self.num_layers} layers."
            )
        if self.hidden_act not in ("silu", "gelu_tanh"):
            raise ValueError(f"Unsupported activation {self.hidden_act!r}; supported: silu, gelu_tanh.")

    @property
    def num_queries_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def kv_window(self) -> int | None:
        """The window every layer attends within, or None when some layer sees the whole context. The KV
        blocks behind it are never read again and can be freed."""
        if any(w is None for w in self.sliding_windows):
            return None
        return max(w for w in self.sliding_windows if w is not None)


# -- HF config.json ---------------------------------------------------------------------------


def hf_rope(hf: dict[str, Any], layer_type: str = "full_attention") -> tuple[float, dict | None]:
    """(rope_theta, rope_scaling) from transformers 5 `rope_parameters` (nested per layer type for Gemma 3)
    or transformers 4 `rope_theta` + `rope_scaling`. The pretraining length and LongRoPE's attention factor
    are resolved here, from the model's own max_position_embeddings."""
    params = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    if layer_type in params:
        params = params[layer_type]
    rope = dict(params)
    theta = float(rope.pop("rope_theta", None) or hf.get("rope_theta") or 10000.0)
    rope.pop("partial_rotary_factor", None)
    rope_type = rope.pop("type", None) or rope.get("rope_type") or "default"
    rope_type = "longrope" if rope_type == "su" else rope_type  # Phi-3's first name for it
    if rope_type == "default":
        return theta, None
    scaling = {**rope, "rope_type": rope_type}
    max_positions = hf.get("max_position_embeddings", 2048)
    if rope_type in ("llama3", "yarn", "longrope"):
        # Phi-3 keeps it beside rope_scaling, and transformers gives that one priority
        scaling["original_max_position_embeddings"] = (
            hf.get("original_max_position_embeddings")
            or scaling.get("original_max_position_embeddings")
            or max_positions
        )
    if rope_type == "longrope" and scaling.get("attention_factor") is None:
        original = scaling["original_max_position_embeddings"]
        factor = scaling.get("factor") or max_positions / original
        scaling["attention_factor"] = (
            1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(original))
        )
    return theta, scaling


def hf_partial_rotary_factor(hf: dict[str, Any]) -> float:
    rope = hf.get("rope_parameters") or {}
    return float(hf.get("partial_rotary_factor") or rope.get("partial_rotary_factor") or 1.0)


def hf_sliding_windows(
    hf: dict[str, Any], num_layers: int, is_sliding: Callable[[int], bool]
) -> tuple[int | None, ...]:
    """Per-layer windows from `sliding_window` and `layer_types` (transformers 5), or `is_sliding(layer)`
    where a config has no layer_types. A window as long as the context changes nothing and is dropped."""
    window = hf.get("sliding_window")
    if (
        hf.get("use_sliding_window") is False
        or not window
        or window >= hf.get("max_position_embeddings", 2048)
    ):
        return (None,) * num_layers
    types = hf.get("layer_types")
    sliding = (
        [t == "sliding_attention" for t in types] if types else [is_sliding(i) for i in range(num_layers)]
    )
    return tuple(int(window) if s else None for s in sliding)


def hf_base(hf: dict[str, Any], architecture: str, name: str, **fields: Any) -> ModelConfig:
    """The fields every family reads the same way; `fields` adds or overrides the rest."""
    num_heads = hf["num_attention_heads"]
    rope_theta, rope_scaling = hf_rope(hf)
    base: dict[str, Any] = dict(
        architecture=architecture,
        name=name,
        vocab_size=hf["vocab_size"],
        hidden_size=hf["hidden_size"],
        num_layers=hf["num_hidden_layers"],
        num_heads=num_heads,
        num_kv_heads=hf.get("num_key_value_heads") or num_heads,
        head_dim=hf.get("head_dim") or hf["hidden_size"] // num_heads,
        intermediate_size=hf["intermediate_size"],
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        max_position_embeddings=hf.get("max_position_embeddings", 2048),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        partial_rotary_factor=hf_partial_rotary_factor(hf),
    )
    act = hf.get("hidden_activation") or hf.get("hidden_act") or "silu"
    if act not in HF_ACTIVATIONS:
        raise ValueError(
            f"Unsupported hidden_act {act!r} for {architecture}; supported: {', '.join(HF_ACTIVATIONS)}."
        )
    base["hidden_act"] = HF_ACTIVATIONS[act]
    return ModelConfig(**(base | fields))


# -- GGUF metadata ----------------------------------------------------------------------------


@dataclass
class GGUFInfo:
    """What a GGUF file says about its model, for a family's config mapping."""

    meta: dict[str, Any]
    """Metadata key -> value, the tokenizer's vocabulary arrays left out."""
    tensor_names: frozenset[str]
    vocab_size: int | None
    """The tokenizer's; {architecture}.vocab_size takes precedence where the file sets it."""
    config_tensors: dict[str, list[float]]
    """Small tensors that are configuration, not weights: rope_freqs (Llama 3 scaling), rope_factors_long /
    rope_factors_short (LongRoPE)."""

    @property
    def architecture(self) -> str:
        return self.meta["general.architecture"]

    def key(self, suffix: str, default: Any = None) -> Any:
        """`{architecture}.{suffix}`, e.g. key("block_count")."""
        return self.meta.get(f"{self.architecture}.{suffix}", default)


def gguf_base(info: GGUFInfo, architecture: str, name: str, **fields: Any) -> ModelConfig:
    """The fields llama.cpp stores the same way for every architecture; `fields` adds or overrides."""
    key = info.key
    hidden, num_heads = key("embedding_length"), key("attention.head_count")
    head_dim = key("attention.key_length") or hidden // num_heads
    scaling_type = key("rope.scaling.type", "none")
    rope_scaling = None
    if scaling_type in ("linear", "yarn"):
        rope_scaling = {"rope_type": scaling_type, "factor": float(key("rope.scaling.factor"))}
        if scaling_type == "yarn":
            rope_scaling["original_max_position_embeddings"] = key("rope.scaling.original_context_length")
    elif scaling_type != "none":
        raise ValueError(f"Unsupported GGUF rope scaling type {scaling_type!r}.")
    vocab_size = key("vocab_size") or info.vocab_size
    if not vocab_size:
        raise ValueError("The GGUF file sets neither a vocab_size nor a tokenizer token list.")
    if "rope_freqs" in info.config_tensors:
        rope_scaling = {"rope_type": "freq_factors", "factors": info.config_tensors["rope_freqs"]}
    base: dict[str, Any] = dict(
        architecture=architecture,
        name=name,
        vocab_size=int(vocab_size),
        hidden_size=hidden,
        num_layers=key("block_count"),
        num_heads=num_heads,
        num_kv_heads=key("attention.head_count_kv") or num_heads,
        head_dim=head_dim,
        intermediate_size=key("feed_forward_length"),
        rms_norm_eps=float(key("attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=float(key("rope.freq_base", 10000.0)),
        rope_scaling=rope_scaling,
        max_position_embeddings=key("context_length", 2048),
        tie_word_embeddings="output.weight" not in info.tensor_names,
        partial_rotary_factor=key("rope.dimension_count", head_dim) / head_dim,
    )
    return ModelConfig(**(base | fields))
