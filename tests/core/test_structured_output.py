"""Structured outputs and prompt logprobs in the engine core, on a tiny random Llama: outputs validate
across seeds in mixed batches, under chunked prefill and preemption; prompt logprobs equal
transformers' log-softmax, with chunked prefill and a warm prefix cache."""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch

from nanoserve.sampling_params import StructuredOutputsParams
from nanoserve.wire.messages import FinishReason
from tests.core.test_engine_core import make_prompts, request, run_to_completion, tiny_engine

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "pet": {"enum": ["cat", "dog"]},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "pet", "ok"],
    "additionalProperties": False,
}


def decode(tokenizer, token_ids: list[int]) -> str:
    return tokenizer.decode(token_ids, skip_special_tokens=True)


@pytest.fixture(scope="module")
def tokenizer(tokenizer_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tokenizer_dir)


def structured(rid: str, prompt: list[int], **params):
    return request(
        rid, prompt, structured_outputs=StructuredOutputsParams(json=SCHEMA), max_tokens=80, **params
    )


@pytest.mark.parametrize("engine_options", [{}, {"num_kv_blocks": 40, "max_num_batched_tokens": 16}])
def test_json_outputs_validate_in_mixed_batches(tiny_gqa_dir, tokenizer, engine_options):
    """The second case preempts (40 blocks of 4 tokens for 12 sequences) and prefills in chunks."""
    engine = tiny_engine(tiny_gqa_dir, **engine_options)
    prompts = make_prompts(12, seed=3)
    for i, prompt in enumerate(prompts):
        if i % 3 == 2:
            engine.add_request(request(f"plain{i}", prompt, temperature=1.0, seed=i, max_tokens=30))
        else:
            engine.add_request(structured(f"json{i}", prompt, temperature=1.0, seed=i, ignore_eos=False))
    preemptions = 0
    results: dict[str, list] = {}
    while engine.has_work():
        out = engine.step()
        preemptions = max(preemptions, out.scheduler_stats.num_preemptions)
        for o in out.outputs:
            entry = results.setdefault(o.request_id, [[], None])
            entry[0].extend(o.new_token_ids)
            entry[1] = o.finish_reason if o.finish_reason is not None else entry[1]
    if engine_options:
        assert preemptions > 0
    texts = set()
    for rid, (tokens, reason) in results.items():
        if rid.startswith("json"):
            assert reason == FinishReason.STOP, rid
            jsonschema.validate(json.loads(decode(tokenizer, tokens)), SCHEMA)
            texts.add(decode(tokenizer, tokens))
        else:
            assert reason == FinishReason.LENGTH and len(tokens) == 30
    assert len(texts) > 1, "different seeds should give different objects"


def test_greedy_structured_output_survives_preemption(tiny_gqa_dir):
    prompts = make_prompts(6, seed=4)
    runs = []
    for options in ({}, {"num_kv_blocks": 24, "max_num_batched_tokens": 8}):
        engine = tiny_engine(tiny_gqa_dir, **options)
        for i, prompt in enumerate(prompts):
            engine.add_request(structured(str(i), prompt))
        runs.append({rid: r[0] for rid, r in run_to_completion(engine).items()})
    assert runs[0] == runs[1]


def test_a_grammar_the_engine_cannot_compile_fails_only_its_request(tiny_gqa_dir):
    engine = tiny_engine(tiny_gqa_dir)
    prompt = make_prompts(1)[0]
    engine.add_request(request("bad", prompt, structured_outputs=StructuredOutputsParams(regex="a(b")))
    engine.add_request(request("good", prompt))
    results = run_to_completion(engine)
    assert results["bad"][1] == FinishReason.ERROR and "regex" in results["bad"][2]
    assert results["good"][1] == FinishReason.LENGTH


def hf_prompt_logprobs(model_dir, prompt: list[int]) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)  # [len(prompt), vocab]: row p predicts token p + 1


def test_prompt_logprobs_match_transformers(tiny_gqa_dir):
    prompt = make_prompts(1, seed=5, lengths=(37,))[0]
    expected = hf_prompt_logprobs(tiny_gqa_dir, prompt)
    # 8-token chunks; the first request warms the prefix cache the second must not take
    engine = tiny_engine(tiny_gqa_dir, max_num_batched_tokens=8)
    engine.add_request(request("warm", prompt, max_tokens=2))
    run_to_completion(engine)
    engine.add_request(request("a", prompt, max_tokens=2, prompt_logprobs=3))
    outputs = []
    while engine.has_work():
        outputs.extend(o for o in engine.step().outputs if o.request_id == "a")
    first = outputs[0]
    assert first.num_cached_tokens == 0
    assert first.prompt_logprobs is not None and len(first.prompt_logprobs) == len(prompt) - 1
    assert all(o.prompt_logprobs is None for o in outputs[1:])
    for p, entries in enumerate(first.prompt_logprobs):
        (token, lp), top = entries[0], entries[1:]
        assert token == prompt[p + 1]
        assert lp == pytest.approx(expected[p, token].item(), abs=1e-4)
        top_lp, top_ids = expected[p].topk(3)
        assert [t for t, _ in top] == top_ids.tolist()
        assert [v for _, v in top] == pytest.approx(top_lp.tolist(), abs=1e-4)


def test_prompt_logprobs_of_a_prompt_behind_another_in_its_step(tiny_gqa_dir):
    """Both prompts are computed in one step, the one with prompt logprobs second: its rows of the step's
    hidden states start where the first prompt's end."""
    before, prompt = make_prompts(2, seed=7, lengths=(11, 13))
    expected = hf_prompt_logprobs(tiny_gqa_dir, prompt)
    engine = tiny_engine(tiny_gqa_dir, max_num_batched_tokens=64)
    engine.add_request(request("before", before, max_tokens=1))
    engine.add_request(request("a", prompt, max_tokens=1, prompt_logprobs=0))
    first = next(o for o in engine.step().outputs if o.request_id == "a")
    assert first.prompt_logprobs is not None and len(first.prompt_logprobs) == len(prompt) - 1
    for p, [(token, lp)] in enumerate(first.prompt_logprobs):
        assert token == prompt[p + 1]
        assert lp == pytest.approx(expected[p, token].item(), abs=1e-4)
