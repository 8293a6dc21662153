"""Engines that come back (`engine_restarts`): a killed engine core is restarted on its rank and its
unfinished requests resume where they were, through every client; past the budget the death is final.
Also: outputs an engine sent before it died reach the frontend before the error.

Real processes throughout. Timing bounds are generous on purpose (this suite runs on a loaded 2-core
machine): every wait is for a condition, with a deadline far from the normal case."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
import textwrap
import threading
import time
from pathlib import Path

import msgspec
import pytest

from nanoserve.config import EngineOptions
from nanoserve.core.scheduler import MAX_HELD_TOKENS
from nanoserve.engine.core_client.async_mp import AsyncMPClient
from nanoserve.engine.core_client.dp import DPLBAsyncMPClient
from nanoserve.engine.core_client.liveness import RankState
from nanoserve.engine.core_client.sync_mp import SyncMPClient
from nanoserve.engine.exceptions import EngineDeadError
from nanoserve.sampling_params import SamplingParams
from nanoserve.wire.messages import EngineCoreRequest, FinishReason

RESTART_WAIT_S = 120.0
"""A respawn imports torch and loads the model again: seconds normally, far more on a loaded machine."""

FAULTS_SITECUSTOMIZE = textwrap.dedent(
    """
    import os

    _marker = os.environ.get("NANOSERVE_TEST_FAIL_START_IF")
    _exit_after = os.environ.get("NANOSERVE_TEST_EXIT_AFTER_STEPS")
    if _marker or _exit_after:
        import nanoserve.core.engine_core as _ec

    if _marker:
        _init = _ec.EngineCore.__init__

        def _failing_init(self, *args, **kwargs):
            if os.path.exists(_marker):
                raise RuntimeError("injected start fault")
            _init(self, *args, **kwargs)

        _ec.EngineCore.__init__ = _failing_init

    if _exit_after:
        import time

        _post_step = _ec.EngineCore.post_step
        _steps = [0]

        def _exiting_post_step(self):
            _post_step(self)
            _steps[0] += 1
            if _steps[0] >= int(_exit_after):
                time.sleep(0.5)  # the output thread sends what this step produced
                os._exit(3)

        _ec.EngineCore.post_step = _exiting_post_step
    """
)


@pytest.fixture
def faults(tmp_path, monkeypatch) -> Path:
    """Engine children get FAULTS_SITECUSTOMIZE; returns a marker path (tests set the variables)."""
    (tmp_path / "sitecustomize.py").write_text(FAULTS_SITECUSTOMIZE)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    return tmp_path / "fail-starts"


def tiny_options(model_dir: Path) -> EngineOptions:
    return EngineOptions(
        model=str(model_dir), dtype="float32", num_kv_blocks=256, num_threads=1, engine_restarts=1
    )


def mp_client(engine) -> AsyncMPClient:
    """The AsyncLLM's client, as the multiprocess client it is."""
    client = engine.engine_core
    assert isinstance(client, AsyncMPClient)
    return client


def mixed_requests(n: int, max_tokens: int, prefix: str = "req") -> list[EngineCoreRequest]:
    """Greedy and seeded alternately. Seeded rows draw among a few candidates: a random tiny model's
    distribution is nearly flat, and float noise between a resumed prefill and the decode steps it
    replaces must not move a draw (see tests/core/test_engine_core.py)."""
    out = []
    for i in range(n):
        if i % 2:
            params = SamplingParams(
                temperature=0.9, top_k=5, seed=100 + i, max_tokens=max_tokens, ignore_eos=True
            )
        else:
            params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        out.append(EngineCoreRequest(f"{prefix}-{i}", [11 + i, 200 + i, 3000 + i, 7, 9], params))
    return out


def renamed(requests: list[EngineCoreRequest], prefix: str) -> list[EngineCoreRequest]:
    return [msgspec.structs.replace(r, request_id=f"{prefix}-{i}") for i, r in enumerate(requests)]


def run_sync(
    client: SyncMPClient, requests: list[EngineCoreRequest], kill_after_tokens: int | None = None
) -> list:
    """Every request's tokens (in request order); with `kill_after_tokens`, SIGKILL the engine once each
    request has that many."""
    tokens: dict[str, list[int]] = {r.request_id: [] for r in requests}
    done: set[str] = set()
    for r in requests:
        client.add_request(r)
    killed = kill_after_tokens is None
    while len(done) < len(requests):
        for o in client.get_output(timeout=RESTART_WAIT_S).outputs:
            tokens[o.request_id] += o.new_token_ids
            if o.finish_reason is not None:
                assert o.finish_reason == FinishReason.LENGTH, o
                done.add(o.request_id)
        if (
            kill_after_tokens is not None
            and not killed
            and min(map(len, tokens.values())) >= kill_after_tokens
        ):
            assert not done, "requests finished before the kill: make them longer"
            os.kill(client.engine_pids()[0], signal.SIGKILL)
            killed = True
    return [tokens[r.request_id] for r in requests]


