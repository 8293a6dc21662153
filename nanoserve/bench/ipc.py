"""`nanoserve bench ipc`: what the process boundary costs, measured without a model.

Drives the null runner (one token per running request per step, no forward pass) through
InprocClient, SyncMPClient and AsyncMPClient, and in the same run measures raw pyzmq PUSH/PULL over
ipc:// from a child process, received three ways: directly, through a thread and `queue.Queue` (what
SyncMPClient does), and through `zmq.asyncio` (what AsyncMPClient does). Prints outputs/s (one per
request per step), messages/s (`EngineCoreOutputs` per second), requests/s, and each client's
outputs/s as a fraction of the raw baseline of its kind, and the round-trip latency of one utility call
(frontend -> engine -> frontend) through SyncMPClient. With `--transport tcp` the engine sockets speak
CURVE unless `--no-zmq-curve`: run both to see what the encryption costs.

`--data-parallel-size 1 2 4` instead times the sync and asyncio clients `LLM` / the server would use with
that many model-free engines (SyncMPClient / AsyncMPClient for one, DPLBSyncMPClient / DPLBAsyncMPClient
beyond), on the same load, so one run shows how the frontend's client layer scales with engine count.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import multiprocessing
import os
import queue
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass

import zmq
import zmq.asyncio

from nanoserve.config import EngineOptions
from nanoserve.sampling_params import SamplingParams
from nanoserve.wire.codec import MsgpackEncoder
from nanoserve.wire.messages import EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest

_END = b"END"


@dataclass
class Result:
    name: str
    seconds: float
    messages: int
    outputs: int = 0
    requests: int = 0

    @property
    def msgs_per_s(self) -> float:
        return self.messages / self.seconds

    @property
    def outputs_per_s(self) -> float:
        return self.outputs / self.seconds

    @property
    def requests_per_s(self) -> float:
        return self.requests / self.seconds


# -- raw pyzmq baselines ------------------------------------------------------------------------------


def _raw_sender(address: str, num_messages: int) -> None:
    """Child process: push `num_messages` encoded one-output EngineCoreOutputs, then END."""
    push = zmq.Context.instance().socket(zmq.PUSH)
    push.setsockopt(zmq.SNDHWM, 0)
    push.connect(address)
    body = MsgpackEncoder().encode(EngineCoreOutputs(outputs=[EngineCoreOutput("req-0", [1234])]))[0]
    for _ in range(num_messages):
        push.send(body, copy=True)
    push.send(_END)
    push.close(linger=10_000)


def _raw_run(name: str, num_messages: int, receive) -> Result:
    path = os.path.join(tempfile.gettempdir(), f"nanoserve-bench-{uuid.uuid4().hex[:12]}")
    address = f"ipc://{path}"
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    pull.setsockopt(zmq.RCVHWM, 0)
    pull.bind(address)
    sender = multiprocessing.get_context("spawn").Process(target=_raw_sender, args=(address, num_messages))
    sender.start()
    try:
        first = pull.recv()  # time from the first message: excludes the sender's start-up
        start = time.perf_counter()
        count = receive(ctx, pull) + (first != _END)
        return Result(name, time.perf_counter() - start, count)
    finally:
        sender.join(30)
        pull.close(linger=0)
        ctx.term()
        if os.path.exists(path):
            os.unlink(path)


def _receive_direct(ctx: zmq.Context, pull: zmq.Socket) -> int:
    count = 0
    while pull.recv(copy=False).bytes != _END:
        count += 1
    return count


def _receive_thread_queue(ctx: zmq.Context, pull: zmq.Socket) -> int:
    q: queue.Queue = queue.Queue()

    def reader() -> None:
        while True:
            frame = pull.recv(copy=False)
            q.put_nowait(frame)
            if frame.bytes == _END:
                return

    thread = threading.Thread(target=reader, daemon=True)
    thread.start()
    count = 0
    while q.get().bytes != _END:
        count += 1
    thread.join()
    return count


def _receive_asyncio(ctx: zmq.Context, pull: zmq.Socket) -> int:
    async def main() -> int:
        sock = zmq.asyncio.Socket.from_socket(pull)
        count = 0
        while (await sock.recv(copy=False)).bytes != _END:
            count += 1
        return count

    return asyncio.run(main())


# -- clients ------------------------------------------------------------------------------------------


def _requests(num_requests: int, max_tokens: int, tag: str) -> list[EngineCoreRequest]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return [EngineCoreRequest(f"{tag}-{i}", [1, 2, 3, 4 + i % 100], params) for i in range(num_requests)]


def _run_sync_client(name: str, client, reqs: list[EngineCoreRequest]) -> Result:
    start = time.perf_counter()
    for r in reqs:
        client.add_request(r)
    messages = outputs = finished = 0
    while finished < len(reqs):
        out = client.get_output()
        messages += 1
        outputs += len(out.outputs)
        finished += len(out.finished_requests or ())
    return Result(name, time.perf_counter() - start, messages, outputs, finished)


async def _run_async_client(name: str, client, reqs: list[EngineCoreRequest]) -> Result:
    start = time.perf_counter()
    for r in reqs:
        await client.add_request_async(r)
    messages = outputs = finished = 0
    while finished < len(reqs):
        out = await client.get_output_async()
        messages += 1
        outputs += len(out.outputs)
        finished += len(out.finished_requests or ())
    return Result(name, time.perf_counter() - start, messages, outputs, finished)


def round_trip_us(client, calls: int = 2000) -> float:
    """Median microseconds of one `echo` utility call: a request out and its answer back, nothing else."""
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        client.call_utility("echo", 0)
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2] * 1e6


def _median(results: list[Result]) -> Result:
    return sorted(results, key=lambda r: r.seconds)[len(results) // 2]


def _time_sync(client, num_requests: int, max_tokens: int, repeats: int) -> Result:
    """Median of `repeats` timed runs after one warm-up run; shuts the client down."""
    name = type(client).__name__
    try:
        runs = [
            _run_sync_client(name, client, _requests(num_requests, max_tokens, f"run{i}"))
            for i in range(repeats + 1)
        ]
        return _median(runs[1:])
    finally:
        client.shutdown()


def _time_async(make_client, num_requests: int, max_tokens: int, repeats: int) -> Result:
    """As `_time_sync`; the client is built inside the event loop that drives it."""

    async def run() -> Result:
        client = make_client()
        name = type(client).__name__
        try:
            runs = [
                await _run_async_client(name, client, _requests(num_requests, max_tokens, f"run{i}"))
                for i in range(repeats + 1)
            ]
            return _median(runs[1:])
        finally:
            client.shutdown()

    return asyncio.run(run())


def bench_clients(
    options: EngineOptions, num_requests: int, max_tokens: int, repeats: int
) -> tuple[dict[str, Result], float]:
    """Each client's result, and SyncMPClient's median utility round trip in microseconds."""
    from nanoserve.engine.core_client.async_mp import AsyncMPClient
    from nanoserve.engine.core_client.inproc import InprocClient
    from nanoserve.engine.core_client.sync_mp import SyncMPClient

    timing = (num_requests, max_tokens, repeats)
    sync_client = SyncMPClient(options)
    try:
        latency = round_trip_us(sync_client)
    except BaseException:
        sync_client.shutdown()
        raise
    clients = {
        "InprocClient": _time_sync(InprocClient(options), *timing),
        "SyncMPClient": _time_sync(sync_client, *timing),
        "AsyncMPClient": _time_async(lambda: AsyncMPClient(options), *timing),
    }
    return clients, latency


def bench_data_parallel(
    options: EngineOptions, sizes: list[int], num_requests: int, max_tokens: int, repeats: int
) -> dict[int, tuple[Result, Result]]:
    """engine count -> (sync, asyncio) client results, each client chosen by the factory as LLM and the
    server would choose it."""
    from nanoserve.engine.core_client.base import EngineCoreClient

    timing = (num_requests, max_tokens, repeats)
    results = {}
    for size in sizes:
        opts = dataclasses.replace(options, data_parallel_size=size)
        results[size] = (
            _time_sync(EngineCoreClient.make_client(True, False, opts), *timing),
            _time_async(lambda opts=opts: EngineCoreClient.make_async_mp_client(opts), *timing),
        )
    return results


def bench_raw(num_messages: int, repeats: int) -> dict[str, Result]:
    kinds = {
        "raw direct": ("raw zmq PULL, direct", _receive_direct),
        "raw thread": ("raw zmq PULL, thread + queue.Queue", _receive_thread_queue),
        "raw asyncio": ("raw zmq PULL, zmq.asyncio", _receive_asyncio),
    }
    return {
        key: _median([_raw_run(name, num_messages, receive) for _ in range(repeats)])
        for key, (name, receive) in kinds.items()
    }


BASELINE_OF = {"InprocClient": "raw direct", "SyncMPClient": "raw thread", "AsyncMPClient": "raw asyncio"}


def report(raw: dict[str, Result], clients: dict[str, Result]) -> str:
    lines = [f"{'path':<38}{'msgs/s':>12}{'outputs/s':>12}{'requests/s':>12}{'vs baseline':>13}"]
    for r in raw.values():
        lines.append(f"{r.name:<38}{r.msgs_per_s:>12,.0f}{'':>12}{'':>12}{'':>13}")
    for name, r in clients.items():
        base = raw[BASELINE_OF[name]]
        ratio = r.outputs_per_s / base.msgs_per_s
        lines.append(
            f"{name:<38}{r.msgs_per_s:>12,.0f}{r.outputs_per_s:>12,.0f}{r.requests_per_s:>12,.1f}"
            f"{ratio:>12.0%} ({base.name.removeprefix('raw zmq PULL, ')})"
        )
    inproc = clients["InprocClient"].outputs_per_s
    for name in ("SyncMPClient", "AsyncMPClient"):
        lines.append(f"{name} / InprocClient outputs/s: {clients[name].outputs_per_s / inproc:.2f}x")
    return "\n".join(lines)


def report_data_parallel(results: dict[int, tuple[Result, Result]]) -> str:
    first_sync, first_async = next(iter(results.values()))
    lines = [
        f"{'engines':>7}  {'sync client':<18}{'outputs/s':>11}{'scale':>7}  {'asyncio client':<19}"
        f"{'outputs/s':>11}{'scale':>7}"
    ]
    for size, (sync, asyn) in results.items():
        lines.append(
            f"{size:>7}  {sync.name:<18}{sync.outputs_per_s:>11,.0f}"
            f"{sync.outputs_per_s / first_sync.outputs_per_s:>6.2f}x  {asyn.name:<19}"
            f"{asyn.outputs_per_s:>11,.0f}{asyn.outputs_per_s / first_async.outputs_per_s:>6.2f}x"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="nanoserve bench ipc", description=__doc__.splitlines()[0])
    parser.add_argument("--num-requests", type=int, default=128, help="concurrent requests per client run")
    parser.add_argument("--max-tokens", type=int, default=256, help="outputs per request")
    parser.add_argument("--raw-messages", type=int, default=200_000, help="messages per raw baseline run")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per path (the median is shown)")
    parser.add_argument("--transport", choices=("ipc", "tcp"), default="ipc")
    parser.add_argument(
        "--zmq-curve",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="with --transport tcp: CurveZMQ on the engine sockets (the default, as in serving)",
    )
    parser.add_argument(
        "--data-parallel-size",
        type=int,
        nargs="+",
        default=None,
        help="engine counts to compare (e.g. 1 2 4); skips the raw baselines and InprocClient",
    )
    args = parser.parse_args(argv)

    options = EngineOptions(
        runner="null",
        max_num_seqs=max(args.num_requests, 1),
        transport=args.transport,
        zmq_curve=args.zmq_curve,
    )
    wire = args.transport if args.transport == "ipc" else f"tcp, curve {'on' if args.zmq_curve else 'off'}"
    if args.data_parallel_size:
        results = bench_data_parallel(
            options, args.data_parallel_size, args.num_requests, args.max_tokens, args.repeats
        )
        print(
            f"null runner, {args.num_requests} concurrent requests x {args.max_tokens} outputs over "
            f"{wire}; median of {args.repeats} runs; scale = outputs/s vs the first engine count"
        )
        print(report_data_parallel(results))
        return 0
    raw = bench_raw(args.raw_messages, args.repeats)
    clients, latency = bench_clients(options, args.num_requests, args.max_tokens, args.repeats)
    print(
        f"null runner, {args.num_requests} concurrent requests x {args.max_tokens} outputs over {wire}; "
        f"raw: {args.raw_messages} one-output messages over ipc; median of {args.repeats} runs"
    )
    print(report(raw, clients))
    print(f"SyncMPClient utility round trip (median of 2000): {latency:.0f} us")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
