"""The one place sockets are made: a run's engine keys get through a CURVE server, nothing else does."""

from __future__ import annotations

import os
import time

import pytest
import zmq
from zmq.utils.monitor import recv_monitor_message

from nanoserve.wire.sockets import (
    CurveClient,
    CurveKeyPair,
    RunKeys,
    bind_socket,
    connect_socket,
    start_authenticator,
)

HANDSHAKE_EVENTS = (
    zmq.EVENT_HANDSHAKE_SUCCEEDED
    | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
)


def first_handshake(ctx: zmq.Context, address: str, curve: CurveClient | None, timeout: float = 20.0) -> int:
    """Connect a PUSH (monitored from before its connect) and send one message; returns the first
    handshake event it sees."""
    sock = ctx.socket(zmq.PUSH)
    monitor = sock.get_monitor_socket(HANDSHAKE_EVENTS)
    try:
        sock.setsockopt(zmq.LINGER, 0)
        if curve is not None:
            sock.setsockopt(zmq.CURVE_SERVERKEY, curve.server_public)
            sock.setsockopt(zmq.CURVE_PUBLICKEY, curve.keys.public)
            sock.setsockopt(zmq.CURVE_SECRETKEY, curve.keys.secret)
        sock.connect(address)
        sock.send(b"hello", zmq.NOBLOCK)
        assert monitor.poll(int(timeout * 1000)), "no handshake within the timeout"
        return recv_monitor_message(monitor)["event"]
    finally:
        sock.disable_monitor()
        monitor.close(linger=0)
        sock.close(linger=0)


@pytest.fixture
def curve_server():
    ctx = zmq.Context()
    keys = RunKeys.generate([0, 1])
    auth = start_authenticator(ctx, keys.server_side())
    pull, endpoint, path = bind_socket(ctx, zmq.PULL, "tcp", curve=keys.server_side())
    assert path is None and endpoint.startswith("tcp://127.0.0.1:")
    yield keys, pull, endpoint
    pull.close(linger=0)
    auth.stop()
    ctx.term()


@pytest.mark.timeout(60)
def test_an_engine_of_the_run_gets_through_encrypted(curve_server):
    keys, pull, endpoint = curve_server
    ctx = zmq.Context()
    try:
        push = connect_socket(ctx, zmq.PUSH, endpoint, keys.engine(1), {zmq.LINGER: 0})
        push.send(b"outputs")
        assert pull.poll(20_000) and pull.recv() == b"outputs"
        assert push.get(zmq.MECHANISM) == zmq.CURVE and pull.get(zmq.MECHANISM) == zmq.CURVE
        push.close()
    finally:
        ctx.term()


@pytest.mark.timeout(60)
def test_peers_without_the_runs_keys_are_refused(curve_server):
    keys, pull, endpoint = curve_server
    other_run = RunKeys.generate([0])
    strangers = {
        "no keys": None,
        "own pair, the (public) server key": CurveClient(CurveKeyPair.generate(), keys.server.public),
        "another run's engine": other_run.engine(0),
    }
    ctx = zmq.Context()
    try:
        for name, curve in strangers.items():
            event = first_handshake(ctx, endpoint, curve)
            assert event != zmq.EVENT_HANDSHAKE_SUCCEEDED, name
        # the check can tell: the run's own engine shakes hands on the same server
        assert first_handshake(ctx, endpoint, keys.engine(0)) == zmq.EVENT_HANDSHAKE_SUCCEEDED
        deadline = time.monotonic() + 20
        received = []
        while time.monotonic() < deadline and pull.poll(100):
            received.append(pull.recv())
        assert received == [b"hello"]  # the engine's message only
    finally:
        ctx.term()


def test_secrets_stay_out_of_reprs():
    keys = RunKeys.generate([0])
    text = repr(keys) + repr(keys.server_side()) + repr(keys.engine(0))
    assert keys.server.public.decode() in text
    for pair in (keys.server, keys.frontend, keys.engines[0]):
        assert pair.secret.decode() not in text


@pytest.mark.timeout(30)
def test_ipc_sockets_are_left_as_they_are():
    keys = RunKeys.generate([0])
    ctx = zmq.Context()
    pull, endpoint, path = bind_socket(ctx, zmq.PULL, "ipc", curve=keys.server_side())
    try:
        push = connect_socket(ctx, zmq.PUSH, endpoint, keys.engine(0), {zmq.LINGER: 0})
        assert path is not None and endpoint == f"ipc://{path}"
        assert pull.get(zmq.MECHANISM) == zmq.NULL and push.get(zmq.MECHANISM) == zmq.NULL
        push.send(b"x")
        assert pull.poll(10_000) and pull.recv() == b"x"
        push.close()
        pull.close()
    finally:
        ctx.term()
        if path is not None:
            os.unlink(path)
