"""Prompt lookup and the speculator's policy: which n-gram is matched, when drafts are worth proposing,
and the step-cost fit that prices them."""

from __future__ import annotations

import pytest

from nanoserve.config import EngineOptions
from nanoserve.core.ngram_proposer import NgramIndex
from nanoserve.core.request import Request
from nanoserve.core.speculator import (
    DEFAULT_BREAK_EVEN_TOKENS,
    PROBE_INTERVAL,
    Speculator,
    StepCostModel,
)
from nanoserve.sampling_params import SamplingParams


def test_the_latest_occurrence_of_the_longest_ngram_is_followed():
    index = NgramIndex(min_n=1, max_n=3)
    #         0  1  2  3  4  5  6  7  8  9
    tokens = [1, 2, 3, 9, 1, 2, 3, 8, 7, 2, 3]
    # "2 3" last occurred at 5-6 (followed by 8 7); "1 2 3" is not the suffix, "9 2 3" never occurred
    assert index.propose(tokens, 3) == [8, 7, 2]
    assert index.propose(tokens, 1) == [8]
    tokens += [4]  # the suffix "3 4" and "4" occurred nowhere before
    assert index.propose(tokens, 3) == []
    tokens += [1, 2, 3]  # "1 2 3": its latest earlier occurrence is 4-6, over "2 3" at 9-10
    assert index.propose(tokens, 2) == [8, 7]


def test_a_suffix_is_not_matched_against_itself_and_short_ngrams_are_not_matched():
    index = NgramIndex(min_n=2, max_n=2)
    assert index.propose([5, 6], 3) == []
    assert index.propose([5, 6, 5], 3) == []  # "6 5" is new; a single "5" is below min_n
    assert index.propose([5, 6, 5, 6], 3) == [5, 6]  # "5 6" at 0-1, followed by what came after
    assert index.propose([5, 6, 5, 6, 5], 3) == [6, 5]


def make_request(rid: str = "r", prompt: list[int] | None = None) -> Request:
    prompt = prompt if prompt is not None else [1, 2, 3, 4] * 4
    return Request(
        rid, prompt, SamplingParams(temperature=0), eos_token_ids=(0,), arrival_time=0.0, max_tokens=64
    )


def speculator(**options) -> Speculator:
    return Speculator(EngineOptions(speculative="ngram", **options))


def test_drafts_are_the_lookup_capped_by_the_room_left():
    spec = speculator(num_speculative_tokens=3)
    request = make_request()
    assert spec.propose(request, batch_size=1, max_drafts=8) == [1, 2, 3]
    assert spec.propose(request, batch_size=1, max_drafts=2) == [1, 2]
    assert spec.propose(request, batch_size=1, max_drafts=0) == []


def test_a_request_whose_drafts_fail_stops_drafting_then_probes_with_one():
    spec = speculator(num_speculative_tokens=3)
    request = make_request()
    batch = 8  # a fresh request drafts one token here, and stops once its drafts fail
    num_proposals = 0
    while drafts := spec.propose(request, batch, 8):
        spec.record(request.request_id, len(drafts), 0)
        num_proposals += 1
    assert num_proposals >= 1 and spec.num_draft_tokens == num_proposals and spec.num_accepted_tokens == 0
    steps = 1  # the step whose proposal came back empty
    while not (drafts := spec.propose(request, batch, 8)):
        steps += 1
        assert steps < PROBE_INTERVAL
    assert steps + 1 == PROBE_INTERVAL and len(drafts) == 1  # the probe is the PROBE_INTERVAL-th step


def test_accepted_drafts_earn_more_and_a_larger_batch_asks_for_more():
    spec = speculator(num_speculative_tokens=4)
    request = make_request()
    assert len(spec.propose(request, batch_size=1, max_drafts=8)) == 4  # at batch 1 drafts are nearly free
    assert spec.propose(request, batch_size=64, max_drafts=8) == []  # 1/2 is too unlikely at batch 64
    for _ in range(10):
        spec.record(request.request_id, 4, 4)
    assert len(spec.propose(request, batch_size=64, max_drafts=8)) == 4
    assert (spec.num_draft_tokens, spec.num_accepted_tokens) == (40, 40)
    spec.forget(request.request_id)
    assert spec.propose(request, batch_size=64, max_drafts=8) == []  # a new request starts at 1/2


@pytest.mark.parametrize("fixed, per_token", [(0.020, 0.001), (0.006, 0.0015)])
def test_the_cost_fit_recovers_the_break_even_step_size(fixed, per_token):
    model = StepCostModel()
    assert model.break_even_tokens() == DEFAULT_BREAK_EVEN_TOKENS
    for i in range(200):
        tokens = 32 + (i * 7) % 64
        model.observe(tokens, fixed + per_token * tokens)
    assert model.break_even_tokens() == pytest.approx(fixed / per_token, rel=1e-6)


def test_the_cost_fit_falls_back_while_every_step_has_the_same_size():
    model = StepCostModel()
    for _ in range(100):
        model.observe(32, 0.05)
    assert model.break_even_tokens() == DEFAULT_BREAK_EVEN_TOKENS


@pytest.mark.parametrize(
    "options, message",
    [
        ({"num_speculative_tokens": 2}, "needs speculative='ngram'"),
        ({"speculative": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens must be at least 1"),
        ({"speculative": "ngram", "prompt_lookup_min": 3, "prompt_lookup_max": 2}, "must not exceed"),
        ({"speculative": "eagle"}, "speculative must be one of"),
    ],
)
def test_bad_speculative_options_are_refused(options, message):
    with pytest.raises(ValueError, match=message):
        EngineOptions(**options)
