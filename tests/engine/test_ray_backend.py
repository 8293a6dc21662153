"""Ray backend: engine-core ranks as Ray actors on a two-node Ray cluster started on this machine.

Each node has one CPU, so the two ranks (one CPU each) land on different nodes, as they would on two
machines. Timeouts are generous: placing and starting an actor takes seconds on an idle machine and a
lot longer on a loaded one. Nodes lost under load: `test_ray_nodes.py`.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time

import pytest
from streams import count_tokens, spread_endless_requests, utilities_to_rank

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # before Ray is imported
ray = pytest.importorskip("ray")

from ray_cluster import assert_ray_released, local_cluster  # noqa: E402

from nanoserve.engine.async_llm import AsyncLLM  # noqa: E402
from nanoserve.engine.core_client.dp import DPLBAsyncMPClient  # noqa: E402
from nanoserve.engine.core_client.ray_launch import RayEngineManager  # noqa: E402
from nanoserve.engine.exceptions import EngineDeadError  # noqa: E402
from nanoserve.sampling_params import SamplingParams  # noqa: E402

pytestmark = pytest.mark.own_process  # Ray can end the process it runs in: not pytest's own


@pytest.fixture(scope="module")
def ray_cluster():
    with local_cluster(2) as cluster:
        yield cluster


@pytest.mark.timeout(240)
def test_llm_offline_on_two_actor_ranks_matches_one_engine(ray_cluster, tiny_gqa_dir):
    from nanoserve.entrypoints.llm import LLM

    prompts = ["The quick brown fox", "Hello there", "One two three four five", "a b c"]
    params = [
        SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True),
        SamplingParams(temperature=0.9, seed=3, max_tokens=6, ignore_eos=True),
    ] * 2
    sizes = dict(num_kv_blocks=64, max_model_len=256)
    one = LLM(str(tiny_gqa_dir), multiprocess_mode=False, **sizes)
    try:
        expected = [o.outputs[0].token_ids for o in one.generate(prompts, params, use_tqdm=False)]
    finally:
        one.llm_engine.shutdown()

    llm = LLM(str(tiny_gqa_dir), data_parallel_size=2, data_parallel_backend="ray", **sizes)
    try:
        client = llm.llm_engine.engine_core
        manager = client.resources.engine_manager
        assert isinstance(manager, RayEngineManager)
        assert manager.host.bind == "127.0.0.1" and client.addresses.input.startswith("tcp://127.0.0.1:")
        assert len(set(manager.node_ids().values())) == 2  # one rank per Ray node
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        assert client.balancer.num_routed.keys() == {0, 1}
    finally:
        llm.llm_engine.shutdown()
    assert got == expected
    assert_ray_released()


@pytest.mark.timeout(240)
def test_killed_actor_fails_its_requests_and_the_other_rank_serves_on(ray_cluster, tiny_gqa_dir):
    async def main() -> None:
        engine = AsyncLLM(str(tiny_gqa_dir), runner="null", data_parallel_size=2, data_parallel_backend="ray")
        client = engine.engine_core
        try:
            # rank 1 asleep holds its requests, so none can finish before its actor is killed
            with utilities_to_rank(client, 1):
                await client.sleep_async(1)
            tasks, on_rank_1 = await spread_endless_requests(engine)

            ray.kill(client.resources.engine_manager.actors[1])
            started = time.monotonic()
            for rid in on_rank_1:
                with pytest.raises(EngineDeadError) as dead:
                    await asyncio.wait_for(tasks[rid], 60)
                assert dead.value.engine_rank == 1 and "ray.kill" in str(dead.value)
            assert time.monotonic() - started < 60  # Ray reports a killed actor within seconds
            assert set(engine.dead_ranks) == {1} and client.is_degraded and not engine.errored

            fresh = await asyncio.gather(*(count_tokens(engine, f"fresh-{i}", 8) for i in range(3)))
            assert fresh == [8, 8, 8]
            for rid in set(tasks) - on_rank_1:  # still streaming, or finished: never failed
                assert not tasks[rid].done() or tasks[rid].result() > 0
            for task in tasks.values():
                task.cancel()
            await asyncio.gather(*tasks.values(), return_exceptions=True)
        finally:
            engine.shutdown()

    asyncio.run(main())
    assert_ray_released()


@pytest.mark.timeout(240)
def test_a_killed_actor_is_restarted_and_its_requests_resume(ray_cluster, tiny_gqa_dir):
    async def main() -> None:
        engine = AsyncLLM(
            str(tiny_gqa_dir),
            runner="null",
            data_parallel_size=2,
            data_parallel_backend="ray",
            engine_restarts=1,
        )
        client = engine.engine_core
        assert isinstance(client, DPLBAsyncMPClient)
        manager = client.resources.engine_manager
        assert isinstance(manager, RayEngineManager)
        try:
            await engine.sleep(1)  # the requests start together once all are in: none ends before the kill
            tasks = {f"r-{i}": asyncio.create_task(count_tokens(engine, f"r-{i}", 8000)) for i in range(4)}
            deadline = time.monotonic() + 60
            while len(client.ledger.entries) < 4:
                assert time.monotonic() < deadline and not [t.result() for t in tasks.values() if t.done()]
                await asyncio.sleep(0.01)
            await engine.wake_up()
            while min((len(e.token_ids) for e in client.ledger.entries.values()), default=0) < 10:
                assert time.monotonic() < deadline and not [t.result() for t in tasks.values() if t.done()]
                await asyncio.sleep(0.01)
            on_rank_1 = {rid for rid in tasks if client.balancer.owner(rid) == 1}
            assert on_rank_1 and len(on_rank_1) < 4
            old_actor = manager.actors[1]
            ray.kill(old_actor)
            counts = await asyncio.wait_for(asyncio.gather(*tasks.values()), 180)
            assert counts == [8000] * 4  # no token lost or repeated across the restart
            assert engine.engine_restarts == {0: 0, 1: 1} and not engine.dead_ranks
            assert manager.actors[1] != old_actor
            assert await count_tokens(engine, "after", 8) == 8
        finally:
            engine.shutdown()

    asyncio.run(main())
    assert_ray_released()


# -- what the actors get, and how they stop ---------------------------------------------------------


def test_engines_get_the_nanoserve_variables_but_not_the_api_key(monkeypatch):
    from nanoserve import envs
    from nanoserve.engine.core_client.ray_launch import engine_environment

    monkeypatch.setenv("NANOSERVE_KERNEL_DIR", "/somewhere")
    monkeypatch.setenv(envs.API_KEY, "secret-token")
    monkeypatch.setenv("UNRELATED_VARIABLE", "x")
    env = engine_environment()
    assert env["NANOSERVE_KERNEL_DIR"] == "/somewhere" and envs.LOGGING_LEVEL in env
    assert envs.API_KEY not in env and "UNRELATED_VARIABLE" not in env
    assert all(name.startswith("NANOSERVE_") for name in env)


@pytest.mark.timeout(240)
def test_a_shipped_model_serves_as_the_local_one(ray_cluster, tiny_gqa_dir):
    from nanoserve.entrypoints.llm import LLM

    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    sizes = dict(num_kv_blocks=64, max_model_len=256)
    one = LLM(str(tiny_gqa_dir), multiprocess_mode=False, **sizes)
    try:
        expected = [o.outputs[0].token_ids for o in one.generate(["Hello there"], params, use_tqdm=False)]
    finally:
        one.llm_engine.shutdown()
    llm = LLM(str(tiny_gqa_dir), data_parallel_backend="ray", ray_ship_model=True, **sizes)
    try:
        got = [o.outputs[0].token_ids for o in llm.generate(["Hello there"], params, use_tqdm=False)]
    finally:
        llm.llm_engine.shutdown()
    assert got == expected
    assert_ray_released()


def test_a_model_missing_on_a_node_names_the_node(ray_cluster, tmp_path):
    from nanoserve.config import EngineOptions
    from nanoserve.core.engine_core_proc import EngineCoreProcArgs
    from nanoserve.engine.core_client.ray_actor import EngineCoreActor

    missing = str(tmp_path / "not-here")
    args = EngineCoreProcArgs(
        EngineOptions(runner="null", model=missing), 0, "tcp://x:1", "tcp://x:2", None, 0
    )
    with pytest.raises((FileNotFoundError, ValueError), match="On Ray node 127.0.0.1 .*ray-ship-model"):
        EngineCoreActor(args).local_model_path()


@pytest.mark.timeout(180)
def test_a_remote_rank_asked_to_stop_drains_then_returns_zero(ray_cluster):
    """What shutdown sends each actor (no signal reaches another machine): SHUTDOWN on its input."""
    from nanoserve.config import EngineOptions
    from nanoserve.engine.core_client.sync_mp import SyncMPClient
    from nanoserve.wire.messages import EngineCoreRequest, EngineCoreRequestType, FinishReason

    client = SyncMPClient(EngineOptions(runner="null", data_parallel_backend="ray", shutdown_timeout=30))
    try:
        manager = client.resources.engine_manager
        params = SamplingParams(max_tokens=300, ignore_eos=True)
        client.add_request(EngineCoreRequest("d", [1, 2], params))
        num_tokens = len(client.get_output(timeout=30).outputs[0].new_token_ids)
        client.input.send(0, EngineCoreRequestType.SHUTDOWN, None)
        reason = None
        while reason is None:
            for out in client.get_output(timeout=30).outputs:
                num_tokens += len(out.new_token_ids)
                reason = out.finish_reason
        assert reason == FinishReason.LENGTH and num_tokens == 300  # finished, not aborted
        assert manager.wait(0, 30) == 0
    finally:
        client.shutdown()
    assert_ray_released()


FREED_DURING_RAY_SHUTDOWN = """
import gc, sys, threading, time, weakref
import ray
from nanoserve.config import EngineOptions
from nanoserve.engine.core_client.sync_mp import SyncMPClient

