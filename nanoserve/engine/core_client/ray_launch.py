"""Engine-core ranks as Ray actors (`data_parallel_backend="ray"`), on this machine or across a Ray cluster.

`RayEngineManager` does for Ray what `EngineProcManager` does for child processes, behind the same
`EngineManager` interface, so every client (one engine, balanced ranks, one rank behind an external
balancer) runs on either. The ranks share one placement group with a bundle of `num_threads` CPUs
(default 1, which the engine then uses as its torch threads) per rank, placed by
`ray_placement_strategy`: PACK (default) fills few nodes, STRICT_SPREAD puts every rank on its own node.
Each rank is an `EngineCoreActor` (`ray_actor.py`) in its bundle, started with its arguments (options,
the frontend's addresses, its CURVE keys) and, with `ray_ship_model`, the model's files, all through
Ray; its environment gets this process's NANOSERVE_* variables (not the API key) and the engine log
level (`runtime_env`). It dials the frontend's sockets over TCP, so readiness still comes through the
ZMQ handshake.

Liveness comes from Ray: a watcher thread waits on every actor's `run()` result. When one resolves (run
returned an exit code, or Ray raised an actor error: killed, crashed, its node lost) the rank's
sentinel, a pipe, turns readable, which is what the client's rank watchers and start-up wait poll for
processes too; Ray's error becomes the rank's death record. If the frontend dies, Ray ends its actors
with it (an actor's lifetime is its owner's). A restart (`engine_restarts`) creates a new actor in the
rank's bundle, as the rank's next incarnation, with a new sentinel; when the rank's node is gone, Ray
moves the bundle to a node that has room (within the strategy) and the actor starts there.

Shutdown: every running rank is asked to stop over its input socket (a SHUTDOWN request: no signal
reaches a process on another machine), drains for `shutdown_timeout` seconds and returns 0; whatever
is left after the grace period is killed with `ray.kill`, then the placement group is removed. The
manager then lets go of every Ray object it held (actor handles, object refs) on the thread that shut
it down, and makes no Ray call after that: Ray ends the whole process, with exit status 1 and no
traceback, when a thread touches it while `ray.shutdown()` is tearing its core worker down, and a
handle freed late (say, when the last rank watcher drops the manager) does just that.

Sockets: on a Ray started here, or a cluster whose nodes are all on loopback, the frontend binds
127.0.0.1. On any other cluster it binds every interface and engines dial this node's IP
(`ray.util.get_node_ip_address()`); CURVE (on by default) admits only this run's engines and encrypts
the traffic, see `nanoserve/wire/sockets.py`.

The Ray connection is shared by every client in the process. Without `ray_address`, and not already
connected, a local Ray is started (every CPU, no dashboard, a small object store: only handles, exit
codes and shipped models travel through it); with `ray_address`, that cluster is joined. Whatever
`ray.init` this module made is undone (`ray.shutdown`) when the last client using it shuts down.
"""

from __future__ import annotations

import contextlib
import dataclasses
import ipaddress
import logging
import multiprocessing
import os
import signal
import threading
import time
from collections.abc import Generator
from multiprocessing.connection import Connection
from types import ModuleType
from typing import Any

import zmq

from nanoserve import envs
from nanoserve.config import EngineOptions
from nanoserve.engine.core_client.engine_input import EngineInput
from nanoserve.engine.core_client.launch import (
    TERMINATE_GRACE_S,
    EngineZmqAddresses,
    SocketHost,
    available_cpus,
)
from nanoserve.engine.core_client.ray_actor import EngineCoreActor, pack_model
from nanoserve.engine.exceptions import EngineDeadError
from nanoserve.wire.messages import EngineCoreRequestType, EngineDeathRecord

logger = logging.getLogger(__name__)

WATCH_INTERVAL_S = 0.2
"""How long one ray.wait of the watcher lasts before it checks whether the manager is shutting down."""
WATCHER_JOIN_S = 10.0
"""How long shutdown waits for the watcher to leave Ray alone (one WATCH_INTERVAL_S on an idle machine)."""
KILL_WAIT_S = 5.0
"""How long shutdown waits for Ray to report killed actors dead before removing their placement group."""
LOCAL_OBJECT_STORE_BYTES = 128 * 1024 * 1024
DEFAULT_PLACEMENT_STRATEGY = "PACK"


def import_ray() -> ModuleType:
    try:
        import ray
    except ImportError as e:
        raise ImportError(
            "data_parallel_backend='ray' needs Ray: pip install 'nanoserve[ray]' (or the 'ray' package)."
        ) from e
    return ray


