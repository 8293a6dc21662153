"""The multiprocess clients against real engine-core child processes: factory, parity with the
in-process client, utilities, sleep/wake, abort, timeouts, start-up failures."""

from __future__ import annotations

import asyncio
import os
import threading
import time

import numpy as np
import psutil
import pytest
import zmq

from nanoserve.config import EngineOptions
from nanoserve.engine.core_client.async_mp import READ_BURST, AsyncMPClient, AsyncOutputReader
from nanoserve.engine.core_client.base import EngineCoreClient
from nanoserve.engine.core_client.inproc import InprocClient
from nanoserve.engine.core_client.sync_mp import SyncMPClient
from nanoserve.engine.exceptions import EngineDeadError, EngineStartupError
from nanoserve.sampling_params import SamplingParams
from nanoserve.wire.messages import EngineCoreRequest, FinishReason

NULL = EngineOptions(runner="null")


def requests(n: int, max_tokens: int = 8, seeded: bool = False) -> list[EngineCoreRequest]:
    out = []
    for i in range(n):
        params = (
            SamplingParams(temperature=0.8, top_p=0.9, seed=100 + i, max_tokens=max_tokens, ignore_eos=True)
            if seeded and i % 2
            else SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        )
        out.append(EngineCoreRequest(f"req-{i}", [1 + i, 20 + i, 300 + i, 7], params))
    return out


def run_sync(
    client: EngineCoreClient, reqs: list[EngineCoreRequest], timeout: float = 30
) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {r.request_id: [] for r in reqs}
    finished: dict[str, FinishReason] = {}
    for r in reqs:
        client.add_request(r)
    deadline = time.monotonic() + timeout
    while len(finished) < len(reqs):
        assert time.monotonic() < deadline, "requests did not finish"
        for o in client.get_output(timeout=timeout).outputs:
            tokens[o.request_id] += o.new_token_ids
            if o.finish_reason is not None:
                finished[o.request_id] = o.finish_reason
    assert all(reason == FinishReason.LENGTH for reason in finished.values()), finished
    return tokens


async def run_async(client: AsyncMPClient, reqs: list[EngineCoreRequest]) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {r.request_id: [] for r in reqs}
    done = 0
    for r in reqs:
        await client.add_request_async(r)
    while done < len(reqs):
        for o in (await client.get_output_async(timeout=30)).outputs:
            tokens[o.request_id] += o.new_token_ids
            done += o.finish_reason is not None
    return tokens


def inproc_tokens(options: EngineOptions, reqs: list[EngineCoreRequest]) -> dict[str, list[int]]:
    client = InprocClient(options)
    try:
        return run_sync(client, reqs)
    finally:
        client.shutdown()


@pytest.fixture
def sync_client():
    client = SyncMPClient(NULL)
    yield client
    client.shutdown()


# -- factory -----------------------------------------------------------------------------------------


@pytest.mark.timeout(120)
def test_factory_all_four_combinations():
    inproc = EngineCoreClient.make_client(multiprocess_mode=False, asyncio_mode=False, options=NULL)
    assert type(inproc) is InprocClient
    inproc.shutdown()
    sync = EngineCoreClient.make_client(multiprocess_mode=True, asyncio_mode=False, options=NULL)
    try:
        assert type(sync) is SyncMPClient
    finally:
        sync.shutdown()
    async_client = EngineCoreClient.make_client(multiprocess_mode=True, asyncio_mode=True, options=NULL)
    try:
        assert type(async_client) is AsyncMPClient
    finally:
        async_client.shutdown()
    with pytest.raises(NotImplementedError, match="multiprocess"):
        EngineCoreClient.make_client(multiprocess_mode=False, asyncio_mode=True, options=NULL)


# -- parity with the in-process client --------------------------------------------------------------------


@pytest.mark.timeout(120)
def test_null_runner_sync_and_async_match_inproc():
    reqs = requests(6, max_tokens=12, seeded=True)
    expected = inproc_tokens(NULL, reqs)
    sync = SyncMPClient(NULL)
    try:
        assert run_sync(sync, reqs) == expected
    finally:
        sync.shutdown()

    async def main():
        client = AsyncMPClient(NULL)
        try:
            return await run_async(client, reqs)
        finally:
            client.shutdown()

    assert asyncio.run(main()) == expected


