"""MPClient: the shared half of the multiprocess clients (engine core in child processes over ZMQ).

Sockets (bound here; engines connect): input ROUTER sends `[identity, request_type, *payload]`, identity
being the engine rank as 2 bytes little-endian; output PULL receives encoded `EngineCoreOutputs`.
Subclasses own how outputs are read (a thread for `SyncMPClient`, an asyncio task for `AsyncMPClient`).

Death is seen three ways: the `ENGINE_CORE_DEAD` frame (after a death record carrying the cause), the
monitor thread seeing an engine end (a process exit, or a Ray actor's end: the `EngineManager` turns
either into a readable sentinel), and an error on the output socket. Each marks
`BackgroundResources.engine_dead`, fails every pending utility future and wakes every blocked
`get_output` with the same `EngineDeadError`; sends fail at once from then on. With several engine
ranks (data parallel), the death of one rank only marks that rank (`mark_rank_dead`); the client is dead
once every rank is.

Cleanup: `BackgroundResources` is the `weakref.finalize` callback, so engines, sockets and the context
are reclaimed on `shutdown()`, on garbage collection, and when construction fails half-way.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import itertools
import logging
import os
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from multiprocessing.process import BaseProcess
from typing import Any

import msgspec
import zmq

from nanoserve.config import EngineOptions
from nanoserve.engine.core_client.base import EngineCoreClient
from nanoserve.engine.core_client.launch import (
    EngineManager,
    EngineZmqAddresses,
    dead_error,
    engine_identity,
    make_engine_manager,
    make_socket,
    wait_for_engine_startup,
)
from nanoserve.engine.exceptions import EngineDeadError
from nanoserve.wire.codec import MsgpackDecoder, MsgpackEncoder
from nanoserve.wire.messages import (
    ENGINE_CORE_DEAD,
    EngineCoreOutputs,
    EngineCoreReadyResponse,
    EngineCoreRequestType,
    EngineDeathRecord,
    UtilityOutput,
)

logger = logging.getLogger(__name__)

DEATH_RECORD_WAIT_S = 0.3
"""How long the monitor waits for a crashed engine's death record before reporting without it."""


