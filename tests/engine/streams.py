"""Async helpers shared by the AsyncLLM tests."""

from __future__ import annotations

from nanoserve.engine.async_llm import AsyncLLM
from nanoserve.sampling_params import SamplingParams


async def count_tokens(engine: AsyncLLM, request_id: str, max_tokens: int) -> int:
    """Stream one request to its end (EOS ignored) and return how many tokens it produced."""
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    num_tokens = 0
    async for out in engine.generate(f"request {request_id}", params, request_id):
        num_tokens = len(out.outputs[0].token_ids)
    return num_tokens