@pytest.mark.timeout(300)
def test_tiny_models_mp_match_inproc_greedy_and_seeded(tiny_model_dir):
    options = EngineOptions(model=str(tiny_model_dir), dtype="float32", num_kv_blocks=64, num_threads=1)
    reqs = requests(4, max_tokens=10, seeded=True)
    expected = inproc_tokens(options, reqs)
    client = SyncMPClient(options)
    try:
        assert run_sync(client, reqs, timeout=120) == expected
        assert client.ready_response.num_kv_blocks == 64
    finally:
        client.shutdown()


@pytest.mark.timeout(600)
def test_bundled_model_mp_matches_inproc(bundled_gguf_path):
    options = EngineOptions(model=bundled_gguf_path, dtype="float32", num_kv_blocks=64)
    reqs = requests(2, max_tokens=6, seeded=True)
    expected = inproc_tokens(options, reqs)
    client = SyncMPClient(options)
    try:
        assert run_sync(client, reqs, timeout=300) == expected
    finally:
        client.shutdown()


@pytest.mark.timeout(120)
def test_ready_response_applied_without_touching_options():
    options = EngineOptions(runner="null", num_kv_blocks=32, block_size=16)
    client = SyncMPClient(options)
    try:
        ready = client.ready_response
        assert ready.num_kv_blocks == 32 and ready.block_size == 16
        assert ready.max_model_len == 32 * 16  # fitted to the KV cache
        assert options.max_model_len is None  # the user's options are left as given
    finally:
        client.shutdown()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("start_method", ["fork", "forkserver"])
def test_other_start_methods(start_method):
    client = SyncMPClient(EngineOptions(runner="null", engine_start_method=start_method))
    try:
        assert run_sync(client, requests(2)) == inproc_tokens(NULL, requests(2))
    finally:
        client.shutdown()


@pytest.mark.timeout(120)
def test_tcp_transport():
    client = SyncMPClient(EngineOptions(runner="null", transport="tcp"))
    try:
        assert run_sync(client, requests(2)) == inproc_tokens(NULL, requests(2))
    finally:
        client.shutdown()


# -- utilities -----------------------------------------------------------------------------------------


@pytest.mark.timeout(120)
def test_sync_utilities(sync_client):
    assert sync_client.call_utility("echo", "hello") == "hello"
    assert sync_client.call_utility("echo", {"a": [1, 2]}) == {"a": [1, 2]}
    arr = np.arange(10_000, dtype=np.float32)  # travels out of band both ways
    np.testing.assert_array_equal(sync_client.call_utility("echo", arr), arr)
    assert sync_client.collective_rpc("describe") == ["null runner"]
    with pytest.raises(RuntimeError, match="Call to save_sharded_state failed: ValueError: The null runner"):
        sync_client.save_sharded_state("/tmp/nowhere")
    with pytest.raises(RuntimeError, match="not an engine utility"):
        sync_client.call_utility("shutdown")  # not on the allow-list
    with pytest.raises(RuntimeError, match="failed"):
        sync_client.call_utility("echo")  # bad arguments: a failure message, the engine lives on
    assert sync_client.reset_prefix_cache() in (True, False)
    assert sync_client.call_utility("echo", 5) == 5
    assert not sync_client.utilities


@pytest.mark.timeout(120)
def test_async_utilities_and_cancelled_future():
    async def main():
        client = AsyncMPClient(NULL)
        try:
            assert await client.call_utility_async("echo", [1, "x"]) == [1, "x"]
            with pytest.raises(RuntimeError, match="not an engine utility"):
                await client.call_utility_async("nope")
            # a sleep(mode="wait") stays pending while a request runs; cancel its caller meanwhile
            await client.add_request_async(requests(1, max_tokens=8000)[0])
            await client.get_output_async(timeout=10)
            task = asyncio.create_task(client.sleep_async(1, "wait"))
            await asyncio.sleep(0)  # the call is sent and its future registered
            assert client.utilities
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            while not (await client.get_output_async(timeout=30)).finished_requests:
                pass
            # the answer to the cancelled call arrives and is dropped; the client keeps working
            assert await client.is_sleeping_async() is True
            await client.wake_up_async()
            assert await client.is_sleeping_async() is False
            assert await client.call_utility_async("echo", 7, timeout=10) == 7
        finally:
            client.shutdown()

    asyncio.run(main())


