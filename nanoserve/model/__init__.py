"""The model layer: config, Llama-family network, paged attention, and loaders."""

from nanoserve.model.attention import (
    AttentionMetadata,
    allocate_kv_cache,
    build_attention_metadata,
    kv_cache_bytes_per_block,
)
from nanoserve.model.config import ModelConfig
from nanoserve.model.llama import LlamaForCausalLM
from nanoserve.model.loader import (
    load_model,
    load_model_config,
    load_tokenizer,
    resolve_dtype,
    resolve_model_path,
)

__all__ = [
    "AttentionMetadata",
    "LlamaForCausalLM",
    "ModelConfig",
    "allocate_kv_cache",
    "build_attention_metadata",
    "kv_cache_bytes_per_block",
    "load_model",
    "load_model_config",
    "load_tokenizer",
    "resolve_dtype",
    "resolve_model_path",
]
