"""Ray backend across nodes that go away: a cluster of four one-CPU nodes on this machine, ranks spread
one per node (STRICT_SPREAD), and a node holding a rank removed under load. The tests only remove
nodes, never add them (a node added in a test would outlive it), so each leaves one more free node
than the next one needs.
"""

from __future__ import annotations

import asyncio
import os
import time

import pytest
from streams import count_tokens

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # before Ray is imported
ray = pytest.importorskip("ray")

from ray_cluster import assert_ray_released, local_cluster  # noqa: E402

from nanoserve.engine.async_llm import AsyncLLM  # noqa: E402
from nanoserve.engine.core_client.liveness import RankState  # noqa: E402
from nanoserve.engine.core_client.ray_launch import RayEngineManager  # noqa: E402
from nanoserve.engine.exceptions import EngineDeadError  # noqa: E402

pytestmark = pytest.mark.own_process  # Ray can end the process it runs in: not pytest's own


@pytest.fixture(scope="module")
def ray_cluster():
    with local_cluster(4) as cluster:
        yield cluster


def off_head_rank(cluster, manager: RayEngineManager) -> tuple[int, object]:
    """A rank whose actor runs on a worker node (the driver lives on the head), and that node."""
    workers = {node.node_id: node for node in cluster.worker_nodes}
    for rank, node_id in manager.node_ids().items():
        if node_id in workers:
            return rank, workers[node_id]
    raise AssertionError("no rank on a worker node")


@pytest.mark.timeout(300)
def test_a_lost_node_marks_its_rank_dead_and_the_other_serves_on(ray_cluster, tiny_long_context_dir):
    """The long requests run a real model over 16k positions: the null runner's 8k-token requests ended
    within a second or two on an AMD Zen 5, some before their node was gone."""

    async def main() -> None:
        engine = AsyncLLM(
            str(tiny_long_context_dir),
            dtype="float32",
            data_parallel_size=2,
            data_parallel_backend="ray",
            ray_placement_strategy="STRICT_SPREAD",
        )
        client = engine.engine_core
        manager = client.resources.engine_manager
        try:
            assert len(set(manager.node_ids().values())) == 2
            lost, node = off_head_rank(ray_cluster, manager)
            tasks = {
                f"long-{i}": asyncio.create_task(count_tokens(engine, f"long-{i}", 10**6)) for i in range(4)
            }
            deadline = time.monotonic() + 30
            while sum(client.balancer.owner(rid) is not None for rid in tasks) < len(tasks):
                assert time.monotonic() < deadline
                await asyncio.sleep(0.01)
            on_lost = {rid for rid in tasks if client.balancer.owner(rid) == lost}
            assert on_lost and len(on_lost) < len(tasks)

            ray_cluster.remove_node(node)
            for rid in on_lost:
                with pytest.raises(EngineDeadError) as dead:
                    await asyncio.wait_for(tasks[rid], 120)
                assert dead.value.engine_rank == lost
            assert set(engine.dead_ranks) == {lost} and not engine.errored
            assert await count_tokens(engine, "fresh", 8) == 8
            for task in tasks.values():
                task.cancel()
            await asyncio.gather(*tasks.values(), return_exceptions=True)
        finally:
            engine.shutdown()

    asyncio.run(main())
    assert_ray_released()


@pytest.mark.timeout(300)
def test_a_rank_of_a_lost_node_restarts_on_a_node_with_room(ray_cluster, tiny_gqa_dir):
    async def main() -> None:
        engine = AsyncLLM(
            str(tiny_gqa_dir),
            runner="null",
            data_parallel_size=2,
            data_parallel_backend="ray",
            ray_placement_strategy="STRICT_SPREAD",
            engine_restarts=1,
        )
        manager = engine.engine_core.resources.engine_manager
        liveness = engine.engine_core.liveness
        try:
            lost, node = off_head_rank(ray_cluster, manager)
            ray_cluster.remove_node(node)
            deadline = time.monotonic() + 180
            while engine.engine_restarts[lost] < 1 or liveness.state(lost) is not RankState.ALIVE:
                assert time.monotonic() < deadline and not engine.dead_ranks
                await asyncio.sleep(0.1)
            nodes = manager.node_ids(timeout=60)
            assert nodes[lost] != node.node_id and len(set(nodes.values())) == 2
            counts = await asyncio.gather(*(count_tokens(engine, f"after-{i}", 8) for i in range(4)))
            assert counts == [8] * 4 and not engine.dead_ranks
        finally:
            engine.shutdown()

    asyncio.run(main())
    assert_ray_released()
