"""The per-step-size choice between each quantized matmul and the unquantized one
(nanoserve/model/matmul_choice.py): the limit read off measured ratios, the cache per kernel build (and
so per CPU), the fixed rule that turns measuring off, and the limit honoured by the model."""

from __future__ import annotations

import json
import sys

import pytest
import torch
from quality import CPU

from nanoserve.model import matmul_choice
from nanoserve.model.kernels import cpu_kernels
from nanoserve.model.layers.linear import Linear
from nanoserve.model.loader import load_model, load_model_config
from nanoserve.model.quant import LM_HEAD_QUANT_MAX_ROWS, QUANT_MATMUL_MAX_TOKENS, fast_kernels


def test_limit_is_the_last_size_before_the_unquantized_matmul_stays_ahead():
    limit = matmul_choice.max_tokens_from_ratios
    assert limit({1: 0.3, 8: 0.6, 64: 0.9, 512: 0.95}) == sys.maxsize
    assert limit({1: 0.3, 8: 0.6, 64: 1.1, 512: 1.3}) == 8
    assert limit({1: 0.3, 8: 1.2, 64: 0.9, 512: 1.3}) == 64, "a slow point followed by a fast one is noise"
    assert limit({1: 1.2, 8: 1.5}) == 0


@pytest.fixture
def kernels():
    module = cpu_kernels()
    if not fast_kernels(module):
        pytest.skip("the C++ quant_matmul (AVX-512 VNNI or AVX2) is not available here")
    return module


@pytest.fixture
def choice_file(tmp_path, monkeypatch):
    path = tmp_path / "matmul_choice.json"
    monkeypatch.setattr(matmul_choice, "cache_file", lambda: path)
    return path


def _int4_model(path: str, kernels, choice: str):
    return load_model(path, load_model_config(path), torch.bfloat16, CPU, "int4", kernels, choice)


def _limits(model) -> list[int]:
    linears = [
        m.quantized.max_tokens for m in model.layers.modules() if isinstance(m, Linear) and m.quantized
    ]
    return [*linears, model.quantized_lm_head.max_tokens]


def test_measured_once_per_kernel_build_then_read_from_the_cache(
    tiny_gqa_dir, kernels, choice_file, monkeypatch
):
    model = _int4_model(str(tiny_gqa_dir), kernels, "auto")
    entries = json.loads(choice_file.read_text())
    build = matmul_choice.library_name(matmul_choice.cpu_identity())
    assert entries and all(key.startswith(build) for key in entries)
    assert set(_limits(model)) <= {entry["max_tokens"] for entry in entries.values()}

    def no_measuring(shape):
        raise AssertionError(f"measured {shape.key} again")

    monkeypatch.setattr(matmul_choice, "measure_ratios", no_measuring)
    again = _int4_model(str(tiny_gqa_dir), kernels, "auto")
    assert _limits(again) == _limits(model)

    # another CPU (model or flags) is another kernel build: it measures for itself
    monkeypatch.setattr(matmul_choice, "cpu_identity", lambda: "x86_64 Another CPU avx512f amx_bf16")
    with pytest.raises(AssertionError, match="measured"):
        _int4_model(str(tiny_gqa_dir), kernels, "auto")


def test_fixed_choice_measures_nothing(tiny_gqa_dir, kernels, choice_file):
    model = _int4_model(str(tiny_gqa_dir), kernels, "fixed")
    assert not choice_file.exists()
    assert _limits(model)[:-1] == [QUANT_MATMUL_MAX_TOKENS] * (len(_limits(model)) - 1)
    assert _limits(model)[-1] == LM_HEAD_QUANT_MAX_ROWS


def test_steps_beyond_the_limit_take_the_unquantized_matmul(tiny_gqa_dir, kernels, choice_file):
    model = _int4_model(str(tiny_gqa_dir), kernels, "auto")
    entries = {key: {"max_tokens": 8, "ratios": {}} for key in json.loads(choice_file.read_text())}
    choice_file.write_text(json.dumps(entries))
    model = _int4_model(str(tiny_gqa_dir), kernels, "auto")
    qkv = model.layers[0].self_attn.qkv_proj
    with torch.inference_mode():
        for rows in (8, 9):
            x = torch.randn(rows, qkv.in_features).bfloat16()
            quantized = rows <= 8
            assert torch.equal(qkv(x), qkv.quantized.matmul(x) if quantized else qkv.unquantized(x))
            assert not torch.equal(qkv.quantized.matmul(x), qkv.unquantized(x))


def test_a_quantized_copy_that_serves_every_step_drops_its_packed_twin(tiny_gqa_dir, kernels, choice_file):
    """repack_for_quantized_steps: where the quantized copy serves steps of every size, no step reads the
    oneDNN-packed weight, and it is freed; a weight with a limit keeps its own for the larger steps."""
    model = _int4_model(str(tiny_gqa_dir), kernels, "auto")
    qkv = model.layers[0].self_attn.qkv_proj
    qkv_shape = f" {qkv.out_features}x{qkv.in_features}"
    limits = {
        key: {"max_tokens": sys.maxsize if key.endswith(qkv_shape) else 8, "ratios": {}}
        for key in json.loads(choice_file.read_text())
    }
    choice_file.write_text(json.dumps(limits))
    model = _int4_model(str(tiny_gqa_dir), kernels, "auto")
    model.repack_for_quantized_steps(kernels)
    linears = [m for m in model.layers.modules() if isinstance(m, Linear) and m.quantized is not None]
    assert {m.packed is None for m in linears} == {True, False}
    for linear in linears:
        assert (linear.packed is None) == (linear.quantized.max_tokens == sys.maxsize)
    with torch.inference_mode():
        x = torch.randn(64, qkv.in_features).bfloat16()
        assert torch.equal(model.layers[0].self_attn.qkv_proj(x), qkv.quantized.matmul(x))


def test_symmetric_and_min_max_8bit_codes_keep_separate_limits():
    """The two 8-bit layouts run different inner loops, so a limit measured for one is not the other's."""
    from nanoserve.model.quant import group_codes, pack_groups, symmetric_codes

    weight = torch.randn(32, 64)
    packed = []
    for codes in (symmetric_codes(weight), group_codes(weight, 8)):
        assert codes is not None
        packed.append(pack_groups(codes, torch.matmul))  # the key never calls the kernel
    symmetric, min_max = packed
    assert symmetric is not None and min_max is not None and symmetric.symmetric and not min_max.symmetric
    keys = {matmul_choice.shape_key("linear", w, (32, 64), torch.float32) for w in (symmetric, min_max)}
    assert len(keys) == 2
