"""GGUF files of the families GGUF defines, written as llama.cpp's converter writes them (gguf_files.py),
load to the config and the weights of the HF folder they came from."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from families import build_family
from gguf_files import write_gguf

from nanoserve.model.loader import load_model, load_model_config

GGUF_SHAPES = (
    "qwen3-gqa-tied",
    "phi3-window-short",
    "phi4-partial-rotary",
    "gemma2-gqa",
    "gemma3",
    "mixtral",
    "qwen3-moe",
)
"""Shapes a GGUF can describe: llama.cpp's Gemma 2 is tied and scales queries by head_dim, its Qwen MoEs have
no dense layers."""
FLOATS = ("rms_norm_eps", "rope_theta", "local_rope_theta", "attn_scale", "attn_softcap", "final_softcap")
"""GGUF stores float32."""


@pytest.fixture(scope="module", params=GGUF_SHAPES)
def folder_and_gguf(request, tmp_path_factory):
    folder = build_family(request.param, tmp_path_factory.mktemp(request.param))
    return folder, write_gguf(folder, tmp_path_factory.mktemp("gguf") / f"{request.param}-F32.gguf")


def test_gguf_config_equals_the_folders(folder_and_gguf):
    folder, gguf_path = folder_and_gguf
    from_hf, from_gguf = load_model_config(str(folder)), load_model_config(str(gguf_path))
    ours, theirs = dataclasses.asdict(from_gguf), dataclasses.asdict(from_hf)
    gguf_scaling, hf_scaling = ours.pop("rope_scaling"), theirs.pop("rope_scaling")
    ours.pop("name"), theirs.pop("name")  # the GGUF's file stem is the folder's, plus -F32
    for key in FLOATS:
        got, want = ours.pop(key), theirs.pop(key)
        assert got == (None if want is None else pytest.approx(want, rel=1e-6)), key
    assert ours == theirs
    if hf_scaling is None:
        assert gguf_scaling is None
    else:
        assert gguf_scaling.keys() <= hf_scaling.keys()
        for key, value in gguf_scaling.items():
            expected = hf_scaling[key]
            assert value == (expected if isinstance(expected, str) else pytest.approx(expected)), key


def test_gguf_weights_equal_the_folders(folder_and_gguf):
    folder, gguf_path = folder_and_gguf
    cpu = torch.device("cpu")
    from_hf = load_model(str(folder), load_model_config(str(folder)), torch.float32, cpu).state_dict()
    from_gguf = load_model(str(gguf_path), load_model_config(str(gguf_path)), torch.float32, cpu).state_dict()
    assert from_gguf.keys() == from_hf.keys()
    for name, tensor in from_hf.items():
        torch.testing.assert_close(from_gguf[name], tensor, atol=0, rtol=0, msg=name)
