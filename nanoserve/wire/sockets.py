"""Every ZMQ socket that crosses a process boundary is made here, so each one gets the same security.

Who binds: the frontend (input ROUTER, output PULL) and the data-parallel coordinator (stats PULL,
publish PUB). Who connects: the engine cores (DEALER, PUSH, stats PUSH) and the frontend (SUB to the
coordinator's PUB).

Over tcp:// every socket speaks CurveZMQ (libzmq's CURVE, through pyzmq) when given keys: the frontend
generates one run's keys (`RunKeys`), never written to disk, and hands each process what it needs
through its start arguments. A binding process is the CURVE server with the run's server key pair,
and a ZAP authenticator (pyzmq's `ThreadAuthenticator`) on its context admits only the client public
keys of that run: a peer without them cannot complete the handshake, so it can neither send a message
nor receive one, and the bytes on the wire are encrypted. A connecting socket knows the server's
public key, so it only ever talks to the run's own frontend or coordinator. ipc:// sockets are left as
they are: files in the temp dir, guarded by their permissions. Without keys (curve turned off) tcp://
is plaintext and open to whoever reaches the port.
"""

from __future__ import annotations

import os
import tempfile
import uuid
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import TypeVar, cast

import zmq
from zmq.auth.thread import ThreadAuthenticator

SocketT = TypeVar("SocketT", bound=zmq.Socket)


@dataclass(frozen=True)
class CurveKeyPair:
    """A CURVE key pair, Z85-encoded (40 bytes each); the secret stays out of reprs and logs."""

    public: bytes
    secret: bytes = field(repr=False)

    @staticmethod
    def generate() -> CurveKeyPair:
        public, secret = zmq.curve_keypair()
        return CurveKeyPair(public, secret)


@dataclass(frozen=True)
class CurveServer:
    """What a binding process holds: the run's server key pair and the client public keys it admits."""

    keys: CurveKeyPair
    clients: frozenset[bytes]


@dataclass(frozen=True)
class CurveClient:
    """What a connecting process holds: its own key pair and the public key of the server it may talk to."""

    keys: CurveKeyPair
    server_public: bytes


@dataclass(frozen=True)
class RunKeys:
    """One run's keys, made by the frontend: the servers' pair, the frontend's own client pair (its SUB
    to the coordinator) and one pair per engine rank (a restarted rank keeps its rank's pair)."""

    server: CurveKeyPair
    frontend: CurveKeyPair
    engines: Mapping[int, CurveKeyPair]

    @staticmethod
    def generate(ranks: Iterable[int]) -> RunKeys:
        if not zmq.has("curve"):
            raise RuntimeError(
                "This libzmq has no CURVE support, so ZMQ over TCP cannot be authenticated or encrypted; "
                "install a pyzmq wheel built with it, or pass zmq_curve=False (--no-zmq-curve) on a trusted "
                "network."
            )
        return RunKeys(
            CurveKeyPair.generate(),
            CurveKeyPair.generate(),
            {rank: CurveKeyPair.generate() for rank in ranks},
        )

    def server_side(self) -> CurveServer:
        clients = frozenset([self.frontend.public, *(pair.public for pair in self.engines.values())])
        return CurveServer(self.server, clients)

    def engine(self, rank: int) -> CurveClient:
        return CurveClient(self.engines[rank], self.server.public)

    def frontend_client(self) -> CurveClient:
        return CurveClient(self.frontend, self.server.public)


class _AllowedKeys:
    """The credentials provider pyzmq's authenticator asks about each CURVE client (Z85 public key)."""

    def __init__(self, clients: frozenset[bytes]) -> None:
        self.clients = clients

    def callback(self, domain: str, key: bytes) -> bool:
        return key in self.clients


def start_authenticator(ctx: zmq.Context, server: CurveServer) -> ThreadAuthenticator:
    """Admit only `server.clients` to the CURVE servers of `ctx` (ZAP is per context). Start it before
    binding; stop it before terminating the context."""
    auth = ThreadAuthenticator(ctx)
    auth.start()
    auth.configure_curve_callback("*", _AllowedKeys(server.clients))
    return auth


def bind_socket(
    ctx: zmq.Context[SocketT],
    socket_type: int,
    transport: str,
    host: str = "127.0.0.1",
    curve: CurveServer | None = None,
) -> tuple[SocketT, str, str | None]:
    """Bind a socket of `socket_type` (tcp: a kernel-chosen port on `host`; ipc: a new file in the temp
    dir) without high-water marks or linger; returns it, its resolved endpoint and its ipc file, if any."""
    sock = ctx.socket(socket_type)
    sock.setsockopt(zmq.RCVHWM, 0)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.LINGER, 0)
    path = None
    try:
        if transport == "tcp":
            if curve is not None:
                sock.setsockopt(zmq.CURVE_SERVER, 1)
                sock.setsockopt(zmq.CURVE_SECRETKEY, curve.keys.secret)
            sock.bind(f"tcp://{host}:0")
        else:
            path = os.path.join(tempfile.gettempdir(), f"nanoserve-{uuid.uuid4().hex[:16]}")
            sock.bind(f"ipc://{path}")
    except BaseException:
        sock.close(linger=0)
        raise
    endpoint = cast(bytes, sock.getsockopt(zmq.LAST_ENDPOINT)).decode()
    return sock, endpoint, path


def connect_socket(
    ctx: zmq.Context[SocketT],
    socket_type: int,
    address: str,
    curve: CurveClient | None = None,
    options: Mapping[int, int | bytes] | None = None,
) -> SocketT:
    """Connect a socket of `socket_type` to `address`, with `options` set first; over tcp:// as a
    CURVE client when given keys."""
    sock = ctx.socket(socket_type)
    try:
        for option, value in (options or {}).items():
            sock.setsockopt(option, value)
        if curve is not None and address.startswith("tcp://"):
            sock.setsockopt(zmq.CURVE_SERVERKEY, curve.server_public)
            sock.setsockopt(zmq.CURVE_PUBLICKEY, curve.keys.public)
            sock.setsockopt(zmq.CURVE_SECRETKEY, curve.keys.secret)
        sock.connect(address)
    except BaseException:
        sock.close(linger=0)
        raise
    return sock
