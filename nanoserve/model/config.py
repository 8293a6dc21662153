"""ModelConfig: the shape of a Llama-family model, parsed from an HF config.json or GGUF metadata."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "freq_factors")
_MODEL_TYPE_TO_ARCH = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
}


@dataclass
class ModelConfig:
    architecture: str
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
    """None for plain RoPE, else a dict with "rope_type" in linear / llama3 / yarn and its parameters, or
    freq_factors with "factors" (one divisor per frequency: how GGUF stores Llama 3 scaling)."""
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    """Bias on the q/k/v projections (Qwen2; Llama with attention_bias)."""
    bos_token_id: int | None
    eos_token_id: int | None
    name: str
    """The model folder name or GGUF file stem, without a quantization suffix."""
    o_proj_bias: bool = False
    """Bias on the attention output projection (Llama with attention_bias, not Qwen2)."""
    eos_token_ids: tuple[int, ...] = field(default=())
    """Every end-of-sequence id the model declares (Llama 3 lists several); includes eos_token_id."""

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"Unsupported architecture {self.architecture!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}."
            )
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
        if self.eos_token_id is not None and not self.eos_token_ids:
            self.eos_token_ids = (self.eos_token_id,)

    @property
    def num_queries_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads

    @classmethod
    def from_hf(cls, hf: dict[str, Any], name: str) -> ModelConfig:
        """Parse a config.json dict (transformers 4 `rope_scaling` or 5 `rope_parameters` style)."""
        archs = hf.get("architectures") or []
        architecture = (
            archs[0]
            if archs
            else _MODEL_TYPE_TO_ARCH.get(hf.get("model_type", ""), str(hf.get("model_type")))
        )
        if architecture == "MistralForCausalLM" and hf.get("sliding_window") is not None:
            if hf["sliding_window"] < hf.get("max_position_embeddings", 0):
                raise ValueError("Mistral with a sliding window shorter than the context is not supported.")
        if architecture == "Qwen2ForCausalLM" and hf.get("use_sliding_window"):
            raise ValueError("Qwen2 with use_sliding_window=true is not supported.")

        rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
        rope_theta = float(hf.get("rope_theta") or rope.pop("rope_theta", None) or 10000.0)
        rope.pop("rope_theta", None)
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        rope_scaling = None if rope_type == "default" else {**rope, "rope_type": rope_type}

        num_heads = hf["num_attention_heads"]
        eos = hf.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        is_qwen2 = architecture == "Qwen2ForCausalLM"
        llama_bias = bool(hf.get("attention_bias", False))
        return cls(
            architecture=architecture,
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
            attention_bias=is_qwen2 or llama_bias,
            bos_token_id=hf.get("bos_token_id"),
            eos_token_id=eos_ids[0] if eos_ids else None,
            name=name,
            o_proj_bias=llama_bias and not is_qwen2,
            eos_token_ids=eos_ids,
        )

    @classmethod
    def from_gguf(
        cls, meta: dict[str, Any], name: str, has_output: bool, rope_freqs: list[float] | None = None
    ) -> ModelConfig:
        """Parse GGUF metadata (key -> value); `has_output` says whether an untied `output` tensor exists,
        `rope_freqs` holds the `rope_freqs.weight` tensor when the file has one."""
        arch = meta["general.architecture"]
        if arch not in ("llama", "qwen2"):
            raise ValueError(f"Unsupported GGUF architecture {arch!r}; supported: llama, qwen2.")

        def key(suffix: str, default: Any = None) -> Any:
            return meta.get(f"{arch}.{suffix}", default)

        hidden = key("embedding_length")
        num_heads = key("attention.head_count")
        scaling_type = key("rope.scaling.type", "none")
        rope_scaling = None
        if scaling_type in ("linear", "yarn"):
            rope_scaling = {"rope_type": scaling_type, "factor": float(key("rope.scaling.factor"))}
            if scaling_type == "yarn":
                rope_scaling["original_max_position_embeddings"] = key("rope.scaling.original_context_length")
        elif scaling_type != "none":
            raise ValueError(f"Unsupported GGUF rope scaling type {scaling_type!r}.")
        if rope_freqs is not None:
            rope_scaling = {"rope_type": "freq_factors", "factors": list(rope_freqs)}
        vocab = meta.get(f"{arch}.vocab_size") or len(meta["tokenizer.ggml.tokens"])
        eos = meta.get("tokenizer.ggml.eos_token_id")
        return cls(
            architecture=_MODEL_TYPE_TO_ARCH[arch],
            vocab_size=int(vocab),
            hidden_size=hidden,
            num_layers=key("block_count"),
            num_heads=num_heads,
            num_kv_heads=key("attention.head_count_kv") or num_heads,
            head_dim=key("attention.key_length") or hidden // num_heads,
            intermediate_size=key("feed_forward_length"),
            rms_norm_eps=float(key("attention.layer_norm_rms_epsilon", 1e-6)),
            rope_theta=float(key("rope.freq_base", 10000.0)),
            rope_scaling=rope_scaling,
            max_position_embeddings=key("context_length", 2048),
            tie_word_embeddings=not has_output,
            attention_bias=arch == "qwen2",
            bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
            eos_token_id=eos,
            name=name,
        )
