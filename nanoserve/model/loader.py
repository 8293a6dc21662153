"""Load a model: its config through the registry, its weights into the family's nn.Module; dtypes."""

from __future__ import annotations

import json
from pathlib import Path
from types import ModuleType

import torch

from nanoserve.model import registry
from nanoserve.model.config import ModelConfig
from nanoserve.model.layers.causal_lm import CausalLM
from nanoserve.model.layers.linear import cpu_prepack_supported
from nanoserve.model.quant import quantization_error
from nanoserve.model.weights import fuse, gguf_info, gguf_weights, hf_weights
from nanoserve.model_files import is_gguf, model_name


def load_model_config(path: str) -> ModelConfig:
    name = model_name(path)
    if is_gguf(path):
        info = gguf_info(path)
        family = registry.family_for_gguf(info)
        assert family.config_from_gguf is not None
        return family.config_from_gguf(info, name)
    config_file = Path(path) / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"No config.json in model folder {path!r}.")
    hf = json.loads(config_file.read_text())
    architecture = registry.hf_architecture(hf)
    return registry.family_for(architecture).config_from_hf(hf, architecture, name)


def load_model(
    path: str,
    config: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    quantization: str = "none",
    kernels: ModuleType | None = None,
) -> CausalLM:
    """kernels: the C++ CPU kernels (nanoserve.model.kernels), for the quantized formats they run."""
    error = quantization_error(quantization, device, kernels)
    if error:
        raise ValueError(error)
    family = registry.family_for(config.architecture)
    weights = gguf_weights(path, family, config) if is_gguf(path) else hf_weights(path, family)
    with torch.device("meta"):
        model = family.build(config)
    expected = {name: tuple(p.shape) for name, p in model.state_dict().items()}
    state: dict[str, torch.Tensor] = {}
    for name, tensor in fuse(weights):
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