@pytest.mark.timeout(120)
def test_utility_and_get_output_timeouts(sync_client):
    with pytest.raises(TimeoutError):
        sync_client.get_output(timeout=0.2)
    sync_client.add_request(requests(1, max_tokens=8000)[0])
    with pytest.raises(TimeoutError, match="sleep"):
        sync_client.call_utility("sleep", 1, "wait", timeout=0.01)
    assert not sync_client.utilities
    sync_client.abort_requests(["req-0"])
    assert sync_client.call_utility("echo", 1, timeout=10) == 1


# -- sleep / wake, abort ----------------------------------------------------------------------------------


def drain_until_finished(client: SyncMPClient, request_id: str) -> tuple[list[int], FinishReason]:
    tokens = []
    while True:
        for o in client.get_output(timeout=30).outputs:
            if o.request_id == request_id:
                tokens += o.new_token_ids
                if o.finish_reason is not None:
                    return tokens, o.finish_reason


@pytest.mark.timeout(120)
def test_sleep_abort_mode(sync_client):
    req = requests(1, max_tokens=8000)[0]
    sync_client.add_request(req)
    sync_client.get_output(timeout=10)
    sync_client.sleep(1, "abort")
    _, reason = drain_until_finished(sync_client, req.request_id)
    assert reason == FinishReason.ABORT
    assert sync_client.is_sleeping()
    sync_client.wake_up()
    assert not sync_client.is_sleeping()
    assert run_sync(sync_client, requests(2)) == inproc_tokens(NULL, requests(2))


@pytest.mark.timeout(120)
def test_sleep_wait_mode_finishes_running_requests_and_holds_new_ones(sync_client):
    first = EngineCoreRequest(
        "first", [5, 6, 7], SamplingParams(temperature=0.0, max_tokens=300, ignore_eos=True)
    )
    sync_client.add_request(first)
    seen = len(sync_client.get_output(timeout=10).outputs[0].new_token_ids)
    sync_client.sleep(1, "wait")  # returns once `first` has finished
    assert sync_client.is_sleeping()
    tokens, reason = drain_until_finished(sync_client, "first")
    assert reason == FinishReason.LENGTH and seen + len(tokens) == 300
    held = EngineCoreRequest(
        "held", [5, 6, 7], SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    )
    sync_client.add_request(held)
    with pytest.raises(TimeoutError):
        sync_client.get_output(timeout=0.3)  # admitted only after wake_up
    sync_client.wake_up()
    tokens, reason = drain_until_finished(sync_client, "held")
    assert reason == FinishReason.LENGTH and len(tokens) == 5


@pytest.mark.timeout(120)
def test_abort_mid_generation_frees_kv_blocks(sync_client):
    req = requests(1, max_tokens=8000)[0]
    sync_client.add_request(req)
    out = sync_client.get_output(timeout=10)
    assert out.scheduler_stats.kv_cache_usage > 0
    sync_client.abort_requests([req.request_id])
    while True:
        out = sync_client.get_output(timeout=10)
        done = [o for o in out.outputs if o.finish_reason is not None]
        if done:
            assert done[0].finish_reason == FinishReason.ABORT
            break
    assert out.scheduler_stats.kv_cache_usage == 0
    assert sync_client.call_utility("echo", "alive") == "alive"


@pytest.mark.timeout(120)
def test_bad_request_finishes_with_error_and_engine_serves_on(sync_client):
    sync_client.add_request(EngineCoreRequest("empty", [], SamplingParams(max_tokens=3)))
    out = sync_client.get_output(timeout=10)
    assert out.outputs[0].finish_reason == FinishReason.ERROR and "empty" in out.outputs[0].error
    params = SamplingParams(max_tokens=3)
    params.temperature = -1.0  # invalid, and so undecodable on the engine side
    sync_client.add_request(EngineCoreRequest("invalid", [1, 2], params))
    out = sync_client.get_output(timeout=10)
    assert out.outputs[0].request_id == "invalid"
    assert out.outputs[0].finish_reason == FinishReason.ERROR and "temperature" in out.outputs[0].error
    assert run_sync(sync_client, requests(1)) == inproc_tokens(NULL, requests(1))


