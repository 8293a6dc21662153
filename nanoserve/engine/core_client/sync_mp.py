"""SyncMPClient: the multiprocess client for synchronous frontends (LLM, LLMEngine).

Its transport (`ThreadOutputReader`): a daemon thread owns the output PULL socket and polls it
together with an inproc PAIR socket that stops it; each message goes to the shared dispatch, and what
it passes on lands in a `queue.Queue` that `get_output()` blocks on. A death is queued after the
outputs received before it, so a caller reads those first and then gets the `EngineDeadError`; every
later or concurrent caller gets it too.
"""

from __future__ import annotations

import queue
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeoutError
from typing import Any, cast

import zmq

from nanoserve.config import EngineOptions
from nanoserve.engine.core_client.mp import MPClient
from nanoserve.engine.core_client.router import EngineRouter, RankDeath, SingleRankRouter
from nanoserve.wire.messages import EngineCoreOutputs, EngineCoreRequest
from nanoserve.wire.sockets import CurveServer, bind_socket


class ThreadOutputReader:
    def __init__(self) -> None:
        self.queue: queue.Queue[EngineCoreOutputs | RankDeath | BaseException] = queue.Queue()
        self.thread: threading.Thread | None = None
        self._socket: zmq.Socket | None = None
        self._ctx: zmq.Context | None = None
        self._stop_address = f"inproc://nanoserve-output-stop-{uuid.uuid4().hex}"

    def open(
        self, ctx: zmq.Context, transport: str, host: str, curve: CurveServer | None
    ) -> tuple[str, str | None]:
        self._ctx = ctx
        self._socket, endpoint, path = bind_socket(ctx, zmq.PULL, transport, host, curve)
        return endpoint, path

    def sync_view(self) -> zmq.Socket:
        assert self._socket is not None
        return self._socket

    def start(self, dispatch: Callable[[list], None], on_failure: Callable[[Exception], None]) -> None:
        assert self._ctx is not None and self._socket is not None
        stop = self._ctx.socket(zmq.PAIR)
        stop.setsockopt(zmq.LINGER, 0)
        stop.bind(self._stop_address)
        self.thread = threading.Thread(
            target=_read_outputs,
            args=(self._socket, stop, dispatch, on_failure),
            name="EngineCoreOutputThread",
            daemon=True,
        )
        self.thread.start()
        self._socket = None  # the thread owns (and closes) both sockets from here on

    def deliver(self, item: EngineCoreOutputs) -> None:
        self.queue.put_nowait(item)

    def put(self, item: EngineCoreOutputs | RankDeath | BaseException) -> None:
        self.queue.put_nowait(item)

    def call(self, fn: Callable[[], None]) -> None:
        fn()

    def get(self, timeout: float | None) -> EngineCoreOutputs | RankDeath:
        try:
            item = self.queue.get(timeout=timeout)
        except queue.Empty:
            raise TimeoutError(f"No engine core output within {timeout} s.") from None
        if isinstance(item, BaseException):
            self.queue.put_nowait(item)  # wake the next blocked caller too
            raise item
        return item

    def stop(self) -> None:
        if self._socket is not None:  # never started: the socket is still ours
            self._socket.close(linger=0)
            self._socket = None
        if self.thread is None or self._ctx is None:
            return
        try:
            sock = self._ctx.socket(zmq.PAIR)
        except zmq.ZMQError:
            return  # the context is terminated: the reader has stopped already
        try:
            sock.connect(self._stop_address)
            sock.send(b"", zmq.NOBLOCK)
        except zmq.ZMQError:
            pass  # the reader has already ended
        finally:
            sock.close(linger=0)


def _read_outputs(
    sock: zmq.Socket,
    stop: zmq.Socket,
    dispatch: Callable[[list], None],
    on_failure: Callable[[Exception], None],
) -> None:
    poller = zmq.Poller()
    poller.register(stop, zmq.POLLIN)
    poller.register(sock, zmq.POLLIN)
    try:
        while True:
            events = dict(poller.poll())
            if stop in events:
                return
            # drain what is there before polling again: one poll per burst, not per message
            while cast(int, sock.get(zmq.EVENTS)) & zmq.POLLIN:
                dispatch(sock.recv_multipart(copy=False))
    except Exception as e:
        on_failure(e)
    finally:
        stop.close(linger=0)
        sock.close(linger=0)


class SyncMPClient(MPClient):
    reader: ThreadOutputReader

    def __init__(self, options: EngineOptions, router: EngineRouter | None = None) -> None:
        super().__init__(
            options, ThreadOutputReader(), router or SingleRankRouter(options.data_parallel_rank or 0)
        )

    def get_output(self, timeout: float | None = None) -> EngineCoreOutputs:
        self._ensure_open()
        return self.router.consume(self.reader.get(timeout))

    def add_requests(self, requests: Sequence[EngineCoreRequest]) -> None:
        self._add(requests)

    def abort_requests(self, request_ids: list[str]) -> None:
        self._abort(request_ids)

    def call_utility(self, method: str, *args: Any, timeout: float | None = None) -> Any:
        calls = self._start_utility(method, args, Future)
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            results = {}
            for rank, _, future in calls:
                remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
                results[rank] = future.result(timeout=remaining)
        except FutureTimeoutError:
            raise TimeoutError(f"Utility call {method!r} got no answer within {timeout} s.") from None
        finally:
            self.utilities.discard([call_id for _, call_id, _ in calls])
        return self._finish_utility(method, args, results)
