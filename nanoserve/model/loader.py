"""Load a model: its config through the registry, its weights into the family's nn.Module; dtypes."""

from __future__ import annotations

import json
import os
from pathlib import Path
from types import ModuleType

import torch

from nanoserve.model import registry
from nanoserve.model.config import ModelConfig
from nanoserve.model.layers.causal_lm import CausalLM
from nanoserve.model.layers.linear import cpu_prepack_supported
from nanoserve.model.quant import GroupCodes, quantization_error
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


CODE_BITS = {"auto": frozenset({4, 8}), "int4": frozenset({4}), "int8": frozenset({8})}
"""Per --quantization: the bits of the GGUF tensors (Q4_0/Q4_1: 4, Q8_0: 8) whose own codes the quantized
weights take; other tensors are dequantized (and, for int4/int8, quantized from their values)."""


def resolve_quantization(quantization: str, path: str, device: torch.device) -> str:
    """auto: the GGUF file's own quantization on CPU (its Q4_0/Q4_1/Q8_0 matrices stay in it, the rest
    unquantized), none for HF folders and other devices."""
    if quantization != "auto":
        return quantization
    return "auto" if is_gguf(path) and device.type == "cpu" else "none"


def load_model(
    path: str,
    config: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    quantization: str = "none",
    kernels: ModuleType | None = None,
    matmul_choice: str = "fixed",
) -> CausalLM:
    """kernels: the C++ CPU kernels (nanoserve.model.kernels), for the quantized formats they run and
    float32's dense_matmul;
    matmul_choice: see nanoserve.model.matmul_choice and nanoserve.model.pack_choice."""
    quantization = resolve_quantization(quantization, path, device)
    error = quantization_error(quantization, device, kernels)
    if error:
        raise ValueError(error)
    family = registry.family_for(config.architecture)
    if is_gguf(path):
        weights = gguf_weights(path, family, config, CODE_BITS.get(quantization, frozenset()))
    else:
        weights = hf_weights(path, family)
    with torch.device("meta"):
        model = family.build(config)
    expected = {name: tuple(p.shape) for name, p in model.state_dict().items()}
    state: dict[str, torch.Tensor] = {}
    codes: dict[str, GroupCodes] = {}
    for name, tensor in fuse(weights):
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        if name not in expected:
            raise ValueError(f"Unexpected weight {name!r} in {path!r} for {config.architecture}.")
        if tuple(tensor.shape) != expected[name]:
            raise ValueError(f"Weight {name!r} has shape {tuple(tensor.shape)}, expected {expected[name]}.")
        if isinstance(tensor, GroupCodes):
            codes[name] = tensor
            tensor = tensor.dequantize()
        state[name] = tensor.to(device=device, dtype=dtype)
    missing = sorted(set(expected) - set(state))
    if missing:
        raise ValueError(
            f"Missing weights in {path!r}: {', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}."
        )
    model.load_state_dict(state, assign=True)  # the loaded tensors become the parameters: no second copy
    model.requires_grad_(False).eval()
    if cpu_prepack_supported(dtype, device):
        model.prepack_for_cpu(matmul_choice, kernels)
    elif kernels is not None and dtype == torch.float32 and device.type == "cpu":
        model.use_dense_matmul(kernels.dense_matmul)
    if quantization != "none":
        model.quantize(quantization, kernels, matmul_choice, codes)
    return model


ONEDNN_ISAS_WITHOUT_BF16 = frozenset(
    {"SSE41", "AVX", "AVX2", "AVX2_VNNI", "AVX2_VNNI_2", "AVX512_CORE", "AVX512_CORE_VNNI"}
)
"""ONEDNN_MAX_CPU_ISA values that keep oneDNN below the bf16 dot-product instructions, where it runs
bf16 matmuls without them (AVX2_VNNI_2 converts to and from bf16 but has no bf16 dot products)."""


def native_bf16(cpu_flags: str, aten_capability: str, onednn_max_isa: str | None) -> bool:
    """Whether bf16 matmuls run on native instructions: the CPU has AVX512-BF16 or AMX (its
    /proc/cpuinfo flags, or ATen's capability where those are missing) and ONEDNN_MAX_CPU_ISA, where
    set, lets oneDNN use them. A cap below them (set by a user, or by tests/other_cpus.py standing in for
    an older CPU) gets float32, as that CPU would."""
    if onednn_max_isa is not None and onednn_max_isa.upper() in ONEDNN_ISAS_WITHOUT_BF16:
        return False
    return "avx512_bf16" in cpu_flags or "amx_bf16" in cpu_flags or aten_capability == "AVX512_AMX"


def _cpu_has_native_bf16() -> bool:
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        flags = ""
    # DNNL_MAX_CPU_ISA: oneDNN's older name, which it still reads
    onednn_max_isa = os.environ.get("ONEDNN_MAX_CPU_ISA") or os.environ.get("DNNL_MAX_CPU_ISA")
    return native_bf16(flags, torch.backends.cpu.get_cpu_capability(), onednn_max_isa)


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
