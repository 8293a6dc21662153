"""Prompt lookup and the speculator's policy: which n-gram is matched, when drafts are worth proposing,
how a request that stopped drafting finds its way back (shadow drafts, never a probing draft), and the
step-cost fit that prices them."""

from __future__ import annotations

import pytest

from nanoserve.config import EngineOptions
from nanoserve.core.ngram_proposer import NgramIndex
from nanoserve.core.request import Request
from nanoserve.core.speculator import DEFAULT_BREAK_EVEN_TOKENS, Speculator, StepCostModel
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


def stop_drafting(spec: Speculator, request: Request, batch_size: int) -> None:
    """Reject the request's drafts until it proposes none."""
    for _ in range(10):
        if not (drafts := spec.propose(request, batch_size, 8)):
            return
        spec.record(request.request_id, len(drafts), 0)
    raise AssertionError("the request kept drafting")


def test_a_request_whose_drafts_fail_stops_and_resumes_when_its_shadow_guesses_come_true():
    spec = speculator(num_speculative_tokens=3)
    request = make_request()
    batch = 8  # a fresh request drafts here, and stops once its drafts fail
    stop_drafting(spec, request, batch)
    num_drafts = spec.num_draft_tokens
    assert num_drafts >= 1 and spec.num_accepted_tokens == 0
    for step in range(100):  # text the lookup does not predict: no drafts, not even a probe
        assert spec.propose(request, batch, 8) == []
        request.append_output_token(1000 + step)
    assert spec.num_draft_tokens == num_drafts
    request.all_token_ids.extend([1, 2, 3, 4])
    for step in range(30):  # the pattern again: each token is the one the lookup guessed
        if drafts := spec.propose(request, batch, 8):
            break
        request.append_output_token([1, 2, 3, 4][step % 4])
    assert drafts and spec.num_draft_tokens == num_drafts, "drafting resumed without a probe"
    assert drafts[0] == request.all_token_ids[-4], "the pattern's next token"


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
    assert model.break_even == DEFAULT_BREAK_EVEN_TOKENS
    for i in range(200):
        tokens = 32 + (i * 7) % 64
        model.observe(tokens, fixed + per_token * tokens)
    assert model.break_even == pytest.approx(fixed / per_token, rel=1e-6)


def test_the_cost_fit_keeps_its_last_estimate_while_every_step_has_the_same_size():
    model = StepCostModel()
    for _ in range(100):
        model.observe(32, 0.05)
    assert model.break_even == DEFAULT_BREAK_EVEN_TOKENS  # nothing to fit yet
    for i in range(100):
        tokens = 32 + (i * 7) % 64
        model.observe(tokens, 0.008 + 0.001 * tokens)
    for _ in range(1000):  # a batch that stopped drafting: one size, the cost the fit predicts
        model.observe(32, 0.040)
    assert model.break_even == pytest.approx(8.0, rel=1e-3)


def predictable_steps(spec: Speculator, request: Request, batch_size: int, num_steps: int) -> int:
    """Decode steps of a request whose text repeats every 4 tokens, so every lookup guess comes true
    (each draft is accepted): the number of draft tokens proposed."""
    proposed = 0
    for _ in range(num_steps):
        drafts = spec.propose(request, batch_size, 8)
        if drafts:
            spec.record(request.request_id, len(drafts), len(drafts))
        for token in drafts:
            request.append_output_token(token)
        request.append_output_token(request.all_token_ids[-4])
        proposed += len(drafts)
    return proposed


@pytest.mark.parametrize(
    "fixed, per_token, drafts_pay",
    [
        (0.0002, 0.001, False),  # compute-bound: a draft costs a whole token of the step
        (0.020, 0.0001, True),  # reading weights: drafts are nearly free
    ],
)
def test_drafts_are_proposed_only_where_the_measured_step_cost_repays_them(fixed, per_token, drafts_pay):
    spec = speculator(num_speculative_tokens=3)
    for i in range(200):  # steps of a batch of 32 with and without drafts
        tokens = 32 + (i * 7) % 64
        spec.cost.observe(tokens, fixed + per_token * tokens)
    proposed = predictable_steps(spec, make_request(), 32, 40)
    assert (proposed > 0) == drafts_pay, "in a compute-bound step not even a probe"


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
