"""SyncMPClient: the multiprocess client for synchronous frontends (LLM, LLMEngine).

A daemon thread owns the output PULL socket: it polls it together with an inproc PAIR shutdown socket,
checks each message for the death frame, decodes it, resolves utility futures and puts everything else
on a `queue.Queue` that `get_output()` blocks on. Any error in the thread, and any engine death, is put
on the queue too, so a caller blocked in `get_output()` always wakes.
"""

from __future__ import annotations

import queue
import threading
import uuid
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeoutError
from typing import Any

import zmq

from nanoserve.config import EngineOptions
from nanoserve.engine.core_client.mp import (
    BackgroundResources,
    MPClient,
    fail_sync_futures,
    process_utility_output,
)
from nanoserve.engine.exceptions import EngineDeadError
from nanoserve.wire.codec import MsgpackDecoder
from nanoserve.wire.messages import (
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineCoreRequestType,
    EngineCoreUtilityRequest,
)


class SyncMPClient(MPClient):
    def __init__(self, options: EngineOptions) -> None:
        self.outputs_queue: queue.Queue[EngineCoreOutputs | BaseException] = queue.Queue()
        self._send_lock = threading.Lock()
        super().__init__(options)

    def _start_output_reader(self) -> None:
        resources = self.resources
        outputs_queue, utility_results = self.outputs_queue, self.utility_results

        def on_dead(error: EngineDeadError) -> None:
            fail_sync_futures(utility_results, error)
            outputs_queue.put_nowait(error)

        resources.on_dead = on_dead
        resources.shutdown_path = f"inproc://nanoserve-output-shutdown-{uuid.uuid4().hex}"
        shutdown_socket = resources.ctx.socket(zmq.PAIR)
        shutdown_socket.setsockopt(zmq.LINGER, 0)
        shutdown_socket.bind(resources.shutdown_path)
        thread = threading.Thread(
            target=_process_outputs_socket,
            args=(
                resources,
                resources.output_socket,
                shutdown_socket,
                self.decoder,
                outputs_queue,
                utility_results,
            ),
            name="EngineCoreOutputThread",
            daemon=True,
        )
        thread.start()
        resources.thread_idents.add(thread.ident)
        # the thread owns (and closes) both sockets from here on
        resources.output_socket = None

    def get_output(self, timeout: float | None = None) -> EngineCoreOutputs:
        if self.resources.engine_dead:
            raise self.resources.dead_error or EngineDeadError()
        try:
            outputs = self.outputs_queue.get(timeout=timeout)
        except queue.Empty:
            raise TimeoutError(f"No engine core output within {timeout} s.") from None
        if isinstance(outputs, BaseException):
            self.outputs_queue.put_nowait(outputs)  # wake the next blocked caller too
            raise outputs
        return outputs

    def _send_input(
        self, request_type: EngineCoreRequestType, payload: Any, engine: bytes | None = None
    ) -> None:
        self.ensure_alive()
        msg, has_buffers = self._encode_input(request_type, payload, engine)
        with self._send_lock:
            self.ensure_alive()
            try:
                self._send_frames(msg, has_buffers)
            except zmq.ZMQError as e:
                self.ensure_alive()
                raise EngineDeadError(f"Could not send to the engine core: {e}") from e

    def add_request(self, request: EngineCoreRequest) -> None:
        self._send_input(EngineCoreRequestType.ADD, request)

    def abort_requests(self, request_ids: list[str]) -> None:
        if request_ids and not self.resources.engine_dead:
            self._send_input(EngineCoreRequestType.ABORT, list(request_ids))

    def call_utility(self, method: str, *args: Any, timeout: float | None = None) -> Any:
        call_id = self._next_call_id()
        future: Future = Future()
        self.utility_results[call_id] = future
        try:
            # registered before the liveness check: a death after it fails this future too
            self._send_input(EngineCoreRequestType.UTILITY, EngineCoreUtilityRequest(call_id, method, args))
            return future.result(timeout=timeout)
        except FutureTimeoutError:
            raise TimeoutError(f"Utility call {method!r} got no answer within {timeout} s.") from None
        finally:
            self.utility_results.pop(call_id, None)


def _process_outputs_socket(
    resources: BackgroundResources,
    out_socket: zmq.Socket,
    shutdown_socket: zmq.Socket,
    decoder: MsgpackDecoder,
    outputs_queue: queue.Queue,
    utility_results: dict[int, Future],
) -> None:
    poller = zmq.Poller()
    poller.register(shutdown_socket, zmq.POLLIN)
    poller.register(out_socket, zmq.POLLIN)
    try:
        while True:
            events = dict(poller.poll())
            if shutdown_socket in events:
                return
            # drain what is there before polling again: one poll per burst, not per message
            while out_socket.get(zmq.EVENTS) & zmq.POLLIN:
                frames = out_socket.recv_multipart(copy=False)
                if resources.validate_alive(frames):
                    continue
                outputs: EngineCoreOutputs = decoder.decode(frames)
                if outputs.utility_output is not None:
                    process_utility_output(outputs.utility_output, utility_results)
                elif outputs.death is not None:
                    resources.record_death(outputs.death)
                else:
                    outputs_queue.put_nowait(outputs)
    except EngineDeadError:
        return  # validate_alive has marked the death and woken everyone
    except Exception as e:
        if not resources.shutting_down:
            error = EngineDeadError(f"The engine core output socket failed: {type(e).__name__}: {e}")
            error.__cause__ = e
            resources.mark_dead(error)
        outputs_queue.put_nowait(e if resources.dead_error is None else resources.dead_error)
    finally:
        shutdown_socket.close(linger=0)
        out_socket.close(linger=0)
