"""MPClient: the shared half of the multiprocess clients (engine cores in child processes or Ray actors).

Sockets (bound here; engines connect): the input ROUTER (`EngineInput`) sends `[identity, request_type,
*payload]`, the identity naming the rank; the output PULL receives encoded `EngineCoreOutputs`. Over
TCP both are CURVE servers and a ZAP authenticator on the client's context admits only this run's
engines (`nanoserve/wire/sockets.py`).

A client is composed of parts that know nothing of it, so that its finalizer can run while they live:
  reader      the transport from the output socket to the frontend: a thread and a `queue.Queue`
              (`SyncMPClient`), or an asyncio task and an `asyncio.Queue` (`AsyncMPClient`);
  dispatch    what each message means, the same for both readers (`OutputDispatch`);
  router      which rank a request or utility call goes to: one, or several balanced (`dp.py`);
  liveness    each rank's state: alive, restarting, or dead for good (`EngineLiveness`);
  ledger      what a restarted rank must resume (`ReplayLedger`, kept only with `engine_restarts`);
  watchers    one thread per rank: a death is reported, and a restart carried out (`RankWatcher`);
  resources   what must be released, the `weakref.finalize` callback (`BackgroundResources`).

Death is seen three ways: the `ENGINE_CORE_DEAD` frame (after a death record carrying the cause), a
rank's watcher seeing its process or actor end, and an error on the output socket. Whichever comes
first reports it to the liveness, which decides: a restart while the budget lasts, else the end of the
rank. Either way the utility calls sent to the dead engine fail with `EngineDeadError`. A rank that is
dead for good fails its requests (with several ranks; the others serve on) or, being the last, the
client: every blocked getter wakes with the error once the outputs received before it are read.

Ordering with restarts: the client changes the ledger, decides where a request goes and sends it while
holding the liveness lock; the reader checks a message's incarnation and passes it on under the same
lock; a watcher replays a restarted rank's requests and marks it alive under it too. So a request is
either sent to a live engine or held for the restart's replay, and the replay starts exactly where the
frontend's tokens end.
"""

from __future__ import annotations

import contextlib
import os
import threading
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from multiprocessing.process import BaseProcess
from typing import Any, Protocol, TypeVar

import msgspec
import zmq
from zmq.auth.thread import ThreadAuthenticator

from nanoserve.config import EngineOptions
from nanoserve.engine.core_client.base import EngineCoreClient
from nanoserve.engine.core_client.dispatch import OutputDispatch
from nanoserve.engine.core_client.engine_input import EngineInput
from nanoserve.engine.core_client.launch import (
    EngineManager,
    EngineZmqAddresses,
    make_engine_manager,
    read_death_record,
    run_keys,
    wait_for_engine_startup,
)
from nanoserve.engine.core_client.ledger import ReplayLedger
from nanoserve.engine.core_client.liveness import EngineLiveness, Listener, RankState
from nanoserve.engine.core_client.router import EngineRouter, RankDeath
from nanoserve.engine.core_client.utilities import Future, UtilityCalls, fail_future
from nanoserve.engine.core_client.watcher import RankWatcher
from nanoserve.engine.exceptions import EngineDeadError
from nanoserve.wire.messages import (
    EngineCoreOutputs,
    EngineCoreReadyResponse,
    EngineCoreRequest,
    EngineCoreRequestType,
    EngineCoreUtilityRequest,
)
from nanoserve.wire.sockets import CurveServer, bind_socket, start_authenticator

FutureT = TypeVar("FutureT", bound=Future)


