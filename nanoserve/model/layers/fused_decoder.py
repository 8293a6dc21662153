"""A decode step from token ids to the final norm in one C++ call (nanoserve/model/kernels/fused_decoder.cpp).

A decode step of a small model runs about eleven kernels per layer, each with little work: at batch 1
the interpreter, the nn.Module calls and the Python bindings between them took as long as the quantized
matmuls. The fused decoder calls the same kernels, with the same per-step-size matmul choice, one after
another in C++, so its output is the module path's bit for bit. It also looks up the embeddings, the
rotary rows and the cache slots itself, so a decode step needs no attention metadata from Python.

It serves models whose every layer is the Llama shape (DecoderLayer) or Gemma's (GemmaDecoderLayer: a norm
on each block's output too, scaled embeddings, Gemma 3's second rotary table): Llama, Mistral, Qwen2, Qwen3,
Phi-3 and Phi-4-mini (whose rotation covers the first three quarters of each head), Gemma 2 and 3, and the
mixtures of experts (Mixtral, Qwen2-MoE, Qwen3-MoE), whose routing and grouping are the module path's ATen
ops called from C++. Prefill steps whose every sequence the C++ prefill kernel attends run through it too
(`prefill`): for a 512-token prompt the module path's Python between the kernels cost about 6 ms of 110
(bundled model, int4, AMX Xeon). The module path stays the reference and the fallback: mixed steps, prompts
sent to torch's flash attention, and machines without the C++ kernels.
"""

from __future__ import annotations

from collections.abc import Sequence
from types import ModuleType
from typing import Any, cast

from torch import Tensor, nn

from nanoserve.model.layers.decoder import DecoderLayer, GemmaDecoderLayer
from nanoserve.model.layers.linear import Linear
from nanoserve.model.layers.mlp import GatedMLP
from nanoserve.model.layers.moe import SparseMoE
from nanoserve.model.quant import GroupQuantWeight, TorchInt4Weight

FusableLayer = DecoderLayer | GemmaDecoderLayer


def fusable_layers(layers: Sequence[nn.Module]) -> list[FusableLayer] | None:
    """The layers, when every one is the Llama shape (its MLP a GatedMLP or a SparseMoE) or the Gemma shape;
    else None."""
    fusable = [
        layer
        for layer in layers
        if isinstance(layer, (DecoderLayer, GemmaDecoderLayer))
        and isinstance(layer.mlp, (GatedMLP, SparseMoE))
    ]
    return fusable if len(fusable) == len(layers) else None


def fused_matmul(kernels: ModuleType, linear: Linear) -> Any:
    """The C++ twin of `linear`, holding the same tensors and the same step-size limit."""
    matmul = kernels.FusedMatmul()
    matmul.weight, matmul.packed, matmul.bias = linear.weight, linear.packed, linear.bias
    matmul.dense, matmul.plain_from = linear.dense is not None, linear.plain_from
    if linear.by_rows is not None:
        matmul.split_from = linear.split_from
    quantized = linear.quantized
    if isinstance(quantized, GroupQuantWeight):
        matmul.quantized, matmul.codes, matmul.scales = "groups", quantized.codes, quantized.scales
        matmul.bits = quantized.bits
    elif isinstance(quantized, TorchInt4Weight):
        matmul.quantized, matmul.codes, matmul.scales = (
            "torch_int4",
            quantized.packed,
            quantized.scales_and_zeros,
        )
    if quantized is not None:
        matmul.max_tokens = quantized.max_tokens
    return matmul


def fused_experts(kernels: ModuleType, moe: SparseMoE) -> Any:
    """The C++ twin of a SparseMoE block, holding its experts' weights (the router's in float32, as it
    routes)."""
    experts = kernels.FusedExperts()
    experts.router = moe.gate.weight.float()
    mlps = [cast(GatedMLP, expert) for expert in moe.experts]
    experts.gate_up = [fused_matmul(kernels, mlp.gate_up_proj) for mlp in mlps]
    experts.down = [fused_matmul(kernels, mlp.down_proj) for mlp in mlps]
    experts.top_k, experts.normalize = moe.top_k, moe.normalize
    if moe.shared_expert is not None and moe.shared_expert_gate is not None:
        experts.shared_gate_up = fused_matmul(kernels, moe.shared_expert.gate_up_proj)
        experts.shared_down = fused_matmul(kernels, moe.shared_expert.down_proj)
        experts.shared_gate = moe.shared_expert_gate.weight
    return experts


def build_fused_decoder(
    layers: list[FusableLayer],
    final_norm_weight: Tensor,
    embedding: Tensor,
    embed_scale: float | None,
    rotary_tables: tuple[Tensor, Tensor | None],
    is_local: list[bool],
    kernels: ModuleType,
) -> Any:
    """A kernels.FusedDecoder over the embedding [vocab, hidden] (times embed_scale, if any), `layers` (see
    fusable_layers), the final norm and the rotary tables [positions, 2, rotated dims of a head]
    (RotaryEmbedding.table_for): the global one and the local one (or None) of the layers is_local marks."""
    fused = []
    for layer, local in zip(layers, is_local, strict=True):
        attn, mlp = layer.self_attn, layer.mlp
        spec = kernels.FusedLayer()
        spec.input_norm = layer.input_layernorm.weight
        if isinstance(layer, GemmaDecoderLayer):
            spec.mlp_norm = layer.pre_feedforward_layernorm.weight
            spec.attention_output_norm = layer.post_attention_layernorm.weight
            spec.mlp_output_norm = layer.post_feedforward_layernorm.weight
        else:
            spec.mlp_norm = layer.post_attention_layernorm.weight
        if attn.q_norm is not None and attn.k_norm is not None:
            spec.q_norm, spec.k_norm = attn.q_norm.weight, attn.k_norm.weight
        spec.qkv, spec.o_proj = fused_matmul(kernels, attn.qkv_proj), fused_matmul(kernels, attn.o_proj)
        if isinstance(mlp, SparseMoE):
            spec.experts = fused_experts(kernels, mlp)
            spec.activation = mlp.experts[0].activation
        else:
            assert isinstance(mlp, GatedMLP)
            spec.gate_up = fused_matmul(kernels, mlp.gate_up_proj)
            spec.down = fused_matmul(kernels, mlp.down_proj)
            spec.activation = mlp.activation
        spec.window = attn.window or 0
        spec.local_rotary = local
        fused.append(spec)
    first = layers[0].self_attn
    return kernels.FusedDecoder(
        fused,
        final_norm_weight,
        embedding,
        *rotary_tables,
        embed_scale,
        first.num_heads,
        first.num_kv_heads,
        first.head_dim,
        layers[0].input_layernorm.eps,
        first.scale,
        first.softcap or 0.0,
    )
