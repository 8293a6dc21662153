"""AsyncMPClient: the multiprocess client for asyncio frontends (AsyncLLM, the HTTP server).

Its transport (`AsyncOutputReader`): an asyncio task on the caller's loop owns the output PULL socket
(an asyncio socket), hands each message to the shared dispatch, and feeds an `asyncio.Queue` that
`get_output_async()` awaits. The task starts with the client when a loop is running, else on the first
async call, and moves to a new loop once the old one has stopped (successive `asyncio.run` calls).
Whatever another thread delivers (a death from a rank's watcher, failing utility futures) is scheduled
onto that loop, after what the task has queued already. Sends go through the plain ROUTER socket: with
no high-water mark they never block the loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable, Sequence
from typing import Any

import zmq
import zmq.asyncio

from nanoserve.config import EngineOptions
from nanoserve.engine.core_client.mp import MPClient
from nanoserve.engine.core_client.router import EngineRouter, RankDeath, SingleRankRouter
from nanoserve.wire.messages import EngineCoreOutputs, EngineCoreRequest
from nanoserve.wire.sockets import CurveServer, bind_socket

READ_BURST = 256
"""Messages the reader hands on in a row. Awaiting a socket that already holds a message does not
suspend, so without a bound a rank that outputs faster than the frontend reads (a model-free engine
streams thousands of steps a second) kept the loop's other tasks (HTTP handlers, the output handler,
a caller polling progress) waiting for as long as it did."""
LOOP_STOP_WAIT_S = 1.0
"""How long shutdown waits for the reader's loop to cancel the task and close its socket; past that
the loop is busy or stopping, and the socket is closed from here."""


def in_loop(loop: asyncio.AbstractEventLoop) -> bool:
    try:
        return asyncio.get_running_loop() is loop
    except RuntimeError:
        return False


class AsyncOutputReader:
    thread = None

    def __init__(self) -> None:
        self.queue: asyncio.Queue[EngineCoreOutputs | RankDeath | BaseException] = asyncio.Queue()
        self.socket: zmq.asyncio.Socket | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self.task: asyncio.Task | None = None
        self._dispatch: Callable[[list], None] | None = None
        self._on_failure: Callable[[Exception], None] | None = None

    def open(
        self, ctx: zmq.Context, transport: str, host: str, curve: CurveServer | None
    ) -> tuple[str, str | None]:
        self.socket, endpoint, path = bind_socket(
            zmq.asyncio.Context.shadow(ctx.underlying), zmq.PULL, transport, host, curve
        )
        return endpoint, path

    def sync_view(self) -> zmq.Socket:
        assert self.socket is not None
        return zmq.Socket.shadow(self.socket.underlying)

    def start(self, dispatch: Callable[[list], None], on_failure: Callable[[Exception], None]) -> None:
        self._dispatch, self._on_failure = dispatch, on_failure
        with contextlib.suppress(RuntimeError):  # no running loop: started by the first async call
            asyncio.get_running_loop()
            self.ensure_task()

    def ensure_task(self) -> None:
        """Read on the running loop (call from it before awaiting outputs or answers)."""
        loop = asyncio.get_running_loop()
        task = self.task
        if task is not None and not task.done() and self.loop is loop:
            return
        if self.socket is None or self._dispatch is None or self._on_failure is None:
            return  # stopped, or not started
        if self.loop is not None and self.loop is not loop:
            self._move_to(loop)
        self.loop = loop
        self.task = loop.create_task(
            _read_outputs(self.socket, self._dispatch, self._on_failure), name="EngineCoreOutputTask"
        )

    def _move_to(self, loop: asyncio.AbstractEventLoop) -> None:
        """The old loop has stopped: its task died with it; the outputs it had queued carry over."""
        if self.loop is not None and self.loop.is_running():
            raise RuntimeError("AsyncMPClient is in use by another running event loop.")
        moved: asyncio.Queue = asyncio.Queue()
        with contextlib.suppress(asyncio.QueueEmpty):
            while True:
                moved.put_nowait(self.queue.get_nowait())
        self.queue = moved
        self.task = None

    def deliver(self, item: EngineCoreOutputs) -> None:
        self.queue.put_nowait(item)

    def put(self, item: EngineCoreOutputs | RankDeath | BaseException) -> None:
        self.call(lambda: self.queue.put_nowait(item))

    def call(self, fn: Callable[[], None]) -> None:
        loop = self.loop
        if loop is None or in_loop(loop) or loop.is_closed():
            fn()
            return
        with contextlib.suppress(RuntimeError):  # closed meanwhile: nobody is waiting there any more
            loop.call_soon_threadsafe(fn)

    async def get(self, timeout: float | None) -> EngineCoreOutputs | RankDeath:
        try:
            if timeout is None:
                item = await self.queue.get()
            else:
                item = await asyncio.wait_for(self.queue.get(), timeout)
        except TimeoutError:
            raise TimeoutError(f"No engine core output within {timeout} s.") from None
        if isinstance(item, BaseException):
            self.queue.put_nowait(item)  # wake the next waiting caller too
            raise item
        return item

    def stop(self) -> None:
        """Cancel the task and close the socket on the task's own loop (an asyncio socket must not be
        closed under a running loop's feet)."""
        task, loop, sock = self.task, self.loop, self.socket
        self.socket = None
        if sock is None and task is None:
            return

        def stop() -> None:
            if task is not None and not task.done():
                with contextlib.suppress(RuntimeError):  # its loop is closed: the task is gone with it
                    task.cancel()
            if sock is not None:
                with contextlib.suppress(Exception):
                    sock.close(linger=0)
                if not sock.closed:  # its loop is gone and could not unregister it
                    zmq.Socket.close(sock, linger=0)

        if loop is not None and loop.is_running() and not in_loop(loop):
            done = threading.Event()
            try:
                loop.call_soon_threadsafe(lambda: (stop(), done.set()))
                done.wait(LOOP_STOP_WAIT_S)
            except RuntimeError:
                stop()
        else:
            stop()


