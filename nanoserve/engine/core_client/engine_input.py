"""EngineInput: the frontend's ROUTER socket, through which requests go out to the engine ranks.

Out: `[identity, request_type, *encoded payload]`, the identity naming the rank (`engine_identity`).
In, only while a rank starts (the first time or after a restart): its handshake phases, ending with
the ready response. A restarted rank connects with the dead one's identity; ROUTER_HANDOVER lets its
connection take that identity over even before the old one is torn down.

ZMQ sockets are not thread-safe and several threads use this one (callers sending, a watcher reading a
restarted rank's phases and replaying its requests), so every use takes one lock, never held while
waiting for anything. A message with out-of-band buffers (zero-copy tensors) is kept in
`pending_messages` until ZMQ is done with every frame, so the memory behind it stays alive.
"""

from __future__ import annotations

import collections
import threading
from typing import Any

import zmq

from nanoserve.wire.codec import MsgpackEncoder
from nanoserve.wire.messages import EngineCoreRequestType, engine_identity


class EngineInput:
    def __init__(self, sock: zmq.Socket) -> None:
        sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
        self.socket = sock
        self.encoder = MsgpackEncoder()
        self.lock = threading.Lock()
        self.pending_messages: collections.deque[tuple[zmq.MessageTracker, Any]] = collections.deque()

    def send(self, rank: int, request_type: EngineCoreRequestType, payload: Any) -> None:
        """Send one message to a rank (raises zmq.ZMQError when the socket is gone)."""
        with self.lock:
            frames = self.encoder.encode(payload)
            msg = [engine_identity(rank), request_type.value, *frames]
            sock = self.socket
            if len(frames) == 1:
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

    def recv(self) -> tuple[int, list[bytes]] | None:
        """A message an engine sent (a start-up phase) as (rank, frames), or None if there is none now."""
        with self.lock:
            try:
                identity, *frames = self.socket.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return None
        return int.from_bytes(identity, "little"), frames

    def close(self) -> None:
        with self.lock:
            self.socket.close(linger=0)