@dataclass
class BackgroundResources:
    """Everything a client must release; used as its finalizer, so it never refers to the client."""

    ctx: zmq.Context
    input_socket: zmq.Socket | None = None
    output_socket: zmq.Socket | None = None
    """None once the output reader owns it (the reader closes it)."""
    engine_manager: EngineManager | None = None
    coordinator: BaseProcess | None = None
    """Data parallel: the process that publishes every rank's load to the frontends."""
    ipc_paths: list[str] = field(default_factory=list)
    shutdown_path: str | None = None
    """Sync client: inproc address of the output thread's shutdown PAIR socket."""
    output_task: asyncio.Task | None = None
    async_output_socket: Any = None
    """Async client: the asyncio output socket, closed on its loop."""
    loop: asyncio.AbstractEventLoop | None = None
    on_dead: Callable[[EngineDeadError], None] | None = None
    """Fails the pending futures and wakes the blocked getters of the owning client."""
    engine_dead: bool = False
    dead_error: EngineDeadError | None = None
    death_record: EngineDeathRecord | None = None
    """The last death record received, from any rank."""
    ranks: list[int] = field(default_factory=lambda: [0])
    dead_ranks: dict[int, EngineDeadError] = field(default_factory=dict)
    """Only used with several ranks: the ranks that died while others live on."""
    death_records: dict[int, EngineDeathRecord] = field(default_factory=dict)
    on_rank_dead: Callable[[int, EngineDeadError], None] | None = None
    """Data-parallel clients: fails the dead rank's requests and utility calls (any thread)."""
    death_event: threading.Event = field(default_factory=threading.Event)
    shutting_down: bool = False
    closed: bool = False
    thread_idents: set[int] = field(default_factory=set)
    """The reader and monitor threads (cleanup must not block on them from inside them)."""
    lock: threading.Lock = field(default_factory=threading.Lock)

    def __call__(self) -> None:
        """Stop engines, stop the reader, close sockets, then terminate the context (in that order)."""
        with self.lock:
            if self.closed:
                return
            self.closed = True
            self.shutting_down = True
        if threading.get_ident() in self.thread_idents:
            # collected on one of our own threads: terminating the context there would wait for itself
            threading.Thread(target=self._release, name="EngineCoreClientCleanup", daemon=True).start()
            return
        self._release()

    def _release(self) -> None:
        if self.engine_manager is not None:
            self.engine_manager.shutdown()
        if self.coordinator is not None:
            from nanoserve.engine.core_client.coordinator import stop_coordinator

            stop_coordinator(self.coordinator)
        if not self.engine_dead:
            self.mark_dead(EngineDeadError("The engine core client has been shut down."), quiet=True)
        self.stop_output_reader()
        for sock in (self.input_socket, self.output_socket):
            if sock is not None:
                sock.close(linger=0)
        self.input_socket = self.output_socket = None
        self.ctx.term()
        for path in self.ipc_paths:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)

    def _message_reader_stop(self) -> None:
        try:
            sock = self.ctx.socket(zmq.PAIR)
        except zmq.ZMQError:
            return  # the context is terminated: shutdown has already stopped the reader
        try:
            sock.connect(self.shutdown_path)
            sock.send(b"", zmq.NOBLOCK)
        except zmq.ZMQError:
            pass  # the reader has already ended
        finally:
            sock.close(linger=0)

    def stop_output_reader(self) -> None:
        """Sync: message the reader thread's PAIR socket. Async: cancel the task and close its socket
        on the task's own loop (an asyncio socket must not be closed under a running loop's feet)."""
        if self.shutdown_path is not None:
            self._message_reader_stop()
        if self.async_output_socket is None and self.output_task is None:
            return
        task, loop, sock = self.output_task, self.loop, self.async_output_socket

        def stop() -> None:
            if task is not None and not task.done():
                with contextlib.suppress(RuntimeError):  # its loop is closed: the task is gone with it
                    task.cancel()
            if sock is not None:
                with contextlib.suppress(Exception):
                    sock.close(linger=0)
                if not sock.closed:  # its loop is gone and could not unregister it
                    zmq.Socket.close(sock, linger=0)

        if loop is not None and loop.is_running() and not _in_loop(loop):
            done = threading.Event()
            try:
                loop.call_soon_threadsafe(lambda: (stop(), done.set()))
                done.wait(1.0)
            except RuntimeError:
                stop()
        else:
            stop()
        self.async_output_socket = None

    def record_death(self, record: EngineDeathRecord) -> None:
        self.death_records[record.engine_rank] = record
        self.death_record = record

    def validate_alive(self, frames: Sequence[Any]) -> bool:
        """False for an ordinary message. The death frame raises `EngineDeadError` when it ends the
        client; the death frame of one rank among several marks that rank and returns True (skip it)."""
        if not (
            len(frames) == 1
            and len(frames[0]) == len(ENGINE_CORE_DEAD)
            and _frame_bytes(frames[0]) == ENGINE_CORE_DEAD
        ):
            return False
        # a PULL socket does not say which peer sent a frame: the dying rank's record came just before
        record = self.death_record
        if record is None and len(self.ranks) > 1:
            return True  # cannot tell which rank: the monitor will see its process exit
        rank = record.engine_rank if record is not None else self.ranks[0]
        manager = self.engine_manager
        exit_code = manager.exit_code(rank) if manager is not None else None
        error = self.mark_rank_dead(rank, dead_error(rank, exit_code, self.death_records.get(rank, record)))
        if self.engine_dead:
            raise error
        return True

    def mark_rank_dead(self, rank: int, error: EngineDeadError) -> EngineDeadError:
        """One rank is gone. With one rank that is the client's death; with several the others serve on
        until the last one dies."""
        if len(self.ranks) <= 1:
            return self.mark_dead(error)
        with self.lock:
            known = self.dead_ranks.get(rank)
            if known is not None:
                if known.exit_code is None:
                    known.exit_code = error.exit_code
                return known
            self.dead_ranks[rank] = error
            all_dead = len(self.dead_ranks) == len(self.ranks)
        if all_dead:
            return self.mark_dead(error)
        if not self.shutting_down:
            logger.error("%s; the other engine ranks keep serving", error)
        if self.on_rank_dead is not None:
            self.on_rank_dead(rank, error)
        return error

    def mark_dead(self, error: EngineDeadError, quiet: bool = False) -> EngineDeadError:
        """Record the first death; fail everything waiting on the engine. Returns the error in force."""
        with self.lock:
            if self.engine_dead:
                if self.dead_error is not None and self.dead_error.exit_code is None:
                    self.dead_error.exit_code = error.exit_code
                return self.dead_error or error
            self.engine_dead = True
            self.dead_error = error
        self.death_event.set()
        if not quiet:
            logger.error("%s", error)
        if self.on_dead is not None:
            self.on_dead(error)
        return error


