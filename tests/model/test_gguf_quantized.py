"""GGUF files in Q4_0, Q4_1 and Q8_0 load straight into the quantized weights: the matmuls compute with
the file's own values (no second rounding), the float weights equal the dequantized load, and
--quantization auto takes each file's own format (none for HF folders and float files)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from families import build_family
from gguf_files import write_gguf

from nanoserve.model.gguf_codes import gguf_codes
from nanoserve.model.kernels import cpu_kernels
from nanoserve.model.layers.linear import Linear
from nanoserve.model.loader import load_model, load_model_config
from nanoserve.model.quant import fast_kernels

CPU = torch.device("cpu")
BITS = {"Q4_0": 4, "Q4_1": 4, "Q8_0": 8}


@pytest.fixture(scope="module")
def kernels():
    module = cpu_kernels()
    if not fast_kernels(module):
        pytest.skip("the C++ quant_matmul (AVX-512 VNNI or AVX2) is not available here")
    return module


@pytest.fixture(scope="module", params=["qwen3-gqa-tied", "mixtral"])
def folder(request, tmp_path_factory):
    return build_family(request.param, tmp_path_factory.mktemp(request.param))


def _load(path, quantization: str, kernels=None):
    return load_model(str(path), load_model_config(str(path)), torch.float32, CPU, quantization, kernels)


def _linears(model) -> dict[str, Linear]:
    return {name: m for name, m in model.layers.named_modules() if isinstance(m, Linear)}


def _matmul_columns(quantized, k: int) -> torch.Tensor:
    """The weight [N, K] as the quantized matmul sees it: its output for each unit input (which int8
    activations hold exactly)."""
    return quantized.matmul(torch.eye(k)).T


@pytest.mark.parametrize("type_name", sorted(BITS))
def test_gguf_codes_are_the_files_values(type_name):
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize, quantize

    torch.manual_seed(0)
    weight = (torch.randn(48, 96) * 0.05).numpy()
    weight[3, :32] = 0.02  # a group of equal weights
    data = quantize(weight, GGMLQuantizationType[type_name])
    codes = gguf_codes(data, type_name, weight.shape)
    assert codes is not None and codes.bits == BITS[type_name]
    assert int(codes.codes.max()) < 2**codes.bits
    expected = dequantize(data, GGMLQuantizationType[type_name]).reshape(weight.shape)
    np.testing.assert_array_equal(codes.dequantize().numpy(), expected)
    scale = data.reshape(48, 3, -1)[..., :2].copy().view(np.float16)[..., 0]
    np.testing.assert_array_equal(codes.scale.numpy(), scale)  # each block's d, as stored


@pytest.mark.parametrize("type_name", sorted(BITS))
def test_quantized_gguf_loads_into_its_own_codes(folder, kernels, type_name, tmp_path):
    path = write_gguf(folder, tmp_path / f"model-{type_name}.gguf", type_name)
    dequantized, auto = _load(path, "none"), _load(path, "auto", kernels)
    assert auto.state_dict().keys() == dequantized.state_dict().keys()
    for name, tensor in dequantized.state_dict().items():
        torch.testing.assert_close(auto.state_dict()[name], tensor, atol=0, rtol=0, msg=name)
    bits = BITS[type_name]
    for name, linear in _linears(auto).items():
        assert linear.quantized is not None and linear.quantized.bits == bits, name
        # the file's values exactly, up to float32 sums (requantizing Q4_0/Q8_0 would move them by steps)
        torch.testing.assert_close(_matmul_columns(linear.quantized, linear.in_features), linear.weight)
    head = auto.quantized_lm_head
    assert head is not None
    columns = _matmul_columns(head, auto.lm_head_weight.shape[1])
    if bits == 8:  # the file's 8-bit codes; 4-bit ones are requantized to 8 bits
        torch.testing.assert_close(columns, auto.lm_head_weight)
    explicit = _load(path, f"int{bits}", kernels)
    for name, linear in _linears(explicit).items():
        torch.testing.assert_close(
            _matmul_columns(linear.quantized, linear.in_features), _linears(auto)[name].weight
        )


def test_quantization_auto_is_none_for_float_weights(folder, kernels, tmp_path):
    float_gguf = write_gguf(folder, tmp_path / "model-F32.gguf")
    for path in (folder, float_gguf):
        model = _load(path, "auto", kernels)
        assert all(linear.quantized is None for linear in _linears(model).values())
        assert model.quantized_lm_head is None
