"""The layout of oneDNN's bf16 weights, chosen per CPU and shape (nanoserve/model/pack_choice.py): the
winners read off measured times, the cache, the fixed rule, the same products in every layout, the plain
weight taking the steps from plain_from and the packed one by rows those from split_from
(nanoserve/model/kernels/packed_linear.cpp)."""

from __future__ import annotations

import json
import sys

import pytest
import torch
import torch.nn.functional as F
from quality import CPU

from nanoserve.model import pack_choice
from nanoserve.model.layers import linear
from nanoserve.model.layers.linear import Linear, cpu_prepack_supported, pack_weight, packed_linear
from nanoserve.model.loader import load_model, load_model_config

pytestmark = pytest.mark.skipif(
    not cpu_prepack_supported(torch.bfloat16, CPU), reason="oneDNN's bf16 packing is not available here"
)


def test_winner_is_the_lowest_total_relative_to_the_fastest_at_each_size():
    # hint 1 wins small steps by 10 %, hint 32 the 64-row step by 25 %: relative totals 2.1 against 2.33
    assert pack_choice.best_hint({1: {1: 1.0, 64: 2.0}, 32: {1: 1.1, 64: 1.5}}) == 32
    assert pack_choice.best_hint({1: {1: 1.0, 64: 1.6}, 32: {1: 1.5, 64: 1.5}}) == 1


def test_a_candidate_from_the_size_where_it_stays_faster():
    packed = {128: 1.0, 256: 2.0, 512: 4.0}
    assert pack_choice.faster_from(packed, {128: 1.1, 256: 1.9, 512: 3.5}) == 256
    assert pack_choice.faster_from(packed, {128: 0.9, 256: 2.1, 512: 3.5}) == 512, (
        "a fast point before a slow one"
    )
    assert pack_choice.faster_from(packed, {128: 0.9, 256: 1.9, 512: 3.9}) == 128
    assert pack_choice.faster_from(packed, {128: 0.9, 256: 1.9, 512: 4.1}) == sys.maxsize


def test_by_rows_races_the_faster_of_the_packed_and_the_plain_weight(kernels, monkeypatch):
    """split_from is where running by rows beats both other ways, at that size and every larger one."""
    times = {
        1: {128: 1.0, 256: 2.0, 512: 4.0},
        32: {128: 1.5, 256: 3.0, 512: 6.0},
        "plain": {128: 2.0, 256: 2.5, 512: 3.0},
        "rows 1": {128: 1.2, 256: 2.4, 512: 2.9},
        "rows 32": {128: 0.1, 256: 0.1, 512: 0.1},
    }
    monkeypatch.setattr(
        pack_choice,
        "_best_of_passes",
        lambda candidates, sizes, *args: {
            name: {size: times[name][size] for size in sizes}
            if sizes[0] > 64
            else {size: 1.0 for size in sizes}
            for name in candidates
        },
    )
    weights = [torch.zeros(96, 64, dtype=torch.bfloat16)]
    entry = pack_choice.measure_layout(weights, by_rows=kernels.packed_linear_by_rows)
    assert entry["batch_hint"] == 1 and entry["plain_from"] == 512
    assert entry["split_from"] == 512, "rows 1 beats plain's 3.0 at 512 only (rows 32 is not the layout kept)"
    assert entry["times"]["by_rows"][32] == times["rows 32"]
    assert pack_choice.measure_layout(weights)["split_from"] == sys.maxsize, "no kernels: nothing by rows"


