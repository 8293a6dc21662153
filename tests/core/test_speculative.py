"""Speculative decoding (n-gram prompt lookup) end to end on tiny random Llamas: the output is plain
decoding's, token for token, under batching, chunked prefill, prefix-cache hits and preemption; seeded
sampling, penalties, logprobs and structured outputs are unchanged; drafts are both accepted and
rejected along the way (random models fall into loops the lookup predicts, and leave them)."""

from __future__ import annotations

import json
import random

import jsonschema
import pytest
from engine_steps import hf_greedy, request, run_to_completion, tiny_engine

from nanoserve.core.speculator import Speculator
from nanoserve.sampling_params import StructuredOutputsParams
from nanoserve.wire.messages import FinishReason

NUM_TOKENS = 40


@pytest.fixture(autouse=True)
def untimed_speculator(monkeypatch):
    """Which drafts are proposed depends on the measured cost of steps; without the timings the cost fit
    keeps its default, so the drafts (and whether some are rejected) depend on the tokens alone."""
    monkeypatch.setattr(Speculator, "observe_step", lambda self, scheduled, seconds: None)


def looping_prompts(num: int, seed: int = 0) -> list[list[int]]:
    """Prompts that repeat a random phrase, of several lengths."""
    rng = random.Random(seed)
    prompts = []
    for i in range(num):
        phrase = [rng.randrange(3, 49152) for _ in range(4 + i % 3)]
        prompts.append((phrase * 8)[: 13 + 5 * i])
    return prompts


def run(model_dir, requests, **options) -> tuple[dict[str, list], object]:
    engine = tiny_engine(model_dir, **options)
    for r in requests:
        engine.add_request(r)
    results = run_to_completion(engine)
    return results, engine.scheduler.get_stats()


def assert_drafts_were_accepted_and_rejected(stats) -> None:
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens, stats


def test_greedy_output_is_transformers_token_for_token(tiny_model_dir):
    prompts = looping_prompts(6)
    requests = [request(str(i), p, max_tokens=NUM_TOKENS) for i, p in enumerate(prompts)]
    results, stats = run(tiny_model_dir, requests, speculative="ngram")
    expected = hf_greedy(tiny_model_dir, prompts, NUM_TOKENS)
    assert [results[str(i)][0] for i in range(6)] == expected
    assert all(results[str(i)][1] == FinishReason.LENGTH for i in range(6))
    assert_drafts_were_accepted_and_rejected(stats)


@pytest.mark.parametrize(
    "options",
    [
        {"max_num_batched_tokens": 7},  # every prompt prefilled in chunks, drafts cut by the budget
        {"num_kv_blocks": 24, "max_num_batched_tokens": 64},  # the newest requests are preempted
        {"num_speculative_tokens": 6, "prompt_lookup_min": 1, "prompt_lookup_max": 2},
    ],
)
def test_chunked_prefill_preemption_and_other_lookups_keep_the_output(tiny_gqa_dir, options):
    prompts = looping_prompts(6, seed=1)
    requests = [request(str(i), p, max_tokens=NUM_TOKENS) for i, p in enumerate(prompts)]
    results, stats = run(tiny_gqa_dir, requests, speculative="ngram", **options)
    assert [results[str(i)][0] for i in range(6)] == hf_greedy(tiny_gqa_dir, prompts, NUM_TOKENS)
    assert_drafts_were_accepted_and_rejected(stats)
    if "num_kv_blocks" in options:
        assert stats.num_preemptions > 0


def test_prefix_cache_hits_and_blocks_of_accepted_drafts(tiny_gqa_dir):
    """The second run shares the blocks the first one filled, accepted drafts' blocks included."""
    prompt = looping_prompts(1, seed=2)[0]
    engine = tiny_engine(tiny_gqa_dir, speculative="ngram")
    engine.add_request(request("first", prompt, max_tokens=NUM_TOKENS))
    first = run_to_completion(engine)["first"][0]
    engine.add_request(request("again", prompt + first, max_tokens=8))
    again = run_to_completion(engine)["again"]
    assert again[3] >= len(prompt) + len(first) - 4  # all but the last, partial block from the cache
    assert first + again[0] == hf_greedy(tiny_gqa_dir, [prompt], NUM_TOKENS + 8)[0]
    assert engine.scheduler.kv_cache.usage == 0.0