def _frame_bytes(frame: Any) -> bytes:
    return frame.bytes if isinstance(frame, zmq.Frame) else bytes(frame)


def _in_loop(loop: asyncio.AbstractEventLoop) -> bool:
    try:
        return asyncio.get_running_loop() is loop
    except RuntimeError:
        return False


def _monitor_engines(resources: BackgroundResources, manager: EngineManager) -> None:
    """Wait for engines to end; unless we are shutting down, each end is a rank's death.
    Returns once the client is dead (every rank gone) or shutting down."""
    import multiprocessing.connection

    sentinels = manager.sentinels()
    while sentinels:
        ready = multiprocessing.connection.wait(list(sentinels))
        if resources.shutting_down:
            return
        for sentinel in ready:
            rank = sentinels.pop(sentinel)
            exit_code = manager.wait(rank, 1)
            if exit_code is not None and exit_code > 0:
                # a crash, not a kill: its death record may still be on its way through the output socket
                _wait_for_death_record(resources, rank)
            record = resources.death_records.get(rank) or manager.death_record(rank)
            resources.mark_rank_dead(rank, dead_error(rank, exit_code, record))
        if resources.engine_dead:
            if not resources.shutting_down:
                manager.shutdown()  # stop whatever is left
                resources.stop_output_reader()
            return


def _wait_for_death_record(resources: BackgroundResources, rank: int) -> None:
    if len(resources.ranks) <= 1:
        if not resources.death_event.is_set():
            resources.death_event.wait(DEATH_RECORD_WAIT_S)
        return
    deadline = time.monotonic() + DEATH_RECORD_WAIT_S
    while rank not in resources.dead_ranks and not resources.engine_dead and time.monotonic() < deadline:
        time.sleep(0.01)


def _fail_future(future: Any, error: BaseException) -> None:
    with contextlib.suppress(asyncio.InvalidStateError, concurrent.futures.InvalidStateError):
        if not future.done():
            future.set_exception(error)