ray.init(address=sys.argv[1], log_to_driver=False)
client = SyncMPClient(EngineOptions(runner="null", data_parallel_backend="ray"))
client.shutdown()
manager = [client.resources.engine_manager]
alive = weakref.ref(manager[0])
del client
deadline = time.monotonic() + 60
while [t for t in threading.enumerate() if t.name.startswith(("EngineCore", "RayEngine"))]:
    assert time.monotonic() < deadline, "the client's threads outlived it"
    time.sleep(0.05)
gc.collect()
worker = ray._private.worker.global_worker


class CoreWorkerThatFreesTheManager:
    # the manager freed right after Ray's core worker shut down, before Python forgets it: what a rank
    # watcher thread letting go of it last does when its timing meets ray.shutdown() on another thread
    def __init__(self, real):
        self.real = real

    def __getattr__(self, name):
        return getattr(self.real, name)

    def shutdown_driver(self):
        self.real.shutdown_driver()
        manager.clear()
        print("manager freed:", alive() is None, flush=True)


worker.core_worker = CoreWorkerThatFreesTheManager(worker.core_worker)
ray.shutdown()
print("survived ray.shutdown()", flush=True)
"""


@pytest.mark.timeout(240)
def test_a_shut_down_client_freed_while_ray_shuts_down_leaves_the_process_alive(ray_cluster):
    """Ray ends a process (status 1, no traceback) whose thread frees a Ray object while ray.shutdown()
    tears Ray down; a shut-down client must hold none, whichever thread lets go of it last."""
    script = [sys.executable, "-c", FREED_DURING_RAY_SHUTDOWN, ray_cluster.address]
    done = subprocess.run(script, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "manager freed: True\nsurvived ray.shutdown()\n" in done.stdout
    assert_ray_released()
