"""Loading: model paths, configs from config.json and GGUF, weights (incl. the bundled Q4_1 GGUF), tokenizers."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from nanoserve.model.attention import allocate_kv_cache, build_attention_metadata
from nanoserve.model.layers.rotary import rope_inv_freq
from nanoserve.model.loader import load_model, load_model_config, native_bf16, resolve_dtype
from nanoserve.model.models import llama, qwen2
from nanoserve.model_files import load_tokenizer, resolve_model_path

CPU = torch.device("cpu")


@pytest.fixture(scope="session")
def bundled_model(bundled_gguf_path):
    config = load_model_config(bundled_gguf_path)
    return config, load_model(bundled_gguf_path, config, torch.float32, CPU)


def test_resolve_model_path(bundled_gguf_path, tmp_path):
    assert resolve_model_path(None) == bundled_gguf_path
    assert resolve_model_path(str(tmp_path)) == str(tmp_path)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        resolve_model_path(str(tmp_path / "nope.gguf"))
    (tmp_path / "weights.bin").write_bytes(b"")
    with pytest.raises(ValueError, match="not a .gguf"):
        resolve_model_path(str(tmp_path / "weights.bin"))


def test_bundled_gguf_config(bundled_gguf_path):
    config = load_model_config(bundled_gguf_path)
    assert config.architecture == "LlamaForCausalLM"
    assert config.name == "SmolLM2-135M-Instruct"
    assert (config.num_layers, config.hidden_size, config.intermediate_size) == (30, 576, 1536)
    assert (config.num_heads, config.num_kv_heads, config.head_dim) == (9, 3, 64)
    assert config.vocab_size == 49152
    assert config.rope_theta == 100000.0 and config.rope_scaling is None
    assert config.tie_word_embeddings and not config.attention_bias
    assert config.max_position_embeddings == 8192
    assert config.rms_norm_eps == pytest.approx(1e-5)


def test_bundled_gguf_weights_match_transformers(bundled_model, hf_bundled_model):
    config, model = bundled_model
    ours = dict(model.named_parameters())
    ref = hf_bundled_model.state_dict()
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    for i in (0, config.num_layers - 1):
        qkv = ours[f"layers.{i}.self_attn.qkv_proj.weight"]
        for name, part in zip("qkv", qkv.split([q, kv, kv]), strict=True):
            torch.testing.assert_close(
                part, ref[f"model.layers.{i}.self_attn.{name}_proj.weight"], atol=0, rtol=0
            )
        gate, up = ours[f"layers.{i}.mlp.gate_up_proj.weight"].chunk(2)
        torch.testing.assert_close(gate, ref[f"model.layers.{i}.mlp.gate_proj.weight"], atol=0, rtol=0)
        torch.testing.assert_close(up, ref[f"model.layers.{i}.mlp.up_proj.weight"], atol=0, rtol=0)
    torch.testing.assert_close(ours["embed_tokens.weight"], ref["model.embed_tokens.weight"], atol=0, rtol=0)
    torch.testing.assert_close(ours["norm.weight"], ref["model.norm.weight"], atol=0, rtol=0)


def test_bundled_gguf_logits_match_transformers(bundled_model, hf_bundled_model):
    config, model = bundled_model
    ids = [504, 3575, 282, 4649, 314, 253, 1345, 30]
    n, block_size = len(ids), 16
    kv_caches = allocate_kv_cache(
        config.num_layers, 4, block_size, config.num_kv_heads, config.head_dim, torch.float32, CPU
    )
    attn = build_attention_metadata(
        np.array([n]), np.array([n]), np.array([[2, 0]], dtype=np.int32), block_size, CPU
    )
    with torch.inference_mode():
        logits = model.compute_logits(model(torch.tensor(ids), torch.arange(n), kv_caches, attn))
        ref = hf_bundled_model(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(logits, ref, atol=2e-3, rtol=1e-4)


def test_hf_folder_config(tiny_model_dir):
    config = load_model_config(str(tiny_model_dir))
    hf = json.loads((tiny_model_dir / "config.json").read_text())
    assert config.name == tiny_model_dir.name
    assert config.architecture == "LlamaForCausalLM"
    assert config.num_kv_heads == hf["num_key_value_heads"]
    assert config.tie_word_embeddings == hf["tie_word_embeddings"]
    assert config.head_dim == 16
    if "llama3" in tiny_model_dir.name:
        assert config.rope_theta == 500000.0
        assert config.rope_scaling["rope_type"] == "llama3" and config.rope_scaling["factor"] == 8.0
    else:
        assert config.rope_theta == 10000.0 and config.rope_scaling is None


def test_sharded_safetensors_and_bf16(tiny_gqa_dir, tmp_path):
    from transformers import LlamaForCausalLM as HFLlama

    sharded = tmp_path / "sharded"
    HFLlama.from_pretrained(tiny_gqa_dir).save_pretrained(sharded, max_shard_size="2MB")
    assert len(list(sharded.glob("*.safetensors"))) > 1
    whole = load_model(str(tiny_gqa_dir), load_model_config(str(tiny_gqa_dir)), torch.bfloat16, CPU)
    split = load_model(str(sharded), load_model_config(str(sharded)), torch.bfloat16, CPU)
    for (name, a), (_, b) in zip(whole.state_dict().items(), split.state_dict().items(), strict=True):
        assert a.dtype == torch.bfloat16, name
        torch.testing.assert_close(a, b, atol=0, rtol=0)


def _copy_folder(src: Path, dst: Path, skip: tuple[str, ...] = ()) -> Path:
    shutil.copytree(src, dst, ignore=lambda _dir, names: [n for n in names if n.endswith(skip)])
    return dst


def test_unsupported_architecture(tiny_gqa_dir, tmp_path):
    folder = _copy_folder(tiny_gqa_dir, tmp_path / "gpt2")
    hf = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**hf, "architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ValueError, match="Unsupported architecture 'GPT2LMHeadModel'.*LlamaForCausalLM"):
        load_model_config(str(folder))


def test_missing_files(tiny_gqa_dir, tmp_path):
    no_config = _copy_folder(tiny_gqa_dir, tmp_path / "no-config", skip=("config.json",))
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_model_config(str(no_config))
    no_weights = _copy_folder(tiny_gqa_dir, tmp_path / "no-weights", skip=(".safetensors",))
    with pytest.raises(FileNotFoundError, match="safetensors"):
        load_model(str(no_weights), load_model_config(str(no_weights)), torch.float32, CPU)
    no_tokenizer = _copy_folder(
        tiny_gqa_dir, tmp_path / "no-tokenizer", skip=("tokenizer.json", "tokenizer_config.json")
    )
    with pytest.raises(FileNotFoundError, match="tokenizer"):
        load_tokenizer(str(no_tokenizer))


def test_tokenizers_agree(tiny_gqa_dir, bundled_gguf_path):
    from_folder, from_gguf = load_tokenizer(str(tiny_gqa_dir)), load_tokenizer(bundled_gguf_path)
    text = "Hello, paged attention!"
    assert from_folder(text)["input_ids"] == from_gguf(text)["input_ids"]
    chat = [{"role": "user", "content": "Hi"}]
    rendered = from_gguf.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert "<|im_start|>user\nHi<|im_end|>" in rendered and rendered.endswith("<|im_start|>assistant\n")


def test_resolve_dtype():
    assert resolve_dtype("float32", CPU) == torch.float32
    assert resolve_dtype("bfloat16", CPU) == torch.bfloat16
    assert resolve_dtype("auto", CPU) in (torch.bfloat16, torch.float32)
    with pytest.raises(ValueError, match="dtype"):
        resolve_dtype("int8", CPU)


@pytest.mark.parametrize(
    ("flags", "capability", "onednn_cap", "native"),
    [
        ("fpu avx2 avx512f avx512_bf16", "AVX512", None, True),
        ("fpu avx2 amx_bf16 amx_tile", "AVX512_AMX", None, True),
        ("fpu avx2 avx512f avx512_vnni", "AVX512", None, False),
        ("fpu avx2 fma", "AVX2", None, False),
        ("", "AVX512_AMX", None, True),
        ("fpu avx2 avx512f avx512_bf16 amx_bf16", "AVX2", "AVX2", False),
        ("fpu avx2 avx512f avx512_bf16 amx_bf16", "AVX512", "avx512_core_vnni", False),
        ("fpu avx2 avx512f avx512_bf16 amx_bf16", "AVX512", "AVX512_CORE_BF16", True),
        ("fpu avx2 avx512f avx512_bf16 amx_bf16", "AVX512_AMX", "DEFAULT", True),
        ("fpu avx2 avx512f avx512_bf16 amx_bf16", "AVX512", "avx2_vnni_2", False),
    ],
)
def test_native_bf16_follows_the_cpu_and_onednn_cap(flags, capability, onednn_cap, native):
    assert native_bf16(flags, capability, onednn_cap) is native


def test_config_from_hf_variants():
    base = dict(
        vocab_size=10, hidden_size=8, num_hidden_layers=1, num_attention_heads=2, intermediate_size=16
    )
    qwen = qwen2.config_from_hf(base, "Qwen2ForCausalLM", "q")
    assert qwen.attention_bias and not qwen.o_proj_bias and qwen.num_kv_heads == 2
    old_style = llama.config_from_hf(
        {**base, "rope_theta": 5.0, "rope_scaling": {"type": "linear", "factor": 2.0}},
        "LlamaForCausalLM",
        "l",
    )
    assert old_style.rope_theta == 5.0 and old_style.rope_scaling == {"factor": 2.0, "rope_type": "linear"}
    with pytest.raises(ValueError, match="rope_scaling"):
        llama.config_from_hf({**base, "rope_scaling": {"rope_type": "dynamic"}}, "LlamaForCausalLM", "l")


_GGUF_NAMES = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}


def _llama_cpp_permute(w: np.ndarray, num_heads: int) -> np.ndarray:
    """What llama.cpp's converter does to q/k rows (interleaved RoPE layout)."""
    return w.reshape(num_heads, 2, w.shape[0] // num_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def test_gguf_quant_types_and_unpermute(tiny_model_dir, tmp_path):
    """Write a tiny model to GGUF the way llama.cpp does, each matrix in a different type; load it back."""
    import gguf
    from gguf.quants import dequantize, quantize

    hf_config = load_model_config(str(tiny_model_dir))
    from safetensors.torch import load_file

    state = {k: v.numpy() for f in tiny_model_dir.glob("*.safetensors") for k, v in load_file(f).items()}
    types = [gguf.GGMLQuantizationType[t] for t in ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1")]
    path = tmp_path / "tiny-Q4_1.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(hf_config.num_layers)
    writer.add_context_length(hf_config.max_position_embeddings)
    writer.add_embedding_length(hf_config.hidden_size)
    writer.add_feed_forward_length(hf_config.intermediate_size)
    writer.add_head_count(hf_config.num_heads)
    writer.add_head_count_kv(hf_config.num_kv_heads)
    writer.add_layer_norm_rms_eps(hf_config.rms_norm_eps)
    writer.add_rope_freq_base(hf_config.rope_theta)
    writer.add_vocab_size(hf_config.vocab_size)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    if hf_config.rope_scaling is not None:  # llama.cpp stores Llama 3 scaling as per-frequency divisors
        dim, theta, positions = hf_config.rotary_dim, hf_config.rope_theta, hf_config.max_position_embeddings
        base_inv_freq, _ = rope_inv_freq(dim, theta, None, positions)
        scaled_inv_freq, _ = rope_inv_freq(dim, theta, hf_config.rope_scaling, positions)
        writer.add_tensor("rope_freqs.weight", (base_inv_freq / scaled_inv_freq).numpy())
    expected = {}
    for i, (name, w) in enumerate(sorted(state.items())):
        parts = name.removeprefix("model.").split(".")
        if parts[0] == "layers":
            gguf_name = f"blk.{parts[1]}.{_GGUF_NAMES['.'.join(parts[2:-1])]}.{parts[-1]}"
        else:
            gguf_name = {"embed_tokens": "token_embd", "norm": "output_norm", "lm_head": "output"}[
                parts[0]
            ] + ".weight"
        qtype = types[i % len(types)] if w.ndim == 2 else types[0]
        if gguf_name.split(".")[-2] in ("attn_q", "attn_k"):
            w = _llama_cpp_permute(
                w, hf_config.num_heads if "attn_q" in gguf_name else hf_config.num_kv_heads
            )
        data = quantize(w, qtype)
        writer.add_tensor(gguf_name, data, raw_dtype=qtype if data.dtype == np.uint8 else None)
        # per-row quantization does not mix rows, so dequantizing and un-permuting gives the HF layout back
        expected[name] = dequantize(quantize(state[name], qtype), qtype).reshape(state[name].shape)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    config = load_model_config(str(path))
    assert config.name == "tiny"
    for field in (
        "num_layers",
        "hidden_size",
        "num_heads",
        "num_kv_heads",
        "head_dim",
        "tie_word_embeddings",
    ):
        assert getattr(config, field) == getattr(hf_config, field), field
    ours = load_model(str(path), config, torch.float32, CPU).state_dict()
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    for i in range(config.num_layers):
        got = ours[f"layers.{i}.self_attn.qkv_proj.weight"].split([q, kv, kv])
        for part, proj in zip(got, "qkv", strict=True):
            np.testing.assert_array_equal(
                part.numpy(), expected[f"model.layers.{i}.self_attn.{proj}_proj.weight"]
            )
        gate, up = ours[f"layers.{i}.mlp.gate_up_proj.weight"].chunk(2)
        np.testing.assert_array_equal(gate.numpy(), expected[f"model.layers.{i}.mlp.gate_proj.weight"])
        np.testing.assert_array_equal(up.numpy(), expected[f"model.layers.{i}.mlp.up_proj.weight"])
    np.testing.assert_array_equal(ours["embed_tokens.weight"].numpy(), expected["model.embed_tokens.weight"])
