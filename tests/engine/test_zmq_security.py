"""Over TCP the frontend's sockets (input ROUTER, output PULL, the coordinator's stats PULL and PUB) admit
only the run's engines: ZMQ peers without the run's CURVE keys get nothing in and nothing out, and the
bytes between engines and frontend are not plaintext.

Every engine socket is routed through a recording TCP proxy (the frontend hands engines the proxy's
address instead of its own), so the test sees the bytes on the wire. The request ids carry a marker:
they travel in every request and every output, so plaintext would show it.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
import time

import pytest
import zmq
from streams import count_tokens

from nanoserve.engine.async_llm import AsyncLLM
from nanoserve.engine.core_client.dp import DPLBAsyncMPClient
from nanoserve.engine.core_client.launch import SocketHost
from nanoserve.sampling_params import SamplingParams
from nanoserve.wire.codec import MsgpackEncoder
from nanoserve.wire.messages import (
    ENGINE_CORE_DEAD,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineLoad,
    FinishReason,
    engine_identity,
)

MARKER = "confidential-4f1c9e"
FORGED_TOKEN = 4242
"""Not a token the null runner produces for these short prompts (3 + a token count)."""


class RecordingProxy:
    """Listens on a loopback port, relays each connection to `target` both ways, keeps every byte."""

    def __init__(self, target: str) -> None:
        host, port = target.removeprefix("tcp://").rsplit(":", 1)
        self.target = (host, int(port))
        self.server = socket.create_server(("127.0.0.1", 0))
        self.address = f"tcp://127.0.0.1:{self.server.getsockname()[1]}"
        self.captured = bytearray()
        self.lock = threading.Lock()
        self.sockets: list[socket.socket] = [self.server]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                downstream, _ = self.server.accept()
            except OSError:
                return
            upstream = socket.create_connection(self.target)
            with self.lock:
                self.sockets += [downstream, upstream]
            threading.Thread(target=self._pump, args=(downstream, upstream), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, downstream), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        while True:
            try:
                data = src.recv(65536)
                if not data:
                    return
                with self.lock:
                    self.captured += data
                dst.sendall(data)
            except OSError:
                return

    def close(self) -> None:
        with self.lock:
            for sock in self.sockets:
                sock.close()


@pytest.fixture
def proxies(monkeypatch):
    """Every tcp:// endpoint the frontend side hands to engines goes through a `RecordingProxy`."""
    made: list[RecordingProxy] = []
    original = SocketHost.endpoint

    def via_proxy(self: SocketHost, bound: str) -> str:
        address = original(self, bound)
        if not address.startswith("tcp://"):
            return address
        made.append(RecordingProxy(address))
        return made[-1].address

    monkeypatch.setattr(SocketHost, "endpoint", via_proxy)
    yield made
    for proxy in made:
        proxy.close()


def captured(proxies: list[RecordingProxy]) -> bytes:
    return b"".join(bytes(p.captured) for p in proxies)


async def token_ids(engine: AsyncLLM, request_id: str, max_tokens: int) -> list[int]:
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    ids: list[int] = []
    async for out in engine.generate("tell me a secret", params, request_id):
        ids = list(out.outputs[0].token_ids)
    return ids


