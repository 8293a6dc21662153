"""EngineCore end to end on tiny random-weight Llamas: greedy ids equal transformers' token for token,
under batching, chunked prefill, prefix-cache hits and preemption; bad requests and utilities."""

from __future__ import annotations

import msgspec
import pytest
from engine_steps import MAX_TOKENS, hf_greedy, make_prompts, request, run_to_completion, tiny_engine

from nanoserve.wire.messages import FinishReason


def test_batched_greedy_matches_transformers(tiny_model_dir):
    prompts = make_prompts(6)
    engine = tiny_engine(tiny_model_dir)
    for i, p in enumerate(prompts):
        engine.add_request(request(str(i), p))
    results = run_to_completion(engine)
    expected = hf_greedy(tiny_model_dir, prompts)
    for i in range(len(prompts)):
        assert results[str(i)][0] == expected[i], f"prompt {i}"
        assert results[str(i)][1] == FinishReason.LENGTH


def test_chunked_prefill_and_preemption_keep_outputs_exact(tiny_gqa_dir):
    prompts = make_prompts(6, seed=1)
    expected = hf_greedy(tiny_gqa_dir, prompts)
    # 7 tokens per step forces every longer prompt to be prefilled in chunks
    engine = tiny_engine(tiny_gqa_dir, max_num_batched_tokens=7)
    for i, p in enumerate(prompts):
        engine.add_request(request(str(i), p))
    chunked = run_to_completion(engine)
    assert [chunked[str(i)][0] for i in range(6)] == expected

    # 16 blocks of 4 tokens cannot hold all six sequences at once: the newest are preempted
    engine = tiny_engine(tiny_gqa_dir, num_kv_blocks=16, max_num_batched_tokens=64)
    for i, p in enumerate(prompts):
        engine.add_request(request(str(i), p))
    preemptions = 0
    results: dict[str, list[int]] = {}
    while engine.has_work():
        outputs = engine.step()
        preemptions = max(preemptions, outputs.scheduler_stats.num_preemptions)
        for out in outputs.outputs:
            results.setdefault(out.request_id, []).extend(out.new_token_ids)
    assert preemptions > 0
    assert [results[str(i)] for i in range(6)] == expected


def test_prefix_cache_hit_gives_same_tokens(tiny_gqa_dir):
    shared = make_prompts(1, seed=2, lengths=(24,))[0]
    first, second = shared + [11, 12, 13], shared + [21, 22]
    expected = hf_greedy(tiny_gqa_dir, [first, second])
    engine = tiny_engine(tiny_gqa_dir)
    engine.add_request(request("a", first))
    a = run_to_completion(engine)["a"]
    engine.add_request(request("b", second))
    b = run_to_completion(engine)["b"]
    assert a[0] == expected[0] and b[0] == expected[1]
    assert a[3] == 0 and b[3] == 24, "the 6 shared full blocks should come from the prefix cache"


def test_partial_block_hits_give_same_tokens(tiny_gqa_dir):
    """A repeated prompt computes only its last token, a prompt that shares a prefix ending inside a
    block computes from there: the blocks they start from are copies, the cached ones stay intact."""
    prompt = make_prompts(1, seed=3, lengths=(26,))[0]
    branch = prompt[:25] + [31, 32]
    expected = hf_greedy(tiny_gqa_dir, [prompt, branch])
    engine = tiny_engine(tiny_gqa_dir)
    engine.add_request(request("a", prompt))
    assert run_to_completion(engine)["a"][0] == expected[0]
    engine.add_request(request("again", prompt))
    again = run_to_completion(engine)["again"]
    assert again[0] == expected[0] and again[3] == 25
    engine.add_request(request("branch", branch))
    engine.add_request(request("third", prompt))
    results = run_to_completion(engine)
    assert results["branch"][0] == expected[1] and results["branch"][3] == 25
    assert results["third"][0] == expected[0] and results["third"][3] == 25


