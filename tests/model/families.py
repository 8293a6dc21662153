"""Tiny random-weight models of every family, built with transformers and saved as HF folders.

Each shape exercises what makes its family different: GQA and MHA, tied and untied embeddings, head_dim
unlike hidden / heads, sliding windows shorter than the prompts, soft-capping, LongRoPE in both regimes,
partial rotation, experts with and without a shared one, dense layers among sparse ones.
"""

from __future__ import annotations

from pathlib import Path

import torch

VOCAB = 4096
"""Small, so the logits do not dominate the tests' time; the folders carry no tokenizer."""
LONGROPE_ORIGINAL = 16
"""Pretraining length of the LongRoPE shapes: prompts of the long regime are all longer."""


def _longrope(rotary_dim: int, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    half = rotary_dim // 2
    return {
        "rope_type": "longrope",
        "short_factor": (1 + torch.rand(half, generator=g)).tolist(),
        "long_factor": (1 + 4 * torch.rand(half, generator=g)).tolist(),
    }


BASE = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rms_norm_eps=1e-5,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=2,
)

SHAPES: dict[str, tuple[str, dict]] = {
    # Mistral: every layer slides, over fewer positions than most prompts
    "mistral-window": ("Mistral", dict(sliding_window=12, tie_word_embeddings=False)),
    # Qwen3: q/k norms, head_dim 32 though hidden / heads is 16
    "qwen3-gqa-tied": ("Qwen3", dict(head_dim=32, tie_word_embeddings=True)),
    "qwen3-mha-untied": ("Qwen3", dict(num_key_value_heads=4, head_dim=16, tie_word_embeddings=False)),
    # Phi-3: fused projections, a window on every layer, LongRoPE's short factors (max = original length)
    "phi3-window-short": (
        "Phi3",
        dict(
            num_key_value_heads=4,
            sliding_window=12,
            max_position_embeddings=64,
            original_max_position_embeddings=64,
            rope_scaling=_longrope(16, 0),
            tie_word_embeddings=False,
        ),
    ),
    # ... and its long factors (every prompt longer than the pretraining length)
    "phi3-longrope-long": (
        "Phi3",
        dict(
            original_max_position_embeddings=LONGROPE_ORIGINAL,
            rope_scaling=_longrope(16, 1),
            tie_word_embeddings=False,
        ),
    ),
    # Phi-4-mini: partial rotation (3/4 of each head), GQA, tied
    "phi4-partial-rotary": (
        "Phi3",
        dict(
            partial_rotary_factor=0.75,
            max_position_embeddings=64,
            original_max_position_embeddings=64,
            rope_scaling=_longrope(12, 2),
            tie_word_embeddings=True,
        ),
    ),
    # Gemma 2: head_dim 32, both soft-caps low enough to bite, window on layer 0
    "gemma2-gqa": (
        "Gemma2",
        dict(
            head_dim=32,
            query_pre_attn_scalar=32,
            sliding_window=8,
            attn_logit_softcapping=2.0,
            final_logit_softcapping=5.0,
            hidden_activation="gelu_pytorch_tanh",
        ),
    ),
    # ... and a query scale of its own
    "gemma2-mha-untied": (
        "Gemma2",
        dict(
            num_key_value_heads=4,
            head_dim=16,
            query_pre_attn_scalar=24,
            sliding_window=8,
            attn_logit_softcapping=3.0,
            final_logit_softcapping=10.0,
            tie_word_embeddings=False,
            hidden_activation="gelu_pytorch_tanh",
        ),
    ),
    # Gemma 3: q/k norms, local layers on their own rope base, global ones scaled, pattern local-local-global
    "gemma3": (
        "Gemma3Text",
        dict(
            num_hidden_layers=3,
            head_dim=32,
            query_pre_attn_scalar=32,
            sliding_window=8,
            layer_types=["sliding_attention", "sliding_attention", "full_attention"],
            rope_parameters={
                "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1_000_000.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
            },
        ),
    ),
    # Mixtral: top-2 of 4 experts, renormalized
    "mixtral": ("Mixtral", dict(num_local_experts=4, num_experts_per_tok=2, tie_word_embeddings=False)),
    # Qwen2-MoE: q/k/v biases, unnormalized top-2, a gated shared expert, layer 1 dense
    "qwen2-moe": (
        "Qwen2Moe",
        dict(
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=64,
            mlp_only_layers=[1],
            norm_topk_prob=False,
            tie_word_embeddings=False,
        ),
    ),
    # Qwen3-MoE: q/k norms, head_dim 32, normalized top-2 of 8
    "qwen3-moe": (
        "Qwen3Moe",
        dict(
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            head_dim=32,
            norm_topk_prob=True,
            tie_word_embeddings=False,
        ),
    ),
}


def build_family(name: str, out: Path, seed: int = 0) -> Path:
    """Save SHAPES[name] with random weights (normal, std 0.2) as an fp32 HF folder."""
    import transformers

    family, overrides = SHAPES[name]
    config = getattr(transformers, f"{family}Config")(**(BASE | overrides))
    model_class = "Gemma3ForCausalLM" if family == "Gemma3Text" else f"{family}ForCausalLM"
    torch.manual_seed(seed)
    model = getattr(transformers, model_class)(config)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.2)
    model.save_pretrained(out)
    return out


def prompt_lengths(name: str) -> tuple[int, ...]:
    """Mixed lengths, most longer than the windows; all past the pretraining length in LongRoPE's long regime
    (transformers switches factors by sequence length, so a prompt crossing it mid-generation has no single
    rotation to compare against)."""
    if name == "phi3-longrope-long":
        return (17, 40, 28, 21, 33, 19)
    return (3, 17, 40, 9, 28, 5)