async def _read_outputs(
    sock: zmq.asyncio.Socket, dispatch: Callable[[list], None], on_failure: Callable[[Exception], None]
) -> None:
    # a blocking view of the same socket drains bursts without a future per message; every READ_BURST
    # messages (counted across awaits, which need not suspend) the loop's other tasks get their turn
    sync_view = zmq.Socket.shadow(sock.underlying)
    read = 0
    try:
        while True:
            frames = await sock.recv_multipart(copy=False)
            while frames is not None:
                dispatch(frames)
                read += 1
                if read % READ_BURST == 0:
                    await asyncio.sleep(0)
                try:
                    frames = sync_view.recv_multipart(zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    frames = None
    except Exception as e:
        on_failure(e)


class AsyncMPClient(MPClient):
    reader: AsyncOutputReader

    def __init__(self, options: EngineOptions, router: EngineRouter | None = None) -> None:
        super().__init__(
            options, AsyncOutputReader(), router or SingleRankRouter(options.data_parallel_rank or 0)
        )

    async def get_output_async(self, timeout: float | None = None) -> EngineCoreOutputs:
        self._ensure_open()
        self.reader.ensure_task()
        return self.router.consume(await self.reader.get(timeout))

    async def add_requests_async(self, requests: Sequence[EngineCoreRequest]) -> None:
        self.reader.ensure_task()
        self._add(requests)

    async def abort_requests_async(self, request_ids: list[str]) -> None:
        self._abort(request_ids)

    async def call_utility_async(self, method: str, *args: Any, timeout: float | None = None) -> Any:
        self.reader.ensure_task()
        calls = self._start_utility(method, args, asyncio.get_running_loop().create_future)
        try:
            gathered = asyncio.gather(*(future for _, _, future in calls))
            values = await (gathered if timeout is None else asyncio.wait_for(gathered, timeout))
        except TimeoutError:
            raise TimeoutError(f"Utility call {method!r} got no answer within {timeout} s.") from None
        finally:
            self.utilities.discard([call_id for _, call_id, _ in calls])
        return self._finish_utility(
            method, args, dict(zip((rank for rank, _, _ in calls), values, strict=True))
        )
