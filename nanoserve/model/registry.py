"""The model registry: HF `architectures[0]` and GGUF `general.architecture` -> the family serving it.

Adding a family is one module under nanoserve/model/models/ exporting its FAMILY, listed here.
"""

from __future__ import annotations

from nanoserve.model.config import GGUFInfo
from nanoserve.model.family import ModelFamily
from nanoserve.model.models import gemma2, gemma3, llama, mixtral, phi3, qwen2, qwen3, qwen_moe

FAMILIES: tuple[ModelFamily, ...] = (
    llama.FAMILY,
    qwen2.FAMILY,
    qwen3.FAMILY,
    phi3.FAMILY,
    gemma2.FAMILY,
    gemma3.FAMILY,
    mixtral.FAMILY,
    qwen_moe.FAMILY,
)
_BY_ARCHITECTURE = {arch: family for family in FAMILIES for arch in family.architectures}
_BY_MODEL_TYPE = {model_type: arch for family in FAMILIES for model_type, arch in family.model_types.items()}


def supported_architectures() -> list[str]:
    return sorted(_BY_ARCHITECTURE)


def supported_gguf_architectures() -> list[str]:
    return sorted({arch for family in FAMILIES for arch in family.gguf_architectures})


def hf_architecture(hf: dict) -> str:
    """`architectures[0]`, or the architecture its `model_type` implies."""
    archs = hf.get("architectures") or []
    model_type = str(hf.get("model_type"))
    return archs[0] if archs else _BY_MODEL_TYPE.get(model_type, model_type)


def family_for(architecture: str) -> ModelFamily:
    family = _BY_ARCHITECTURE.get(architecture)
    if family is None:
        raise ValueError(
            f"Unsupported architecture {architecture!r}; supported: {', '.join(supported_architectures())}."
        )
    return family


def family_for_gguf(info: GGUFInfo) -> ModelFamily:
    arch = info.architecture
    for family in FAMILIES:
        if arch in family.gguf_architectures and family.gguf_accepts(info):
            return family
    raise ValueError(
        f"Unsupported GGUF architecture {arch!r}; supported: {', '.join(supported_gguf_architectures())}."
    )