class _RaySession:
    """This process's use of Ray, counted across clients so the last one out undoes our ray.init."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.users = 0
        self.initialized_here = False
        self.started_here = False

    def join(self, address: str | None) -> bool:
        """Connect (or start a local Ray) unless connected already; True when the Ray was started here."""
        ray = import_ray()
        with self.lock:
            if not ray.is_initialized():
                with _sigterm_handler_kept():
                    if address is None:
                        ray.init(
                            num_cpus=available_cpus(),
                            include_dashboard=False,
                            object_store_memory=LOCAL_OBJECT_STORE_BYTES,
                        )
                    else:
                        ray.init(address=address)
                self.initialized_here, self.started_here = True, address is None
            elif address is not None:
                logger.info("already connected to Ray: ignoring ray_address=%s", address)
            self.users += 1
            return self.started_here

    def leave(self) -> None:
        with self.lock:
            self.users -= 1
            if self.users == 0 and self.initialized_here:
                import_ray().shutdown()
                self.initialized_here = self.started_here = False


_SESSION = _RaySession()


@contextlib.contextmanager
def _sigterm_handler_kept() -> Generator[None]:
    """ray.init makes SIGTERM exit the driver at once; the frontend keeps its own handling (the server
    drains in-flight requests and exits 0)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    handler = signal.getsignal(signal.SIGTERM)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, handler)


def _all_nodes_on_loopback(ray: ModuleType) -> bool:
    nodes = [node for node in ray.nodes() if node["Alive"]]
    return bool(nodes) and all(ipaddress.ip_address(n["NodeManagerAddress"]).is_loopback for n in nodes)


def _summary(error: BaseException) -> tuple[str, str]:
    """(type, message) of why an actor's run() failed: the exception it raised (Ray wraps it in a
    RayTaskError), else Ray's own error, whose text runs over several lines (ids, pid, ip) of which the
    first and last say what happened."""
    cause = getattr(error, "cause", None)
    if isinstance(cause, BaseException):
        return type(cause).__name__, str(cause)
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    message = "" if not lines else lines[0] if len(lines) == 1 else f"{lines[0]} {lines[-1]}"
    return type(error).__name__, message


def engine_environment() -> dict[str, str]:
    """The environment an actor adds to its node's: this process's NANOSERVE_* variables (those an
    engine reads), with the engine log level spelled out."""
    return {**envs.forwarded_to_engines(), envs.LOGGING_LEVEL: envs.logging_level()}


@dataclasses.dataclass
class _RankActor:
    """One incarnation of a rank: its actor, and how the frontend learns that it ended."""

    actor: Any
    incarnation: int
    where_ref: Any
    run_ref: Any
    read_end: Connection
    """The rank's sentinel while this incarnation is current."""
    write_end: Connection
    done: threading.Event = dataclasses.field(default_factory=threading.Event)
    result: tuple[int | None, EngineDeathRecord | None] | None = None
    """(exit code, Ray's account of the end) once it has ended."""

    def drop_ray_objects(self) -> None:
        self.actor = self.where_ref = self.run_ref = None