@pytest.mark.timeout(120)
def test_requests_added_together_enter_the_same_step(sync_client):
    batch = requests(8, max_tokens=4)
    sync_client.add_requests(batch)
    first = sync_client.get_output(timeout=10)
    assert sorted(o.request_id for o in first.outputs) == sorted(r.request_id for r in batch)
    assert all(len(o.new_token_ids) == 1 for o in first.outputs)
    finished: set[str] = set()
    while len(finished) < len(batch):
        finished_now = sync_client.get_output(timeout=10).finished_requests or set()
        assert not finished or not finished_now, "the batch finished over more than one step"
        finished |= finished_now
    assert finished == {r.request_id for r in batch}


@pytest.mark.timeout(120)
def test_an_undecodable_request_fails_alone_in_its_batch(sync_client):
    params = SamplingParams(max_tokens=3)
    params.temperature = -1.0  # invalid, and so undecodable on the engine side
    good = requests(2, max_tokens=3)
    sync_client.add_requests([good[0], EngineCoreRequest("invalid", [1, 2], params), good[1]])
    reasons: dict[str, FinishReason] = {}
    errors: dict[str, str | None] = {}
    while len(reasons) < 3:
        for o in sync_client.get_output(timeout=10).outputs:
            if o.finish_reason is not None:
                reasons[o.request_id], errors[o.request_id] = o.finish_reason, o.error
    assert reasons == {
        "req-0": FinishReason.LENGTH,
        "req-1": FinishReason.LENGTH,
        "invalid": FinishReason.ERROR,
    }
    assert "temperature" in (errors["invalid"] or "")


# -- shutdown and start-up failures -------------------------------------------------------------------


@pytest.mark.timeout(120)
def test_shutdown_is_idempotent_bounded_and_final():
    client = SyncMPClient(NULL)
    pid = client.engine_pids()[0]
    client.add_request(requests(1, max_tokens=8000)[0])
    start = time.monotonic()
    client.shutdown()
    client.shutdown()
    assert time.monotonic() - start < 5
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    with pytest.raises(EngineDeadError):
        client.add_request(requests(1)[0])
    with pytest.raises(EngineDeadError):
        client.get_output(timeout=1)


@pytest.mark.timeout(120)
def test_sigterm_drains_then_exits_zero():
    client = SyncMPClient(EngineOptions(runner="null", shutdown_timeout=10))
    try:
        manager = client.resources.engine_manager
        client.add_request(EngineCoreRequest("d", [1, 2], SamplingParams(max_tokens=200, ignore_eos=True)))
        seen = len(client.get_output(timeout=10).outputs[0].new_token_ids)
        os.kill(manager.pids()[0], 15)
        tokens, reason = drain_until_finished(client, "d")
        assert reason == FinishReason.LENGTH and seen + len(tokens) == 200
        assert manager.wait(0, 10) == 0
    finally:
        client.shutdown()


@pytest.mark.timeout(120)
def test_bad_model_path_raises_readable_error():
    start = time.monotonic()
    with pytest.raises(EngineStartupError) as info:
        SyncMPClient(EngineOptions(model="/nonexistent/model-dir"))
    err = info.value
    assert err.engine_rank == 0 and err.exit_code == 1 and err.exc_type is not None
    assert "/nonexistent/model-dir" in str(err) and "start-up" in str(err)
    assert "\n" not in str(err)
    assert time.monotonic() - start < 60


@pytest.mark.timeout(120)
def test_ready_timeout_names_the_variable(monkeypatch):
    monkeypatch.setenv("NANOSERVE_ENGINE_READY_TIMEOUT_S", "0.2")
    with pytest.raises(TimeoutError) as info:
        SyncMPClient(NULL)
    msg = str(info.value)
    assert msg.startswith(
        "Timed out waiting for engine core processes to start. "
        "This is often caused by slow weight loading for large models."
    )
    assert "NANOSERVE_ENGINE_READY_TIMEOUT_S" in msg


