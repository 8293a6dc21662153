"""POST /sleep, POST /wake_up, GET /is_sleeping: the engine's sleep mode over HTTP, for a trusted
operator (an RL trainer freeing the device between rollouts); mounted only with --enable-sleep-endpoints,
as vLLM mounts them only in its dev mode."""

from __future__ import annotations

from typing import Literal

from fastapi import APIRouter, Query

from nanoserve.entrypoints.openai.errors import error_responses
from nanoserve.entrypoints.openai.protocol import SleepState
from nanoserve.entrypoints.openai.serving import Serving

router = APIRouter(responses=error_responses(503))


@router.post("/sleep")
async def sleep(
    serving: Serving,
    level: int = Query(
        1, ge=1, le=2, description="1: free the KV cache, offload the weights; 2: drop them too"
    ),
    mode: Literal["abort", "wait"] = Query(
        "abort", description="abort: abort running requests; wait: let them finish first"
    ),
) -> SleepState:
    await serving.engine.sleep(level, mode)
    return SleepState(is_sleeping=await serving.engine.is_sleeping())


@router.post("/wake_up")
async def wake_up(serving: Serving) -> SleepState:
    await serving.engine.wake_up()
    return SleepState(is_sleeping=await serving.engine.is_sleeping())


@router.get("/is_sleeping")
async def is_sleeping(serving: Serving) -> SleepState:
    return SleepState(is_sleeping=await serving.engine.is_sleeping())
