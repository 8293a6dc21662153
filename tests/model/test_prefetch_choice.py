"""How far ahead quant_matmul prefetches weights (nanoserve.model.prefetch_choice): the distance changes no
result, is measured once per machine and then read from the cache, and engines set it as matmul_choice says."""

from __future__ import annotations

import pytest
import torch
from families import build_family

from nanoserve.model import prefetch_choice
from nanoserve.model.kernels import cpu_kernels
from nanoserve.model.quant import (
    GroupQuantWeight,
    fast_kernels,
    group_codes,
    pack_groups,
    quantization_error,
    symmetric_codes,
)
from tests.core.engine_steps import tiny_engine


@pytest.fixture
def kernels():
    """The C++ kernels with quant_matmul, their prefetch distance put back to the default afterwards."""
    kernels = cpu_kernels()
    if kernels is None or not fast_kernels(kernels):
        pytest.skip(quantization_error("int4", torch.device("cpu"), kernels) or "no C++ kernels")
    kernels.set_weight_prefetch_bytes(prefetch_choice.DEFAULT_DISTANCE)  # an earlier engine may have set it
    yield kernels
    kernels.set_weight_prefetch_bytes(prefetch_choice.DEFAULT_DISTANCE)


@pytest.mark.parametrize("layout", ["4 bits", "8 bits", "8 bits symmetric"])
@pytest.mark.parametrize("rows", [1, 3, 70])
def test_every_distance_gives_the_same_bits(kernels, layout, rows):
    weight = torch.randn(96, 576) * 0.05
    codes = symmetric_codes(weight) if layout == "8 bits symmetric" else group_codes(weight, int(layout[0]))
    assert codes is not None
    packed = pack_groups(codes, kernels.quant_matmul)
    assert packed is not None
    x = torch.randn(rows, 576)
    kernels.set_weight_prefetch_bytes(prefetch_choice.DEFAULT_DISTANCE)
    reference = packed.matmul(x)
    for distance in (0, 512, 1024, 2048, 65536):
        kernels.set_weight_prefetch_bytes(distance)
        assert kernels.weight_prefetch_bytes() == distance
        assert torch.equal(packed.matmul(x), reference), distance


@pytest.mark.parametrize("distance", [-512, 100, 1000, 65536 + 512])
def test_a_distance_outside_whole_groups_or_past_64_kib_is_refused(kernels, distance):
    with pytest.raises(ValueError, match="multiples of 512 bytes"):
        kernels.set_weight_prefetch_bytes(distance)
    assert kernels.weight_prefetch_bytes() == prefetch_choice.DEFAULT_DISTANCE


@pytest.fixture
def any_size_measured(monkeypatch, tmp_path):
    """A scratch cache, and a tiny model's weights treated as if they left the caches."""
    monkeypatch.setattr(prefetch_choice, "cache_file", lambda: tmp_path / "choice.json")
    monkeypatch.setattr(prefetch_choice, "MIN_STREAMED_BYTES", 0)
    monkeypatch.setattr(prefetch_choice, "largest_cache_bytes", lambda: 0)


@pytest.fixture
def int4_model(kernels, tmp_path):
    folder = build_family("qwen3-gqa-tied", tmp_path / "hf")
    engine = tiny_engine(folder, quantization="int4", matmul_choice="fixed")
    model = engine.runner.model
    assert model is not None and prefetch_choice.streamed_weights(model)
    return model


def test_the_measurement_times_every_distance_and_leaves_the_setting(kernels, int4_model):
    kernels.set_weight_prefetch_bytes(512)
    weights = prefetch_choice.streamed_weights(int4_model)
    relative = prefetch_choice.measure_distances(weights, kernels, torch.float32)
    assert sorted(relative) == sorted(prefetch_choice.DISTANCES)
    assert all(0.2 < r < 5 for r in relative.values())
    assert kernels.weight_prefetch_bytes() == 512


def test_the_fastest_distance_is_chosen_and_measured_once(
    kernels, int4_model, any_size_measured, monkeypatch
):
    measured = []

    def measure(weights, kernels, dtype):
        measured.append(len(weights))
        return {1024: 1.01, 2048: 0.97, 4096: 1.02}

    monkeypatch.setattr(prefetch_choice, "measure_distances", measure)
    assert prefetch_choice.choose_weight_prefetch(int4_model, kernels, torch.float32) == 2048
    assert kernels.weight_prefetch_bytes() == 2048 and len(measured) == 1
    kernels.set_weight_prefetch_bytes(prefetch_choice.DEFAULT_DISTANCE)  # a second engine on this machine
    assert prefetch_choice.choose_weight_prefetch(int4_model, kernels, torch.float32) == 2048
    assert kernels.weight_prefetch_bytes() == 2048 and len(measured) == 1  # read from the cache