@pytest.mark.timeout(120)
def test_process_title_names_engine_and_rank(sync_client):
    proc = psutil.Process(sync_client.engine_pids()[0])
    assert "EngineCore_0" in " ".join(proc.cmdline())


@pytest.mark.timeout(120)
def test_idle_engine_blocks(sync_client):
    proc = psutil.Process(sync_client.engine_pids()[0])
    proc.cpu_percent(None)
    time.sleep(1.0)
    assert proc.cpu_percent(None) < 10


@pytest.mark.timeout(120)
def test_concurrent_getters_all_wake_on_shutdown():
    client = SyncMPClient(NULL)
    errors: list[BaseException] = []

    def wait():
        try:
            client.get_output()
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=wait) for _ in range(3)]
    for t in threads:
        t.start()
    time.sleep(0.2)
    client.shutdown()
    for t in threads:
        t.join(5)
    assert len(errors) == 3 and all(isinstance(e, EngineDeadError) for e in errors)


@pytest.mark.timeout(30)
def test_answer_to_cancelled_future_is_tolerated():
    import concurrent.futures

    from nanoserve.engine.core_client.utilities import UtilityCalls
    from nanoserve.wire.messages import UtilityOutput

    calls = UtilityCalls()
    sync_future = concurrent.futures.Future()
    sync_future.cancel()
    call_id = calls.register(0, 0, sync_future)
    calls.resolve(UtilityOutput(call_id, result=5))
    calls.resolve(UtilityOutput(call_id + 1, failure_message="x"))  # unknown call id
    assert not calls

    async def main():
        future = asyncio.get_running_loop().create_future()
        future.cancel()
        calls.resolve(UtilityOutput(calls.register(0, 0, future), failure_message="boom"))

    asyncio.run(main())


def test_output_reader_lets_other_tasks_run_during_a_flood():
    """Messages already queued on the socket are read READ_BURST at a time, with the loop's other tasks
    run in between: drained in one go, a flood kept them waiting until it ended."""
    flood = 10 * READ_BURST
    ctx = zmq.Context()
    reader = AsyncOutputReader()
    endpoint, _ = reader.open(ctx, "tcp", "127.0.0.1", None)
    push = ctx.socket(zmq.PUSH)
    push.connect(endpoint)
    dispatched: list[int] = []
    failures: list[Exception] = []

    async def main() -> list[int]:
        for i in range(flood):
            push.send(i.to_bytes(4, "little"))
        reader.start(
            lambda frames: dispatched.append(int.from_bytes(frames[0].bytes, "little")), failures.append
        )
        seen = []
        while len(dispatched) < flood and not failures:
            seen.append(len(dispatched))
            await asyncio.sleep(0)
        return seen

    try:
        seen = asyncio.run(asyncio.wait_for(main(), 30))
    finally:
        reader.stop()
        push.close(linger=0)
        ctx.term()
    assert not failures and dispatched == list(range(flood))
    assert len({count for count in seen if 0 < count < flood}) >= flood // READ_BURST - 2


@pytest.mark.timeout(120)
def test_async_client_serves_successive_event_loops():
    client = AsyncMPClient(NULL)
    try:
        for _ in range(2):
            tokens = asyncio.run(run_async(client, requests(2)))
            assert tokens == inproc_tokens(NULL, requests(2))
            assert asyncio.run(client.call_utility_async("echo", "x", timeout=10)) == "x"
    finally:
        client.shutdown()


@pytest.mark.timeout(120)
def test_large_tensor_argument_is_tracked_until_sent(sync_client):
    import torch

    big = torch.arange(300_000, dtype=torch.float32)  # 1.2 MB: an out-of-band, zero-copy frame
    result = sync_client.call_utility("echo", big)
    assert torch.equal(result, big)
    for tracker, _ in sync_client.input.pending_messages:
        tracker.wait(5)
    assert all(tracker.done for tracker, _ in sync_client.input.pending_messages)