def test_sampling_penalties_and_logprobs_are_those_of_plain_decoding(tiny_gqa_dir):
    prompts = looping_prompts(5, seed=3)
    kinds = [
        dict(temperature=0.8, top_p=0.9, seed=11),
        dict(temperature=1.0, top_k=20, seed=12),
        dict(temperature=0.0, frequency_penalty=0.5, presence_penalty=0.3),
        dict(temperature=0.0, repetition_penalty=1.3, min_tokens=30, ignore_eos=False),
        dict(temperature=0.0, logprobs=2),
    ]

    def requests():
        return [request(str(i), p, max_tokens=NUM_TOKENS, **kinds[i]) for i, p in enumerate(prompts)]

    engine = tiny_engine(tiny_gqa_dir)
    plain_logprobs: dict[str, list] = {}
    for r in requests():
        engine.add_request(r)
    plain: dict[str, list[int]] = {}
    while engine.has_work():
        for out in engine.step().outputs:
            plain.setdefault(out.request_id, []).extend(out.new_token_ids)
            plain_logprobs.setdefault(out.request_id, []).extend(out.new_logprobs or [])
    engine = tiny_engine(tiny_gqa_dir, speculative="ngram")
    for r in requests():
        engine.add_request(r)
    drafted: dict[str, list[int]] = {}
    drafted_logprobs: dict[str, list] = {}
    while engine.has_work():
        for out in engine.step().outputs:
            drafted.setdefault(out.request_id, []).extend(out.new_token_ids)
            drafted_logprobs.setdefault(out.request_id, []).extend(out.new_logprobs or [])
    assert drafted == plain
    assert_drafts_were_accepted_and_rejected(engine.scheduler.get_stats())
    assert len(drafted_logprobs["4"]) == NUM_TOKENS  # one entry per token, accepted drafts included
    for want, have in zip(plain_logprobs["4"], drafted_logprobs["4"], strict=True):
        assert [t for t, _ in have] == [t for t, _ in want]
        assert [lp for _, lp in have] == pytest.approx([lp for _, lp in want], abs=1e-4)


SCHEMA = {
    "type": "array",
    "items": {
        "type": "object",
        "properties": {"name": {"enum": ["north wind", "south sea"]}},
        "required": ["name"],
        "additionalProperties": False,
    },
    "minItems": 6,
    "maxItems": 6,
}


def test_structured_outputs_match_plain_decoding_with_a_mask_per_draft_position(tiny_gqa_dir, tokenizer_dir):
    """Six objects of the same shape: the lookup drafts the next one from the last, under the grammar."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    prompts = looping_prompts(4, seed=4)
    spec = StructuredOutputsParams(json=SCHEMA)

    def requests():
        return [
            request(str(i), p, max_tokens=200, ignore_eos=False, structured_outputs=spec, **params)
            for i, (p, params) in enumerate(
                zip(prompts, [{}, {}, {"temperature": 0.9, "seed": 3}, {}], strict=True)
            )
        ]

    plain, _ = run(tiny_gqa_dir, requests())
    drafted, stats = run(tiny_gqa_dir, requests(), speculative="ngram")
    assert {k: v[:2] for k, v in drafted.items()} == {k: v[:2] for k, v in plain.items()}
    for tokens, reason, _, _ in drafted.values():
        assert reason == FinishReason.STOP
        jsonschema.validate(json.loads(tokenizer.decode(tokens, skip_special_tokens=True)), SCHEMA)
    assert_drafts_were_accepted_and_rejected(stats)
