"""EngineCoreProc: the engine core in a child process, served over ZMQ.

Sockets (the frontend binds both, this process connects):
  input   DEALER, identity = rank as 2 bytes little-endian. Receives `[request_type, *payload]` from the
          frontend's ROUTER; an ADD's payload is a list of requests, which enter the same step. At start-up
          it sends the other way: one `EngineHandshakePhase` per phase (started, loading_weights), then
          `[phase "ready", EngineCoreReadyResponse]`.
  output  PUSH. Sends one encoded `EngineCoreOutputs` per message to the frontend's PULL.
  stats   PUSH, data parallel only. Sends an `EngineLoad` to the coordinator's PULL whenever the queue
          lengths or KV use in a step's stats change (never blocks: dropped if the coordinator is gone).
Threads: the input thread receives and decodes into `input_queue`; the main thread runs the busy loop
(drain inputs, step while there is work); the output thread encodes and sends, so (de)serialization
overlaps the model step.
Everything sent carries this start's `incarnation`, so the frontend can tell a restarted rank's messages
from those still in flight from the one that died.
Failure: any exception in the busy loop (or during start-up) sends `EngineCoreOutputs(death=...)`, then
the single frame `ENGINE_CORE_DEAD`, flushes, and exits 1. SIGTERM/SIGINT, or a SHUTDOWN request on the
input socket (how the frontend asks a rank on another machine): stop admitting, drain in-flight
requests for `shutdown_timeout` seconds, abort the rest, exit 0. Over TCP all three sockets are CURVE
clients (`args.curve`): they reach only the run's frontend and coordinator. The process around it
(entry point, signals, parent death) is `bootstrap.py`.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import logging
import os
import queue
import signal
import threading
import time
import traceback
import uuid
from dataclasses import dataclass
from typing import Any

import msgspec
import zmq

from nanoserve.config import EngineOptions
from nanoserve.startup_gc import collector_paused
from nanoserve.wire.codec import MsgpackDecoder, MsgpackEncoder
from nanoserve.wire.messages import (
    ENGINE_CORE_DEAD,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreReadyResponse,
    EngineCoreRequest,
    EngineCoreRequestType,
    EngineCoreUtilityRequest,
    EngineDeathRecord,
    EngineHandshakePhase,
    EngineLoad,
    FinishReason,
    UtilityOutput,
    engine_identity,
)
from nanoserve.wire.sockets import CurveClient, connect_socket

logger = logging.getLogger(__name__)

OUTPUT_LINGER_MS = 4000
"""How long the output socket keeps trying to deliver the last messages (a death record) at exit."""
INPUT_THREAD_JOIN_S = 1.0
"""The input thread ends at once when told to; waiting longer would only hide a stuck socket."""
DEFERRED_UTILITY_POLL_S = 0.05
"""While a utility waits for the engine to go idle (sleep mode="wait"), how often the idle loop checks."""
TRACEBACK_TAIL_LINES = 25

_WAKEUP = object()  # input-queue sentinel: re-check the shutdown flag
_STOP = object()  # output-queue sentinel: flush and end the output thread


@dataclass(frozen=True)
class EngineCoreProcArgs:
    """What an engine-core process (or Ray actor) is started with."""

    options: EngineOptions
    engine_rank: int
    input_address: str
    output_address: str
    stats_address: str | None = None
    """Data parallel: the coordinator's PULL."""
    incarnation: int = 0
    """How many times this rank was started before (restarts after deaths)."""
    frontend_pid: int | None = None
    """The process this one must not outlive; None under Ray (an actor dies with its owner)."""
    curve: CurveClient | None = None
    """Over TCP: this rank's CURVE key pair and the frontend's public key (None: plaintext, or ipc)."""


def death_record(engine_rank: int, exc: BaseException) -> EngineDeathRecord:
    tail = "".join(traceback.format_exception(exc)).splitlines()[-TRACEBACK_TAIL_LINES:]
    return EngineDeathRecord(engine_rank, type(exc).__name__, str(exc), "\n".join(tail))


