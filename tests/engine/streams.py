"""Async helpers shared by the AsyncLLM tests."""

from __future__ import annotations

import asyncio
import time

from nanoserve.engine.async_llm import AsyncLLM
from nanoserve.sampling_params import SamplingParams


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
    tasks = {f"long-{i}": asyncio.create_task(count_tokens(engine, f"long-{i}", 10**6)) for i in range(count)}
    deadline = time.monotonic() + 20
    while sum(client.balancer.owner(rid) is not None for rid in tasks) < count:
        assert time.monotonic() < deadline
        await asyncio.sleep(0.01)
    on_rank_1 = {rid for rid in tasks if client.balancer.owner(rid) == 1}
    assert on_rank_1 and len(on_rank_1) < count
    return tasks, on_rank_1