def test_a_pass_streams_the_weights_in_step_order_up_to_its_bytes(int4_model, monkeypatch):
    everything = prefetch_choice.streamed_weights(int4_model)
    assert everything == [w for w in int4_model.quantized_weights() if isinstance(w, GroupQuantWeight)]
    assert everything[0].in_features == int4_model.config.hidden_size  # the first layer's qkv
    monkeypatch.setattr(prefetch_choice, "STREAMED_BYTES", everything[0].nbytes + everything[1].nbytes)
    assert prefetch_choice.streamed_weights(int4_model) == everything[:2]


def test_a_small_model_runs_at_the_distance_a_large_one_measured(
    kernels, int4_model, any_size_measured, monkeypatch
):
    monkeypatch.setattr(prefetch_choice, "measure_distances", lambda *args: {1024: 0.9, 2048: 1.0, 4096: 1.1})
    prefetch_choice.choose_weight_prefetch(
        int4_model, kernels, torch.float32
    )  # a model larger than the caches
    monkeypatch.setattr(prefetch_choice, "MIN_STREAMED_BYTES", 1 << 40)
    monkeypatch.setattr(prefetch_choice, "measure_distances", lambda *args: pytest.fail("measured"))
    kernels.set_weight_prefetch_bytes(prefetch_choice.DEFAULT_DISTANCE)
    assert prefetch_choice.choose_weight_prefetch(int4_model, kernels, torch.float32) == 1024


def test_weights_within_twice_the_largest_cache_are_not_measured(
    kernels, int4_model, any_size_measured, monkeypatch
):
    weight_bytes = sum(w.nbytes for w in prefetch_choice.streamed_weights(int4_model))
    monkeypatch.setattr(prefetch_choice, "largest_cache_bytes", lambda: weight_bytes)
    monkeypatch.setattr(prefetch_choice, "measure_distances", lambda *args: pytest.fail("measured"))
    assert prefetch_choice.choose_weight_prefetch(int4_model, kernels, torch.float32) == 4096


def test_the_largest_cache_is_read_as_linux_lists_it(tmp_path):
    for index, size in enumerate(["32K", "32K", "512K", "32768K", "not a size"]):
        (tmp_path / f"index{index}").mkdir()
        (tmp_path / f"index{index}" / "size").write_text(size + "\n")
    assert prefetch_choice.largest_cache_bytes(tmp_path) == 32 << 20
    assert prefetch_choice.largest_cache_bytes(tmp_path / "absent") == 0


def test_weights_that_stay_in_the_caches_are_not_measured(kernels, int4_model, monkeypatch, tmp_path):
    """A tiny model's weights stay cached from pass to pass: it keeps the default and caches nothing, so
    that a larger model on the same machine measures the distance for both."""
    monkeypatch.setattr(prefetch_choice, "cache_file", lambda: tmp_path / "choice.json")
    monkeypatch.setattr(prefetch_choice, "measure_distances", lambda *args: pytest.fail("measured"))
    kernels.set_weight_prefetch_bytes(1024)
    assert prefetch_choice.choose_weight_prefetch(int4_model, kernels, torch.float32) == 4096
    assert kernels.weight_prefetch_bytes() == 4096 and not (tmp_path / "choice.json").exists()


@pytest.mark.parametrize(("matmul_choice", "expected"), [("auto", 1024), ("fixed", 4096)])
def test_engines_set_the_distance_as_matmul_choice_says(
    kernels, matmul_choice, expected, any_size_measured, monkeypatch, tmp_path
):
    monkeypatch.setattr(prefetch_choice, "measure_distances", lambda *args: {1024: 0.9, 2048: 1.0, 4096: 1.1})
    kernels.set_weight_prefetch_bytes(2048)
    tiny_engine(
        build_family("qwen3-gqa-tied", tmp_path / "hf"), quantization="int4", matmul_choice=matmul_choice
    )
    assert kernels.weight_prefetch_bytes() == expected