def wait_until(condition, timeout: float = RESTART_WAIT_S) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.02)


@pytest.mark.timeout(300)
def test_sync_client_restarts_a_killed_engine_and_resumes_its_requests(tiny_gqa_dir):
    requests = mixed_requests(6, max_tokens=300)
    client = SyncMPClient(tiny_options(tiny_gqa_dir))
    try:
        expected = run_sync(client, requests)
        pid = client.engine_pids()[0]
        assert run_sync(client, renamed(requests, "again"), kill_after_tokens=3) == expected
        assert client.engine_pids()[0] != pid
        assert client.liveness.restart_counts() == {0: 1} and client.liveness.state(0) is RankState.ALIVE
        assert not client.ledger.entries  # what finished is forgotten
        assert client.call_utility("reset_prefix_cache") in (True, False)
    finally:
        client.shutdown()


@pytest.mark.timeout(300)
def test_a_speculative_engine_restarts_and_delivers_each_accepted_token_once(tiny_gqa_dir):
    """Outputs carry several tokens (accepted drafts): the ledger replays exactly what was delivered."""
    requests = mixed_requests(4, max_tokens=300)
    options = dataclasses.replace(tiny_options(tiny_gqa_dir), speculative="ngram")
    client = SyncMPClient(options)
    try:
        expected = run_sync(client, requests)
        assert run_sync(client, renamed(requests, "again"), kill_after_tokens=3) == expected
        assert client.liveness.restart_counts() == {0: 1}
        client.add_request(renamed(requests[:1], "stats")[0])
        stats = client.get_output(timeout=RESTART_WAIT_S).scheduler_stats
        assert stats is not None and stats.num_accepted_tokens > 0  # the new engine's drafts since it started
    finally:
        client.shutdown()


@pytest.mark.timeout(300)
def test_llm_generate_across_an_engine_kill_matches_an_undisturbed_run(tiny_gqa_dir):
    from nanoserve.entrypoints.llm import LLM

    prompts = ["The quick brown fox", "Hello there", "One two three four five", "a b c", "Once upon"]
    params = [
        SamplingParams(temperature=0.0, max_tokens=300, ignore_eos=True),
        SamplingParams(temperature=0.8, top_k=5, seed=3, max_tokens=300, ignore_eos=True),
    ]
    params = [params[i % 2] for i in range(len(prompts))]
    llm = LLM(str(tiny_gqa_dir), engine_restarts=1, dtype="float32", num_kv_blocks=256, num_threads=1)
    try:
        expected = llm.generate(prompts, params, use_tqdm=False)
        assert llm.llm_engine is not None
        client = llm.llm_engine.engine_core
        assert isinstance(client, SyncMPClient)
        pid = client.engine_pids()[0]

        def kill_mid_generation() -> None:
            def all_started() -> bool:
                with client.liveness.lock:
                    counts = [len(e.token_ids) for e in client.ledger.entries.values()]
                return len(counts) == len(prompts) and min(counts) >= MAX_HELD_TOKENS

            wait_until(all_started)
            os.kill(pid, signal.SIGKILL)

        killer = threading.Thread(target=kill_mid_generation, daemon=True)
        killer.start()
        got = llm.generate(prompts, params, use_tqdm=False)
        killer.join(10)
        assert client.liveness.restart_counts() == {0: 1} and client.engine_pids()[0] != pid
        for want, have in zip(expected, got, strict=True):
            assert have.outputs[0].token_ids == want.outputs[0].token_ids
            assert have.outputs[0].text == want.outputs[0].text
            assert len(have.outputs[0].token_ids) == 300
    finally:
        llm.shutdown()


async def stream_text(engine, prompt: str, params: SamplingParams, request_id: str, progress: dict) -> str:
    text = ""
    async for out in engine.generate(prompt, params, request_id):
        text = out.outputs[0].text
        progress[request_id] = len(out.outputs[0].token_ids)
    return text


def stream_params(i: int) -> SamplingParams:
    if i % 2:
        return SamplingParams(temperature=0.9, top_k=5, seed=40 + i, max_tokens=400, ignore_eos=True)
    return SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)


