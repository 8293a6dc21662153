"""Scheduler driven by fake RunnerOutputs: budgets, chunked prefill, preemption, stops, aborts."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from nanoserve.config import EngineOptions
from nanoserve.core.request import Request, RequestStatus
from nanoserve.core.scheduler import MAX_HELD_TOKENS, Scheduler
from nanoserve.model.batch import RunnerOutput, SchedulerOutput
from nanoserve.sampling_params import SamplingParams
from nanoserve.wire.messages import EngineCoreOutput, FinishReason

EOS = 2


def make_scheduler(
    num_kv_blocks: int = 64,
    max_model_len: int = 256,
    **options,
) -> Scheduler:
    options.setdefault("block_size", 4)
    return Scheduler(EngineOptions(**options), num_kv_blocks=num_kv_blocks, max_model_len=max_model_len)


def make_request(
    request_id: str, prompt_len: int = 8, max_tokens: int = 4, first_token: int = 100, **params
) -> Request:
    sp = SamplingParams(max_tokens=max_tokens, **params)
    prompt = list(range(first_token, first_token + prompt_len))
    return Request(request_id, prompt, sp, eos_token_ids=(EOS,), arrival_time=0.0, max_tokens=max_tokens)


def fake_run(sched: SchedulerOutput, token_for: Callable[[Request], int] = lambda r: 7) -> RunnerOutput:
    sampling = [c.request for c in sched.chunks if c.samples]
    return RunnerOutput(
        [r.request_id for r in sampling], [[token_for(r)] for r in sampling], [None] * len(sampling)
    )


def step(
    s: Scheduler, token_for: Callable[[Request], int] = lambda r: 7
) -> tuple[SchedulerOutput, list[EngineCoreOutput]]:
    sched = s.schedule()
    return sched, s.update_from_output(sched, fake_run(sched, token_for))


def run_to_completion(s: Scheduler, max_steps: int = 1000, **kwargs) -> dict[str, list[EngineCoreOutput]]:
    outputs: dict[str, list[EngineCoreOutput]] = {}
    for _ in range(max_steps):
        if not s.has_unfinished_requests():
            return outputs
        sched, outs = step(s, **kwargs)
        assert sched.num_batched_tokens <= s.max_num_batched_tokens
        assert s.num_running <= s.max_num_seqs
        for o in outs:
            outputs.setdefault(o.request_id, []).append(o)
    raise AssertionError("requests did not finish")


def test_single_request_prefill_then_decode():
    s = make_scheduler()
    r = make_request("a", prompt_len=8, max_tokens=3)
    s.add_request(r)
    sched, outs = step(s)
    assert [(c.request.request_id, c.num_new_tokens) for c in sched.chunks] == [("a", 8)]
    # the first token carries when the request was queued and first scheduled
    assert outs == [EngineCoreOutput("a", [7], queued_time=r.queued_time, scheduled_time=r.scheduled_time)]
    assert 0 < r.queued_time <= r.scheduled_time
    assert r.num_computed_tokens == 8 and r.num_tokens == 9
    sched, outs = step(s)
    assert sched.chunks[0].num_new_tokens == 1
    sched, outs = step(s)
    assert outs[0].finish_reason is FinishReason.LENGTH
    assert r.status is RequestStatus.FINISHED_LENGTH
    assert not s.has_unfinished_requests() and not s.has_request("a")
    assert s.kv_cache.usage == 0.0


def test_token_budget_and_max_num_seqs():
    s = make_scheduler(max_num_batched_tokens=10, max_num_seqs=3)
    for i in range(6):
        s.add_request(make_request(f"r{i}", prompt_len=6, max_tokens=5, first_token=100 * (i + 1)))
    first, outs1 = step(s)
    # r0 takes 6, r1 gets the 4 left (chunked), nothing else fits
    assert [(c.request.request_id, c.num_new_tokens) for c in first.chunks] == [("r0", 6), ("r1", 4)]
    second, outs2 = step(s)
    # r0 decodes, r1 finishes its prefill, r2 gets a chunk of what is left; r3 is over max_num_seqs
    assert [(c.request.request_id, c.num_new_tokens) for c in second.chunks] == [
        ("r0", 1),
        ("r1", 2),
        ("r2", 6),
    ]
    assert s.num_running == 3
    outputs = run_to_completion(s)
    for o in reversed(outs1 + outs2):
        outputs[o.request_id].insert(0, o)
    assert sorted(outputs) == [f"r{i}" for i in range(6)]
    assert all(len(o) == 5 for o in outputs.values())


def test_chunked_prefill_of_a_long_prompt():
    s = make_scheduler(max_num_batched_tokens=16)
    r = make_request("long", prompt_len=40, max_tokens=2)
    s.add_request(r)
    sizes = []
    for _ in range(3):
        sched, outs = step(s)
        sizes.append(sched.chunks[0].num_new_tokens)
        assert (outs == []) == (len(sizes) < 3)
    assert sizes == [16, 16, 8]
    assert r.num_computed_tokens == 40 and r.num_output_tokens == 1


def test_decodes_scheduled_before_new_prefills():
    s = make_scheduler(max_num_batched_tokens=32)
    s.add_request(make_request("old", prompt_len=8, max_tokens=10))
    step(s)
    s.add_request(make_request("new", prompt_len=8, max_tokens=10, first_token=500))
    sched, _ = step(s)
    assert [c.request.request_id for c in sched.chunks] == ["old", "new"]
    assert [c.num_new_tokens for c in sched.chunks] == [1, 8]


def test_fcfs_order():
    s = make_scheduler(max_num_seqs=1)
    for name in ("a", "b", "c"):
        s.add_request(make_request(name, max_tokens=2, first_token=ord(name) * 10))
    order = []
    for _ in range(20):
        if not s.has_unfinished_requests():
            break
        sched, outs = step(s)
        order += [o.request_id for o in outs if o.finished]
    assert order == ["a", "b", "c"]


def test_preemption_under_a_tiny_kv_budget():
    # 6 blocks of 4 tokens; two requests of 8 prompt tokens each need 3 blocks after 1..4 new tokens
    s = make_scheduler(num_kv_blocks=6, max_model_len=24, enable_prefix_caching=False)
    a = make_request("a", prompt_len=8, max_tokens=10)
    b = make_request("b", prompt_len=8, max_tokens=10, first_token=500)
    s.add_request(a)
    s.add_request(b)
    preempted = []
    outputs: dict[str, list[EngineCoreOutput]] = {}
    for _ in range(100):
        if not s.has_unfinished_requests():
            break
        sched, outs = step(s)
        for rid in sched.preempted_request_ids:
            preempted.append(rid)
            # requeued at the front of the waiting queue, blocks freed
            assert s.waiting[0].request_id == rid
            assert s.kv_cache.block_ids(rid) == []
        for o in outs:
            outputs.setdefault(o.request_id, []).append(o)
    assert preempted and preempted[0] == "b"  # the newest goes first
    assert b.num_preemptions >= 1
    assert s.get_stats().num_preemptions == len(preempted)
    assert [len(outputs["a"]), len(outputs["b"])] == [10, 10]
    assert a.num_tokens == b.num_tokens == 18
    assert s.kv_cache.num_free_blocks == 6


def test_preempted_request_recomputes_its_output_tokens():
    s = make_scheduler(num_kv_blocks=4, max_model_len=16, enable_prefix_caching=False)
    a = make_request("a", prompt_len=7, max_tokens=8)
    b = make_request("b", prompt_len=4, max_tokens=8, first_token=500)
    s.add_request(a)
    s.add_request(b)
    while not b.num_preemptions:
        step(s)
    assert b.status is RequestStatus.PREEMPTED and b.num_computed_tokens == 0
    # b resumes once a is done, recomputing prompt + output as one prefill
    while b.status is not RequestStatus.RUNNING:
        sched, _ = step(s)
    resumed = [c for c in sched.chunks if c.request is b][0]
    assert resumed.num_new_tokens == b.num_tokens - 1  # already advanced by its own sample
    assert b.num_output_tokens >= 2


def test_max_model_len_limits_generation():
    s = make_scheduler(max_model_len=12)
    r = make_request("a", prompt_len=8, max_tokens=100)
    s.add_request(r)
    outputs = run_to_completion(s)
    assert r.num_tokens == 12 and len(outputs["a"]) == 4
    assert outputs["a"][-1].finish_reason is FinishReason.LENGTH


def test_prompt_longer_than_max_model_len_is_refused():
    s = make_scheduler(max_model_len=8)
    with pytest.raises(ValueError, match="max_model_len"):
        s.add_request(make_request("a", prompt_len=9))


def test_max_model_len_beyond_kv_capacity_is_refused():
    with pytest.raises(ValueError, match="KV cache capacity"):
        make_scheduler(num_kv_blocks=2, max_model_len=9)


def test_eos_stops():
    s = make_scheduler()
    r = make_request("a", max_tokens=10)
    s.add_request(r)
    outputs = run_to_completion(s, token_for=lambda r: EOS if r.num_output_tokens == 2 else 7)
    assert [o.new_token_ids[0] for o in outputs["a"]] == [7, 7, EOS]
    last = outputs["a"][-1]
    assert last.finish_reason is FinishReason.STOP and last.stop_reason is None


def test_any_of_several_eos_ids_stops():
    """Llama 3 ends turns with <|eot_id|> and text with <|end_of_text|>: either one stops."""
    s = make_scheduler()
    for rid in ("a", "b"):
        r = make_request(rid, max_tokens=10, first_token=100 if rid == "a" else 200)
        r.eos_token_ids = (EOS, 9)
        s.add_request(r)
    ends = {"a": EOS, "b": 9}
    outputs = run_to_completion(s, token_for=lambda r: ends[r.request_id] if r.num_output_tokens == 1 else 7)
    for rid, end in ends.items():
        assert [o.new_token_ids[0] for o in outputs[rid]] == [7, end]
        assert outputs[rid][-1].finish_reason is FinishReason.STOP and outputs[rid][-1].stop_reason is None


def test_ignore_eos():
    s = make_scheduler()
    s.add_request(make_request("a", max_tokens=5, ignore_eos=True))
    outputs = run_to_completion(s, token_for=lambda r: EOS)
    assert len(outputs["a"]) == 5 and outputs["a"][-1].finish_reason is FinishReason.LENGTH


def test_stop_token_ids_set_stop_reason():
    s = make_scheduler()
    s.add_request(make_request("a", max_tokens=10, stop_token_ids=[42, 43]))
    outputs = run_to_completion(s, token_for=lambda r: 43 if r.num_output_tokens == 1 else 7)
    last = outputs["a"][-1]
    assert len(outputs["a"]) == 2
    assert last.finish_reason is FinishReason.STOP and last.stop_reason == 43


def test_min_tokens_delays_stops():
    s = make_scheduler()
    s.add_request(make_request("a", max_tokens=10, min_tokens=4, stop_token_ids=[42]))
    outputs = run_to_completion(s, token_for=lambda r: EOS if r.num_output_tokens % 2 else 42)
    # tokens 42, EOS, 42 are ignored; the 4th token (EOS) stops
    assert [o.new_token_ids[0] for o in outputs["a"]] == [42, EOS, 42, EOS]
    assert outputs["a"][-1].finish_reason is FinishReason.STOP


def test_logprobs_are_forwarded():
    s = make_scheduler()
    s.add_request(make_request("a", max_tokens=1))
    sched = s.schedule()
    lp = [(7, -0.5), (8, -1.0)]
    (out,) = s.update_from_output(sched, RunnerOutput(["a"], [[7]], [[lp]]))
    assert out.new_logprobs == [lp] and out.finish_reason is FinishReason.LENGTH


def held_request(request_id: str, max_tokens: int, **params) -> Request:
    r = make_request(request_id, max_tokens=max_tokens, **params)
    r.final_output_only = True
    return r


def test_final_output_only_sends_chunks_and_the_rest_at_the_finish():
    s = make_scheduler()
    r = held_request("a", max_tokens=MAX_HELD_TOKENS * 2 + 3, logprobs=1)
    s.add_request(r)
    sent: list[EngineCoreOutput] = []
    steps_with_output = []
    for i in range(r.max_tokens):
        sched = s.schedule()
        lp = [(10 + i, -float(i)), (0, -0.1)]
        outs = s.update_from_output(sched, RunnerOutput(["a"], [[10 + i]], [[lp]]))
        if outs:
            steps_with_output.append(i + 1)
        sent.extend(outs)
    # the first token at once, then every MAX_HELD_TOKENS, then the rest at the finish
    assert steps_with_output == [1, 1 + MAX_HELD_TOKENS, 1 + 2 * MAX_HELD_TOKENS, r.max_tokens]
    assert [t for o in sent for t in o.new_token_ids] == [10 + i for i in range(r.max_tokens)]
    assert [lp[0] for o in sent for lp in o.new_logprobs or []] == [
        (10 + i, -float(i)) for i in range(r.max_tokens)
    ]
    # the first output carries the queue times, as the first token would; the last the finish
    assert sent[0].new_token_ids == [10] and sent[0].queued_time == r.queued_time > 0
    assert sent[1].queued_time == 0.0
    assert [o.finish_reason for o in sent] == [None, None, None, FinishReason.LENGTH]
    assert not s.has_unfinished_requests()


def test_final_output_only_hands_over_held_tokens_on_abort():
    s = make_scheduler()
    s.add_request(held_request("a", max_tokens=10))
    s.add_request(make_request("b", max_tokens=10, first_token=500))
    outs = [o for _ in range(4) for o in step(s)[1]]
    assert [o.request_id for o in outs] == ["a", "b", "b", "b", "b"]
    (a,) = s.finish_requests("a", RequestStatus.FINISHED_ABORTED)
    assert a.new_token_ids == [7, 7, 7] and a.finish_reason is FinishReason.ABORT


def test_final_output_only_resumed_request_sends_only_new_tokens():
    s = make_scheduler()
    r = held_request("a", max_tokens=5)
    r.output_token_ids, r.num_sent_tokens = [5, 6], 2
    r.all_token_ids.extend([5, 6])
    s.add_request(r)
    outs = run_to_completion(s)["a"]
    assert [o.new_token_ids for o in outs] == [[7, 7, 7]] and outs[0].queued_time == 0.0


def test_abort_frees_blocks():
    s = make_scheduler(num_kv_blocks=16, max_model_len=64, max_num_seqs=1)
    start = s.kv_cache.num_free_blocks
    s.add_request(make_request("a", prompt_len=9))
    s.add_request(make_request("b", prompt_len=9, first_token=500))
    step(s)
    assert s.kv_cache.num_free_blocks < start
    assert s.request_ids() == ["a", "b"]
    outs = s.finish_requests(["a", "b", "unknown"], RequestStatus.FINISHED_ABORTED)
    assert [(o.request_id, o.new_token_ids, o.finish_reason) for o in outs] == [
        ("a", [], FinishReason.ABORT),
        ("b", [], FinishReason.ABORT),
    ]
    assert s.kv_cache.num_free_blocks == start
    assert s.num_running == s.num_waiting == 0 and not s.has_unfinished_requests()


def test_abort_between_schedule_and_update():
    s = make_scheduler()
    s.add_request(make_request("a"))
    sched = s.schedule()
    s.finish_requests("a", RequestStatus.FINISHED_ERROR)
    assert s.update_from_output(sched, fake_run(sched)) == []
    assert s.kv_cache.usage == 0.0


def test_prefix_cache_hit_on_admission():
    s = make_scheduler()
    s.add_request(make_request("a", prompt_len=10, max_tokens=1))
    run_to_completion(s)
    b = make_request("b", prompt_len=10, max_tokens=1)
    s.add_request(b)
    sched, outs = step(s)
    assert sched.chunks[0].num_new_tokens == 2
    assert b.num_cached_tokens == 8 and outs[0].num_cached_tokens == 8
    stats = s.get_stats()
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (20, 8)


def test_stats_and_reset_prefix_cache():
    s = make_scheduler(max_num_seqs=1)
    s.add_request(make_request("a"))
    s.add_request(make_request("b", first_token=500))
    step(s)
    stats = s.get_stats()
    assert (stats.num_running_reqs, stats.num_waiting_reqs) == (1, 1)
    assert stats.kv_cache_usage > 0
    assert not s.reset_prefix_cache()
    run_to_completion(s)
    assert s.reset_prefix_cache()


def check_kv_invariants(s: Scheduler) -> None:
    kv = s.kv_cache
    held = [b for r in s.running for b in kv.block_ids(r.request_id)]
    assert not any(kv.block_ids(r.request_id) for r in s.waiting)
    assert kv.num_free_blocks == kv.num_blocks - len(set(held))
    for r in s.running:
        assert len(kv.block_ids(r.request_id)) * kv.block_size >= r.num_computed_tokens


@pytest.mark.parametrize("enable_prefix_caching", [True, False])
def test_random_workload_keeps_invariants(enable_prefix_caching):
    import random

    rng = random.Random(0)
    s = make_scheduler(
        num_kv_blocks=12,
        max_model_len=40,
        max_num_batched_tokens=12,
        max_num_seqs=4,
        enable_prefix_caching=enable_prefix_caching,
    )
    expected = {}
    for i in range(20):
        prompt_len = rng.randint(1, 20)
        max_tokens = rng.randint(1, 10)
        # a few shared prefixes so the prefix cache gets hits
        s.add_request(make_request(f"r{i}", prompt_len, max_tokens, first_token=1000 * (i % 3)))
        expected[f"r{i}"] = min(max_tokens, 40 - prompt_len)
    counts: dict[str, int] = {}
    for _ in range(2000):
        if not s.has_unfinished_requests():
            break
        sched, outs = step(s, token_for=lambda r: rng.randint(10, 20))
        assert sched.num_batched_tokens <= 12
        assert s.num_running <= 4
        assert len({c.request.request_id for c in sched.chunks}) == len(sched.chunks)
        check_kv_invariants(s)
        for o in outs:
            counts[o.request_id] = counts.get(o.request_id, 0) + 1
    assert counts == expected
    assert s.kv_cache.num_free_blocks == 12
    if enable_prefix_caching:
        assert s.get_stats().prefix_cache_hits > 0
    assert s.get_stats().num_preemptions > 0
