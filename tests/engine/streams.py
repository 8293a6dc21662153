"""Helpers shared by the client and AsyncLLM tests."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Generator
from typing import Any

from nanoserve.engine.async_llm import AsyncLLM
from nanoserve.engine.core_client.dp import DPLBAsyncMPClient
from nanoserve.engine.core_client.mp import MPClient
from nanoserve.sampling_params import SamplingParams


@contextlib.contextmanager
def utilities_to_rank(client: MPClient, rank: int) -> Generator[None]:
    """Send the client's utility calls to one rank only (e.g. to put just that rank to sleep)."""
    router: Any = client.router
    router.utility_targets = lambda method, liveness: [rank]
    try:
        yield
    finally:
        del router.utility_targets


async def count_tokens(engine: AsyncLLM, request_id: str, max_tokens: int) -> int:
    """Stream one request to its end (EOS ignored) and return how many tokens it produced."""
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    num_tokens = 0
    async for out in engine.generate(f"request {request_id}", params, request_id):
        num_tokens = len(out.outputs[0].token_ids)
    return num_tokens


async def spread_endless_requests(
    engine: AsyncLLM, count: int = 4
) -> tuple[dict[str, asyncio.Task], set[str]]:
    """Start `count` requests that never finish on their own; once the balancer has placed them all,
    return their tasks and the ids placed on rank 1 (some, not all)."""
    client = engine.engine_core
    assert isinstance(client, DPLBAsyncMPClient)
    tasks = {f"long-{i}": asyncio.create_task(count_tokens(engine, f"long-{i}", 10**6)) for i in range(count)}
    deadline = time.monotonic() + 20
    while sum(client.balancer.owner(rid) is not None for rid in tasks) < count:
        assert time.monotonic() < deadline
        await asyncio.sleep(0.01)
    on_rank_1 = {rid for rid in tasks if client.balancer.owner(rid) == 1}
    assert on_rank_1 and len(on_rank_1) < count
    return tasks, on_rank_1