def test_first_token_carries_queue_and_schedule_times(tiny_gqa_dir):
    # max_num_seqs=1: the second request waits in the queue while the first runs
    engine = tiny_engine(tiny_gqa_dir, max_num_seqs=1)
    engine.add_request(request("a", [5, 6, 7], max_tokens=3))
    engine.add_request(request("b", [8, 9], max_tokens=3))
    firsts, later = {}, []
    while engine.has_work():
        step = engine.step()
        for out in step.outputs:
            if out.request_id not in firsts:
                firsts[out.request_id] = (out, step.timestamp)
            else:
                later.append(out)
    for out, timestamp in firsts.values():
        assert 0 < out.queued_time <= out.scheduled_time <= timestamp
    assert firsts["b"][0].scheduled_time >= firsts["a"][1]  # b was scheduled once a had finished
    assert all(out.queued_time == out.scheduled_time == 0.0 for out in later)


def test_bad_requests_finish_with_error_and_engine_keeps_serving(tiny_gqa_dir):
    engine = tiny_engine(tiny_gqa_dir, max_model_len=64)
    engine.add_request(request("empty", []))
    engine.add_request(request("long", list(range(3, 80))))
    engine.add_request(request("vocab", [5, 10**6]))
    engine.add_request(request("ok", [5, 6, 7]))
    engine.add_request(request("ok", [5, 6, 7]))
    results = run_to_completion(engine)
    for rid in ("empty", "long", "vocab"):
        assert results[rid][1] == FinishReason.ERROR and results[rid][2], rid
    assert "longer than the maximum model length" in results["long"][2]
    assert results["ok"][1] == FinishReason.LENGTH and len(results["ok"][0]) == MAX_TOKENS


def test_max_tokens_is_clamped_to_the_context(tiny_gqa_dir):
    engine = tiny_engine(tiny_gqa_dir, max_model_len=32)
    engine.add_request(request("r", list(range(3, 23)), max_tokens=None))
    tokens, reason, _, _ = run_to_completion(engine)["r"]
    assert len(tokens) == 12 and reason == FinishReason.LENGTH


def test_abort_frees_blocks(tiny_gqa_dir):
    engine = tiny_engine(tiny_gqa_dir)
    free_at_start = engine.scheduler.get_stats().kv_cache_usage
    engine.add_request(request("r", list(range(3, 40)), max_tokens=200))
    engine.step()
    assert engine.scheduler.get_stats().kv_cache_usage > free_at_start
    engine.abort_requests(["r"])
    outputs = engine.step().outputs
    assert [(o.request_id, o.finish_reason) for o in outputs] == [("r", FinishReason.ABORT)]
    assert engine.scheduler.get_stats().kv_cache_usage == free_at_start
    assert not engine.has_work()


def test_utilities_are_allow_listed(tiny_gqa_dir):
    engine = tiny_engine(tiny_gqa_dir)
    assert engine.call_utility("echo", ("hi",)) == "hi"
    assert engine.call_utility("reset_prefix_cache", ()) is True
    assert engine.call_utility("collective_rpc", ("num_parameters",))[0] > 0
    with pytest.raises(ValueError, match="not an engine utility"):
        engine.call_utility("shutdown", ())
    with pytest.raises(ValueError, match="not a worker RPC"):
        engine.call_utility("collective_rpc", ("__init__",))


@pytest.mark.parametrize("level", [1, 2])
def test_sleep_abort_and_wake_up(tiny_gqa_dir, level):
    prompt = make_prompts(1, seed=3)[0]
    engine = tiny_engine(tiny_gqa_dir)
    engine.add_request(request("before", prompt, max_tokens=50))
    engine.step()
    engine.call_utility("sleep", (level, "abort"))
    assert engine.call_utility("is_sleeping", ())
    outputs = engine.step().outputs
    assert [(o.request_id, o.finish_reason) for o in outputs] == [("before", FinishReason.ABORT)]
    engine.add_request(request("during", prompt))
    assert not engine.step().outputs, "a sleeping engine admits nothing"
    engine.call_utility("wake_up", ())
    assert not engine.call_utility("is_sleeping", ())
    assert run_to_completion(engine)["during"][0] == hf_greedy(tiny_gqa_dir, [prompt])[0]


