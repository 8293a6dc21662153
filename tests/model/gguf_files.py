"""Write an HF folder as a GGUF file the way llama.cpp's converter (convert_hf_to_gguf.py) does: its
metadata keys, tensor names from the gguf package's own name map, q/k rows permuted for `llama`, Gemma's
norms stored as 1 + w, experts stacked into one tensor per projection, LongRoPE factors as tensors."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np

ARCHS = {
    "Qwen3ForCausalLM": "QWEN3",
    "Phi3ForCausalLM": "PHI3",
    "Gemma2ForCausalLM": "GEMMA2",
    "Gemma3ForCausalLM": "GEMMA3",
    "MixtralForCausalLM": "LLAMA",
    "Qwen3MoeForCausalLM": "QWEN3MOE",
}


def _permute(w: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's q/k row order for its interleaved RoPE."""
    return w.reshape(num_heads, 2, w.shape[0] // num_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _metadata(writer, hf: dict, architecture: str) -> None:
    heads = hf["num_attention_heads"]
    head_dim = hf.get("head_dim") or hf["hidden_size"] // heads
    writer.add_block_count(hf["num_hidden_layers"])
    writer.add_context_length(hf["max_position_embeddings"])
    writer.add_embedding_length(hf["hidden_size"])
    writer.add_feed_forward_length(hf["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(hf["num_key_value_heads"])
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_layer_norm_rms_eps(hf["rms_norm_eps"])
    writer.add_vocab_size(hf["vocab_size"])
    rope = hf.get("rope_parameters") or {}
    rope = rope.get("full_attention", rope)
    writer.add_rope_freq_base(rope["rope_theta"])
    if rope.get("rope_type") == "linear":
        import gguf

        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(rope["factor"])
    if hf.get("sliding_window"):
        writer.add_sliding_window(hf["sliding_window"])
    if architecture.startswith("Gemma"):
        if hf.get("attn_logit_softcapping"):
            writer.add_attn_logit_softcapping(hf["attn_logit_softcapping"])
        if hf.get("final_logit_softcapping"):
            writer.add_final_logit_softcapping(hf["final_logit_softcapping"])
    if architecture == "Gemma3ForCausalLM":
        writer.add_sliding_window_pattern([t == "sliding_attention" for t in hf["layer_types"]])
        writer.add_rope_freq_base_swa(hf["rope_parameters"]["sliding_attention"]["rope_theta"])
    if architecture == "Phi3ForCausalLM":
        writer.add_rope_dimension_count(int(head_dim * rope.get("partial_rotary_factor", 1.0)))
        original = hf["original_max_position_embeddings"]
        scale = hf["max_position_embeddings"] / original
        writer.add_rope_scaling_attn_factors(
            math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1 else 1.0
        )
        writer.add_rope_scaling_orig_ctx_len(original)
        writer.add_tensor("rope_factors_long.weight", np.array(rope["long_factor"], dtype=np.float32))
        writer.add_tensor("rope_factors_short.weight", np.array(rope["short_factor"], dtype=np.float32))
    experts = hf.get("num_local_experts") or hf.get("num_experts")
    if experts:
        writer.add_expert_count(experts)
        writer.add_expert_used_count(hf["num_experts_per_tok"])
        if hf.get("moe_intermediate_size"):
            writer.add_expert_feed_forward_length(hf["moe_intermediate_size"])


def write_gguf(hf_dir: Path, out: Path) -> Path:
    """hf_dir's fp32 weights as F32 tensors in a GGUF file at `out`."""
    import gguf
    from safetensors.numpy import load_file

    hf = json.loads((hf_dir / "config.json").read_text())
    architecture = hf["architectures"][0]
    arch = gguf.MODEL_ARCH[ARCHS[architecture]]
    names = gguf.get_tensor_name_map(arch, hf["num_hidden_layers"])
    writer = gguf.GGUFWriter(str(out), gguf.MODEL_ARCH_NAMES[arch])
    _metadata(writer, hf, architecture)
    state = {k: v for f in sorted(hf_dir.glob("*.safetensors")) for k, v in load_file(f).items()}
    stacked: dict[str, list[tuple[int, np.ndarray]]] = {}
    for name, w in sorted(state.items()):
        if architecture.startswith("Gemma") and name.endswith("norm.weight"):
            w = w + 1
        if architecture == "MixtralForCausalLM" and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = hf["num_attention_heads"] if "q_proj" in name else hf["num_key_value_heads"]
            w = _permute(w, heads)
        parts = name.removesuffix(".weight").split(".")
        if (
            "experts" in parts
        ):  # model.layers.N.<moe>.experts.E.<proj>: stacked over E under ...experts.<proj>
            e = parts.index("experts")
            stacked.setdefault(".".join(parts[: e + 1] + parts[e + 2 :]), []).append((int(parts[e + 1]), w))
            continue
        gguf_name = names.get_name(".".join(parts))
        assert gguf_name is not None, name
        writer.add_tensor(f"{gguf_name}.{name.rsplit('.', 1)[1]}", w)
    for name, matrices in sorted(stacked.items()):
        gguf_name = names.get_name(name)
        assert gguf_name is not None, name
        writer.add_tensor(
            f"{gguf_name}.weight", np.stack([m for _, m in sorted(matrices, key=lambda x: x[0])])
        )
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out