class OutputReader(Protocol):
    """Moves messages from the output socket to the dispatch, and what the dispatch (or a death)
    produces to the frontend's queue."""

    thread: threading.Thread | None
    """The reader's own thread, if it has one."""

    def open(
        self, ctx: zmq.Context, transport: str, host: str, curve: CurveServer | None
    ) -> tuple[str, str | None]:
        """Bind the output PULL socket; returns its endpoint and ipc file."""
        ...

    def sync_view(self) -> zmq.Socket:
        """A blocking view of the socket, for start-up (before `start`)."""
        ...

    def start(self, dispatch: Callable[[list], None], on_failure: Callable[[Exception], None]) -> None: ...

    def deliver(self, item: EngineCoreOutputs) -> None:
        """Queue outputs from the reader's own thread or loop (the dispatch)."""
        ...

    def put(self, item: EngineCoreOutputs | RankDeath | BaseException) -> None:
        """Queue an item from any thread, after what is queued already."""
        ...

    def call(self, fn: Callable[[], None]) -> None:
        """Run `fn` where the client's futures may be completed (the loop of an asyncio client)."""
        ...

    def stop(self) -> None: ...


@dataclass
class BackgroundResources:
    """Everything a client must release; used as its finalizer, so it never refers to the client."""

    ctx: zmq.Context
    liveness: EngineLiveness
    reader: OutputReader
    input: EngineInput | None = None
    authenticator: ThreadAuthenticator | None = None
    """Over CURVE: admits this run's engines to the client's sockets (stopped before the context ends)."""
    engine_manager: EngineManager | None = None
    coordinator: BaseProcess | None = None
    """Data parallel: the process that publishes every rank's load to the frontends."""
    ipc_paths: list[str] = field(default_factory=list)
    thread_idents: set[int] = field(default_factory=set)
    """The client's threads (cleanup must not block on them from inside them)."""
    closed: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)

    def own(self, thread: threading.Thread) -> None:
        """A started thread of the client (see `thread_idents`)."""
        if thread.ident is not None:
            self.thread_idents.add(thread.ident)

    def __call__(self) -> None:
        """Stop engines, stop the reader, close sockets, then terminate the context (in that order)."""
        with self.lock:
            if self.closed:
                return
            self.closed = True
        if threading.get_ident() in self.thread_idents:
            # collected on one of our own threads: terminating the context there would wait for itself
            threading.Thread(target=self._release, name="EngineCoreClientCleanup", daemon=True).start()
            return
        self._release()

    def _release(self) -> None:
        self.liveness.begin_shutdown()
        if self.engine_manager is not None:
            self.engine_manager.shutdown()
        if self.coordinator is not None:
            from nanoserve.engine.core_client.coordinator import stop_coordinator

            stop_coordinator(self.coordinator)
        self.liveness.end(EngineDeadError("The engine core client has been shut down."), shutting_down=True)
        self.reader.stop()
        if self.input is not None:
            self.input.close()
        if self.authenticator is not None:
            self.authenticator.stop()
        self.ctx.term()
        for path in self.ipc_paths:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)


def _on_rank_change(
    reader: OutputReader, utilities: UtilityCalls, ledger: ReplayLedger, liveness: EngineLiveness
) -> Listener:
    """A liveness listener built from the client's parts (not the client: the finalizer must stay free)."""

    def listener(rank: int, state: RankState, error: EngineDeadError | None, incarnation: int) -> None:
        if state is RankState.ALIVE or error is None:
            return
        reader.call(lambda: utilities.fail(error, rank, incarnation))
        if state is RankState.RESTARTING:
            return
        with liveness.lock:
            ledger.drop_rank(rank)
        dead_error = liveness.dead_error
        if dead_error is not None:
            reader.call(lambda: utilities.fail(dead_error))
            reader.put(dead_error)
        else:
            reader.put(RankDeath(rank, error))

    return listener