@pytest.mark.timeout(240)
def test_peers_without_the_keys_get_nothing_through(tiny_gqa_dir, proxies):
    async def main() -> None:
        engine = AsyncLLM(str(tiny_gqa_dir), runner="null", data_parallel_size=2, transport="tcp")
        client = engine.engine_core
        assert isinstance(client, DPLBAsyncMPClient) and client.addresses.keys is not None
        subscriber = client.router.load_subscriber
        assert subscriber is not None
        frontend_ports = {  # where the frontend side listens (the proxies dial these)
            "input": proxies[0].target,
            "output": proxies[1].target,
            "stats": proxies[2].target,
            "publish": subscriber.address,
        }
        assert len(proxies) == 3 and subscriber.address.startswith("tcp://127.0.0.1:")
        ctx = zmq.Context()
        strangers: list[zmq.Socket] = []

        def stranger(kind: int, port: str | tuple[str, int], **options: int | bytes) -> zmq.Socket:
            sock = ctx.socket(kind)
            sock.setsockopt(zmq.LINGER, 0)
            for name, value in options.items():
                sock.setsockopt(getattr(zmq, name), value)
            sock.connect(port if isinstance(port, str) else f"tcp://{port[0]}:{port[1]}")
            strangers.append(sock)
            return sock

        try:
            reference = await token_ids(engine, "reference", 24)
            await engine.sleep(1)  # the marked requests wait, in flight, while the strangers try
            rids = [f"{MARKER}-{i}" for i in range(4)]
            tasks = [asyncio.create_task(token_ids(engine, rid, 24)) for rid in rids]
            deadline = time.monotonic() + 60
            while sum(client.balancer.owner(rid) is not None for rid in rids) < len(rids):
                assert time.monotonic() < deadline
                await asyncio.sleep(0.01)

            encoder = MsgpackEncoder()
            forged = [
                EngineCoreOutputs(
                    engine_index=client.balancer.owner(rid) or 0,
                    outputs=[EngineCoreOutput(rid, [FORGED_TOKEN], finish_reason=FinishReason.STOP)],
                )
                for rid in rids
            ]
            output = stranger(zmq.PUSH, frontend_ports["output"])
            stats = stranger(zmq.PUSH, frontend_ports["stats"])
            rank0 = stranger(zmq.DEALER, frontend_ports["input"], IDENTITY=engine_identity(0))
            garbage = [b"\xff\x00garbage", b"\x00" * 64]
            for _ in range(3):
                output.send(ENGINE_CORE_DEAD, zmq.NOBLOCK)
                for message in forged:
                    output.send_multipart(encoder.encode(message), zmq.NOBLOCK)
                output.send_multipart(garbage, zmq.NOBLOCK)
                stats.send_multipart(encoder.encode(EngineLoad(0, num_waiting_reqs=10**6)), zmq.NOBLOCK)
                stats.send_multipart(garbage, zmq.NOBLOCK)
                rank0.send_multipart(garbage, zmq.NOBLOCK)
            listener = stranger(zmq.SUB, frontend_ports["publish"], SUBSCRIBE=b"")
            # the coordinator publishes a heartbeat every second: plaintext would deliver some
            await asyncio.sleep(3)
            await asyncio.wait_for(
                engine.wake_up(), 60
            )  # a stranger holding rank 0's identity would not answer
            got = await asyncio.wait_for(asyncio.gather(*tasks), 120)
            fresh = await count_tokens(engine, "after", 8)

            assert got == [reference] * len(rids)  # no forged token, no forged early finish
            assert FORGED_TOKEN not in reference and fresh == 8
            assert not engine.errored and not engine.dead_ranks
            assert not listener.poll(0) and not rank0.poll(0)  # no load update, no request left
            wire = captured(proxies)
            assert wire and MARKER.encode() not in wire
        finally:
            for sock in strangers:
                sock.close(linger=0)
            ctx.term()
            engine.shutdown()

    asyncio.run(main())


@pytest.mark.timeout(120)
def test_curve_off_warns_and_sends_plaintext(tiny_gqa_dir, proxies, caplog):
    async def main() -> None:
        engine = AsyncLLM(str(tiny_gqa_dir), runner="null", transport="tcp", zmq_curve=False)
        try:
            assert engine.engine_core.addresses.keys is None
            assert await count_tokens(engine, f"{MARKER}-plain", 8) == 8
        finally:
            engine.shutdown()

    with caplog.at_level(logging.WARNING, logger="nanoserve.engine.core_client.launch"):
        asyncio.run(main())
    assert any("zmq_curve is off" in r.getMessage() for r in caplog.records)
    assert MARKER.encode() in captured(proxies)  # the capture sees plaintext: the other test's check can fail


@pytest.mark.timeout(120)
def test_ipc_transport_has_no_keys(tiny_gqa_dir, proxies):
    async def main() -> None:
        engine = AsyncLLM(str(tiny_gqa_dir), runner="null")
        try:
            client = engine.engine_core
            assert client.addresses.keys is None and client.addresses.input.startswith("ipc://")
            assert await count_tokens(engine, "ipc", 8) == 8
        finally:
            engine.shutdown()

    asyncio.run(main())
    assert not proxies