@pytest.mark.parametrize("rows", [1, 37, 512])
def test_by_rows_gives_each_share_of_rows_its_own_products(kernels, rows):
    """packed_linear_by_rows: the products (and bias) of the packed weight, each thread's share of the rows
    multiplied apart from the others', so a row's result does not depend on what the other shares hold."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        generator = torch.Generator().manual_seed(rows)
        weight = torch.randn(96, 64, generator=generator).bfloat16()
        bias = torch.randn(96, generator=generator).bfloat16()
        packed = pack_weight(weight, 32)
        x = torch.randn(rows, 64, generator=generator).bfloat16()
        out = kernels.packed_linear_by_rows(x, packed, bias, 96)
        expected = F.linear(x.float(), weight.float(), bias.float())
        torch.testing.assert_close(out.float(), expected, rtol=1e-2, atol=2e-2)
        first_share = (rows + 1) // 2
        other = torch.cat(
            [x[:first_share], torch.randn(rows - first_share, 64, generator=generator).bfloat16()]
        )
        assert torch.equal(
            kernels.packed_linear_by_rows(other, packed, bias, 96)[:first_share], out[:first_share]
        )
    finally:
        torch.set_num_threads(before)


def test_every_layout_gives_the_products_of_the_plain_weight():
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(96, 64, generator=generator).bfloat16()
    for rows in (1, 16, 64):
        x = torch.randn(rows, 64, generator=generator).bfloat16()
        expected = F.linear(x.float(), weight.float())
        for hint in pack_choice.BATCH_HINTS:
            out = packed_linear(x, pack_weight(weight, hint), None)
            torch.testing.assert_close(out.float(), expected, rtol=1e-2, atol=1e-2)


@pytest.fixture
def choice_file(tmp_path, monkeypatch):
    path = tmp_path / "matmul_choice.json"
    monkeypatch.setattr(pack_choice, "cache_file", lambda: path)
    return path


def _bf16_model(path: str, choice: str):
    return load_model(path, load_model_config(path), torch.bfloat16, CPU, "none", None, choice)


def test_measured_once_then_read_from_the_cache(tiny_gqa_dir, choice_file, monkeypatch):
    model = _bf16_model(str(tiny_gqa_dir), "auto")
    entries = {key: entry for key, entry in json.loads(choice_file.read_text()).items() if " layout " in key}
    shapes = {tuple(m.weight.shape) for m in model.modules() if isinstance(m, Linear)}
    shapes.add(tuple(model.embed_tokens.weight.shape))  # the tied lm_head
    assert len(entries) == len(shapes)
    assert {entry["batch_hint"] for entry in entries.values()} <= set(pack_choice.BATCH_HINTS)
    head = entries[pack_choice.pack_key(tuple(model.embed_tokens.weight.shape), torch.bfloat16)]
    assert head["plain_from"] == sys.maxsize and "prefill" not in head["times"]
    assert all(
        set(entry["times"]["prefill"]) == {str(h) for h in pack_choice.BATCH_HINTS}
        for key, entry in entries.items()
        if key != pack_choice.pack_key(tuple(model.embed_tokens.weight.shape), torch.bfloat16)
    )

    def no_measuring(weights, prefill=True, served_from=1, by_rows=None):
        raise AssertionError(f"measured {tuple(weights[0].shape)} again")

    monkeypatch.setattr(pack_choice, "measure_layout", no_measuring)
    _bf16_model(str(tiny_gqa_dir), "auto")
    monkeypatch.setattr(torch, "get_num_threads", lambda: 7)  # another thread count splits differently
    with pytest.raises(AssertionError, match="measured"):
        _bf16_model(str(tiny_gqa_dir), "auto")


def test_cached_layout_is_the_one_packed_and_fixed_measures_nothing(tiny_gqa_dir, choice_file, monkeypatch):
    hints: dict[tuple[int, int], set[int]] = {}
    prepack = Linear.prepack

    def recording_prepack(self: Linear, batch_hint: int = 1) -> None:
        hints.setdefault(tuple(self.weight.shape), set()).add(batch_hint)
        prepack(self, batch_hint)

    monkeypatch.setattr(Linear, "prepack", recording_prepack)
    _bf16_model(str(tiny_gqa_dir), "fixed")
    assert not choice_file.exists()
    assert hints and all(found == {1} for found in hints.values())

    model = _bf16_model(str(tiny_gqa_dir), "fixed")
    qkv_shape = tuple(model.layers[0].self_attn.qkv_proj.weight.shape)
    cached = {
        pack_choice.pack_key(shape, torch.bfloat16): {
            "batch_hint": 1,
            "plain_from": sys.maxsize,
            "split_from": sys.maxsize,
            "times": {},
        }
        for shape in hints
    }
    cached[pack_choice.pack_key(qkv_shape, torch.bfloat16)] |= {"batch_hint": 32, "plain_from": 128}
    embed_shape = tuple(model.embed_tokens.weight.shape)
    cached[pack_choice.pack_key(embed_shape, torch.bfloat16)] = {
        "batch_hint": 1,
        "plain_from": sys.maxsize,
        "split_from": sys.maxsize,
    }
    choice_file.write_text(json.dumps(cached))
    hints.clear()
    model = _bf16_model(str(tiny_gqa_dir), "auto")
    assert hints.pop(qkv_shape) == {32}
    assert all(found == {1} for found in hints.values())
    qkv = model.layers[0].self_attn.qkv_proj
    assert qkv.plain_from == 128 and model.layers[0].mlp.down_proj.plain_from == sys.maxsize
    calls = []
    monkeypatch.setattr(linear, "packed_linear", lambda *args: calls.append("packed") or packed_linear(*args))
    plain = F.linear
    monkeypatch.setattr(linear.F, "linear", lambda *args: calls.append("plain") or plain(*args))
    with torch.inference_mode():
        for rows in (127, 128):
            x = torch.randn(rows, qkv.in_features).bfloat16()
            out = qkv(x)
            torch.testing.assert_close(
                out, (x.float() @ qkv.weight.float().T).bfloat16(), rtol=1e-2, atol=1e-2
            )
    assert calls == ["packed", "plain"]


def test_a_layout_is_timed_at_the_steps_it_serves(choice_file):
    """Where a quantized copy takes the steps up to 32 rows, the layouts race at 64 rows and at prefill
    sizes only, over several weights (one weight repeated would stay in the caches); where it takes up
    to 199, at the prefill sizes from 200 on."""
    generator = torch.Generator().manual_seed(0)
    weights = [torch.randn(96, 64, generator=generator).bfloat16() for _ in range(3)]
    entry = pack_choice.measure_layout(weights, served_from=33)
    for hint in pack_choice.BATCH_HINTS:
        assert set(entry["times"]["decode"][hint]) == {64}
        assert set(entry["times"]["prefill"][hint]) == set(pack_choice.PREFILL_STEP_SIZES)
    assert entry["batch_hint"] in pack_choice.BATCH_HINTS
    everything = pack_choice.measure_layout(weights)
    assert set(everything["times"]["decode"][1]) == set(pack_choice.STEP_SIZES)
    large_only = pack_choice.measure_layout(weights, served_from=200)
    assert large_only["times"]["decode"] == {}
    assert set(large_only["times"]["prefill"][1]) == {256, 512}
    past_prefill = pack_choice.measure_layout(weights, served_from=513)
    assert set(past_prefill["times"]["prefill"][1]) == {512}, "the largest prefill size stands in"
    head = pack_choice.measure_layout(weights, prefill=False, served_from=65)
    assert head["batch_hint"] == pack_choice.BATCH_HINTS[0] and head["plain_from"] == sys.maxsize


def test_linear_runs_by_rows_from_split_from(kernels, monkeypatch):
    layer = Linear(64, 96, bias=True).bfloat16()
    layer.prepack(32)
    layer.plain_from, layer.split_from = 256, 128
    calls = []
    layer.by_rows = lambda *args: calls.append("rows") or kernels.packed_linear_by_rows(*args)
    monkeypatch.setattr(linear, "packed_linear", lambda *args: calls.append("packed") or packed_linear(*args))
    with torch.inference_mode():
        for rows in (127, 128, 300):
            x = torch.randn(rows, 64).bfloat16()
            expected = F.linear(x.float(), layer.weight.float(), layer.bias.float())
            torch.testing.assert_close(layer(x).float(), expected, rtol=1e-2, atol=2e-2)
    assert calls == ["packed", "rows", "rows"], "by rows from split_from on, past plain_from too"


def test_the_fused_decoders_matmul_makes_the_same_choice_by_rows(kernels):
    """FusedMatmul (the fused decoder's twin of a Linear) runs by rows from the same split_from and so gives
    the Linear's bits; on SmolLM2's qkv shape oneDNN's two-thread call and the rows' one-thread calls round
    differently at some sizes, so a twin that ignored split_from would not."""
    from nanoserve.model.layers.fused_decoder import fused_matmul

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        layer = Linear(576, 960, bias=False).bfloat16()
        layer.prepack(32)
        layer.split_from, layer.by_rows = 100, kernels.packed_linear_by_rows
        twin = fused_matmul(kernels, layer)
        generator = torch.Generator().manual_seed(0)
        with torch.inference_mode():
            for rows in (37, 512, 1000):
                x = torch.randn(rows, 576, generator=generator).bfloat16()
                assert torch.equal(twin(x), layer(x)), rows
    finally:
        torch.set_num_threads(before)
