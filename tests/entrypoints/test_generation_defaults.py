"""A model's generation_config.json: its sampling fields are the defaults of LLM.generate without
SamplingParams and of server requests that leave them out (as vLLM does), and its EOS ids end requests."""

from __future__ import annotations

import shutil
from types import SimpleNamespace

import pytest

from nanoserve.entrypoints.llm import LLM
from nanoserve.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from nanoserve.entrypoints.openai.serving import OpenAIServing
from nanoserve.sampling_params import SamplingParams

DEFAULTS = {"temperature": 0.6, "top_p": 0.9, "max_tokens": 5}
"""As nanoserve.model_files.generation_defaults reads them from a Llama 3 style generation_config.json."""


@pytest.fixture(scope="module")
def llm(tmp_path_factory, tiny_gqa_dir):
    folder = tmp_path_factory.mktemp("defaults") / "model"
    shutil.copytree(tiny_gqa_dir, folder)
    (folder / "generation_config.json").write_text(
        '{"eos_token_id": [7, 9], "temperature": 0.0, "max_new_tokens": 5, "top_k": 3}'
    )
    with LLM(model=str(folder), dtype="float32", max_model_len=64, multiprocess_mode=False) as llm:
        yield llm


def test_llm_takes_the_models_defaults(llm):
    assert llm.get_default_sampling_params() == SamplingParams(temperature=0.0, max_tokens=5, top_k=3)
    (out,) = llm.generate("Hello", use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 5 and out.outputs[0].finish_reason == "length"
    (explicit,) = llm.generate("Hello", SamplingParams(max_tokens=2, temperature=0.0), use_tqdm=False)
    assert len(explicit.outputs[0].token_ids) == 2


def test_requests_carry_every_eos_id(llm):
    tokenizer = llm.get_tokenizer()
    assert llm.llm_engine.processor.eos_token_ids == (tokenizer.eos_token_id, 7, 9)


def test_server_requests_take_the_defaults_they_leave_out():
    messages = [{"role": "user", "content": "hi"}]
    absent = ChatCompletionRequest(messages=messages).to_sampling_params(None, DEFAULTS)
    assert (absent.temperature, absent.top_p, absent.top_k) == (0.6, 0.9, 0)
    given = ChatCompletionRequest(messages=messages, temperature=0.2, top_p=None).to_sampling_params(
        None, DEFAULTS
    )
    assert (given.temperature, given.top_p) == (0.2, 0.9)
    assert CompletionRequest(prompt="x").to_sampling_params(16).temperature == 1.0  # no model defaults


def test_server_max_tokens_default_comes_from_the_model():
    engine = SimpleNamespace(max_model_len=64, generation_defaults=DEFAULTS, tokenizer=SimpleNamespace())
    serving = OpenAIServing(engine, "m")
    chat = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}])
    assert serving.fit_max_tokens(chat, 10) == 5
    assert serving.fit_max_tokens(CompletionRequest(prompt="x", max_tokens=9), 10) == 9
    assert serving.fit_max_tokens(CompletionRequest(prompt="x"), 62) == 2  # capped by the room left
