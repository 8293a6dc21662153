"""Data parallel: options and flags, the load balancer alone, and the DP clients against real engine-core
processes (null runner, model-free) plus one tiny-model parity check through `LLM`."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest
from streams import count_tokens, spread_endless_requests, utilities_to_rank

from nanoserve.config import EngineOptions
from nanoserve.engine.core_client.base import EngineCoreClient
from nanoserve.engine.core_client.coordinator import HEARTBEAT_INTERVAL_S, should_publish
from nanoserve.engine.core_client.dp import (
    DPAsyncMPClient,
    DPLBAsyncMPClient,
    DPLBSyncMPClient,
    DPLoadBalancer,
    combine_utility_results,
)
from nanoserve.engine.core_client.inproc import InprocClient
from nanoserve.engine.exceptions import EngineDeadError
from nanoserve.entrypoints.cli import build_parser, engine_options_from_args
from nanoserve.sampling_params import SamplingParams, StructuredOutputsParams
from nanoserve.wire.messages import DPLoadUpdate, EngineCoreRequest, FinishReason, SchedulerStats

DP2 = EngineOptions(runner="null", data_parallel_size=2)


def make_request(
    request_id: str, prompt: list[int], max_tokens: int = 8, seeded: bool = False
) -> EngineCoreRequest:
    if seeded:
        params = SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=max_tokens, ignore_eos=True)
    else:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return EngineCoreRequest(request_id, prompt, params)


def many_requests(n: int, max_tokens: int = 8, prefix: str = "req") -> list[EngineCoreRequest]:
    return [
        make_request(f"{prefix}-{i}", [5 + i, 20 + i, 300 + i, 7], max_tokens, seeded=bool(i % 2))
        for i in range(n)
    ]


async def collect(
    client: EngineCoreClient, ids: set[str], timeout: float = 60
) -> tuple[dict[str, list[int]], dict[str, FinishReason], dict[str, str | None], dict[str, int]]:
    """Read outputs until every id in `ids` finished: tokens, finish reasons, errors, serving rank."""
    tokens: dict[str, list[int]] = {i: [] for i in ids}
    reasons: dict[str, FinishReason] = {}
    errors: dict[str, str | None] = {}
    ranks: dict[str, int] = {}
    deadline = time.monotonic() + timeout
    while len(reasons) < len(ids):
        assert time.monotonic() < deadline, f"unfinished: {ids - set(reasons)}"
        outputs = await client.get_output_async(timeout=timeout)
        for o in outputs.outputs:
            if o.request_id not in ids:
                continue
            tokens[o.request_id] += o.new_token_ids
            if o.new_token_ids:
                ranks.setdefault(o.request_id, outputs.engine_index)
            if o.finish_reason is not None:
                reasons[o.request_id] = o.finish_reason
                errors[o.request_id] = o.error
    return tokens, reasons, errors, ranks


def inproc_tokens(requests: list[EngineCoreRequest]) -> dict[str, list[int]]:
    client = InprocClient(EngineOptions(runner="null", multiprocess_mode=False))
    try:
        for r in requests:
            client.add_request(r)
        tokens: dict[str, list[int]] = {r.request_id: [] for r in requests}
        done = 0
        while done < len(requests):
            for o in client.get_output().outputs:
                tokens[o.request_id] += o.new_token_ids
                done += o.finish_reason is not None
        return tokens
    finally:
        client.shutdown()


# -- options and flags ----------------------------------------------------------------------------


@pytest.mark.timeout(10)
def test_options_are_validated():
    assert EngineOptions().data_parallel_size == 1
    with pytest.raises(ValueError, match="data_parallel_size"):
        EngineOptions(data_parallel_size=0)
    with pytest.raises(ValueError, match="data_parallel_backend"):
        EngineOptions(data_parallel_backend="mpi")
    with pytest.raises(ValueError, match="needs data_parallel_rank"):
        EngineOptions(data_parallel_size=2, data_parallel_external_lb=True)
    with pytest.raises(ValueError, match=r"data_parallel_rank must be in \[0, 2\)"):
        EngineOptions(data_parallel_size=2, data_parallel_rank=2, data_parallel_external_lb=True)
    with pytest.raises(ValueError, match="only meaningful"):
        EngineOptions(data_parallel_size=2, data_parallel_rank=1)
    with pytest.raises(ValueError, match="multiprocess_mode"):
        EngineOptions(data_parallel_size=2, multiprocess_mode=False)
    with pytest.raises(ValueError, match="ray_address is only meaningful"):
        EngineOptions(ray_address="auto")
    with pytest.raises(ValueError, match="multiprocess_mode"):
        EngineOptions(data_parallel_backend="ray", multiprocess_mode=False)


@pytest.mark.timeout(10)
def test_cli_flags():
    args = build_parser().parse_args(
        ["generate", "hi", "--data-parallel-size", "4", "--data-parallel-rank", "3", "--data-parallel-external-lb",
         "--data-parallel-backend", "mp"]
    )  # fmt: skip
    options = engine_options_from_args(args)
    assert (options.data_parallel_size, options.data_parallel_rank) == (4, 3)
    assert options.data_parallel_external_lb and options.data_parallel_backend == "mp"
    assert engine_options_from_args(build_parser().parse_args(["generate", "hi"])).data_parallel_size == 1
    args = build_parser().parse_args(
        ["serve", "--data-parallel-backend", "ray", "--ray-address", "10.0.0.1:6379"]
    )
    options = engine_options_from_args(args)
    assert (options.data_parallel_backend, options.ray_address) == ("ray", "10.0.0.1:6379")


# -- the balancer alone ---------------------------------------------------------------------------


@pytest.mark.timeout(10)
def test_balancer_weighs_cost_and_rotates_ties():
    lb = DPLoadBalancer([0, 1], block_size=16)
    assert [lb.choose(make_request(f"r{i}", [1, 2, 3]), ()) for i in range(4)] == [0, 1, 0, 1]
    lb = DPLoadBalancer([0, 1], block_size=16)
    assert lb.choose(make_request("long", list(range(1000)), max_tokens=100), ()) == 0
    # by count rank 1 would take one of every two; by cost it takes all ten short ones
    assert {lb.choose(make_request(f"s{i}", [1, 2, 3]), ()) for i in range(10)} == {1}
    lb.update(0, SchedulerStats(kv_cache_usage=0.5), {"long"})
    assert lb.loads[0].in_flight_cost == 0 and lb.loads[0].kv_cache_usage == 0.5
    assert lb.choose(make_request("x", [9]), dead={0}) == 1
    with pytest.raises(EngineDeadError):
        lb.choose(make_request("y", [9]), dead={0, 1})


@pytest.mark.timeout(10)
def test_balancer_prefers_the_rank_holding_the_prefix_until_overloaded():
    lb = DPLoadBalancer([0, 1], block_size=16)
    shared = list(range(100, 164))  # four full blocks
    first = lb.choose(make_request("p0", [*shared, 1]), ())
    ranks = [lb.choose(make_request(f"p{i}", [*shared, i]), ()) for i in range(1, 6)]
    assert ranks == [first] * 5
    assert lb.choose(make_request("other", [7, 8, 9]), ()) != first
    # enough in flight on the holder and the prefix is no longer worth the wait
    ranks = [lb.choose(make_request(f"q{i}", [*shared, i]), ()) for i in range(40)]
    assert 1 - first in ranks


@pytest.mark.timeout(10)
def test_utility_results_combine():
    assert combine_utility_results("reset_prefix_cache", {0: True, 1: False}) is False
    assert combine_utility_results("collective_rpc", {0: ["a"], 1: ["b"]}) == ["a", "b"]
    assert combine_utility_results("is_sleeping", {0: True, 1: True}) is True
    with pytest.raises(RuntimeError, match="disagree on is_sleeping"):
        combine_utility_results("is_sleeping", {0: True, 1: False})


@pytest.mark.timeout(10)
def test_coordinator_publishes_on_change_at_most_every_100ms_and_heartbeats():
    assert should_publish(True, now=10.15, last_publish=10.0)
    assert not should_publish(True, now=10.05, last_publish=10.0)
    assert not should_publish(False, now=10.5, last_publish=10.0)
    assert should_publish(False, now=10.0 + HEARTBEAT_INTERVAL_S, last_publish=10.0)


async def sleep_one_rank(client: DPLBAsyncMPClient, rank: int) -> None:
    with utilities_to_rank(client, rank):
        await client.sleep_async(1)


# -- clients against engine processes -------------------------------------------------------------


@pytest.mark.timeout(180)
def test_factory_and_external_lb_rank():
    async def main() -> None:
        client = EngineCoreClient.make_async_mp_client(
            EngineOptions(
                runner="null", data_parallel_size=2, data_parallel_rank=1, data_parallel_external_lb=True
            )
        )
        try:
            assert type(client) is DPAsyncMPClient and client.engine_ranks == [1]
            assert len(client.engine_pids()) == 1
            await client.add_request_async(make_request("a", [1, 2, 3]))
            outputs = await client.get_output_async(timeout=60)
            assert outputs.engine_index == 1
        finally:
            client.shutdown()

    asyncio.run(main())


@pytest.mark.timeout(180)
def test_both_engines_get_work_outputs_match_and_aborts_route():
    requests = many_requests(16, max_tokens=12)
    expected = inproc_tokens(requests)

    async def main() -> None:
        client = EngineCoreClient.make_async_mp_client(DP2)
        try:
            assert type(client) is DPLBAsyncMPClient and len(client.engine_pids()) == 2
            one = client.ready_responses[0]
            assert client.ready_response.num_kv_blocks == 2 * one.num_kv_blocks
            for r in requests:
                await client.add_request_async(r)
            tokens, reasons, _, ranks = await collect(client, {r.request_id for r in requests})
            assert tokens == expected
            assert set(reasons.values()) == {FinishReason.LENGTH}
            assert sorted(ranks.values()).count(0) == 8, ranks  # equal cost: an even split
            assert client.balancer.owners == {}

            # aborts reach the engine that holds each request, on either rank. Asleep, the ranks hold their
            # requests (the null runner would end one at its context length within a second): an abort
            # sent to the wrong rank would leave its request held, unfinished
            await client.sleep_async(1)
            long = [make_request(f"long-{i}", [1, 2, 3, i], max_tokens=10**6) for i in range(4)]
            for r in long:
                await client.add_request_async(r)
            owners = {r.request_id: client.balancer.owner(r.request_id) for r in long}
            assert set(owners.values()) == {0, 1}
            await client.abort_requests_async(list(owners))
            _, reasons, _, _ = await collect(client, set(owners))
            assert set(reasons.values()) == {FinishReason.ABORT}
        finally:
            client.shutdown()

    asyncio.run(main())


@pytest.mark.timeout(180)
def test_utilities_fan_out_and_must_agree():
    async def main() -> None:
        client = EngineCoreClient.make_async_mp_client(DP2)
        try:
            assert await client.reset_prefix_cache_async() is True
            described = await client.collective_rpc_async("describe")
            assert len(described) == 2 and described[0] == described[1]  # one answer per rank, joined
            await client.sleep_async(1)
            assert await client.is_sleeping_async() is True
            await client.wake_up_async()
            assert await client.is_sleeping_async() is False
            # put only rank 1 to sleep: the ranks no longer agree, and that is an error, not a guess
            await sleep_one_rank(client, 1)
            with pytest.raises(RuntimeError, match="disagree on is_sleeping"):
                await client.is_sleeping_async()
            await client.wake_up_async()
            assert await client.is_sleeping_async() is False
        finally:
            client.shutdown()

    asyncio.run(main())


@pytest.mark.timeout(180)
def test_sigkill_one_rank_under_load():
    async def main() -> None:
        client = EngineCoreClient.make_async_mp_client(DP2)
        try:
            # rank 1 asleep holds its requests, so none can finish before it is killed
            await sleep_one_rank(client, 1)
            long = [make_request(f"long-{i}", [1, 2, 3, i], max_tokens=10**6) for i in range(6)]
            short = [make_request(f"short-{i}", [4, 5, 6, i], max_tokens=400) for i in range(6)]
            for r in long + short:
                await client.add_request_async(r)
            on_rank_1 = {r.request_id for r in long + short if client.balancer.owner(r.request_id) == 1}
            survivors = {r.request_id for r in short if client.balancer.owner(r.request_id) == 0}
            assert len(on_rank_1) == 6 and survivors
            pids = client.engine_pids()
            os.kill(pids[1], signal.SIGKILL)
            started = time.monotonic()
            _, reasons, errors, _ = await collect(client, on_rank_1 | survivors)
            assert all(reasons[i] == FinishReason.ERROR for i in on_rank_1), reasons
            assert all("Engine core 1" in errors[i] and "SIGKILL" in errors[i] for i in on_rank_1)
            assert all(reasons[i] == FinishReason.LENGTH for i in survivors)
            assert time.monotonic() - started < 30  # under a second when idle; margin for a loaded machine
            assert client.dead_ranks == {1} and client.is_degraded and not client.engine_dead

            fresh = many_requests(4, prefix="fresh")
            for r in fresh:
                await client.add_request_async(r)
            _, reasons, _, ranks = await collect(client, {r.request_id for r in fresh})
            assert set(reasons.values()) == {FinishReason.LENGTH} and set(ranks.values()) == {0}
            on_rank_0 = {r.request_id for r in long if client.balancer.owner(r.request_id) == 0}
            await client.abort_requests_async([r.request_id for r in long])  # those on rank 1 are gone
            await collect(client, on_rank_0)
            assert await client.reset_prefix_cache_async() is True  # fans out to the live rank only

            os.kill(pids[0], signal.SIGKILL)  # the last rank: now the client is dead
            with pytest.raises(EngineDeadError):
                for _ in range(100):
                    await client.get_output_async(timeout=60)
            assert client.engine_dead
            with pytest.raises(EngineDeadError):
                await client.add_request_async(make_request("late", [1]))
        finally:
            client.shutdown()

    asyncio.run(main())


@pytest.mark.timeout(180)
def test_shared_prefix_workload_lands_on_the_prefix_holder():
    shared = list(range(1000, 1128))  # eight full blocks

    async def main() -> None:
        client = EngineCoreClient.make_async_mp_client(DP2)
        try:
            holders = set()
            for i in range(6):  # arriving one after another, with unrelated traffic in between
                prefixed = make_request(f"p-{i}", [*shared, i], max_tokens=4)
                other = make_request(f"o-{i}", [50 + i, 60 + i], max_tokens=4)
                await client.add_request_async(prefixed)
                await client.add_request_async(other)
                _, _, _, ranks = await collect(client, {prefixed.request_id, other.request_id})
                holders.add(ranks[prefixed.request_id])
            assert len(holders) == 1, holders
        finally:
            client.shutdown()

    asyncio.run(main())


@pytest.mark.timeout(180)
def test_sync_client_sigkill_and_llm_offline_dp2_matches_dp1(tiny_gqa_dir):
    from nanoserve.entrypoints.llm import LLM

    client = EngineCoreClient.make_client(True, False, DP2)
    try:
        assert type(client) is DPLBSyncMPClient
        with utilities_to_rank(client, 0):
            client.sleep(1)  # rank 0 asleep holds "k" until it is killed
        client.add_request(make_request("k", [1, 2], max_tokens=10**6))
        assert client.balancer.owner("k") == 0
        os.kill(client.engine_pids()[0], signal.SIGKILL)
        deadline = time.monotonic() + 60
        while (out := client.get_output(timeout=60)).engine_index != 0 or not out.outputs[-1].finish_reason:
            assert time.monotonic() < deadline
        assert (
            out.outputs[-1].finish_reason == FinishReason.ERROR and "Engine core 0" in out.outputs[-1].error
        )
        assert client.is_sleeping() is False  # rank 1 alone answers: no disagreement with the dead rank
    finally:
        client.shutdown()

    prompts = ["The quick brown fox", "Hello there", "One two three four five", "a b c"]
    choice = StructuredOutputsParams(choice=["north", "south", "east", "west"])
    params = [
        SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True),
        SamplingParams(temperature=0.9, seed=3, max_tokens=6, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=6, structured_outputs=choice),
        SamplingParams(temperature=0.9, seed=4, max_tokens=6, structured_outputs=choice),
    ]
    texts = {}
    for size in (1, 2):
        llm = LLM(str(tiny_gqa_dir), data_parallel_size=size, num_kv_blocks=64, max_model_len=256)
        try:
            outputs = llm.generate(prompts, params, use_tqdm=False)
            texts[size] = [o.outputs[0].token_ids for o in outputs]
            assert all(o.outputs[0].text in choice.choice for o in outputs[2:])
            if size == 2:
                assert llm.llm_engine.engine_core.balancer.num_routed.keys() == {0, 1}
        finally:
            llm.llm_engine.shutdown()
    assert texts[1] == texts[2]


@pytest.mark.timeout(180)
def test_coordinator_streams_engine_loads_to_the_balancer(monkeypatch):
    # The balancer's loads after each publication it applies are recorded: sampling them from here could
    # miss the busy stretch while this process waits for a core or the GIL (the reader thread decodes a
    # flood of null-runner outputs). The stretch is long: a request ends at the null runner's 8192 tokens
    # (about 0.1 s when idle) and each rank runs 64 of them one at a time, so a coordinator kept waiting
    # for a core still publishes a busy load before the engines, which wait alike, are done.
    published: list[dict[int, int]] = []
    apply_update = DPLoadBalancer.apply_update

    def recording_apply_update(balancer: DPLoadBalancer, update: DPLoadUpdate) -> None:
        apply_update(balancer, update)
        published.append(
            {r: load.num_running_reqs + load.num_waiting_reqs for r, load in balancer.loads.items()}
        )

    monkeypatch.setattr(DPLoadBalancer, "apply_update", recording_apply_update)
    client = EngineCoreClient.make_client(
        True, False, EngineOptions(runner="null", data_parallel_size=2, max_num_seqs=1)
    )
    try:
        assert client.resources.coordinator.is_alive()
        long = [make_request(f"long-{i}", [1, 2, 3, i], max_tokens=10**6) for i in range(128)]
        for r in long:
            client.add_request(r)
        # no output is read here: whatever the balancer knows of the engines came from the coordinator.
        # Each wait is for a condition; the deadline (seconds when idle) leaves room for a loaded machine.
        deadline = time.monotonic() + 60
        while not all(any(counts.get(r) for counts in published) for r in (0, 1)):
            assert time.monotonic() < deadline, (published, client.balancer.num_updates)
            time.sleep(0.01)
        client.abort_requests([r.request_id for r in long])
        loads = client.balancer.loads
        while published[-1] != {0: 0, 1: 0} or any(
            loads[r].num_running_reqs + loads[r].num_waiting_reqs for r in (0, 1)
        ):
            assert time.monotonic() < deadline, (published[-5:], loads)
            time.sleep(0.01)
        heartbeats = client.balancer.num_heartbeats
        deadline = time.monotonic() + 20 * HEARTBEAT_INTERVAL_S
        while client.balancer.num_heartbeats == heartbeats:  # nothing changes now: heartbeats only
            assert time.monotonic() < deadline
            time.sleep(0.05)
    finally:
        client.shutdown()
    assert not client.resources.coordinator.is_alive()


@pytest.mark.timeout(180)
def test_async_llm_dead_rank_raises_for_its_requests_and_health_says_degraded(tiny_gqa_dir):
    import httpx

    from nanoserve.engine.async_llm import AsyncLLM
    from nanoserve.entrypoints.openai.api_server import ServerOptions, build_app
    from nanoserve.entrypoints.openai.metrics import PrometheusStatLogger

    async def main() -> None:
        engine = AsyncLLM(str(tiny_gqa_dir), runner="null", data_parallel_size=2)
        client = engine.engine_core
        app = build_app(engine, ServerOptions(), PrometheusStatLogger("tiny"))
        http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://nanoserve")
        try:
            health = await http.get("/health")
            assert health.status_code == 200 and health.json()["status"] == "ok"
            await sleep_one_rank(client, 1)  # rank 1 holds its requests until it is killed
            tasks, on_rank_1 = await spread_endless_requests(engine)
            pids = client.engine_pids()
            os.kill(pids[1], signal.SIGKILL)
            for rid in on_rank_1:
                with pytest.raises(EngineDeadError) as dead:
                    await asyncio.wait_for(tasks[rid], 10)
                assert dead.value.engine_rank == 1 and dead.value.signal == "SIGKILL"
            assert not engine.errored and set(engine.dead_ranks) == {1}
            assert await count_tokens(engine, "fresh", 8) == 8  # the other rank serves on
            for rid in set(tasks) - on_rank_1:  # still streaming, or finished: never failed
                assert not tasks[rid].done() or tasks[rid].result() > 0

            health = await http.get("/health")
            assert health.status_code == 200
            body = health.json()
            assert body["status"] == "degraded" and body["dead_ranks"] == [1]
            assert "Engine core 1" in body["errors"]["1"] and "SIGKILL" in body["errors"]["1"]

            await sleep_one_rank(client, 0)
            held = asyncio.create_task(count_tokens(engine, "held", 8))
            deadline = time.monotonic() + 60
            while client.balancer.owner("held") is None:
                assert time.monotonic() < deadline
                await asyncio.sleep(0.01)
            os.kill(pids[0], signal.SIGKILL)  # the last rank: now the engine is dead
            with pytest.raises(EngineDeadError, match="Engine core 0"):
                await asyncio.wait_for(held, 10)
            assert engine.errored and (await http.get("/health")).status_code == 503
            await asyncio.gather(*tasks.values(), return_exceptions=True)
        finally:
            await http.aclose()
            engine.shutdown()

    asyncio.run(main())