class RayEngineManager:
    """The engine-core actors of one client: place, start, restart, watch, stop (see the module docstring)."""

    start_phase = "waiting for Ray to place it"

    def __init__(self, options: EngineOptions) -> None:
        self.options = options
        self.cpus_per_rank = options.num_threads or 1
        self.strategy = options.ray_placement_strategy or DEFAULT_PLACEMENT_STRATEGY
        self._ranks: dict[int, _RankActor] = {}
        self._bundles: dict[int, int] = {}
        """rank -> its bundle in the placement group."""
        self._placement_group: Any = None
        self._model_ref: Any = None
        """The shipped model in the object store (kept for restarts), with `ray_ship_model`."""
        self._addresses: EngineZmqAddresses | None = None
        self._engine_input: EngineInput | None = None
        self._watcher: threading.Thread | None = None
        self._stopping = threading.Event()
        self._lock = threading.Lock()
        """Guards `ranks` against the watcher, and restarts against shutdown."""
        self._closed = False
        started_here = _SESSION.join(options.ray_address)
        try:
            ray = import_ray()
            if started_here or _all_nodes_on_loopback(ray):
                self.host = SocketHost("tcp")
            else:
                self.host = SocketHost("tcp", bind="0.0.0.0", advertise=ray.util.get_node_ip_address())
        except BaseException:
            _SESSION.leave()
            raise

    @property
    def actors(self) -> dict[int, Any]:
        return {rank: ranked.actor for rank, ranked in self._ranks.items()}

    def start(self, addresses: EngineZmqAddresses, ranks: list[int], engine_input: EngineInput) -> None:
        from ray.util.placement_group import placement_group

        ray = import_ray()
        self._addresses, self._engine_input = addresses, engine_input
        if self.options.ray_ship_model:
            shipped = pack_model(self.options.model)
            logger.info("shipping the model (%.1f MiB) through Ray's object store", shipped.num_bytes / 2**20)
            self._model_ref = ray.put(shipped)
        self._warn_if_unplaceable(ray, len(ranks))
        self._bundles = {rank: index for index, rank in enumerate(ranks)}
        bundles = [{"CPU": self.cpus_per_rank} for _ in ranks]
        self._placement_group = placement_group(bundles, strategy=self.strategy)
        for rank in ranks:
            self._launch(rank, 0)
        self._watcher = threading.Thread(target=self._watch, name="RayEngineWatcher", daemon=True)
        self._watcher.start()

    def _warn_if_unplaceable(self, ray: ModuleType, num_ranks: int) -> None:
        if self.strategy != "STRICT_SPREAD":
            return
        nodes = [n for n in ray.nodes() if n["Alive"] and n["Resources"].get("CPU", 0) >= self.cpus_per_rank]
        if len(nodes) < num_ranks:
            logger.warning(
                "STRICT_SPREAD needs %d nodes with %d free CPU(s) each and the Ray cluster has %d: the ranks "
                "wait for Ray to place them until more nodes join (or the start-up deadline passes)",
                num_ranks,
                self.cpus_per_rank,
                len(nodes),
            )

    def restart(self, rank: int, incarnation: int) -> None:
        with self._lock:
            if self._closed:
                raise EngineDeadError("The engine core client is shutting down.")
            old = self._ranks[rank]
            with contextlib.suppress(Exception):
                import_ray().kill(old.actor, no_restart=True)
            old.read_end.close()
            old.write_end.close()
            self._launch(rank, incarnation)

    def _launch(self, rank: int, incarnation: int) -> None:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from nanoserve.core.engine_core_proc import EngineCoreProcArgs

        ray, addresses, options = import_ray(), self._addresses, self.options
        assert addresses is not None
        # a path means the same on every node only if it is absolute (an actor's working dir is Ray's)
        model = options.model if options.model is None else os.path.abspath(os.path.expanduser(options.model))
        per_rank = dataclasses.replace(options, num_threads=self.cpus_per_rank, model=model)
        args = EngineCoreProcArgs(
            per_rank,
            rank,
            addresses.input,
            addresses.output,
            addresses.stats,
            incarnation,
            curve=addresses.engine_curve(rank),
        )
        strategy = PlacementGroupSchedulingStrategy(
            self._placement_group, placement_group_bundle_index=self._bundles[rank]
        )
        actor = (
            ray.remote(EngineCoreActor)
            .options(
                num_cpus=self.cpus_per_rank,
                scheduling_strategy=strategy,
                runtime_env={"env_vars": engine_environment()},
            )
            .remote(args, self._model_ref)
        )
        read_end, write_end = multiprocessing.Pipe(duplex=False)
        where_ref = actor.where.remote()  # an actor runs its calls in order: before run
        self._ranks[rank] = _RankActor(actor, incarnation, where_ref, actor.run.remote(), read_end, write_end)

    def _watch(self) -> None:
        ray = import_ray()
        try:
            while not self._stopping.is_set():
                with self._lock:
                    pending = {r.run_ref: (rank, r) for rank, r in self._ranks.items() if not r.done.is_set()}
                if not pending:
                    self._stopping.wait(WATCH_INTERVAL_S)
                    continue
                done, _ = ray.wait(list(pending), num_returns=1, timeout=WATCH_INTERVAL_S)
                for ref in done:
                    rank, ranked = pending[ref]
                    try:
                        self._settle(ranked, ray.get(ref), None)
                    except Exception as e:  # killed, crashed, its node lost, or run() itself failed
                        self._settle(ranked, None, EngineDeathRecord(rank, *_summary(e), ""))
        except Exception as e:  # this process lost Ray (ray.shutdown elsewhere): its actors went with it
            with self._lock:
                left = [(rank, r) for rank, r in self._ranks.items() if not r.done.is_set()]
            for rank, ranked in left:
                self._settle(ranked, None, EngineDeathRecord(rank, type(e).__name__, f"lost Ray: {e}", ""))

    def _settle(self, ranked: _RankActor, exit_code: int | None, record: EngineDeathRecord | None) -> None:
        with self._lock:
            ranked.result = (exit_code, record)
            ranked.done.set()
            if not ranked.write_end.closed:  # closed: replaced by a restart already
                ranked.write_end.send_bytes(b"")

    def kill(self, rank: int) -> None:
        with self._lock:
            if self._closed:  # shutdown kills every actor itself, and then Ray may be going away
                return
            with contextlib.suppress(Exception):
                import_ray().kill(self._ranks[rank].actor, no_restart=True)

    def sentinel(self, rank: int) -> int:
        return self._ranks[rank].read_end.fileno()

    def ended(self, rank: int) -> bool:
        return self._ranks[rank].done.is_set()

    def exit_code(self, rank: int) -> int | None:
        result = self._ranks[rank].result
        return None if result is None else result[0]

    def wait(self, rank: int, timeout: float) -> int | None:
        self._ranks[rank].done.wait(timeout)
        return self.exit_code(rank)

    def death_record(self, rank: int) -> EngineDeathRecord | None:
        result = self._ranks[rank].result
        return None if result is None else result[1]

    def pids(self) -> list[int]:
        """Empty: the engines are processes of Ray's nodes, perhaps on other machines."""
        return []

    def locations(self, timeout: float = 10.0) -> dict[int, tuple[int, str, str]]:
        """rank -> (pid, node IP, Ray node id) of the actor serving it now."""
        ray = import_ray()
        ranks = list(self._ranks)
        found = ray.get([self._ranks[rank].where_ref for rank in ranks], timeout=timeout)
        return dict(zip(ranks, found, strict=True))

    def node_ids(self, timeout: float = 10.0) -> dict[int, str]:
        """The Ray node each rank's actor runs on."""
        return {rank: node_id for rank, (_, _, node_id) in self.locations(timeout).items()}

    def shutdown(self, timeout: float | None = None) -> None:
        """Ask every running rank to stop, wait for the drain, ray.kill every actor, remove the
        placement group, drop every Ray object, leave Ray. Bounded and idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        if timeout is None:
            timeout = self.options.shutdown_timeout + TERMINATE_GRACE_S
        try:
            if import_ray().is_initialized():  # else the actors and group went with the connection
                self._stop_actors(timeout)
        finally:
            self._stopping.set()
            if self._watcher is not None and self._watcher is not threading.current_thread():
                self._watcher.join(WATCHER_JOIN_S)
                if self._watcher.is_alive():
                    logger.warning(
                        "the Ray watcher of the engine actors did not stop within %.0f s", WATCHER_JOIN_S
                    )
            with self._lock:  # whoever still waits on a sentinel wakes (at EOF) and sees the shutdown
                for ranked in self._ranks.values():
                    ranked.write_end.close()
                    ranked.drop_ray_objects()
                self._placement_group = self._model_ref = None
            _SESSION.leave()

    def _stop_actors(self, timeout: float) -> None:
        ray = import_ray()
        from ray.util.placement_group import remove_placement_group

        asked = [rank for rank in self._ranks if self._ask_to_stop(rank)]
        deadline = time.monotonic() + timeout
        for rank in asked:
            if not self._ranks[rank].done.wait(max(0.0, deadline - time.monotonic())):
                logger.warning("engine core %d did not stop within %.1f s; killing it", rank, timeout)
        for ranked in self._ranks.values():
            with contextlib.suppress(Exception):
                ray.kill(ranked.actor, no_restart=True)
        deadline = time.monotonic() + KILL_WAIT_S
        for ranked in self._ranks.values():  # the watcher sees each killed actor's run() fail
            ranked.done.wait(max(0.0, deadline - time.monotonic()))
        if self._placement_group is not None:
            with contextlib.suppress(Exception):
                remove_placement_group(self._placement_group)

    def _ask_to_stop(self, rank: int) -> bool:
        """Send a running rank the SHUTDOWN request (it drains as on SIGTERM); True if sent."""
        if self._ranks[rank].done.is_set() or self._engine_input is None:
            return False
        try:
            self._engine_input.send(rank, EngineCoreRequestType.SHUTDOWN, None)
        except zmq.ZMQError:
            return False  # the input socket is closed
        return True
