"""Waiting on AsyncLLM request streams for an HTTP request: collect final outputs, merge the deltas of
several streams, and stop (aborting the engine requests) when the client disconnects."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, Awaitable
from typing import Any

from fastapi import Request

from nanoserve.engine.async_llm import AsyncLLM, RequestStream
from nanoserve.engine.exceptions import EngineDeadError
from nanoserve.entrypoints.openai.errors import OpenAIError, engine_error
from nanoserve.outputs import RequestOutput


async def collect(engine: AsyncLLM, streams: list[RequestStream]) -> list[RequestOutput]:
    """The final output of each stream (aborting all of them if cancelled)."""

    async def last(stream: RequestStream) -> RequestOutput:
        final = None
        async for output in engine.iterate(stream):
            final = output
        return final

    tasks = [asyncio.ensure_future(last(s)) for s in streams]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException as e:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if isinstance(e, EngineDeadError):
            raise engine_error(e) from e
        raise


async def merge(
    engine: AsyncLLM, streams: list[RequestStream]
) -> AsyncGenerator[tuple[int, RequestOutput], None]:
    """(stream index, delta output) from several streams as they arrive; leaving early aborts them all."""
    if len(streams) == 1:
        async for output in engine.iterate(streams[0], output_kind="delta"):
            yield 0, output
        return
    queue: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]] = asyncio.Queue()

    async def pump(i: int, stream: RequestStream) -> None:
        try:
            async for output in engine.iterate(stream, output_kind="delta"):
                queue.put_nowait((i, output))
            queue.put_nowait((i, None))
        except Exception as e:
            queue.put_nowait((i, e))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        num_open = len(tasks)
        while num_open:
            i, item = await queue.get()
            if item is None:
                num_open -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def run_until_disconnect(raw_request: Request, work: Awaitable[Any]) -> Any:
    """Await `work`, cancelling it (which aborts its requests) if the client disconnects first."""
    task = asyncio.ensure_future(work)

    async def wait_disconnect() -> None:
        while (await raw_request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(wait_disconnect())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
    if task.cancelled():
        raise OpenAIError("The client disconnected.", 499, "client_disconnected")
    return task.result()
