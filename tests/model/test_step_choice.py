"""Whole decode steps all quantized (nanoserve.model.step_choice): the size it raises the limits to, that
it measures once per machine and shape, and that measuring leaves the model as it was."""

from __future__ import annotations

import pytest
import torch
from families import build_family

from nanoserve.model import step_choice
from nanoserve.model.kernels import cpu_kernels
from nanoserve.model.layers.linear import cpu_prepack_supported
from nanoserve.model.quant import fast_kernels, quantization_error
from tests.core.engine_steps import tiny_engine


@pytest.mark.parametrize(
    ("times", "expected"),
    [
        ({32: (2.0, 1.0), 64: (2.0, 3.0)}, 32),
        ({32: (2.0, 1.0), 64: (3.0, 2.0)}, 64),
        ({32: (1.0, 2.0), 64: (3.0, 1.0)}, 0),  # a win at 64 alone does not count
        ({64: (3.0, 1.0)}, 64),
        ({}, 0),
    ],
)
def test_the_largest_size_won_at_every_smaller_one(times, expected):
    assert step_choice.largest_winning_size(times) == expected


def cpu_kernels_or_skip():
    kernels = cpu_kernels()
    if kernels is None or not fast_kernels(kernels):
        pytest.skip(quantization_error("int4", torch.device("cpu"), kernels) or "no C++ kernels")
    return kernels


@pytest.fixture
def bf16_int4_model(tmp_path):
    """A tiny Llama-shaped bf16 model in int4 on the fused decoder, its weights' limits set to 16 rows."""
    kernels = cpu_kernels_or_skip()
    folder = build_family("qwen3-gqa-tied", tmp_path / "hf")
    engine = tiny_engine(folder, dtype="bfloat16", quantization="int4", matmul_choice="fixed")
    model = engine.runner.model
    assert model is not None and model.fused_decoder is not None
    for weight in model.decoder_quantized_weights():
        weight.max_tokens = 16
    model.use_cpu_kernels(kernels)
    return model, kernels, engine.runner.options.block_size


def test_measuring_leaves_the_model_as_it_was(bf16_int4_model):
    model, kernels, block_size = bf16_int4_model
    decoder = model.fused_decoder
    times = step_choice.measure_steps(model, kernels, torch.bfloat16, block_size, [32, 64])
    assert sorted(times) == [32, 64] and all(0 < t < 10 for pair in times.values() for t in pair)
    assert model.fused_decoder is decoder and not decoder.one_region_at(32)
    assert {w.max_tokens for w in model.decoder_quantized_weights()} == {16}


def test_the_limits_rise_to_the_size_won_measured_once(bf16_int4_model, monkeypatch, tmp_path):
    model, kernels, block_size = bf16_int4_model
    monkeypatch.setattr(step_choice, "cache_file", lambda: tmp_path / "choice.json")
    measured = []

    def measure(model, kernels, dtype, block_size, sizes):
        measured.append(sizes)
        return {32: (2.0, 1.0), 64: (2.0, 3.0)}

    monkeypatch.setattr(step_choice, "measure_steps", measure)
    assert step_choice.choose_quantized_steps(model, kernels, torch.bfloat16, block_size) == 32
    assert measured == [[32, 64]]
    assert {w.max_tokens for w in model.decoder_quantized_weights()} == {32}
    assert model.fused_decoder.one_region_at(32) and not model.fused_decoder.one_region_at(33)
    assert model.quantized_lm_head is None or model.quantized_lm_head.max_tokens != 32

    for weight in model.decoder_quantized_weights():  # a second engine of the same shape
        weight.max_tokens = 16
    assert step_choice.choose_quantized_steps(model, kernels, torch.bfloat16, block_size) == 32
    assert measured == [[32, 64]]  # read from the cache


def test_the_key_tells_models_apart_by_every_weights_limit(bf16_int4_model):
    model, _, _ = bf16_int4_model
    weights = model.decoder_quantized_weights()
    before = step_choice.step_key(model, weights, torch.bfloat16)
    weights[-1].max_tokens = 32  # the last layer's down_proj alone
    assert step_choice.step_key(model, weights, torch.bfloat16) != before
    assert step_choice.step_key(model, weights, torch.float32) != step_choice.step_key(
        model, weights, torch.bfloat16
    )
    # a float32 model over a bf16 cache times its steps apart; over its own dtype, as without one
    float32 = step_choice.step_key(model, weights, torch.float32)
    assert step_choice.step_key(model, weights, torch.float32, torch.float32) == float32
    assert step_choice.step_key(model, weights, torch.float32, torch.bfloat16) != float32


