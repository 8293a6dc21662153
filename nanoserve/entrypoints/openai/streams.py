"""Waiting on AsyncLLM request streams for an HTTP request: collect final outputs, merge the deltas of
several streams, and stop (aborting the engine requests) when the client disconnects or the request's
deadline passes."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncGenerator, Awaitable
from dataclasses import dataclass
from typing import Any

from fastapi import Request

from nanoserve.engine.async_llm import AsyncLLM, RequestStream
from nanoserve.engine.exceptions import EngineDeadError
from nanoserve.entrypoints.openai.errors import OpenAIError, engine_error
from nanoserve.outputs import RequestOutput


@dataclass(frozen=True)
class Deadline:
    """When a request must be done by (--request-timeout), and the error it ends with when it is not."""

    timeout_s: float
    at: float
    """time.monotonic() of the deadline."""

    @classmethod
    def after(cls, timeout_s: float | None) -> Deadline | None:
        return None if timeout_s is None else cls(timeout_s, time.monotonic() + timeout_s)

    def remaining(self) -> float:
        return max(0.0, self.at - time.monotonic())

    def error(self) -> OpenAIError:
        return OpenAIError(
            f"The request did not finish within the server's request timeout of {self.timeout_s:g} s "
            "and was aborted.",
            408,
            "timeout_error",
        )


async def collect(engine: AsyncLLM, streams: list[RequestStream]) -> list[RequestOutput]:
    """The final output of each stream (aborting all of them if cancelled)."""

    async def last(stream: RequestStream) -> RequestOutput:
        final = None
        async for output in engine.iterate(stream):
            final = output
        assert final is not None, "a request stream ends with its finished output"
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


async def run_until_disconnect(
    raw_request: Request, work: Awaitable[Any], deadline: Deadline | None = None
) -> Any:
    """Await `work`, cancelling it (which aborts its requests) if the client disconnects or the deadline
    passes first."""
    task = asyncio.ensure_future(work)

    async def wait_disconnect() -> None:
        while (await raw_request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(wait_disconnect())
    timeout = None if deadline is None else deadline.remaining()
    try:
        await asyncio.wait({task, watcher}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    finally:
        disconnected = watcher.done()
        watcher.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
    if task.cancelled():
        if disconnected or deadline is None:
            raise OpenAIError("The client disconnected.", 499, "client_disconnected")
        raise deadline.error()
    return task.result()