async def run_streams(engine, n: int, prefix: str, kill=None) -> list[str]:
    """n concurrent streams; `kill()` is called once every stream has a few tokens. The streams start
    generating together (the engine sleeps, holding what it is sent, until all are in), so none is
    far ahead of the others at the kill."""
    progress: dict[str, int] = {}
    ids = [f"{prefix}-{i}" for i in range(n)]
    if kill is not None:
        await engine.sleep(1)
    tasks = [
        asyncio.create_task(stream_text(engine, f"Story number {i}:", stream_params(i), rid, progress))
        for i, rid in enumerate(ids)
    ]
    if kill is not None:
        deadline = time.monotonic() + RESTART_WAIT_S
        while not set(ids) <= engine.streams.keys():
            assert time.monotonic() < deadline and not [t.result() for t in tasks if t.done()]
            await asyncio.sleep(0.01)
        await engine.wake_up()
        while not (len(progress) == n and min(progress.values()) >= 2):
            assert time.monotonic() < deadline and not [t.result() for t in tasks if t.done()]
            await asyncio.sleep(0.01)
        kill()
    return list(await asyncio.wait_for(asyncio.gather(*tasks), RESTART_WAIT_S))


@pytest.mark.timeout(300)
def test_async_llm_streams_resume_after_a_kill_then_the_next_death_is_final(tiny_gqa_dir):
    from nanoserve.engine.async_llm import AsyncLLM

    async def main() -> None:
        engine = AsyncLLM(
            str(tiny_gqa_dir), engine_restarts=1, dtype="float32", num_kv_blocks=256, num_threads=1
        )
        try:
            expected = await run_streams(engine, 8, "calm")
            pid = mp_client(engine).engine_pids()[0]
            seen_restarting = []

            def kill() -> None:
                os.kill(pid, signal.SIGKILL)

            async def watch_health() -> None:
                while not engine.engine_restarts.get(0) or engine.restarting_ranks:
                    if engine.restarting_ranks:
                        seen_restarting.append(True)
                        await engine.check_health(hang_timeout_s=0.01)  # a restart is not a hang
                    await asyncio.sleep(0.01)

            watcher = asyncio.create_task(watch_health())
            assert await run_streams(engine, 8, "killed", kill) == expected
            await asyncio.wait_for(watcher, RESTART_WAIT_S)
            assert seen_restarting and not engine.errored and engine.engine_restarts == {0: 1}

            # the budget is spent: the next death is final, and every open stream fails with its cause
            progress: dict[str, int] = {}
            endless = SamplingParams(temperature=0.0, max_tokens=480, ignore_eos=True)
            tasks = [
                asyncio.create_task(stream_text(engine, "x", endless, f"last-{i}", progress))
                for i in range(3)
            ]
            while len(progress) < 3:
                assert not any(t.done() for t in tasks)
                await asyncio.sleep(0.005)
            killed_at = time.monotonic()
            os.kill(mp_client(engine).engine_pids()[0], signal.SIGKILL)
            for task in tasks:
                with pytest.raises(EngineDeadError, match="killed by SIGKILL") as dead:
                    await asyncio.wait_for(task, 30)
                assert "died 2 times" in str(dead.value)
            # 2 s when idle; the bound leaves room for a loaded machine
            assert time.monotonic() - killed_at < 10
            assert engine.errored and not engine.restarting_ranks
            with pytest.raises(EngineDeadError):
                await engine.check_health()
        finally:
            engine.shutdown()

    asyncio.run(main())


@pytest.mark.timeout(300)
def test_one_rank_of_two_restarts_while_the_other_serves_on(tiny_gqa_dir):
    from nanoserve.engine.async_llm import AsyncLLM

    async def main() -> None:
        engine = AsyncLLM(
            str(tiny_gqa_dir), engine_restarts=1, data_parallel_size=2, dtype="float32", num_kv_blocks=256
        )
        client = engine.engine_core
        assert isinstance(client, DPLBAsyncMPClient)
        try:
            expected = await run_streams(engine, 8, "calm")
            assert set(client.balancer.num_routed) == {0, 1}
            pids = client.engine_pids()
            ranks = {}
            balancer = client.balancer

            def kill() -> None:
                ranks.update({rid: balancer.owner(rid) for rid in engine.streams})
                os.kill(pids[1], signal.SIGKILL)

            assert await run_streams(engine, 8, "killed", kill) == expected
            assert set(ranks.values()) == {0, 1}  # both ranks held streams when rank 1 was killed
            assert engine.engine_restarts == {0: 0, 1: 1} and not engine.dead_ranks and not engine.errored
            new_pids = client.engine_pids()
            assert new_pids[0] == pids[0] and new_pids[1] != pids[1]
        finally:
            engine.shutdown()

    asyncio.run(main())