def test_sleep_wait_completes_once_running_requests_finish(tiny_gqa_dir):
    engine = tiny_engine(tiny_gqa_dir)
    engine.add_request(request("running", [5, 6, 7]))
    first = engine.step().outputs
    future = engine.call_utility("sleep", (1, "wait"))
    assert not future.done()
    engine.add_request(request("held", [5, 6, 7]))
    results = run_to_completion(engine)
    assert future.done() and engine.call_utility("is_sleeping", ())
    assert len(first[0].new_token_ids + results["running"][0]) == MAX_TOKENS and "held" not in results
    engine.call_utility("wake_up", ())
    assert len(run_to_completion(engine)["held"][0]) == MAX_TOKENS


def first_stop_candidate(model_dir, prompt: list[int]) -> int:
    """A token the greedy run of `prompt` produces early: as a stop token it would end it at once."""
    engine = tiny_engine(model_dir)
    engine.add_request(request("probe", prompt, max_tokens=4))
    return run_to_completion(engine)["probe"][0][1]


RESUMABLE = {
    "greedy": dict(),
    "seeded": dict(temperature=0.9, top_k=5, seed=11),
    "penalties": dict(temperature=0.8, top_k=5, seed=5, repetition_penalty=1.3, frequency_penalty=0.5),
    "min_tokens": dict(min_tokens=8),
}
"""Seeded rows draw among a few candidates: a random tiny model's distribution is nearly flat (top
probability 1e-4), and a resumed request's prefill computes its logits along another path than the
decode steps did, so over the whole vocabulary float noise alone could move a draw."""


@pytest.mark.parametrize("kind", RESUMABLE)
def test_a_resumed_request_continues_exactly_where_it_stopped(tiny_gqa_dir, kind):
    """What a restarted engine is sent: the prompt and the tokens already delivered, as output produced
    so far. It must generate what the uninterrupted request would have: max_tokens, min_tokens,
    penalties and the seeded stream all count the resumed tokens."""
    prompt = make_prompts(1, seed=3)[0]
    params = dict(RESUMABLE[kind], max_tokens=16)
    if kind == "min_tokens":  # a stop token the request would meet at once, held back by min_tokens
        params.update(ignore_eos=False, stop_token_ids=[first_stop_candidate(tiny_gqa_dir, prompt)])
    engine = tiny_engine(tiny_gqa_dir)
    engine.add_request(request("whole", prompt, **params))
    whole = run_to_completion(engine)["whole"]
    tokens, reason = whole[0], whole[1]
    assert len(tokens) >= 8
    fresh = tiny_engine(tiny_gqa_dir)  # a new engine, as after a restart
    for k in (1, 5, len(tokens) - 1):
        resumed = msgspec.structs.replace(
            request(f"r{k}", prompt, **params), resumed_output_token_ids=tokens[:k]
        )
        fresh.add_request(resumed)
        rest = run_to_completion(fresh)[f"r{k}"]
        assert tokens[:k] + rest[0] == tokens and rest[1] == reason, k


def test_a_resumed_request_must_leave_a_token_to_generate(tiny_gqa_dir):
    engine = tiny_engine(tiny_gqa_dir, max_model_len=64)
    done = msgspec.structs.replace(request("done", [5, 6, 7], max_tokens=4), resumed_output_token_ids=[9] * 4)
    bad = msgspec.structs.replace(request("bad", [5, 6, 7]), resumed_output_token_ids=[10**6])
    engine.add_request(done)
    engine.add_request(bad)
    results = run_to_completion(engine)
    assert results["done"][1] == FinishReason.ERROR and "at least one token left" in results["done"][2]
    assert results["bad"][1] == FinishReason.ERROR and "Resumed output token ids" in results["bad"][2]
