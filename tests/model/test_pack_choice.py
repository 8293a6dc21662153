"""The layout of oneDNN's bf16 weights, chosen per CPU and shape (nanoserve/model/pack_choice.py): the
winners read off measured times, the cache, the fixed rule, the same products in every layout, and the
plain weight taking the steps from plain_from."""

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


def test_plain_weight_from_the_size_where_it_stays_faster():
    packed = {128: 1.0, 256: 2.0, 512: 4.0}
    assert pack_choice.plain_from(packed, {128: 1.1, 256: 1.9, 512: 3.5}) == 256
    assert pack_choice.plain_from(packed, {128: 0.9, 256: 2.1, 512: 3.5}) == 512, (
        "a fast point before a slow one"
    )
    assert pack_choice.plain_from(packed, {128: 0.9, 256: 1.9, 512: 3.9}) == 128
    assert pack_choice.plain_from(packed, {128: 0.9, 256: 1.9, 512: 4.1}) == sys.maxsize


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

    def no_measuring(weights, prefill=True, served_from=1):
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
        pack_choice.pack_key(shape, torch.bfloat16): {"batch_hint": 1, "plain_from": sys.maxsize, "times": {}}
        for shape in hints
    }
    cached[pack_choice.pack_key(qkv_shape, torch.bfloat16)] |= {"batch_hint": 32, "plain_from": 128}
    embed_shape = tuple(model.embed_tokens.weight.shape)
    cached[pack_choice.pack_key(embed_shape, torch.bfloat16)] = {"batch_hint": 1, "plain_from": sys.maxsize}
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