@pytest.mark.parametrize("cpu_kernels", ["auto", "unfused"])
def test_the_limits_do_not_depend_on_the_fused_path(cpu_kernels, monkeypatch, tmp_path):
    """An engine on the fused decode step and one without it run the same matmul at each step size, so
    both get the same tokens: the whole-step choice is made on the fused decoder either way."""
    from nanoserve.model.layers import causal_lm

    kernels = cpu_kernels_or_skip()

    def limits_of_16(shapes):
        for shape in shapes:
            for weight in shape.quantized:
                weight.max_tokens = 16
        return {}

    monkeypatch.setattr(causal_lm, "choose_max_tokens", limits_of_16)
    monkeypatch.setattr(step_choice, "cache_file", lambda: tmp_path / "choice.json")
    monkeypatch.setattr(step_choice, "measure_steps", lambda *args: {32: (2.0, 1.0), 64: (2.0, 3.0)})
    folder = build_family("qwen3-gqa-tied", tmp_path / "hf")
    engine = tiny_engine(folder, dtype="bfloat16", quantization="int4", cpu_kernels=cpu_kernels)
    model = engine.runner.model
    assert model is not None and kernels is not None
    assert {w.max_tokens for w in model.decoder_quantized_weights()} == {32}
    assert (model.fused_decoder is not None) == (cpu_kernels == "auto")


def test_nothing_to_measure_where_every_step_is_quantized(bf16_int4_model, monkeypatch):
    model, kernels, block_size = bf16_int4_model
    for weight in model.decoder_quantized_weights():
        weight.max_tokens = 64

    def measure(*args):
        raise AssertionError("nothing to measure")

    monkeypatch.setattr(step_choice, "measure_steps", measure)
    assert step_choice.choose_quantized_steps(model, kernels, torch.bfloat16, block_size) == 0


def test_bf16_layouts_are_chosen_for_the_steps_int4_leaves_them(monkeypatch, tmp_path):
    """Once whole steps set the limits (32 rows here), each quantized weight's bf16 copy is packed in
    the layout measured for steps from 33 rows, not in the one for every size chosen at load."""
    from nanoserve.model import pack_choice
    from nanoserve.model.layers import causal_lm
    from nanoserve.model.layers.linear import Linear

    cpu_kernels_or_skip()
    if not cpu_prepack_supported(torch.bfloat16, torch.device("cpu")):
        pytest.skip("oneDNN's bf16 packing is not available here: no bf16 copy has a layout")

    def limits_of_16(shapes):
        for shape in shapes:
            for weight in shape.quantized:
                weight.max_tokens = 16
        return {}

    def layout_by_served_size(weights, prefill=True, served_from=1, by_rows=None):
        hint = 32 if served_from == 33 else 1
        return {"batch_hint": hint, "plain_from": 512, "split_from": 1024, "times": {}}

    monkeypatch.setattr(causal_lm, "choose_max_tokens", limits_of_16)
    monkeypatch.setattr(step_choice, "cache_file", lambda: tmp_path / "choice.json")
    monkeypatch.setattr(pack_choice, "cache_file", lambda: tmp_path / "choice.json")
    monkeypatch.setattr(step_choice, "measure_steps", lambda *args: {32: (2.0, 1.0), 64: (2.0, 3.0)})
    monkeypatch.setattr(pack_choice, "measure_layout", layout_by_served_size)
    folder = build_family("qwen3-gqa-tied", tmp_path / "hf")
    engine = tiny_engine(folder, dtype="bfloat16", quantization="int4")
    model = engine.runner.model
    assert model is not None
    quantized = [m for m in model.layers.modules() if isinstance(m, Linear) and m.quantized is not None]
    assert quantized and all(m.quantized.max_tokens == 32 for m in quantized)
    assert {m.batch_hint for m in quantized} == {32}
    assert all(m.packed is not None and m.plain_from == 512 and m.split_from == 1024 for m in quantized)
    assert all(m.by_rows is engine.runner.kernels.packed_linear_by_rows for m in quantized)
    keys = [key for key in step_choice.read_cache(tmp_path / "choice.json") if " layout " in key]
    assert any(" from 33 rows " in key for key in keys) and any(" from 1 rows " in key for key in keys)