@pytest.mark.timeout(300)
def test_an_engine_that_dies_at_every_start_ends_with_a_readable_error(faults, monkeypatch):
    monkeypatch.setenv("NANOSERVE_TEST_FAIL_START_IF", str(faults))
    client = SyncMPClient(EngineOptions(runner="null", engine_restarts=2))
    try:
        client.add_request(mixed_requests(1, max_tokens=10**6)[0])
        client.get_output(timeout=30)
        faults.write_text("from now on every start fails")
        os.kill(client.engine_pids()[0], signal.SIGKILL)
        with pytest.raises(EngineDeadError) as dead:
            while True:
                client.get_output(timeout=RESTART_WAIT_S)
        message = str(dead.value)
        assert "died 3 times" in message and "budget of 2 restart(s)" in message
        assert "First death: Engine core 0 is dead; killed by SIGKILL" in message
        assert "failed during start-up" in message and "RuntimeError: injected start fault" in message
        assert client.liveness.restart_counts() == {0: 2} and client.engine_dead
        with pytest.raises(EngineDeadError):
            client.add_request(mixed_requests(1, max_tokens=5, prefix="late")[0])
    finally:
        client.shutdown()


@pytest.mark.timeout(120)
def test_a_sleeping_engine_restarts_asleep_and_keeps_what_it_held():
    client = SyncMPClient(EngineOptions(runner="null", engine_restarts=1))
    try:
        client.sleep(1)
        held = EngineCoreRequest(
            "held", [5, 6, 7], SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
        )
        client.add_request(held)
        os.kill(client.engine_pids()[0], signal.SIGKILL)
        wait_until(
            lambda: client.liveness.restart_counts() == {0: 1} and client.liveness.state(0) is RankState.ALIVE
        )
        assert client.is_sleeping() is True
        with pytest.raises(TimeoutError):
            client.get_output(timeout=0.5)  # still held: admitted on wake_up
        client.wake_up()
        out = client.get_output(timeout=30)
        tokens = list(out.outputs[0].new_token_ids)
        while out.outputs[-1].finish_reason is None:
            out = client.get_output(timeout=30)
            tokens += out.outputs[0].new_token_ids
        assert len(tokens) == 5 and out.outputs[-1].finish_reason == FinishReason.LENGTH
    finally:
        client.shutdown()


@pytest.mark.timeout(120)
def test_a_utility_call_in_flight_at_the_death_fails_and_the_restarted_engine_answers():
    client = SyncMPClient(EngineOptions(runner="null", engine_restarts=1))
    try:
        client.add_request(mixed_requests(1, max_tokens=10**6)[0])
        client.get_output(timeout=30)
        # stopped, the engine cannot finish the request (the null runner would, at its context length, within
        # a second) and so cannot answer the sleep before it is killed
        os.kill(client.engine_pids()[0], signal.SIGSTOP)
        result: list = []
        waiter = threading.Thread(target=lambda: result.append(_capture(lambda: client.sleep(1, "wait"))))
        waiter.start()
        wait_until(lambda: len(client.utilities) == 1)
        os.kill(client.engine_pids()[0], signal.SIGKILL)
        waiter.join(30)
        assert isinstance(result[0], EngineDeadError) and "SIGKILL" in str(result[0])  # not replayed
        assert client.call_utility("echo", "back", timeout=RESTART_WAIT_S) == "back"  # waits for the restart
        assert client.is_sleeping() is False
        client.abort_requests(["req-0"])
    finally:
        client.shutdown()


def _capture(fn):
    try:
        return fn()
    except BaseException as e:
        return e


@pytest.mark.timeout(120)
def test_outputs_sent_before_an_engine_exits_are_delivered_before_the_error(faults, monkeypatch):
    monkeypatch.setenv("NANOSERVE_TEST_EXIT_AFTER_STEPS", "3")
    request = EngineCoreRequest(
        "last", [5, 6, 7], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    )
    client = SyncMPClient(EngineOptions(runner="null"))
    try:
        client.add_request(request)
        wait_until(lambda: client.engine_dead, 60)  # the engine sent its last outputs and exited
        tokens, reasons = [], []
        with pytest.raises(EngineDeadError, match="exit code 3"):
            while True:
                for o in client.get_output(timeout=10).outputs:
                    tokens += o.new_token_ids
                    reasons.append(o.finish_reason)
        assert len(tokens) == 3 and reasons[-1] == FinishReason.LENGTH
    finally:
        client.shutdown()

    async def main() -> None:
        client = AsyncMPClient(EngineOptions(runner="null"))
        try:
            await client.add_request_async(request)
            while not client.engine_dead:
                await asyncio.sleep(0.02)
            await asyncio.sleep(0.1)  # the reader task runs: what arrived is queued before the death
            tokens = []
            with pytest.raises(EngineDeadError, match="exit code 3"):
                while True:
                    for o in (await client.get_output_async(timeout=10)).outputs:
                        tokens += o.new_token_ids
            assert len(tokens) == 3
        finally:
            client.shutdown()

    asyncio.run(main())
