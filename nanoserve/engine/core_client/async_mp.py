"""AsyncMPClient: the multiprocess client for asyncio frontends (AsyncLLM, the HTTP server).

Same protocol as `SyncMPClient`; an asyncio task on the caller's loop owns the output PULL socket
(an asyncio socket), checks for the death frame, decodes, resolves utility futures (asyncio futures)
and feeds an `asyncio.Queue` that `get_output_async()` awaits. The task starts with the client when a
loop is running, else on the first async call; shutdown cancels it. Engine death from any thread
(monitor, reader, shutdown) is delivered on the loop: pending futures fail, waiting getters wake.
Sends go through the plain ROUTER socket: with no high-water mark they never block the loop.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import zmq
import zmq.asyncio

from nanoserve.config import EngineOptions
from nanoserve.engine.core_client.mp import BackgroundResources, MPClient, _in_loop, process_utility_output
from nanoserve.engine.exceptions import EngineDeadError
from nanoserve.wire.codec import MsgpackDecoder
from nanoserve.wire.messages import (
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineCoreRequestType,
    EngineCoreUtilityRequest,
)


class AsyncMPClient(MPClient):
    def __init__(self, options: EngineOptions) -> None:
        self.outputs_queue: asyncio.Queue[EngineCoreOutputs | BaseException] = asyncio.Queue()
        super().__init__(options)

    def _output_context(self, ctx: zmq.Context) -> zmq.Context:
        return zmq.asyncio.Context.shadow(ctx.underlying)

    def _own_output_socket(self, sock: zmq.Socket) -> None:
        self.resources.async_output_socket = sock

    def _start_output_reader(self) -> None:
        resources = self.resources
        utility_results = self.utility_results
        queue_box = self._queue_box = [self.outputs_queue]  # the queue is replaced on a new loop

        def fail_all(error: EngineDeadError) -> None:
            for call_id in list(utility_results):
                future = utility_results.pop(call_id, None)
                if future is not None and not future.done():
                    future.set_exception(error)
            queue_box[0].put_nowait(error)

        def on_dead(error: EngineDeadError) -> None:
            loop = resources.loop
            if loop is None or _in_loop(loop) or loop.is_closed():
                fail_all(error)
            else:
                with contextlib.suppress(RuntimeError):
                    loop.call_soon_threadsafe(fail_all, error)

        resources.on_dead = on_dead
        with contextlib.suppress(RuntimeError):  # no running loop: started by the first async call
            asyncio.get_running_loop()
            self._ensure_output_task()

    def _ensure_output_task(self) -> None:
        resources = self.resources
        task = resources.output_task
        if task is not None and not task.done() and resources.loop is asyncio.get_running_loop():
            return
        if resources.engine_dead or resources.async_output_socket is None:
            return
        loop = asyncio.get_running_loop()
        if resources.loop is not None and resources.loop is not loop:
            self._move_to_loop(resources.loop)
        resources.loop = loop
        resources.output_task = loop.create_task(
            _process_outputs(
                resources,
                resources.async_output_socket,
                self.decoder,
                self.outputs_queue,
                self.utility_results,
            ),
            name="EngineCoreOutputTask",
        )

    def _move_to_loop(self, old_loop: asyncio.AbstractEventLoop) -> None:
        """Serve a new event loop after the old one has stopped (e.g. successive `asyncio.run` calls):
        its reader task and queue died with it; outputs it had queued carry over."""
        if old_loop.is_running():
            raise RuntimeError("AsyncMPClient is in use by another running event loop.")
        queue: asyncio.Queue = asyncio.Queue()
        with contextlib.suppress(asyncio.QueueEmpty):
            while True:
                queue.put_nowait(self.outputs_queue.get_nowait())
        self.outputs_queue = self._queue_box[0] = queue
        self.resources.output_task = None

    async def get_output_async(self, timeout: float | None = None) -> EngineCoreOutputs:
        self.ensure_alive()
        self._ensure_output_task()
        try:
            if timeout is None:
                outputs = await self.outputs_queue.get()
            else:
                outputs = await asyncio.wait_for(self.outputs_queue.get(), timeout)
        except TimeoutError:
            raise TimeoutError(f"No engine core output within {timeout} s.") from None
        if isinstance(outputs, BaseException):
            self.outputs_queue.put_nowait(outputs)  # wake the next waiting caller too
            raise outputs
        return outputs

    def _send_input(
        self, request_type: EngineCoreRequestType, payload: Any, engine: bytes | None = None
    ) -> None:
        self.ensure_alive()
        self._ensure_output_task()
        msg, has_buffers = self._encode_input(request_type, payload, engine)
        try:
            self._send_frames(msg, has_buffers)
        except zmq.ZMQError as e:
            self.ensure_alive()
            raise EngineDeadError(f"Could not send to the engine core: {e}") from e

    async def add_request_async(self, request: EngineCoreRequest) -> None:
        self._send_input(EngineCoreRequestType.ADD, request)

    async def abort_requests_async(self, request_ids: list[str]) -> None:
        if request_ids and not self.resources.engine_dead:
            self._send_input(EngineCoreRequestType.ABORT, list(request_ids))

    async def call_utility_async(self, method: str, *args: Any, timeout: float | None = None) -> Any:
        self._ensure_output_task()
        call_id = self._next_call_id()
        future = asyncio.get_running_loop().create_future()
        self.utility_results[call_id] = future
        try:
            self._send_input(EngineCoreRequestType.UTILITY, EngineCoreUtilityRequest(call_id, method, args))
            if timeout is None:
                return await future
            return await asyncio.wait_for(future, timeout)
        except TimeoutError:
            raise TimeoutError(f"Utility call {method!r} got no answer within {timeout} s.") from None
        finally:
            self.utility_results.pop(call_id, None)


async def _process_outputs(
    resources: BackgroundResources,
    sock: zmq.asyncio.Socket,
    decoder: MsgpackDecoder,
    outputs_queue: asyncio.Queue,
    utility_results: dict[int, asyncio.Future],
) -> None:
    # a blocking view of the same socket drains bursts without a future per message
    sync_view = zmq.Socket.shadow(sock.underlying)
    try:
        while True:
            frames = await sock.recv_multipart(copy=False)
            while frames is not None:
                if not resources.validate_alive(frames):
                    outputs: EngineCoreOutputs = decoder.decode(frames)
                    if outputs.utility_output is not None:
                        process_utility_output(outputs.utility_output, utility_results)
                    elif outputs.death is not None:
                        resources.record_death(outputs.death)
                    else:
                        outputs_queue.put_nowait(outputs)
                try:
                    frames = sync_view.recv_multipart(zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    frames = None
    except EngineDeadError:
        return  # validate_alive has marked the death and woken everyone
    except Exception as e:
        if not resources.shutting_down:
            error = EngineDeadError(f"The engine core output socket failed: {type(e).__name__}: {e}")
            error.__cause__ = e
            resources.mark_dead(error)
