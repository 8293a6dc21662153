"""Starting engine-core processes and waiting, under one deadline, until each is ready.

The frontend binds the input ROUTER and the output PULL first (ipc:// in the temp dir by default,
tcp:// on loopback with kernel-chosen ports when asked; over TCP authenticated and encrypted with
CURVE, see `nanoserve/wire/sockets.py`), then starts one child per engine rank. Each child connects
back and reports its phases on the ROUTER; the last report carries its
`EngineCoreReadyResponse`. One deadline (NANOSERVE_ENGINE_READY_TIMEOUT_S, default 600 s) covers spawn,
imports, weight loading and KV sizing. A child that exits during start-up ends the wait at once with
its exit code and, when it could still send it, its death record (read from the output PULL).
A rank restarted after a death goes through the same wait, alone, as its next incarnation.

Who runs the engines is an `EngineManager`: `EngineProcManager` here (child processes), or
`RayEngineManager` (`ray_launch.py`, Ray actors). The client, the start-up wait and the rank watchers
see only that interface; a manager also says where the frontend must bind (`SocketHost`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import multiprocessing
import multiprocessing.connection
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Generator
from dataclasses import dataclass, field
from multiprocessing.process import BaseProcess
from typing import Any, Protocol

import zmq

from nanoserve import envs
from nanoserve.config import EngineOptions
from nanoserve.engine.core_client.allocator import engine_preload, preloaded
from nanoserve.engine.core_client.engine_input import EngineInput
from nanoserve.engine.exceptions import EngineDeadError, EngineStartupError
from nanoserve.wire.codec import MsgpackDecoder
from nanoserve.wire.messages import (
    ENGINE_CORE_DEAD,
    EngineCoreOutputs,
    EngineCoreReadyResponse,
    EngineDeathRecord,
    EngineHandshakePhase,
)
from nanoserve.wire.sockets import CurveClient, RunKeys

logger = logging.getLogger(__name__)

READY_TIMEOUT_MESSAGE = (
    "Timed out waiting for engine core processes to start. "
    "This is often caused by slow weight loading for large models."
)
TERMINATE_GRACE_S = 5.0
"""How long shutdown waits after SIGTERM (beyond the engine's own drain time) before SIGKILL."""
KILL_WAIT_S = 5.0
"""How long a SIGKILLed child may take to be reaped."""
REAP_WAIT_S = 1.0
"""A process's sentinel fires just before its exit status can be reaped: how long to wait for that."""
PHASE_POLL_S = 0.05
"""How often a start-up wait looks at the ROUTER (a death wakes it at once)."""
DEATH_RECORD_WAIT_S = 0.5
"""How long to wait for the record of an engine that died during start-up, before reporting without it."""


def engine_options(options: EngineOptions) -> EngineOptions:
    """The options an engine process gets: with several data-parallel ranks on one machine, each takes
    an equal share of the cores unless the user set `num_threads` (oversubscribed threads thrash)."""
    if options.data_parallel_size == 1 or options.num_threads is not None:
        return options
    return dataclasses.replace(options, num_threads=max(1, available_cpus() // options.data_parallel_size))


def available_cpus() -> int:
    """The cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


@dataclass(frozen=True)
class SocketHost:
    """Where the frontend binds the sockets engines connect to, and the host engines dial to reach them
    (not the same when binding every interface for engines on other machines)."""

    transport: str
    bind: str = "127.0.0.1"
    advertise: str = "127.0.0.1"

    def endpoint(self, bound: str) -> str:
        """The endpoint an engine dials for a socket bound at `bound`."""
        if not bound.startswith("tcp://") or self.bind == self.advertise:
            return bound
        return f"tcp://{self.advertise}:{bound.rsplit(':', 1)[1]}"


@dataclass
class EngineZmqAddresses:
    """Where engines dial the frontend (and the coordinator), and the keys they dial with."""

    input: str
    output: str
    ipc_paths: list[str] = field(default_factory=list)
    """Socket files to unlink at shutdown."""
    stats: str | None = None
    """Data parallel: the coordinator's PULL, where each engine pushes its load."""
    keys: RunKeys | None = None
    """CURVE keys of the run (tcp:// unless turned off); None: plaintext, or ipc://."""

    def engine_curve(self, rank: int) -> CurveClient | None:
        """What engine `rank` needs to reach the frontend's sockets, if they speak CURVE."""
        return None if self.keys is None else self.keys.engine(rank)


def run_keys(options: EngineOptions, transport: str, ranks: list[int]) -> RunKeys | None:
    """This run's CURVE keys: over TCP unless `zmq_curve` is off (which is logged as a warning); none
    over ipc://, whose socket files only this user can open."""
    if transport != "tcp":
        return None
    if not options.zmq_curve:
        logger.warning(
            "zmq_curve is off: the engine sockets on TCP carry prompts and outputs in plaintext and accept "
            "any peer that reaches their ports; use this only on a trusted network."
        )
        return None
    return RunKeys.generate(ranks)


class EngineManager(Protocol):
    """What a client needs from whoever runs its engine ranks. Each rank has a sentinel, a file
    descriptor that turns readable once the rank's current incarnation has ended, so one wait can
    watch engines of both kinds. An exit code is 0 after a requested shutdown, positive after a
    failure, negative for a killing signal, None when unknown (or still running)."""

    host: SocketHost
    start_phase: str
    """What a rank is doing before it reports its first phase."""

    def start(self, addresses: EngineZmqAddresses, ranks: list[int], engine_input: EngineInput) -> None:
        """Start the ranks, which dial `addresses`; `engine_input` is the way to ask a rank to stop
        where no signal reaches it (another machine)."""
        ...

    def restart(self, rank: int, incarnation: int) -> None:
        """Start a rank again, as that incarnation, after its previous one ended (same rank, same
        sockets). Refused with EngineDeadError once shutdown has begun."""
        ...

    def kill(self, rank: int) -> None:
        """End a rank's current incarnation at once (a restart that hangs in start-up)."""
        ...

    def sentinel(self, rank: int) -> int: ...

    def ended(self, rank: int) -> bool: ...

    def exit_code(self, rank: int) -> int | None: ...

    def wait(self, rank: int, timeout: float) -> int | None: ...

    def death_record(self, rank: int) -> EngineDeathRecord | None:
        """Why a rank ended, as far as the manager knows (the engine's own record comes over the
        output socket)."""
        ...

    def pids(self) -> list[int]: ...

    def shutdown(self, timeout: float | None = None) -> None: ...


def make_engine_manager(options: EngineOptions) -> EngineManager:
    """The manager for `options.data_parallel_backend`; it starts nothing until `start`."""
    if options.data_parallel_backend == "ray":
        from nanoserve.engine.core_client.ray_launch import RayEngineManager

        return RayEngineManager(options)
    return EngineProcManager(options)


class EngineProcManager:
    """The engine-core child processes of one client: start, restart, watch, stop.

    Every wait for a child goes through one lock. A rank's watcher and `shutdown` may wait for the
    same child at once, and of two concurrent waitpid calls only one gets the exit status: the other
    would read the child as still running, and shutdown would SIGKILL a process that already exited 0.
    """

    start_phase = "spawning"

    def __init__(self, options: EngineOptions) -> None:
        self.options = options
        self.host = SocketHost(options.transport)
        self.procs: dict[int, BaseProcess] = {}
        self._addresses: EngineZmqAddresses | None = None
        self._reap_lock = threading.Lock()
        self._spawn_lock = threading.Lock()
        """Held while spawning, and by shutdown to close: no child is started once shutdown has begun."""
        self._closed = False

    def start(self, addresses: EngineZmqAddresses, ranks: list[int], engine_input: EngineInput) -> None:
        self._addresses = addresses
        for rank in ranks:
            self._spawn(rank, 0)

    def restart(self, rank: int, incarnation: int) -> None:
        self.wait(rank, KILL_WAIT_S)  # reap the dead one
        with self._spawn_lock:
            if self._closed:
                raise EngineDeadError("The engine core client is shutting down.")
            self._spawn(rank, incarnation)

    def _spawn(self, rank: int, incarnation: int) -> None:
        from nanoserve.core.bootstrap import run_engine_core
        from nanoserve.core.engine_core_proc import EngineCoreProcArgs

        options, addresses = self.options, self._addresses
        assert addresses is not None
        args = EngineCoreProcArgs(
            engine_options(options),
            rank,
            addresses.input,
            addresses.output,
            addresses.stats,
            incarnation,
            frontend_pid=os.getpid(),
            curve=addresses.engine_curve(rank),
        )
        preload = engine_preload(options)
        if preload is not None:
            logger.info("engine core %d starts with %s preloaded", rank, preload)
        self.procs[rank] = start_process(
            options.engine_start_method, run_engine_core, f"EngineCore_{rank}", (args,), preload
        )

    def kill(self, rank: int) -> None:
        _signal(self.procs[rank], signal.SIGKILL)

    def sentinel(self, rank: int) -> int:
        return self.procs[rank].sentinel

    def ended(self, rank: int) -> bool:
        return self.exit_code(rank) is not None

    def exit_code(self, rank: int) -> int | None:
        with self._reap_lock:
            return self.procs[rank].exitcode

    def wait(self, rank: int, timeout: float) -> int | None:
        """The exit code of `rank` once its process has ended, or None if it is still running after
        `timeout` seconds."""
        proc = self.procs[rank]
        multiprocessing.connection.wait([proc.sentinel], timeout)
        with self._reap_lock:
            proc.join(timeout=REAP_WAIT_S)
            return proc.exitcode

    def pids(self) -> list[int]:
        return [p.pid for p in self.procs.values() if p.pid is not None]

    def death_record(self, rank: int) -> EngineDeathRecord | None:
        return None  # a process says nothing beyond its exit code

    def shutdown(self, timeout: float | None = None) -> None:
        """SIGTERM every engine, wait for the drain, SIGKILL what is left. Bounded and idempotent."""
        with self._spawn_lock:
            self._closed = True
        if timeout is None:
            timeout = self.options.shutdown_timeout + TERMINATE_GRACE_S
        alive = [rank for rank in self.procs if not self.ended(rank)]
        for rank in alive:
            _signal(self.procs[rank], signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for rank in alive:
            if self.wait(rank, max(0.0, deadline - time.monotonic())) is None:
                proc = self.procs[rank]
                logger.warning("engine core %s did not stop within %.1f s; killing it", proc.name, timeout)
                _signal(proc, signal.SIGKILL)
                self.wait(rank, KILL_WAIT_S)


def start_process(
    start_method: str, target: Callable[..., None], name: str, args: tuple, preload: str | None = None
) -> BaseProcess:
    """Start a daemon child (an engine core, the coordinator) with `start_method`, with `preload` in
    its LD_PRELOAD (nanoserve.engine.core_client.allocator)."""
    context: Any = multiprocessing.get_context(start_method)  # typed as BaseContext, which lacks Process
    proc = context.Process(target=target, name=name, args=args, daemon=True)
    with main_module_hidden(start_method), preloaded(preload):
        proc.start()
    return proc


@contextlib.contextmanager
def main_module_hidden(start_method: str) -> Generator[None]:
    """Keep a spawned child from re-running the user's script: it needs nothing from `__main__`, and
    a script without an `if __name__ == "__main__":` guard would otherwise start engines recursively."""
    main = sys.modules.get("__main__")
    if start_method == "fork" or main is None:
        yield
        return
    saved = {name: main.__dict__[name] for name in ("__file__", "__spec__") if name in main.__dict__}
    with _MAIN_LOCK:
        try:
            main.__dict__.pop("__file__", None)
            main.__spec__ = None
            yield
        finally:
            main.__dict__.pop("__spec__", None)
            main.__dict__.update(saved)


_MAIN_LOCK = threading.Lock()


def _signal(proc: BaseProcess, signum: int) -> None:
    try:
        if proc.pid is not None:
            os.kill(proc.pid, signum)
    except ProcessLookupError:
        pass


def wait_for_engine_startup(
    engine_input: EngineInput,
    manager: EngineManager,
    incarnations: dict[int, int],
    read_death_record: Callable[[int], EngineDeathRecord | None],
    timeout_s: float | None = None,
    cancelled: Callable[[], bool] = lambda: False,
) -> dict[int, EngineCoreReadyResponse]:
    """Collect the ready response of each rank in `incarnations` (rank -> the incarnation expected),
    logging phases; raise on a death, at the deadline, or once `cancelled()` says so.

    Phases of other ranks or older incarnations are ignored: a restart may find a dead attempt's
    messages still queued."""
    timeout_s = envs.engine_ready_timeout_s() if timeout_s is None else timeout_s
    deadline = time.monotonic() + timeout_s
    phase_decoder = MsgpackDecoder(EngineHandshakePhase)
    ready_decoder = MsgpackDecoder(EngineCoreReadyResponse)
    phases = {rank: manager.start_phase for rank in incarnations}
    ready: dict[int, EngineCoreReadyResponse] = {}
    started = time.monotonic()
    while len(ready) < len(phases):
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            waiting = ", ".join(f"engine {r}: {phases[r]}" for r in sorted(phases) if r not in ready)
            raise TimeoutError(
                f"{READY_TIMEOUT_MESSAGE} Waited {timeout_s:g} s ({waiting}); set {envs.ENGINE_READY_TIMEOUT_S} "
                "to a larger number of seconds to wait longer."
            )
        if cancelled():
            raise EngineDeadError("The engine core client is shutting down.")
        message = engine_input.recv()
        if message is None:
            waiting = [manager.sentinel(rank) for rank in phases if rank not in ready]
            multiprocessing.connection.wait(waiting, min(remaining, PHASE_POLL_S))
        else:
            rank, frames = message
            phase = phase_decoder.decode(frames[0])
            if incarnations.get(rank) == phase.incarnation:
                phases[rank] = phase.phase
                logger.info(
                    "engine core %d: %s (%.1f s)",
                    rank,
                    phase.phase.replace("_", " "),
                    time.monotonic() - started,
                )
                if phase.phase == "ready":
                    ready[rank] = ready_decoder.decode(frames[1])
        for rank in phases:
            if rank not in ready and manager.ended(rank):
                record = read_death_record(rank) or manager.death_record(rank)
                raise startup_error(rank, manager.exit_code(rank), phases[rank], record)
    return ready


def read_death_record(
    output_socket: zmq.Socket, wait_s: float = DEATH_RECORD_WAIT_S
) -> EngineDeathRecord | None:
    """The death record a child sends just before exiting, if it got that far (read straight from the
    output socket: only before the client's reader owns it)."""
    decoder = MsgpackDecoder(EngineCoreOutputs)
    deadline = time.monotonic() + wait_s
    while output_socket.poll(int(max(0.0, deadline - time.monotonic()) * 1000)):
        frames = output_socket.recv_multipart(copy=False)
        if len(frames) == 1 and frames[0].bytes == ENGINE_CORE_DEAD:
            return None
        outputs = decoder.decode(frames)
        if outputs.death is not None:
            return outputs.death
    return None


def startup_error(
    rank: int, exit_code: int | None, phase: str, record: EngineDeathRecord | None
) -> EngineStartupError:
    return EngineStartupError(
        f"Engine core {rank} failed during start-up (last phase: {phase})",
        engine_rank=rank,
        exit_code=exit_code,
        exc_type=record.exc_type if record else None,
        exc_message=record.message if record else None,
        traceback_tail=record.traceback_tail if record else "",
    )


def dead_error(rank: int, exit_code: int | None, record: EngineDeathRecord | None) -> EngineDeadError:
    return EngineDeadError(
        None,
        engine_rank=rank,
        exit_code=exit_code,
        exc_type=record.exc_type if record else None,
        exc_message=record.message if record else None,
        traceback_tail=record.traceback_tail if record else "",
    )
