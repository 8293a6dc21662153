"""The data-parallel coordinator: one small process that gathers every engine rank's load and publishes
it to the frontends.

Sockets (bound here, endpoints reported to the parent through a pipe at start):
  stats    PULL. Each engine pushes an `EngineLoad` when its waiting / running counts or KV use change.
           Bound where the frontend binds its own engine sockets (every interface when engines run on
           other machines); the publish socket stays on loopback, for this machine's frontend.
  publish  PUB. Sends a `DPLoadUpdate` (every rank's latest load) when something changed, at most once
           per `PUBLISH_INTERVAL_S`, and a heartbeat every `HEARTBEAT_INTERVAL_S` when nothing did.
A frontend subscribes (`LoadSubscriber`) and folds the counts into its load balancer; they tell it
about requests that other frontends sent to the same engines. Over TCP both sockets are CURVE servers
with the run's server keys, and an authenticator here admits only the run's engines and frontend.
Losing the coordinator costs only that: the engines' own outputs still carry their stats. It exits on SIGTERM, and when its parent is gone.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import threading
import time
from collections.abc import Callable
from multiprocessing.process import BaseProcess
from typing import cast

import zmq

from nanoserve.engine.core_client.launch import start_process
from nanoserve.wire.codec import MsgpackDecoder, MsgpackEncoder
from nanoserve.wire.messages import DPLoadUpdate, EngineLoad
from nanoserve.wire.sockets import CurveClient, CurveServer, bind_socket, connect_socket, start_authenticator

PUBLISH_INTERVAL_S = 0.1
HEARTBEAT_INTERVAL_S = 1.0
PARENT_CHECK_S = 0.5
START_TIMEOUT_S = 30.0
"""How long the frontend waits for the coordinator to report its endpoints."""
STOP_WAIT_S = 2.0
"""How long a stopped coordinator may take to exit, after SIGTERM and again after SIGKILL."""


def should_publish(changed: bool, now: float, last_publish: float) -> bool:
    """On change, no more often than every PUBLISH_INTERVAL_S; otherwise a heartbeat now and then."""
    since = now - last_publish
    return (changed and since >= PUBLISH_INTERVAL_S) or since >= HEARTBEAT_INTERVAL_S


def run_coordinator(
    ranks: list[int], transport: str, conn, parent_pid: int, stats_host: str, curve: CurveServer | None
) -> None:
    """Target of the coordinator process."""
    ctx = zmq.Context()
    auth, sockets, paths = None, [], []
    try:
        if curve is not None:
            auth = start_authenticator(ctx, curve)
        pull, stats_address, stats_path = bind_socket(ctx, zmq.PULL, transport, stats_host, curve)
        sockets.append(pull)
        pub, publish_address, publish_path = bind_socket(ctx, zmq.PUB, transport, curve=curve)
        sockets.append(pub)
        paths = [p for p in (stats_path, publish_path) if p]
        conn.send((stats_address, publish_address))
        conn.close()
        _serve(pull, pub, ranks, parent_pid)
    finally:
        for sock in sockets:
            sock.close(linger=0)
        if auth is not None:
            auth.stop()
        ctx.term()
        for path in paths:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)


def _serve(pull: zmq.Socket, pub: zmq.Socket, ranks: list[int], parent_pid: int) -> None:
    decoder, encoder = MsgpackDecoder(EngineLoad), MsgpackEncoder()
    loads = {rank: EngineLoad(rank) for rank in ranks}
    changed, last_publish, seq = False, 0.0, 0
    parent = os.getppid()
    next_parent_check = time.monotonic() + PARENT_CHECK_S
    while True:
        now = time.monotonic()
        wait = (PUBLISH_INTERVAL_S if changed else HEARTBEAT_INTERVAL_S) - (now - last_publish)
        if pull.poll(int(max(0.0, min(wait, PARENT_CHECK_S)) * 1000)):
            while cast(int, pull.get(zmq.EVENTS)) & zmq.POLLIN:
                load = decoder.decode([pull.recv(copy=False)])
                changed = changed or load != loads.get(load.engine_rank)
                loads[load.engine_rank] = load
        now = time.monotonic()
        if should_publish(changed, now, last_publish):
            seq += 1
            update = DPLoadUpdate([loads[r] for r in sorted(loads)], seq, is_heartbeat=not changed)
            pub.send(encoder.encode(update)[0])
            changed, last_publish = False, now
        if now >= next_parent_check:
            next_parent_check = now + PARENT_CHECK_S
            if os.getppid() != parent or not _alive(parent_pid):
                return


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def start_coordinator(
    ranks: list[int],
    transport: str,
    start_method: str,
    stats_host: str = "127.0.0.1",
    curve: CurveServer | None = None,
) -> tuple[BaseProcess, str, str]:
    """Start the coordinator; returns it with its stats and publish endpoints (as bound). Its keys
    travel in the process arguments (pickled through the start pipe, never on a command line)."""
    parent_conn, child_conn = multiprocessing.get_context(start_method).Pipe(duplex=False)
    args = (list(ranks), transport, child_conn, os.getpid(), stats_host, curve)
    proc = start_process(start_method, run_coordinator, "DPCoordinator", args)
    child_conn.close()
    try:
        if not parent_conn.poll(START_TIMEOUT_S):
            raise TimeoutError(f"The data-parallel coordinator did not start within {START_TIMEOUT_S:g} s.")
        stats_address, publish_address = parent_conn.recv()
    except BaseException:
        stop_coordinator(proc)
        raise
    finally:
        parent_conn.close()
    return proc, stats_address, publish_address


def stop_coordinator(proc: BaseProcess) -> None:
    if proc.exitcode is None:
        proc.terminate()
        proc.join(STOP_WAIT_S)
    if proc.exitcode is None:
        proc.kill()
        proc.join(STOP_WAIT_S)


class LoadSubscriber:
    """A daemon thread on the frontend that hands each `DPLoadUpdate` to `on_update`. It holds no
    reference to the client; it ends (closing its socket) once `is_closing()` says so."""

    def __init__(
        self,
        ctx: zmq.Context,
        address: str,
        on_update: Callable[[DPLoadUpdate], None],
        is_closing: Callable[[], bool],
        curve: CurveClient | None = None,
    ) -> None:
        self.address = address
        self.sock = connect_socket(ctx, zmq.SUB, address, curve, {zmq.LINGER: 0, zmq.SUBSCRIBE: b""})
        self.thread = threading.Thread(
            target=self._run, args=(on_update, is_closing), name="DPLoadSubscriber", daemon=True
        )
        self.thread.start()

    def _run(self, on_update: Callable[[DPLoadUpdate], None], is_closing: Callable[[], bool]) -> None:
        decoder = MsgpackDecoder(DPLoadUpdate)
        try:
            while not is_closing():
                if self.sock.poll(PUBLISH_INTERVAL_S * 1000):
                    on_update(decoder.decode([self.sock.recv(copy=False)]))
        except zmq.ZMQError:
            pass  # the context is going away
        finally:
            self.sock.close(linger=0)