class EngineCoreProc:
    def __init__(self, args: EngineCoreProcArgs) -> None:
        self.options = args.options
        self.engine_rank = args.engine_rank
        self.incarnation = args.incarnation
        self.engine: Any = None
        self.ctx = zmq.Context()
        identity = engine_identity(args.engine_rank)
        self.input_socket = connect_socket(
            self.ctx,
            zmq.DEALER,
            args.input_address,
            args.curve,
            {zmq.IDENTITY: identity, zmq.RCVHWM: 0, zmq.SNDHWM: 0, zmq.LINGER: 0},
        )
        self.output_socket = connect_socket(
            self.ctx, zmq.PUSH, args.output_address, args.curve, {zmq.SNDHWM: 0, zmq.LINGER: OUTPUT_LINGER_MS}
        )
        self.stats_socket: zmq.Socket | None = None
        if args.stats_address is not None:
            self.stats_socket = connect_socket(
                self.ctx, zmq.PUSH, args.stats_address, args.curve, {zmq.LINGER: 0}
            )
        self._phase_encoder = MsgpackEncoder()

        self.input_queue: queue.Queue = queue.Queue()
        self.output_queue: queue.Queue = queue.Queue()
        self.shutdown_requested = False
        self._stop_address = f"inproc://input-stop-{uuid.uuid4().hex}"
        self._stop_socket: zmq.Socket | None = None
        self._input_thread: threading.Thread | None = None
        self._output_thread: threading.Thread | None = None
        self._in_flight: set[str] = set()
        self._pending_utilities = 0

    # -- start-up -----------------------------------------------------------------------------

    def send_phase(self, phase: str, ready: EngineCoreReadyResponse | None = None) -> None:
        logger.debug("engine core %d: %s", self.engine_rank, phase.replace("_", " "))
        message = EngineHandshakePhase(self.engine_rank, phase, self.incarnation)
        frames = [self._phase_encoder.encode(message)[0]]
        if ready is not None:
            frames.append(self._phase_encoder.encode(ready)[0])
        self.input_socket.send_multipart(frames)

    def build_engine(self) -> None:
        self.send_phase("started")
        # what is built here lives as long as the process: collect once at the end, then freeze it
        with collector_paused(freeze=True):
            from nanoserve.core.engine_core import EngineCore

            self.engine = EngineCore(self.options, self.engine_rank, on_phase=self.send_phase)
        self.send_phase("ready", self.engine.ready_response)

    def start_threads(self) -> None:
        self._stop_socket = self.ctx.socket(zmq.PAIR)
        self._stop_socket.setsockopt(zmq.LINGER, 0)
        self._stop_socket.bind(self._stop_address)
        # the threads own their sockets from here on; the main thread never touches them again
        self._input_thread = threading.Thread(
            target=self._process_input_socket, name="EngineCoreInput", daemon=True
        )
        self._output_thread = threading.Thread(
            target=self._process_output_queue, name="EngineCoreOutput", daemon=True
        )
        self._input_thread.start()
        self._output_thread.start()
        # a process-directed signal may land on any thread, and a Python handler only runs once the main
        # thread executes bytecode: the C-level handler writes to this pipe, and a helper thread turns
        # that into an input-queue item that unblocks the busy loop so the handler can run
        read_fd, write_fd = os.pipe()
        os.set_blocking(write_fd, False)
        signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
        threading.Thread(
            target=self._signal_helper, args=(read_fd,), name="EngineCoreSignal", daemon=True
        ).start()

    # -- signals ------------------------------------------------------------------------------

    def request_shutdown(self) -> None:
        """Called from the signal handler: it must not touch the queue locks the main thread may hold."""
        self.shutdown_requested = True

    def _signal_helper(self, read_fd: int) -> None:
        while os.read(read_fd, 64):
            self.input_queue.put_nowait((_WAKEUP, None))

    # -- busy loop ----------------------------------------------------------------------------

    def run_busy_loop(self) -> None:
        engine = self.engine
        deadline: float | None = None
        while True:
            if self.shutdown_requested and deadline is None:
                deadline = time.monotonic() + self.options.shutdown_timeout
                logger.info(
                    "engine core %d: shutting down, draining %d request(s)",
                    self.engine_rank,
                    len(self._in_flight),
                )
            if deadline is not None:
                if time.monotonic() >= deadline and self._in_flight:
                    engine.abort_requests(list(self._in_flight))
                if not engine.has_work() and not self._in_flight:
                    return
            self._drain_input_queue(self._block_timeout(deadline))
            if engine.has_work():
                outputs = engine.step()
                if outputs.finished_requests:
                    self._in_flight.difference_update(outputs.finished_requests)
                if outputs.outputs or outputs.finished_requests:
                    self.output_queue.put_nowait(outputs)
                engine.post_step()

    def _block_timeout(self, deadline: float | None) -> float | None:
        """0: do not block. None: block until an input arrives."""
        if self.engine.has_work():
            return 0
        if deadline is not None:
            return max(0.0, deadline - time.monotonic())
        if self._pending_utilities:
            return DEFERRED_UTILITY_POLL_S  # a deferred utility (sleep mode="wait") completes in post_step
        return None

    def _drain_input_queue(self, timeout: float | None) -> None:
        try:
            item = self.input_queue.get_nowait() if timeout == 0 else self.input_queue.get(timeout=timeout)
        except queue.Empty:
            if self._pending_utilities:
                self.engine.post_step()
            return
        while True:
            self._handle_input(*item)
            try:
                item = self.input_queue.get_nowait()
            except queue.Empty:
                return

    def _handle_input(self, request_type: Any, payload: Any) -> None:
        if request_type is EngineCoreRequestType.ADD:
            for request in payload:
                self._add_request(request)
        elif request_type is EngineCoreRequestType.ABORT:
            self.engine.abort_requests(payload)
        elif request_type is EngineCoreRequestType.UTILITY:
            self._run_utility(payload)
        elif request_type is EngineCoreRequestType.SHUTDOWN:
            self.shutdown_requested = True
        elif isinstance(payload, BaseException):
            raise RuntimeError(
                f"an engine core I/O thread failed: {type(payload).__name__}: {payload}"
            ) from payload

    def _add_request(self, request: EngineCoreRequest) -> None:
        request_id = request.request_id
        if self.shutdown_requested:
            self._finish_unstarted(request_id, FinishReason.ABORT)
            return
        self._in_flight.add(request_id)
        try:
            self.engine.add_request(request)
        except Exception as e:  # a bad request must not take the engine down
            logger.exception("engine core %d: request %s failed to enter", self.engine_rank, request_id)
            self._in_flight.discard(request_id)
            self._finish_unstarted(request_id, FinishReason.ERROR, f"{type(e).__name__}: {e}")

    def _finish_unstarted(self, request_id: str, reason: FinishReason, error: str | None = None) -> None:
        out = EngineCoreOutput(request_id, [], finish_reason=reason, error=error)
        self.output_queue.put_nowait(
            EngineCoreOutputs(self.engine_rank, [out], finished_requests={request_id})
        )

    def _run_utility(self, request: EngineCoreUtilityRequest) -> None:
        call_id = request.call_id
        if self.shutdown_requested:
            self._send_utility(
                call_id, failure=f"Call to {request.method} failed: the engine core is shutting down."
            )
            return
        try:
            result = self.engine.call_utility(request.method, tuple(request.args))
        except Exception as e:
            logger.info("engine core %d: utility %s failed: %s", self.engine_rank, request.method, e)
            self._send_utility(call_id, failure=f"Call to {request.method} failed: {type(e).__name__}: {e}")
            return
        if isinstance(result, concurrent.futures.Future):
            self._pending_utilities += 1
            result.add_done_callback(lambda f: self._finish_deferred(call_id, request.method, f))
        else:
            self._send_utility(call_id, result=result)

    def _finish_deferred(self, call_id: int, method: str, future: concurrent.futures.Future) -> None:
        self._pending_utilities -= 1
        if future.cancelled():
            self._send_utility(call_id, failure=f"Call to {method} failed: cancelled by the engine core.")
        elif future.exception() is not None:
            e = future.exception()
            self._send_utility(call_id, failure=f"Call to {method} failed: {type(e).__name__}: {e}")
        else:
            self._send_utility(call_id, result=future.result())

    def _send_utility(self, call_id: int, result: Any = None, failure: str | None = None) -> None:
        out = UtilityOutput(call_id, failure_message=failure, result=result)
        self.output_queue.put_nowait(EngineCoreOutputs(self.engine_rank, utility_output=out))

    # -- I/O threads ----------------------------------------------------------------------------

    def _process_input_socket(self) -> None:
        decoders = {
            EngineCoreRequestType.ADD: MsgpackDecoder(list[EngineCoreRequest]),
            EngineCoreRequestType.ABORT: MsgpackDecoder(list[str]),
            EngineCoreRequestType.UTILITY: MsgpackDecoder(EngineCoreUtilityRequest),
            EngineCoreRequestType.SHUTDOWN: MsgpackDecoder(None),
        }
        single_request = MsgpackDecoder(EngineCoreRequest)
        stop = self.ctx.socket(zmq.PAIR)
        stop.connect(self._stop_address)
        poller = zmq.Poller()
        poller.register(self.input_socket, zmq.POLLIN)
        poller.register(stop, zmq.POLLIN)
        try:
            while True:
                if stop in dict(poller.poll()):
                    return
                type_frame, *frames = self.input_socket.recv_multipart(copy=False)
                try:
                    request_type = EngineCoreRequestType(type_frame.bytes)
                    payload = decoders[request_type].decode(frames)
                except Exception as e:
                    if type_frame.bytes != EngineCoreRequestType.ADD.value:
                        logger.error("engine core %d: rejected an undecodable input: %s", self.engine_rank, e)
                        continue
                    request_type = EngineCoreRequestType.ADD
                    payload = self._decode_each_request(single_request, frames, e)
                self.input_queue.put_nowait((request_type, payload))
        except Exception as e:
            self.input_queue.put_nowait((None, e))
        finally:
            stop.close(linger=0)
            self.input_socket.close(linger=0)

    def _decode_each_request(
        self, decoder: MsgpackDecoder, frames: list, error: Exception
    ) -> list[EngineCoreRequest]:
        """An ADD that failed to decode as a whole: the requests that decode on their own go ahead, the
        others finish with an ERROR output, where their id can be read."""
        try:
            items = msgspec.msgpack.decode(frames[0].buffer, type=list[msgspec.Raw])
        except Exception:
            items = []
        if not items:
            logger.error("engine core %d: rejected an undecodable ADD: %s", self.engine_rank, error)
        requests = []
        for item in items:
            try:
                requests.append(decoder.decode([item, *frames[1:]]))  # zero-copy frames keep their indices
            except Exception as e:
                self._reject_undecodable(item, e)
        return requests

    def _reject_undecodable(self, item: msgspec.Raw, error: Exception) -> None:
        """Finish a request that fails to decode with an ERROR output, if its id can be read."""
        request_id = None
        with contextlib.suppress(Exception):
            raw = msgspec.msgpack.decode(item)  # array_like: the id comes first
            request_id = raw[0] if isinstance(raw, list) and isinstance(raw[0], str) else None
        logger.error(
            "engine core %d: rejected an undecodable request (%s): %s", self.engine_rank, request_id, error
        )
        if request_id is not None:
            self._finish_unstarted(request_id, FinishReason.ERROR, f"Invalid request: {error}")

    def _process_output_queue(self) -> None:
        encoder = MsgpackEncoder()
        socket = self.output_socket
        free: list[bytearray] = []
        in_flight: collections.deque[tuple[zmq.MessageTracker, bytearray]] = collections.deque()
        last_load: tuple | None = None
        try:
            while True:
                item = self.output_queue.get()
                if item is _STOP:
                    return
                if item is ENGINE_CORE_DEAD:
                    socket.send(ENGINE_CORE_DEAD)
                    continue
                while in_flight and in_flight[0][0].done:
                    free.append(in_flight.popleft()[1])
                item.incarnation = self.incarnation
                buf = free.pop() if free else bytearray()
                frames = self._encode(encoder, item, buf)
                # the body buffer is reused only once ZMQ reports this frame sent (frames under 64 KiB
                # are copied by pyzmq and come back done at once)
                if len(frames) == 1:
                    tracker = socket.send(frames[0], copy=False, track=True)
                else:
                    tracker = socket.send(frames[0], zmq.SNDMORE, copy=False, track=True)
                    socket.send_multipart(frames[1:], copy=False)
                in_flight.append((tracker, frames[0]))
                stats = item.scheduler_stats
                if self.stats_socket is not None and stats is not None:
                    load = (stats.num_waiting_reqs, stats.num_running_reqs, round(stats.kv_cache_usage, 3))
                    if load != last_load and self._send_load(self.stats_socket, encoder, load):
                        last_load = load
        except Exception as e:
            self.input_queue.put_nowait((None, e))  # the busy loop dies with this cause
        finally:
            socket.close(linger=OUTPUT_LINGER_MS)
            if self.stats_socket is not None:
                self.stats_socket.close(linger=0)

    def _send_load(self, sock: zmq.Socket, encoder: MsgpackEncoder, load: tuple) -> bool:
        """Never blocks; False when the message could not be queued (it is sent again with the next
        output, so the coordinator never keeps a load the engine has left)."""
        try:
            sock.send(encoder.encode(EngineLoad(self.engine_rank, *load))[0], zmq.NOBLOCK)
        except zmq.Again:
            return False
        return True

    def _encode(self, encoder: MsgpackEncoder, outputs: EngineCoreOutputs, buf: bytearray) -> list:
        try:
            return encoder.encode_into(outputs, buf)
        except BufferError:  # still exported to a frame ZMQ let go of late: use a fresh buffer
            return encoder.encode_into(outputs, bytearray())
        except TypeError as e:
            if outputs.utility_output is None:
                raise
            call_id = outputs.utility_output.call_id
            failure = f"The utility's result cannot be sent over the wire: {e}"
            failed = EngineCoreOutputs(
                self.engine_rank, utility_output=UtilityOutput(call_id, failure), incarnation=self.incarnation
            )
            return encoder.encode_into(failed, bytearray())

    # -- exit ---------------------------------------------------------------------------------

    def close(self, death: BaseException | None = None) -> None:
        """Stop the threads (after sending the death record and frame, when dying) and free the sockets."""
        if self._output_thread is not None and self._output_thread.is_alive():
            if death is not None:
                self.output_queue.put_nowait(
                    EngineCoreOutputs(self.engine_rank, death=death_record(self.engine_rank, death))
                )
                self.output_queue.put_nowait(ENGINE_CORE_DEAD)
            self.output_queue.put_nowait(_STOP)
            self._output_thread.join(timeout=OUTPUT_LINGER_MS / 1000 + 1)
        elif self._output_thread is None:
            if death is not None:
                self._send_death_directly(death)
            self.output_socket.close(linger=OUTPUT_LINGER_MS)
            if self.stats_socket is not None:
                self.stats_socket.close(linger=0)
        if self._input_thread is not None and self._stop_socket is not None:
            try:
                self._stop_socket.send(b"", zmq.NOBLOCK)
            except zmq.Again:
                pass  # the input thread has already ended
            self._input_thread.join(timeout=INPUT_THREAD_JOIN_S)
            self._stop_socket.close(linger=0)
        else:
            self.input_socket.close(linger=0)
        if self.engine is not None:
            try:
                self.engine.shutdown()
            except Exception:
                logger.exception("engine core %d: error while shutting the engine down", self.engine_rank)
        stuck = [t.name for t in (self._input_thread, self._output_thread) if t is not None and t.is_alive()]
        if stuck:  # their sockets are still open, so term() would wait for ever; the process exit frees them
            logger.warning("engine core %d: %s did not stop", self.engine_rank, ", ".join(stuck))
            return
        self.ctx.term()  # returns once the output socket has flushed (or its linger has run out)

    def _send_death_directly(self, death: BaseException) -> None:
        try:
            record = death_record(self.engine_rank, death)
            body = MsgpackEncoder().encode(
                EngineCoreOutputs(self.engine_rank, death=record, incarnation=self.incarnation)
            )
            self.output_socket.send_multipart(body)
            self.output_socket.send(ENGINE_CORE_DEAD)
        except Exception:
            logger.exception("engine core %d: could not report its death", self.engine_rank)
