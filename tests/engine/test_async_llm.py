"""AsyncLLM over a real engine-core child process (tiny random-weight Llama, float32)."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

from nanoserve.core.scheduler import MAX_HELD_TOKENS
from nanoserve.engine.async_llm import AsyncLLM, IterationStats
from nanoserve.engine.exceptions import EngineDeadError
from nanoserve.entrypoints.llm import LLM
from nanoserve.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
LONG = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 100))


def make_engine(tiny_gqa_dir, **kwargs) -> AsyncLLM:
    return AsyncLLM(str(tiny_gqa_dir), dtype="float32", max_model_len=256, **kwargs)


async def wait_until(predicate, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        await asyncio.sleep(0.02)
    return predicate()


@pytest.mark.timeout(120)
def test_generate_matches_llm_and_streams_deltas(tiny_gqa_dir):
    llm = LLM(str(tiny_gqa_dir), dtype="float32", max_model_len=256)
    try:
        expected = llm.generate(["Once upon a time", "Hello"], GREEDY, use_tqdm=False)
    finally:
        llm.shutdown()

    async def main():
        engine = make_engine(tiny_gqa_dir)
        try:
            cumulative = [out async for out in engine.generate("Once upon a time", GREEDY, "a")]
            deltas = [
                out async for out in engine.generate("Once upon a time", GREEDY, "b", output_kind="delta")
            ]
            token_ids = [
                out
                async for out in engine.generate({"prompt_token_ids": expected[1].prompt_token_ids}, GREEDY)
            ]
            # outputs that reach a lagging consumer are merged: 12 fast steps may come as one, 200 do not
            long = [out async for out in engine.generate("Once upon a time", LONG, "long")]
            return cumulative, deltas, token_ids, long
        finally:
            engine.shutdown()

    cumulative, deltas, token_ids, long = run(main())
    final = cumulative[-1].outputs[0]
    assert cumulative[-1].finished and not any(o.finished for o in cumulative[:-1])
    assert final.token_ids == expected[0].outputs[0].token_ids and final.text == expected[0].outputs[0].text
    assert len(long) > 1 and long[-1].finished and not any(o.finished for o in long[:-1])  # it streamed
    assert long[-1].outputs[0].token_ids[: len(final.token_ids)] == final.token_ids
    assert "".join(d.outputs[0].text for d in deltas) == final.text
    assert sum((d.outputs[0].token_ids for d in deltas), []) == final.token_ids
    assert token_ids[-1].outputs[0].token_ids == expected[1].outputs[0].token_ids


@pytest.mark.timeout(120)
def test_concurrent_requests_n_and_stats(tiny_gqa_dir):
    recorded: list[IterationStats] = []

    async def main():
        engine = make_engine(tiny_gqa_dir, stat_loggers=[lambda sched, stats: recorded.append(stats)])
        try:

            async def final(i: int):
                params = SamplingParams(temperature=0.8, seed=i, max_tokens=5 + i, ignore_eos=True, n=2)
                outs = [out async for out in engine.generate(f"Prompt {i}", params, f"r{i}")]
                return outs[-1]

            return await asyncio.gather(*(final(i) for i in range(8)))
        finally:
            engine.shutdown()

    finals = run(main())
    for i, out in enumerate(finals):
        assert [len(c.token_ids) for c in out.outputs] == [5 + i, 5 + i]
        assert [c.finish_reason for c in out.outputs] == ["length", "length"]
    assert sum(s.num_generation_tokens for s in recorded) == sum(2 * (5 + i) for i in range(8))
    finished = [f for s in recorded for f in s.finished]
    assert len(finished) == 8 and all(f.finish_reason == "length" for f in finished)
    assert sorted(f.request_id for f in finished) == [f"r{i}" for i in range(8)]
    assert all(
        f.time_to_first_token is not None and 0 < f.time_to_first_token <= f.e2e_latency for f in finished
    )
    assert sum(len(s.time_to_first_tokens) for s in recorded) == 8


@pytest.mark.timeout(120)
def test_final_output_only_request_gets_the_first_token_then_chunks(tiny_gqa_dir):
    """What the server does for a request without `stream`: the same result as a streamed request, from
    1 + ceil(199 / MAX_HELD_TOKENS) engine outputs instead of 200, with its time to first token."""
    recorded: list[IterationStats] = []

    async def final(engine: AsyncLLM, request_id: str, final_output_only: bool):
        stream = await engine.add_request(request_id, "Once upon a time", LONG, final_output_only)
        return [out async for out in engine.iterate(stream)][-1]

    async def main():
        engine = make_engine(tiny_gqa_dir, stat_loggers=[lambda sched, stats: recorded.append(stats)])
        try:
            streamed = await final(engine, "streamed", False)
            outputs_streamed = sum(1 for s in recorded if s.num_generation_tokens)
            recorded.clear()
            held = await final(engine, "held", True)
            return streamed, outputs_streamed, held
        finally:
            engine.shutdown()

    streamed, outputs_streamed, held = run(main())
    assert held.outputs[0].token_ids == streamed.outputs[0].token_ids
    assert held.outputs[0].text == streamed.outputs[0].text and len(held.outputs[0].token_ids) == 200
    assert outputs_streamed == 200
    assert sum(1 for s in recorded if s.num_generation_tokens) == 1 - (-199 // MAX_HELD_TOKENS)
    first = next(s for s in recorded if s.num_generation_tokens)
    assert first.num_generation_tokens == 1 and len(first.time_to_first_tokens) == 1


@pytest.mark.timeout(120)
def test_cancelling_the_consumer_aborts_in_the_engine(tiny_gqa_dir):
    async def main():
        engine = make_engine(tiny_gqa_dir)
        try:
            params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
            got_one = asyncio.Event()

            async def consume():
                async for _ in engine.generate("Tell me a story", params, "long"):
                    got_one.set()

            task = asyncio.create_task(consume())
            await got_one.wait()
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert "long" not in engine.streams
            assert not engine.output_processor.has_unfinished_requests()
            # the engine reports the request gone and its KV blocks free
            assert await wait_until(
                lambda: (
                    engine.last_scheduler_stats is not None
                    and engine.last_scheduler_stats.num_running_reqs == 0
                    and engine.last_scheduler_stats.kv_cache_usage == 0
                )
            )
            # breaking out of the loop aborts too, and the engine serves on
            async for _ in engine.generate("Tell me a story", params, "broken"):
                break
            outs = [o async for o in engine.generate("Hi", GREEDY, "after")]
            assert len(outs[-1].outputs[0].token_ids) == 12
            await engine.check_health()
        finally:
            engine.shutdown()

    run(main())


@pytest.mark.timeout(120)
def test_invalid_requests_raise_value_error(tiny_gqa_dir):
    async def main():
        engine = make_engine(tiny_gqa_dir)
        try:
            with pytest.raises(ValueError, match="longer than the maximum model length"):
                await engine.add_request("x", list(range(1, 300)), GREEDY)
            with pytest.raises(ValueError, match="out of the vocabulary"):
                await engine.add_request("y", [1, 10**9], GREEDY)
            stream = await engine.add_request("dup", "hi", GREEDY)
            with pytest.raises(ValueError, match="already running"):
                await engine.add_request("dup", "hi", GREEDY)
            outs = [o async for o in engine.iterate(stream)]
            assert outs[-1].finished and not engine.streams
        finally:
            engine.shutdown()

    run(main())


@pytest.mark.timeout(120)
def test_engine_death_fails_open_streams_and_later_calls(tiny_gqa_dir):
    async def main():
        engine = make_engine(tiny_gqa_dir)
        try:
            params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
            streams = [engine.generate("Tell me a story", params, f"s{i}") for i in range(3)]
            firsts = [await s.__anext__() for s in streams]
            assert all(not f.finished for f in firsts)
            os.kill(engine.engine_core.engine_pids()[0], signal.SIGKILL)
            killed_at = time.monotonic()
            for s in streams:
                with pytest.raises(EngineDeadError, match="SIGKILL"):
                    async for _ in s:
                        pass
            assert time.monotonic() - killed_at < 10  # about 0.1 s when idle; margin for a loaded machine
            assert engine.errored
            with pytest.raises(EngineDeadError):
                await engine.check_health()
            with pytest.raises(EngineDeadError):
                async for _ in engine.generate("hi", GREEDY):
                    pass
        finally:
            engine.shutdown()

    run(main())


@pytest.mark.timeout(120)
def test_hang_detection_and_shutdown(tiny_gqa_dir):
    async def main():
        engine = make_engine(tiny_gqa_dir)
        params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
        gen = engine.generate("Tell me a story", params, "h")
        await gen.__anext__()
        assert not engine.is_hung(60)
        engine.last_output_time -= 120  # as if the engine had been silent for two minutes
        assert engine.is_hung(60)
        with pytest.raises(EngineDeadError, match="no output"):
            await engine.check_health(60)
        pid = engine.engine_core.engine_pids()[0]
        engine.shutdown()
        engine.shutdown()  # idempotent
        with pytest.raises(EngineDeadError):
            async for _ in gen:
                pass
        return pid

    pid = run(main())
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