class MPClient(EngineCoreClient):
    """Composition and the calls both variants share; `SyncMPClient` and `AsyncMPClient` add their
    reader and the blocking or awaitable surface."""

    def __init__(self, options: EngineOptions, reader: OutputReader, router: EngineRouter) -> None:
        self.options = options
        self.reader = reader
        self.router = router
        self.liveness = EngineLiveness(router.ranks, options.engine_restarts, options.engine_restart_window)
        self.ledger = ReplayLedger(enabled=options.engine_restarts > 0)
        self.utilities = UtilityCalls()
        self.resources = resources = BackgroundResources(zmq.Context(), self.liveness, reader)
        self._finalizer = weakref.finalize(self, resources)
        success = False
        try:
            ctx = resources.ctx
            manager = resources.engine_manager = make_engine_manager(options)
            host = manager.host
            keys = run_keys(options, host.transport, router.ranks)
            curve = None if keys is None else keys.server_side()
            if curve is not None:
                resources.authenticator = start_authenticator(ctx, curve)
                resources.own(resources.authenticator.thread)
            input_socket, input_address, input_path = bind_socket(
                ctx, zmq.ROUTER, host.transport, host.bind, curve
            )
            self.input = resources.input = EngineInput(input_socket)
            output_address, output_path = reader.open(ctx, host.transport, host.bind, curve)
            resources.ipc_paths = [p for p in (input_path, output_path) if p]
            self.addresses = EngineZmqAddresses(
                host.endpoint(input_address), host.endpoint(output_address), keys=keys
            )
            router.start(resources, host, self.addresses)
            manager.start(self.addresses, router.ranks, self.input)
            output_view = reader.sync_view()
            ready = wait_for_engine_startup(
                self.input,
                manager,
                dict.fromkeys(router.ranks, 0),
                lambda rank: read_death_record(output_view),
            )
            self._apply_ready_response(ready)
            self.liveness.add_listener(_on_rank_change(reader, self.utilities, self.ledger, self.liveness))
            dispatch = OutputDispatch(self.liveness, self.ledger, self.utilities, manager, reader.deliver)
            reader.start(dispatch, dispatch.socket_failed)
            if reader.thread is not None:
                resources.own(reader.thread)
            for rank in router.ranks:
                watcher = RankWatcher(rank, manager, self.liveness, self.ledger, self.utilities, self.input)
                watcher.start()
                resources.own(watcher.thread)
            success = True
        finally:
            if not success:
                self._finalizer()

    def _apply_ready_response(self, responses: dict[int, EngineCoreReadyResponse]) -> None:
        """Keep what the engines computed; the user's options are left as given. Over several ranks the
        capacity is the sum of their KV blocks and running sequences, and the longest sequence is what every
        rank can hold."""
        self.ready_responses = responses
        first = responses[self.router.ranks[0]]
        if len(responses) == 1:
            self.ready_response = first
            return
        self.ready_response = msgspec.structs.replace(
            first,
            num_kv_blocks=sum(r.num_kv_blocks for r in responses.values()),
            max_num_seqs=sum(r.max_num_seqs for r in responses.values()),
            max_model_len=min(r.max_model_len for r in responses.values()),
        )

    # -- state ---------------------------------------------------------------------------------

    @property
    def engine_ranks(self) -> list[int]:
        return list(self.router.ranks)

    @property
    def engine_dead(self) -> bool:
        return self.liveness.is_dead

    @property
    def dead_ranks(self) -> set[int]:
        return set(self.liveness.dead_ranks())

    @property
    def live_ranks(self) -> list[int]:
        return [rank for rank in self.router.ranks if self.liveness.state(rank) is not RankState.FINAL]

    @property
    def is_degraded(self) -> bool:
        """Some ranks are dead for good, others still serve."""
        return bool(self.liveness.dead_ranks()) and not self.liveness.is_dead

    def engine_pids(self) -> list[int]:
        manager = self.resources.engine_manager
        return manager.pids() if manager is not None else []

    def ensure_alive(self) -> None:
        if self.liveness.is_dead:
            raise self.liveness.dead_error or EngineDeadError()

    def _ensure_open(self) -> None:
        """After shutdown nothing more is delivered (before it, the outputs received before a death are)."""
        if self.resources.closed:
            raise self.liveness.dead_error or EngineDeadError("The engine core client has been shut down.")

    def shutdown(self) -> None:
        """Stop the engines and free every resource; idempotent, bounded by the engines' drain time."""
        self._finalizer()

    # -- the calls both variants share ----------------------------------------------------------

    def _send(self, rank: int, request_type: EngineCoreRequestType, payload: Any) -> None:
        try:
            self.input.send(rank, request_type, payload)
        except zmq.ZMQError as e:
            self.ensure_alive()
            raise EngineDeadError(f"Could not send to the engine core: {e}") from e

    def _add(self, requests: Sequence[EngineCoreRequest]) -> None:
        """To live ranks now, one message per rank so that each engine takes its share in one step; to a
        restarting rank with its replay."""
        if not requests:
            return
        self.ensure_alive()
        batches: dict[int, list[EngineCoreRequest]] = {}
        with self.liveness.lock:
            try:
                for request in requests:
                    rank = self.router.choose(request, self.liveness)
                    state = self.liveness.state(rank)
                    if state is RankState.FINAL:
                        raise self.liveness.error(rank) or EngineDeadError()
                    self.ledger.add(rank, request)
                    if state is RankState.ALIVE:
                        batches.setdefault(rank, []).append(request)
            finally:  # what the ledger and router took is sent, even when a later request fails
                self._send_batches(batches)

    def _send_batches(self, batches: dict[int, list[EngineCoreRequest]]) -> None:
        """One ADD per rank. A batch that cannot be sent (it does not encode, or the rank is gone) leaves
        the ledger and the router, so nothing waits for it; the others go all the same. The first failure
        is raised."""
        failure: Exception | None = None
        for rank, batch in batches.items():
            try:
                self._send(rank, EngineCoreRequestType.ADD, batch)
            except Exception as e:
                ids = [request.request_id for request in batch]
                self.ledger.discard(ids)
                self.router.released(ids)
                failure = failure or e
        if failure is not None:
            raise failure

    def _abort(self, request_ids: list[str]) -> None:
        if not request_ids or self.liveness.is_dead:
            return
        with self.liveness.lock:
            self.ledger.discard(request_ids)
            for rank, ids in self.router.owners(request_ids).items():
                state = self.liveness.state(rank)
                if state is RankState.ALIVE:
                    self._send(rank, EngineCoreRequestType.ABORT, ids)
                elif state is RankState.RESTARTING:
                    self.router.released(ids)  # the engine never hears of them again

    def _start_utility(
        self, method: str, args: tuple, make_future: Callable[[], FutureT]
    ) -> list[tuple[int, int, FutureT]]:
        """Register and send one call per target rank: (rank, call id, future) each. A rank that is
        restarting gets its call once it is back."""
        self.ensure_alive()
        calls: list[tuple[int, int, FutureT]] = []
        try:
            with self.liveness.lock:
                for rank in self.router.utility_targets(method, self.liveness):
                    future = make_future()
                    state = self.liveness.state(rank)
                    call_id = self.utilities.register(rank, self.liveness.incarnation(rank), future)
                    calls.append((rank, call_id, future))
                    request = EngineCoreUtilityRequest(call_id, method, args)
                    if state is RankState.ALIVE:
                        self._send(rank, EngineCoreRequestType.UTILITY, request)
                    elif state is RankState.RESTARTING:
                        self.ledger.hold_utility(rank, request)
                    else:
                        fail_future(future, self.liveness.error(rank) or EngineDeadError())
        except BaseException:
            self.utilities.discard([call_id for _, call_id, _ in calls])
            raise
        return calls

    def _finish_utility(self, method: str, args: tuple, results: dict[int, Any]) -> Any:
        """One answer from every rank's; a restarted rank is put back in the sleep level noted here."""
        if method in ("sleep", "wake_up"):
            asked = (args[0] if args else 1) if method == "sleep" else 0
            with self.liveness.lock:
                for rank in results:  # sleeping deeper only: an engine at level 2 stays there on sleep(1)
                    level = max(asked, self.ledger.sleep_levels.get(rank, 0)) if asked else 0
                    self.ledger.note_sleep(rank, level)
        return self.router.combine(method, results)
