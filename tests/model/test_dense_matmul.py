"""float32 matmuls of small steps on the C++ dense_matmul (nanoserve/model/kernels/dense_matmul.cpp): its
products against float64, its bias added as torch adds it, and the step sizes it serves, fixed or
measured per CPU and shape (nanoserve/model/pack_choice.py) and cached. The model tests in float32
(transformers token for token, the fused decode step) run through it as well."""

from __future__ import annotations

import json
import sys

import pytest
import torch
import torch.nn.functional as F
from quality import CPU

from nanoserve.model import pack_choice
from nanoserve.model.layers.linear import Linear
from nanoserve.model.loader import load_model, load_model_config


@pytest.fixture(params=[1, 2])
def threads(request):
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


@pytest.mark.parametrize(
    "n, k",
    [(96, 64), (97, 61), (5, 1536), (3, 7), (576, 576)],
    ids=["tiles", "column-and-input-tails", "fewer-columns-than-threads", "under-one-vector", "smollm2"],
)
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 9, 70])
def test_products_match_float64(kernels, threads, n, k, rows):
    generator = torch.Generator().manual_seed(rows * 1000 + n)
    weight = torch.randn(n, k, generator=generator)
    x = torch.randn(rows, k, generator=generator)
    out = kernels.dense_matmul(x, weight, None)
    expected = x.double() @ weight.double().T
    assert out.dtype == torch.float32 and out.shape == (rows, n)
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5 * k**0.5)


def test_bias_is_added_as_torch_adds_it(kernels):
    generator = torch.Generator().manual_seed(1)
    weight, bias = torch.randn(40, 32, generator=generator), torch.randn(40, generator=generator)
    x = torch.randn(6, 32, generator=generator)[::2]  # a strided x is read as its contiguous copy
    assert torch.equal(kernels.dense_matmul(x, weight, bias), kernels.dense_matmul(x, weight, None) + bias)


def test_other_dtypes_are_refused(kernels):
    weight = torch.randn(16, 32)
    with pytest.raises(RuntimeError, match="dense_matmul: float32"):
        kernels.dense_matmul(torch.randn(2, 32).bfloat16(), weight.bfloat16(), None)
    with pytest.raises(RuntimeError, match="dense_matmul: x"):
        kernels.dense_matmul(torch.randn(2, 16), weight, None)


@pytest.fixture
def choice_file(tmp_path, monkeypatch):
    path = tmp_path / "matmul_choice.json"
    monkeypatch.setattr(pack_choice, "cache_file", lambda: path)
    return path


def _model(path: str, choice: str, kernels, dtype=torch.float32):
    return load_model(path, load_model_config(path), dtype, CPU, "none", kernels, choice)


def test_fixed_choice_serves_steps_under_the_limit(tiny_gqa_dir, choice_file, kernels, monkeypatch):
    model = _model(str(tiny_gqa_dir), "fixed", kernels)
    assert not choice_file.exists()
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    assert linears and all(
        m.dense is not None and m.plain_from == pack_choice.DENSE_PLAIN_FROM for m in linears
    )
    assert model.dense_embed is not None and model.embed_plain_from == pack_choice.DENSE_PLAIN_FROM
    calls = []
    plain = F.linear
    monkeypatch.setattr(F, "linear", lambda *args: calls.append("plain") or plain(*args))
    qkv = model.layers[0].self_attn.qkv_proj
    dense = qkv.dense
    assert dense is not None
    qkv.dense = model.dense_embed = lambda *args: calls.append("dense") or dense(*args)
    limit = pack_choice.DENSE_PLAIN_FROM
    with torch.inference_mode():
        for rows in (1, limit - 1, limit):
            x = torch.randn(rows, qkv.in_features)
            torch.testing.assert_close(qkv(x), x @ qkv.weight.T, rtol=1e-5, atol=1e-5)
            hidden = torch.randn(rows, model.config.hidden_size)
            logits = model.compute_logits(hidden)
            torch.testing.assert_close(logits, hidden @ model.embed_tokens.weight.T, rtol=1e-5, atol=1e-5)
    assert calls == ["dense"] * 4 + ["plain"] * 2, "qkv and the tied lm_head, at 1, 63 and 64 rows"


def test_choice_measured_once_then_read_from_the_cache(tiny_gqa_dir, choice_file, kernels, monkeypatch):
    model = _model(str(tiny_gqa_dir), "auto", kernels)
    entries = {key: entry for key, entry in json.loads(choice_file.read_text()).items() if " dense " in key}
    shapes = {tuple(m.weight.shape) for m in model.modules() if isinstance(m, Linear)}
    shapes.add(tuple(model.embed_tokens.weight.shape))
    assert len(entries) == len(shapes)
    head_shape = tuple(model.embed_tokens.weight.shape)
    head = entries[pack_choice.pack_key(head_shape, torch.float32, "dense")]
    assert set(head["times"]["dense"]) == {str(size) for size in pack_choice.DENSE_STEP_SIZES}
    qkv = model.layers[0].self_attn.qkv_proj
    qkv_entry = entries[pack_choice.pack_key(tuple(qkv.weight.shape), torch.float32, "dense")]
    assert qkv.plain_from == qkv_entry["plain_from"] and model.embed_plain_from == head["plain_from"]

    def no_measuring(weights, kernel, prefill=True):
        raise AssertionError(f"measured {tuple(weights[0].shape)} again")

    monkeypatch.setattr(pack_choice, "measure_dense", no_measuring)
    _model(str(tiny_gqa_dir), "auto", kernels)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 7)
    with pytest.raises(AssertionError, match="measured"):
        _model(str(tiny_gqa_dir), "auto", kernels)


def test_limit_is_where_the_plain_matmul_stays_faster():
    dense = {1: 1.0, 4: 2.0, 16: 4.0, 64: 8.0}
    assert pack_choice.plain_from(dense, {1: 2.0, 4: 3.0, 16: 3.9, 64: 7.0}) == 16
    assert pack_choice.plain_from(dense, {1: 2.0, 4: 3.0, 16: 5.0, 64: 9.0}) == sys.maxsize


def test_without_kernels_or_in_bf16_steps_stay_on_torch(tiny_gqa_dir, kernels):
    for model in (
        _model(str(tiny_gqa_dir), "fixed", None),
        _model(str(tiny_gqa_dir), "fixed", kernels, torch.bfloat16),
    ):
        assert model.dense_embed is None
        assert all(m.dense is None for m in model.modules() if isinstance(m, Linear))