class MPClient(EngineCoreClient):
    """Base of SyncMPClient and AsyncMPClient: sockets, launch, handshake, monitor, utility futures."""

    def __init__(self, options: EngineOptions) -> None:
        self.options = options
        self.encoder = MsgpackEncoder()
        self.decoder = MsgpackDecoder(EngineCoreOutputs)
        self.utility_results: dict[int, Any] = {}
        self.pending_messages: collections.deque[tuple[zmq.MessageTracker, Any]] = collections.deque()
        self._call_ids = itertools.count(1)
        self.resources = BackgroundResources(ctx=zmq.Context())
        self._finalizer = weakref.finalize(self, self.resources)
        success = False
        try:
            ctx = self.resources.ctx
            manager = self.resources.engine_manager = make_engine_manager(options)
            self.engine_host = host = manager.host
            input_socket, input_address, input_path = make_socket(ctx, zmq.ROUTER, host.transport, host.bind)
            self.resources.input_socket = input_socket
            output_socket, output_address, output_path = make_socket(
                self._output_context(ctx), zmq.PULL, host.transport, host.bind
            )
            self._own_output_socket(output_socket)
            self.resources.ipc_paths = [p for p in (input_path, output_path) if p]
            self.input_socket = input_socket
            self.addresses = addresses = EngineZmqAddresses(
                host.endpoint(input_address), host.endpoint(output_address)
            )
            self.engine_ranks = self._engine_ranks(options)
            self.core_engines = [engine_identity(rank) for rank in self.engine_ranks]
            self.core_engine = self.core_engines[0]
            self.resources.ranks = list(self.engine_ranks)
            self._start_coordinator(addresses)
            manager.start(addresses, self.engine_ranks)
            sync_view = zmq.Socket.shadow(output_socket.underlying)
            self._apply_ready_response(wait_for_engine_startup(input_socket, sync_view, manager))
            self._start_output_reader()
            self._start_engine_monitor()
            success = True
        finally:
            if not success:
                self._finalizer()

    def _start_coordinator(self, addresses: EngineZmqAddresses) -> None:
        """Data parallel with internal balancing starts its coordinator here, before the engines."""

    def _engine_ranks(self, options: EngineOptions) -> list[int]:
        """The ranks this client launches and talks to: one, its own rank behind an external balancer."""
        return [options.data_parallel_rank or 0]

    def _apply_ready_response(self, responses: dict[int, EngineCoreReadyResponse]) -> None:
        """Keep what the engines computed; the user's options are left as given. Over several ranks the
        capacity is the sum of their KV blocks and running sequences, and the longest sequence is what every
        rank can hold."""
        self.ready_responses = responses
        first = responses[self.engine_ranks[0]]
        if len(responses) == 1:
            self.ready_response = first
            return
        self.ready_response = msgspec.structs.replace(
            first,
            num_kv_blocks=sum(r.num_kv_blocks for r in responses.values()),
            max_num_seqs=sum(r.max_num_seqs for r in responses.values()),
            max_model_len=min(r.max_model_len for r in responses.values()),
        )

    def _output_context(self, ctx: zmq.Context) -> zmq.Context:
        return ctx

    def _own_output_socket(self, sock: zmq.Socket) -> None:
        self.resources.output_socket = sock

    def _start_output_reader(self) -> None:
        raise NotImplementedError

    def _start_engine_monitor(self) -> None:
        thread = threading.Thread(
            target=_monitor_engines,
            args=(self.resources, self.resources.engine_manager),
            name="EngineCoreMonitor",
            daemon=True,
        )
        thread.start()
        self.resources.thread_idents.add(thread.ident)

    @property
    def engine_dead(self) -> bool:
        return self.resources.engine_dead

    def engine_pids(self) -> list[int]:
        manager = self.resources.engine_manager
        return manager.pids() if manager is not None else []

    def ensure_alive(self) -> None:
        if self.resources.engine_dead:
            raise self.resources.dead_error or EngineDeadError()

    def shutdown(self) -> None:
        """Stop the engines and free every resource; idempotent, bounded by the engines' drain time."""
        self._finalizer()

    def _encode_input(
        self, request_type: EngineCoreRequestType, payload: Any, engine: bytes | None = None
    ) -> tuple[list, bool]:
        frames = self.encoder.encode(payload)
        return [engine or self.core_engine, request_type.value, *frames], len(frames) > 1

    def _send_frames(self, msg: list, has_buffers: bool) -> None:
        """Send one message; one with out-of-band buffers is tracked frame by frame and kept in
        `pending_messages` until ZMQ is done with every frame, so the tensors behind it stay alive."""
        sock = self.input_socket
        if not has_buffers:
            sock.send_multipart(msg, copy=False)
            return
        trackers = [sock.send(part, zmq.SNDMORE, copy=False, track=True) for part in msg[:-1]]
        trackers.append(sock.send(msg[-1], copy=False, track=True))
        pending = self.pending_messages
        while pending and pending[0][0].done:
            pending.popleft()
        tracker = zmq.MessageTracker(*trackers)
        if not tracker.done:
            pending.append((tracker, msg))

    def _next_call_id(self) -> int:
        return next(self._call_ids)


def process_utility_output(output: UtilityOutput, utility_results: dict[int, Any]) -> None:
    """Resolve the future waiting for this call; a caller that already gave up is fine."""
    future = utility_results.pop(output.call_id, None)
    if future is None:
        return
    try:
        if output.failure_message is not None:
            future.set_exception(RuntimeError(output.failure_message))
        else:
            future.set_result(output.result)
    except (asyncio.InvalidStateError, concurrent.futures.InvalidStateError):
        # the caller cancelled it; a failure is still worth a line in the log
        if output.failure_message is not None:
            logger.info("cancelled utility call %d failed: %s", output.call_id, output.failure_message)


def fail_sync_futures(utility_results: dict[int, concurrent.futures.Future], error: BaseException) -> None:
    for call_id in list(utility_results):
        future = utility_results.pop(call_id, None)
        if future is not None:
            _fail_future(future, error)
