"""The scheduler with speculative decoding, driven by a fake runner that knows the "true" next tokens:
drafts take budget and slots, accepted ones advance the request, rejected ones give their blocks back,
and stops inside the drafts end the request exactly where plain decoding would."""

from __future__ import annotations

from collections.abc import Callable

from nanoserve.core.request import Request, RequestStatus
from nanoserve.core.scheduler import Scheduler
from nanoserve.model.batch import RunnerOutput, SchedulerOutput
from nanoserve.sampling_params import SamplingParams
from nanoserve.wire.messages import FinishReason
from tests.core.test_scheduler import EOS, make_scheduler

PATTERN = [10, 11, 12, 13]

Truth = Callable[[Request, int], int]
"""(request, position) -> the token the model gives after the first `position` tokens."""


def pattern_truth(request: Request, position: int) -> int:
    return pattern_truth_at(position)


def fake_verify(sched: SchedulerOutput, truth: Truth) -> RunnerOutput:
    """Like the runner: per sampling chunk, the true token after the known ones, then while the drafts
    match the truth, the next true token."""
    ids, tokens, logprobs = [], [], []
    for chunk in sched.chunks:
        if not chunk.samples:
            continue
        request = chunk.request
        assert isinstance(request, Request)
        position = request.num_tokens
        kept = [truth(request, position)]
        for draft in chunk.draft_token_ids:
            if draft != kept[-1]:
                break
            position += 1
            kept.append(truth(request, position))
        ids.append(request.request_id)
        tokens.append(kept)
        logprobs.append([[(t, -0.25 * k)] for k, t in enumerate(kept)])
    return RunnerOutput(ids, tokens, logprobs)


def speculative_scheduler(**options) -> Scheduler:
    return make_scheduler(speculative="ngram", **options)


def pattern_request(rid: str = "a", prompt_len: int = 13, max_tokens: int = 20) -> Request:
    prompt = [pattern_truth_at(i) for i in range(prompt_len)]
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    return Request(rid, prompt, params, (EOS,), arrival_time=0.0, max_tokens=max_tokens)


def pattern_truth_at(position: int) -> int:
    return PATTERN[position % len(PATTERN)]


def run_steps(s: Scheduler, num_steps: int, truth: Truth = pattern_truth) -> list:
    outputs = []
    for _ in range(num_steps):
        sched = s.schedule()
        outputs += s.update_from_output(sched, fake_verify(sched, truth))
    return outputs


def test_accepted_drafts_advance_the_request_and_rejected_ones_give_their_slots_back():
    s = speculative_scheduler(num_speculative_tokens=3)
    r = pattern_request()
    s.add_request(r)
    (out,) = run_steps(s, 1)
    assert out.new_token_ids == [11] and r.num_computed_tokens == 13

    # "12 13 10 11" occurred before, followed by 12 13 10; the model agrees on 12, then says 99
    def truth(request: Request, position: int) -> int:
        return 99 if position == 15 else pattern_truth(request, position)

    sched = s.schedule()
    (chunk,) = sched.chunks
    assert chunk.draft_token_ids == [12, 13, 10] and chunk.num_new_tokens == 4
    assert len(s.kv_cache.block_ids("a")) == 5  # slots up to position 16, 4 to a block
    (out,) = s.update_from_output(sched, fake_verify(sched, truth))
    assert out.new_token_ids == [12, 99]
    assert out.new_logprobs == [[(12, 0.0)], [(99, -0.25)]]
    assert r.output_token_ids == [11, 12, 99]
    assert r.num_computed_tokens == 15 and r.num_tokens == 16  # 99's K/V is computed next step
    assert len(s.kv_cache.block_ids("a")) == 4  # the block only rejected drafts reached went back
    stats = s.get_stats()
    assert (stats.num_draft_tokens, stats.num_accepted_tokens) == (3, 1)


def test_drafts_leave_room_for_one_token_within_max_tokens_and_the_budget():
    s = speculative_scheduler(num_speculative_tokens=3)
    s.add_request(pattern_request(max_tokens=3))
    run_steps(s, 1)
    sched = s.schedule()
    assert sched.chunks[0].draft_token_ids == [12]  # 1 token out, 3 allowed: 1 draft + the bonus token
    (out,) = s.update_from_output(sched, fake_verify(sched, pattern_truth))
    assert out.new_token_ids == [12, 13] and out.finish_reason is FinishReason.LENGTH
    assert s.kv_cache.num_free_blocks == s.kv_cache.num_blocks

    s = speculative_scheduler(num_speculative_tokens=3, max_num_batched_tokens=3)
    s.add_request(pattern_request(prompt_len=8, max_tokens=10))  # prefilled in 3 steps
    run_steps(s, 3)
    sched = s.schedule()
    assert sched.chunks[0].num_new_tokens == 3 and sched.chunks[0].draft_token_ids == [11, 12]


def test_a_stop_token_among_the_accepted_drafts_ends_the_request_there():
    s = speculative_scheduler(num_speculative_tokens=3)
    prompt = [10, 11, EOS, 13] * 3  # EOS inside the prompt: drafted, and accepted

    def truth(request: Request, position: int) -> int:
        return prompt[position % 4]

    r = Request(
        "a", prompt, SamplingParams(temperature=0, max_tokens=20), (EOS,), arrival_time=0.0, max_tokens=20
    )
    s.add_request(r)
    outputs = []
    while s.has_unfinished_requests():
        sched = s.schedule()
        outputs += s.update_from_output(sched, fake_verify(sched, truth))
    assert [o.new_token_ids for o in outputs] == [[10], [11, EOS]]
    assert outputs[-1].finish_reason is FinishReason.STOP and r.status is RequestStatus.FINISHED_STOPPED
    assert s.kv_cache.num_free_blocks == s.kv_cache.num_blocks


def test_without_room_for_drafts_a_request_decodes_plainly_rather_than_preempt():
    """a: 13 prompt tokens in 4 blocks of 4, b: 3 in 1; a's 3 drafts need a 5th block."""
    chunks = {}
    for num_kv_blocks in (6, 5):
        s = speculative_scheduler(num_speculative_tokens=3, num_kv_blocks=num_kv_blocks, max_model_len=20)
        s.add_request(pattern_request("a", max_tokens=10))
        b = Request("b", [50, 51, 52], SamplingParams(temperature=0), (EOS,), arrival_time=0.0, max_tokens=10)
        s.add_request(b)
        run_steps(s, 1)
        sched = s.schedule()
        assert not sched.preempted_request_ids
        chunks[num_kv_blocks] = [(c.request.request_id, c.draft_token_ids) for c in sched.chunks]
    assert chunks[6] == [("a", [12, 13, 10]), ("b", [])]
    assert chunks[5] == [("a", []), ("b", [])]  # no block left: a decodes plainly, b keeps its place
