"""CausalLM: the shell every family shares around its decoder layers: token embedding (scaled where the
family does), one rotary table looked up once per step (two for Gemma 3's local and global layers), the
layers over the paged KV cache, the final norm and the logits (soft-capped where the family does).

It also owns what the engine does to any model after loading: pre-packing bf16 matmul weights for oneDNN
(or, in float32, running them on the C++ dense_matmul), switching on the C++ kernels (and, for
Llama- and Gemma-shaped layers, the fused decode step), quantizing. A family subclasses it and builds
`self.layers`.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from nanoserve.model.attention import AttentionMetadata
from nanoserve.model.config import ModelConfig
from nanoserve.model.layers.fused_decoder import build_fused_decoder, fusable_layers
from nanoserve.model.layers.linear import DenseMatmul, Linear, pack_weight, packed_linear
from nanoserve.model.layers.mlp import GatedMLP
from nanoserve.model.layers.norm import RMSNorm
from nanoserve.model.layers.rotary import RotaryEmbedding
from nanoserve.model.matmul_choice import (
    LM_HEAD_STEP_SIZES,
    STEP_SIZES,
    WeightShape,
    choose_max_tokens,
    shape_key,
)
from nanoserve.model.pack_choice import choose_layouts
from nanoserve.model.quant import (
    LM_HEAD_QUANT_MAX_ROWS,
    GroupCodes,
    QuantizedWeight,
    fast_kernels,
    move_to_huge_pages,
    pack_codes,
    quantize_weight,
    symmetric_codes,
)


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
        self.dense_embed: DenseMatmul | None = None  # ... or run on dense_matmul (float32)
        self.quantized_lm_head: QuantizedWeight | None = None  # see quantize
        self.fused_decoder: Any = None
        """kernels.FusedDecoder: the layers of decode-only steps, and of prefill steps whose attention is all
        on the C++ kernel, in one C++ call (see use_cpu_kernels)."""
        self.lm_head = (
            None if config.tie_word_embeddings else Linear(config.hidden_size, config.vocab_size, bias=False)
        )
        self.soft_cap_kernel: Callable[[Tensor, float], Tensor] | None = None
        """The C++ soft_cap_logits (in place, on the lm_head's contiguous float32 output), set by
        use_cpu_kernels."""

    def forward(
        self, input_ids: Tensor, positions: Tensor, kv_caches: list[Tensor], attn: AttentionMetadata
    ) -> Tensor:
        """input_ids, positions: [T] -> final hidden states [T, hidden]; writes the new K/V into kv_caches."""
        decode = attn.decode_only
        if self.fused_decoder is not None and decode is not None:
            return self.decode(input_ids, kv_caches, decode.block_table, decode.seq_lens)
        prefill = attn.prefill_on_kernel
        if self.fused_decoder is not None and prefill is not None:
            return self.fused_decoder.prefill(
                input_ids,
                positions,
                kv_caches,
                attn.slot_mapping,
                prefill.block_table,
                prefill.query_starts,
                prefill.query_lens,
                prefill.seq_lens,
            )
        x = self.embed_tokens(input_ids)
        if self.config.embed_scale is not None:
            x = x * torch.tensor(self.config.embed_scale, dtype=x.dtype, device=x.device)
        cos_sin = self.rotary(positions, x.dtype)
        local_cos_sin = cos_sin if self.local_rotary is None else self.local_rotary(positions, x.dtype)
        for layer, kv_cache, is_local in zip(self.layers, kv_caches, self.is_local, strict=True):
            x = layer(x, local_cos_sin if is_local else cos_sin, kv_cache, attn)
        return self.norm(x)

    def decode(
        self, input_ids: Tensor, kv_caches: list[Tensor], block_table: Tensor, seq_lens: Tensor
    ) -> Tensor:
        """A decode-only step on the fused decoder (which must be there): input_ids [S], each sequence's
        newest token, at position seq_len - 1; block_table int32 [S, B] as the scheduler keeps it (entries
        behind a sliding window are never read); seq_lens int64 [S] -> final hidden states [S, hidden]."""
        assert self.fused_decoder is not None, "decode needs the fused decoder (use_cpu_kernels)"
        return self.fused_decoder.forward(input_ids, kv_caches, block_table, seq_lens)

    def compute_logits(self, hidden: Tensor) -> Tensor:
        """[N, hidden] -> float32 [N, vocab]."""
        logits = self._lm_head(hidden).float()  # a new tensor: the matmul's output
        cap = self.config.final_softcap
        if cap is None:
            return logits
        if self.soft_cap_kernel is not None:
            return self.soft_cap_kernel(logits, cap)
        return torch.tanh(logits / cap) * cap

    def _lm_head(self, hidden: Tensor) -> Tensor:
        head = self.quantized_lm_head
        if head is not None and hidden.shape[0] <= head.max_tokens:
            return head.matmul(hidden)
        return self._unquantized_lm_head(hidden)

    def _unquantized_lm_head(self, hidden: Tensor) -> Tensor:
        if self.lm_head is not None:
            return self.lm_head(hidden)
        if self.packed_embed is not None:
            return packed_linear(hidden, self.packed_embed, None)
        if self.dense_embed is not None:
            return self.dense_embed(hidden, self.embed_tokens.weight, None)
        return F.linear(hidden, self.embed_tokens.weight)

    @property
    def lm_head_weight(self) -> Tensor:
        """[vocab, hidden]: the embedding where tied."""
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def weight_bytes_per_step(self, num_tokens: int, num_logits: int) -> int:
        """Weight bytes a step of num_tokens rows (num_logits of them turned into logits) reads: every
        matmul's weight, as the copy that serves a step of that size, and the embedding rows. Expert
        weights count by the share of experts the step's tokens are expected to reach (router choices
        taken as uniform), so for a mixture of experts it is an estimate."""
        total = num_tokens * self.embed_tokens.weight[0].nbytes
        moe = self.config.moe
        reach = 1.0 if moe is None else 1 - (1 - moe.num_experts_per_tok / moe.num_experts) ** num_tokens
        for name, module in self.layers.named_modules():
            if isinstance(module, Linear):
                share = reach if ".experts." in name else 1.0
                total += int(module.bytes_read(num_tokens) * share)
        head = self.quantized_lm_head
        if head is not None and num_logits <= head.max_tokens:
            return total + head.nbytes
        return total + self.lm_head_weight.nbytes

    # -- after loading ------------------------------------------------------------------------

    def prepack_for_cpu(self, matmul_choice: str = "fixed", kernels: ModuleType | None = None) -> None:
        """Pack every matmul weight for oneDNN (CPU, bf16); the weights stay for everything else. Each
        shape's layout: measured with matmul_choice "auto", else batch 1's (nanoserve.model.pack_choice);
        with the C++ kernels, "auto" also measures which steps run the packed weight by rows."""
        layouts, head_layout = self._layouts(matmul_choice, kernels)
        for module, layout in layouts.items():
            module.prepack(layout["batch_hint"])
            self._choose_large_steps(module, layout, kernels)
        if head_layout is not None:
            self.packed_embed = pack_weight(self.embed_tokens.weight, head_layout["batch_hint"])

    def repack_for_quantized_steps(self, kernels: ModuleType | None = None) -> None:
        """Once the quantized copies have their limits, lay each shape's packed weights out (measured, as
        matmul_choice "auto") for the steps those leave to them, packing again only where that changes;
        the packed twins no step reads are dropped first (drop_unread_packed)."""
        self.fused_decoder = None  # it holds the packed weights: use_cpu_kernels builds it again
        self.drop_unread_packed()
        layouts, _ = self._layouts("auto", kernels)
        for module, layout in layouts.items():
            if module.batch_hint != layout["batch_hint"]:
                module.prepack(layout["batch_hint"])
            self._choose_large_steps(module, layout, kernels)

    def drop_unread_packed(self) -> None:
        """Free the packed weights whose quantized copy serves every step size (every shape, on an AVX-512
        VNNI CPU without AMX: 202 MiB for SmolLM2-135M); call use_cpu_kernels after, as the fused decoder
        holds them."""
        for module in self.modules():
            if isinstance(module, Linear) and module.quantized_serves_every_step:
                module.packed = None

    @staticmethod
    def _choose_large_steps(module: Linear, layout: dict, kernels: ModuleType | None) -> None:
        """From which step size `module` multiplies the plain weight, and from which the packed one by rows."""
        module.plain_from, module.split_from = layout["plain_from"], layout["split_from"]
        module.by_rows = kernels.packed_linear_by_rows if kernels is not None else None

    def _layouts(
        self, matmul_choice: str, kernels: ModuleType | None
    ) -> tuple[dict[Linear, dict], dict | None]:
        """Each Linear's layout ({"batch_hint", "plain_from", "split_from"}, its shape timed at the steps
        its quantized copies leave to it; none for those whose quantized copy serves every step), and the
        tied lm_head's (None: untied)."""
        linears = [
            module
            for module in self.modules()
            if isinstance(module, Linear) and not module.quantized_serves_every_step
        ]
        by_shape: dict[tuple[int, int], list[Tensor]] = {}
        served_from: dict[tuple[int, int], int] = {}
        for module in linears:
            shape = (module.weight.shape[0], module.weight.shape[1])
            by_shape.setdefault(shape, []).append(module.weight)
            smallest = 1 if module.quantized is None else module.quantized.max_tokens + 1
            served_from[shape] = min(served_from.get(shape, smallest), smallest)
        embed = self.embed_tokens.weight
        embed_shape = (embed.shape[0], embed.shape[1])
        if self.lm_head is None:
            by_shape.setdefault(embed_shape, []).append(embed)
        # the tied lm_head's steps are the sampled rows: never prefill-sized
        head = frozenset() if self.lm_head is not None else frozenset({embed_shape})
        fixed = {"batch_hint": 1, "plain_from": sys.maxsize, "split_from": sys.maxsize}
        by_rows = kernels.packed_linear_by_rows if kernels is not None else None
        layouts = (
            choose_layouts(by_shape, head, served_from, by_rows)
            if matmul_choice == "auto"
            else dict.fromkeys(by_shape, fixed)
        )
        per_module = {module: layouts[(module.weight.shape[0], module.weight.shape[1])] for module in linears}
        return per_module, None if self.lm_head is not None else layouts[embed_shape]

    def use_dense_matmul(self, dense: DenseMatmul) -> None:
        """Run every float32 matmul on dense (the C++ dense_matmul), the tied lm_head's included."""
        for module in self.modules():
            if isinstance(module, Linear):
                module.dense = dense
        if self.lm_head is None:
            self.dense_embed = dense

    def use_cpu_kernels(self, kernels: ModuleType, fused_decode: bool = True) -> None:
        """RMSNorm, the MLP's activation and the logits' soft-cap in C++; attention takes its kernels from
        AttentionMetadata. With fused_decode, decode-only steps of Llama- and Gemma-shaped layers (experts
        included) run as one C++ call (after quantize: it holds the weights as they are then, and pointers
        into their storage; call it again after moving a weight to new storage)."""
        activations = {"silu": kernels.silu_and_mul, "gelu_tanh": kernels.gelu_tanh_and_mul}
        self.soft_cap_kernel = kernels.soft_cap_logits
        for module in self.modules():
            if isinstance(module, RMSNorm):
                module.kernel = kernels.rms_norm
            elif isinstance(module, GatedMLP):
                module.kernel = activations[module.activation]
        layers = fusable_layers(list(self.layers))
        self.fused_decoder = None
        if fused_decode and layers is not None:
            embedding = self.embed_tokens.weight.contiguous()  # itself, unless a loader left a view
            dtype, device = embedding.dtype, embedding.device
            table = self.rotary.table_for(dtype, device)
            local = None if self.local_rotary is None else self.local_rotary.table_for(dtype, device)
            self.fused_decoder = build_fused_decoder(
                layers,
                self.norm.weight,
                embedding,
                self.config.embed_scale,
                (table, local),
                self.is_local,
                kernels,
            )

    def quantize(
        self,
        method: str,
        kernels: ModuleType | None,
        matmul_choice: str = "fixed",
        codes: dict[str, GroupCodes] | None = None,
    ) -> None:
        """Add quantized copies of the matmul weights (see nanoserve.model.quant): the decoder layers'
        (experts' included) in 4 or 8 bits; the lm_head's, the largest single weight of a small model, in
        symmetric 8 bits (Q8_0's scale: the file's own codes where it shipped Q8_0), and only with the C++
        kernel (4 bits there raised perplexity by 8%). codes: a GGUF file's own codes by parameter name,
        packed as they are; with method auto only those weights are quantized (and the lm_head only where
        the file quantized it). matmul_choice: how each weight's largest quantized step is set
        (nanoserve.model.matmul_choice)."""
        bits = {"int4": 4, "int8": 8, "auto": None}[method]
        codes = codes or {}
        for name, module in self.layers.named_modules():
            if isinstance(module, Linear):
                own = codes.get(f"layers.{name}.weight")
                if own is not None:
                    module.quantized = pack_codes(own, kernels)
                elif bits is not None:
                    module.quantized = quantize_weight(module.weight, bits, kernels)
        head_codes = codes.get("embed_tokens.weight" if self.lm_head is None else "lm_head.weight")
        if fast_kernels(kernels) and (bits is not None or head_codes is not None):
            if head_codes is None or head_codes.bits != 8:
                head_codes = symmetric_codes(self.lm_head_weight)
            if head_codes is not None:
                self.quantized_lm_head = pack_codes(head_codes, kernels)
            if self.quantized_lm_head is not None:
                self.quantized_lm_head.max_tokens = LM_HEAD_QUANT_MAX_ROWS
        move_to_huge_pages(self.quantized_weights())
        if matmul_choice == "auto":
            choose_max_tokens(self._weight_shapes())

    def quantized_weights(self) -> list[QuantizedWeight]:
        """Every quantized copy: the decoder layers' matmuls, then the lm_head's."""
        head = [self.quantized_lm_head] if self.quantized_lm_head is not None else []
        return self.decoder_quantized_weights() + head

    def decoder_quantized_weights(self) -> list[QuantizedWeight]:
        """The quantized copies of the decoder layers' matmuls."""
        return [
            m.quantized for m in self.layers.modules() if isinstance(m, Linear) and m.quantized is not None
        ]

    def _weight_shapes(self) -> list[WeightShape]:
        """The quantized weights grouped by shape, each beside its unquantized matmul (bias left out)."""
        dtype = self.embed_tokens.weight.dtype
        shapes: dict[str, WeightShape] = {}

        def add(role: str, quantized: QuantizedWeight, weight: Tensor, unquantized, step_sizes) -> None:
            key = shape_key(role, quantized, (weight.shape[0], weight.shape[1]), dtype)
            shape = shapes.setdefault(key, WeightShape(key, [], [], weight.shape[1], dtype, step_sizes))
            shape.quantized.append(quantized)
            shape.unquantized.append(unquantized)

        for module in self.layers.modules():
            if isinstance(module, Linear) and module.quantized is not None:
                unquantized = functools.partial(module.unquantized, with_bias=False)
                add("linear", module.quantized, module.weight, unquantized, STEP_SIZES)
        if self.quantized_lm_head is not None:
            add(
                "lm_head",
                self.quantized_lm_head,
                self.lm_head_weight,
                self._unquantized_lm_head,
                LM_HEAD_STEP_SIZES,
            )
        return list(shapes.values())
