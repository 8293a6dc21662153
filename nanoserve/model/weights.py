"""Weights as they come off disk, in one vocabulary: the model's own parameter names.

HF safetensors go through the family's renames and adaptations; GGUF tensors are dequantized (or, in
Q4_0, Q4_1 and Q8_0, kept as GroupCodes when the caller asks: nanoserve.model.gguf_codes), named from
llama.cpp's names, un-permuted where llama.cpp permuted q/k, and stacked experts are split. Both then
pass `fuse`, which concatenates q/k/v and gate/up as the model's fused Linears hold them.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import torch

from nanoserve.model.config import GGUFInfo, ModelConfig
from nanoserve.model.family import ModelFamily
from nanoserve.model.gguf_codes import BLOCK_BYTES, gguf_codes
from nanoserve.model.quant import GroupCodes
from nanoserve.model_files import gguf_header, gguf_metadata, gguf_vocab_size

GGUF_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1")
"""Tested; others the gguf package dequantizes (K-quants ...) load too."""
GGUF_CONFIG_TENSORS = ("rope_freqs", "rope_factors_long", "rope_factors_short")
"""Tensors that configure the rotary embedding rather than weigh anything (see GGUFInfo)."""


def hf_weights(path: str, family: ModelFamily) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    index = Path(path) / "model.safetensors.index.json"
    if (
        index.is_file()
    ):  # the index names the shards; other *.safetensors (e.g. consolidated) are not HF weights
        files = [Path(path) / f for f in sorted(set(json.loads(index.read_text())["weight_map"].values()))]
    else:
        files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"No *.safetensors files in model folder {path!r}.")
    renames = [(re.compile(pattern), replacement) for pattern, replacement in family.hf_renames]
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                if name.endswith("rotary_emb.inv_freq"):
                    continue
                tensor = f.get_tensor(name)
                for pattern, replacement in renames:
                    name = pattern.sub(replacement, name)
                if family.adapt_hf_weight is not None:
                    tensor = family.adapt_hf_weight(name, tensor)
                yield name, tensor


def gguf_info(path: str) -> GGUFInfo:
    from gguf.quants import dequantize

    tensors = {t.name.removesuffix(".weight"): t for t in gguf_header(path).tensors}
    config_tensors = {
        name: dequantize(np.asarray(tensors[name].data), tensors[name].tensor_type).reshape(-1).tolist()
        for name in GGUF_CONFIG_TENSORS
        if name in tensors
    }
    return GGUFInfo(
        gguf_metadata(path),
        frozenset(t.name for t in tensors.values()),
        gguf_vocab_size(path),
        config_tensors,
    )


def _unpermute_rope(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row permutation (interleaved RoPE) to get the rotate-half (HF) row order."""
    rows = w.shape[0]
    return w.reshape(num_heads, rows // num_heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


Weight = torch.Tensor | GroupCodes


def gguf_weights(
    path: str, family: ModelFamily, config: ModelConfig, code_bits: frozenset[int] = frozenset()
) -> Iterator[tuple[str, Weight]]:
    """code_bits: the tensors of a Q4_0/Q4_1 (4) or Q8_0 (8) type with these bits come as GroupCodes."""
    from gguf import GGMLQuantizationType

    for t in gguf_header(path).tensors:
        parts = t.name.split(".")  # blk.N.attn_q.weight | token_embd.weight
        layer, base, kind = (
            (parts[1], parts[2], parts[3]) if parts[0] == "blk" else (None, parts[0], parts[1])
        )
        if base in GGUF_CONFIG_TENSORS:
            continue
        if base not in family.gguf_names:
            raise ValueError(f"Unexpected GGUF tensor {t.name!r} for {config.architecture}.")
        qtype = GGMLQuantizationType(t.tensor_type)
        # numpy order is [rows, cols]: GGUF lists dimensions reversed
        shape = tuple(reversed([int(d) for d in t.shape]))
        tensor: Weight | None = None
        if qtype.name in BLOCK_BYTES and (8 if qtype.name == "Q8_0" else 4) in code_bits:
            tensor = gguf_codes(t.data, qtype.name, shape)
        if tensor is None:
            tensor = _dequantized(t, qtype, shape)
        if family.gguf_permutes_qk and base in ("attn_q", "attn_k"):
            heads = config.num_heads if base == "attn_q" else config.num_kv_heads
            tensor = _map_rows(tensor, lambda rows, heads=heads: _unpermute_rope(rows, heads))
        name = family.gguf_names[base]
        prefix = "" if layer is None else f"layers.{layer}."
        if "{}" in name:  # [experts, rows, cols]: one matrix per expert
            experts = tensor.unbind() if isinstance(tensor, GroupCodes) else list(tensor)
            for expert, matrix in enumerate(experts):
                yield f"{prefix}{name.format(expert)}.{kind}", matrix
        else:
            yield f"{prefix}{name}.{kind}", tensor


def _map_rows(tensor: Weight, fn: Callable[[torch.Tensor], torch.Tensor]) -> Weight:
    return tensor.map_rows(fn) if isinstance(tensor, GroupCodes) else fn(tensor)


def _dequantized(t, qtype, shape: tuple[int, ...]) -> torch.Tensor:
    from gguf.quants import dequantize

    try:
        # np.asarray: a plain view, not a memmap, which dequantize slices row group by row group much faster
        array = dequantize(np.asarray(t.data), qtype)
    except NotImplementedError as e:
        raise ValueError(
            f"GGUF tensor {t.name!r} uses {qtype.name}, which the gguf package cannot dequantize "
            f"(tested: {', '.join(GGUF_TYPES)})."
        ) from e
    return torch.from_numpy(np.array(array.reshape(shape), dtype=np.float32))


_FUSED = {
    "q_proj": ("qkv_proj", 0, 3),
    "k_proj": ("qkv_proj", 1, 3),
    "v_proj": ("qkv_proj", 2, 3),
    "gate_proj": ("gate_up_proj", 0, 2),
    "up_proj": ("gate_up_proj", 1, 2),
}
"""HF projection -> (the fused Linear it goes into, its place, how many parts the fused Linear has)."""


def fuse(weights: Iterator[tuple[str, Weight]]) -> Iterator[tuple[str, Weight]]:
    """HF-style names -> the model's, concatenating q/k/v and gate/up as all their parts arrive (codes of
    one bit width stay codes; a mix is dequantized)."""
    pending: dict[str, dict[int, Weight]] = {}
    for name, tensor in weights:
        name = name.removeprefix("model.")
        parts = name.split(".")
        if len(parts) >= 2 and parts[-2] in _FUSED:
            target, index, num_parts = _FUSED[parts[-2]]
            key = ".".join([*parts[:-2], target, parts[-1]])
            group = pending.setdefault(key, {})
            group[index] = tensor
            if len(group) == num_parts:
                yield key, _cat([group[i] for i in sorted(group)])
                del pending[key]
            continue
        yield name, tensor
    if pending:
        raise ValueError(f"Incomplete fused weights: {', '.join(sorted(pending))}.")


def _cat(parts: list[Weight]) -> Weight:
    codes = [p for p in parts if isinstance(p, GroupCodes)]
    if len(codes) == len(parts) and len({p.bits for p in codes}) == 1:
        return GroupCodes.cat(codes)
    return torch.cat([p.dequantize() if isinstance(p, GroupCodes) else p for p in parts])
