"""float32 matmuls on the C++ dense_matmul (nanoserve/model/kernels/dense_matmul.cpp): its products against
float64, its bias added as torch adds it, a row's result the same bits whatever rows share its step, and
every step of a float32 model on it. The model tests in float32 (transformers token for token, the fused
decode step) run through it as well."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from quality import CPU

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


def test_a_rows_result_does_not_depend_on_the_rows_beside_it(kernels, threads):
    generator = torch.Generator().manual_seed(2)
    weight = torch.randn(37, 72, generator=generator)
    x = torch.randn(70, 72, generator=generator)
    together = kernels.dense_matmul(x, weight, None)
    for start, stop in ((0, 1), (5, 6), (3, 5), (10, 13), (20, 24), (30, 39), (1, 70)):
        assert torch.equal(kernels.dense_matmul(x[start:stop], weight, None), together[start:stop]), (
            start,
            stop,
        )


def _model(path: str, kernels, dtype=torch.float32):
    return load_model(path, load_model_config(path), dtype, CPU, "none", kernels, "fixed")


def test_float32_model_runs_every_step_on_it(tiny_gqa_dir, kernels, monkeypatch):
    model = _model(str(tiny_gqa_dir), kernels)
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    assert linears and all(m.dense is not None for m in linears) and model.dense_embed is not None
    calls = []
    plain = F.linear
    monkeypatch.setattr(F, "linear", lambda *args: calls.append("plain") or plain(*args))
    qkv = model.layers[0].self_attn.qkv_proj
    dense = qkv.dense
    assert dense is not None
    qkv.dense = model.dense_embed = lambda *args: calls.append("dense") or dense(*args)
    with torch.inference_mode():
        for rows in (1, 64, 512):
            x = torch.randn(rows, qkv.in_features)
            torch.testing.assert_close(qkv(x), x @ qkv.weight.T, rtol=1e-5, atol=1e-5)
            hidden = torch.randn(rows, model.config.hidden_size)
            logits = model.compute_logits(hidden)
            torch.testing.assert_close(logits, hidden @ model.embed_tokens.weight.T, rtol=1e-5, atol=1e-5)
    assert calls == ["dense"] * 6, "qkv and the tied lm_head at 1, 64 and 512 rows"


def test_without_kernels_or_in_bf16_steps_stay_on_torch(tiny_gqa_dir, kernels):
    for model in (
        _model(str(tiny_gqa_dir), None),
        _model(str(tiny_gqa_dir), kernels, torch.bfloat16),
    ):
        assert model.dense_embed is None
        assert all(m.dense is None for m in model.modules() if isinstance(m, Linear))
