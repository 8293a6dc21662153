"""CausalLM: the shell every family shares around its decoder layers: token embedding (scaled where the
family does), one rotary table looked up once per step (two for Gemma 3's local and global layers), the
layers over the paged KV cache, the final norm and the logits (soft-capped where the family does).

It also owns what the engine does to any model after loading: pre-packing matmul weights for oneDNN,
switching on the C++ kernels, quantizing. A family subclasses it and builds `self.layers`.
"""

from __future__ import annotations

from types import ModuleType

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from nanoserve.model.attention import AttentionMetadata
from nanoserve.model.config import ModelConfig
from nanoserve.model.layers.linear import Linear, pack_weight, packed_linear
from nanoserve.model.layers.mlp import GatedMLP
from nanoserve.model.layers.norm import RMSNorm
from nanoserve.model.layers.rotary import RotaryEmbedding
from nanoserve.model.quant import LM_HEAD_QUANT_MAX_ROWS, QuantizedWeight, fast_kernels, quantize_weight


class CausalLM(nn.Module):
    def __init__(self, config: ModelConfig, layers: list[nn.Module]) -> None:
        """layers: modules called as layer(x, cos_sin, kv_cache, attn) -> x."""
        super().__init__()
        self.config = config
        # _weight skips the random init: the loader overwrites it, and normal_ on meta is slow to warm up
        self.embed_tokens = nn.Embedding(
            config.vocab_size, config.hidden_size, _weight=torch.empty(config.vocab_size, config.hidden_size)
        )
        positions = config.max_position_embeddings
        self.rotary = RotaryEmbedding(config.rotary_dim, config.rope_theta, config.rope_scaling, positions)
        self.local_rotary = None
        if config.local_rope_theta is not None:
            self.local_rotary = RotaryEmbedding(config.rotary_dim, config.local_rope_theta, None, positions)
        self.is_local = [w is not None and self.local_rotary is not None for w in config.sliding_windows]
        """Per layer: whether it rotates with the local table (Gemma 3's sliding-window layers)."""
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.packed_embed: Tensor | None = None  # the tied lm_head packed for oneDNN, see prepack_for_cpu
        self.quantized_lm_head: QuantizedWeight | None = None  # see quantize
        self.lm_head = (
            None if config.tie_word_embeddings else Linear(config.hidden_size, config.vocab_size, bias=False)
        )

    def forward(
        self, input_ids: Tensor, positions: Tensor, kv_caches: list[Tensor], attn: AttentionMetadata
    ) -> Tensor:
        """input_ids, positions: [T] -> final hidden states [T, hidden]; writes the new K/V into kv_caches."""
        x = self.embed_tokens(input_ids)
        if self.config.embed_scale is not None:
            x = x * torch.tensor(self.config.embed_scale, dtype=x.dtype, device=x.device)
        cos_sin = self.rotary(positions, x.dtype)
        local_cos_sin = cos_sin if self.local_rotary is None else self.local_rotary(positions, x.dtype)
        for layer, kv_cache, is_local in zip(self.layers, kv_caches, self.is_local, strict=True):
            x = layer(x, local_cos_sin if is_local else cos_sin, kv_cache, attn)
        return self.norm(x)

    def compute_logits(self, hidden: Tensor) -> Tensor:
        """[N, hidden] -> float32 [N, vocab]."""
        logits = self._lm_head(hidden).float()
        cap = self.config.final_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def _lm_head(self, hidden: Tensor) -> Tensor:
        head = self.quantized_lm_head
        if head is not None and hidden.shape[0] <= head.max_tokens:
            return head.matmul(hidden)
        if self.lm_head is not None:
            return self.lm_head(hidden)
        if self.packed_embed is not None:
            return packed_linear(hidden, self.packed_embed, None)
        return F.linear(hidden, self.embed_tokens.weight)

    # -- after loading ------------------------------------------------------------------------

    def prepack_for_cpu(self) -> None:
        """Pack every matmul weight for oneDNN (CPU, bf16); the weights stay for everything else."""
        for module in self.modules():
            if isinstance(module, Linear):
                module.prepack()
        if self.lm_head is None:
            self.packed_embed = pack_weight(self.embed_tokens.weight)

    def use_cpu_kernels(self, kernels: ModuleType) -> None:
        """RMSNorm and the MLP's activation in C++; attention takes its kernels from AttentionMetadata."""
        activations = {"silu": kernels.silu_and_mul, "gelu_tanh": kernels.gelu_tanh_and_mul}
        for module in self.modules():
            if isinstance(module, RMSNorm):
                module.kernel = kernels.rms_norm
            elif isinstance(module, GatedMLP):
                module.kernel = activations[module.activation]

    def quantize(self, method: str, kernels: ModuleType | None) -> None:
        """Add quantized copies of the matmul weights for small steps (see nanoserve.model.quant): the
        decoder layers' (experts' included) in 4 or 8 bits; the lm_head's, the largest single weight of a
        small model, in 8 bits, and only with the C++ kernel (4 bits there raised perplexity by 8%)."""
        bits = {"int4": 4, "int8": 8}[method]
        for layer in self.layers:
            for module in layer.modules():
                if isinstance(module, Linear):
                    module.quantized = quantize_weight(module.weight, bits, kernels)
        if fast_kernels(kernels):
            head = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
            self.quantized_lm_head = quantize_weight(head, 8, kernels)
            if self.quantized_lm_head is not None:
                self.quantized_lm_head.max_tokens = LM_HEAD_QUANT_MAX_ROWS
