"""The bundled SmolLM2-135M-Instruct GGUF end to end: nanoserve's greedy tokens equal transformers'.

Compared in float32: in bf16 different kernels legitimately pick different tokens on near ties.
"""

from __future__ import annotations

import pytest
import torch

from nanoserve import LLM, SamplingParams

NEW_TOKENS = 24
CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Write one sentence about the sea."}],
]
PROMPTS = ["The history of the city began", "def fibonacci(n):"]


@pytest.fixture(scope="module")
def llm(bundled_gguf_path):
    with LLM(model=bundled_gguf_path, dtype="float32", multiprocess_mode=False) as llm:
        yield llm


def hf_greedy(model, prompt_ids: list[int]) -> list[int]:
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt_ids]), max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=2
        )
    return out[0, len(prompt_ids) :].tolist()


@pytest.mark.timeout(300)
def test_greedy_ids_match_transformers(llm, hf_bundled_model):
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS)
    outputs = llm.chat(CHATS, params, use_tqdm=False) + llm.generate(PROMPTS, params, use_tqdm=False)
    for out in outputs:
        expected = hf_greedy(hf_bundled_model, out.prompt_token_ids)
        if expected and expected[-1] == 2:  # both keep the EOS token they stopped on
            assert out.outputs[0].finish_reason == "stop"
        assert out.outputs[0].token_ids == expected, out.prompt
    assert outputs[0].outputs[0].text == "The capital of France is Paris."


@pytest.mark.timeout(300)
def test_speculative_greedy_ids_match_transformers(bundled_gguf_path, hf_bundled_model):
    """n-gram speculation on a reply that quotes its prompt: drafts are accepted, and the ids are still
    transformers' plain greedy ids."""
    from nanoserve.bench.speculative import draft_counts, summary_prompt

    with LLM(model=bundled_gguf_path, dtype="float32", multiprocess_mode=False, speculative="ngram") as llm:
        prompt = summary_prompt(llm.get_tokenizer())
        params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
        (out,) = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)
        num_drafts, num_accepted = draft_counts(llm)
    with torch.no_grad():
        expected = hf_bundled_model.generate(
            torch.tensor([prompt]),
            max_new_tokens=NEW_TOKENS,
            min_new_tokens=NEW_TOKENS,
            do_sample=False,
            pad_token_id=2,
        )[0, len(prompt) :].tolist()
    assert out.outputs[0].token_ids == expected
    assert 0 < num_accepted <= num_drafts
