"""InprocClient: the engine core as a plain object in the caller's process.

No serialization, no sockets, no busy loop: `get_output()` runs one engine step and returns what it
produced. It backs the synchronous frontends when multiprocessing is off.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from nanoserve.config import EngineOptions
from nanoserve.core.engine_core import EngineCore
from nanoserve.engine.core_client.base import EngineCoreClient
from nanoserve.engine.core_client.liveness import EngineLiveness
from nanoserve.wire.messages import EngineCoreOutputs, EngineCoreRequest


class InprocClient(EngineCoreClient):
    def __init__(self, options: EngineOptions) -> None:
        self.engine_core = EngineCore(options)
        self.ready_response = self.engine_core.ready_response
        self.liveness = EngineLiveness([0])  # an engine in this process dies with it: always alive

    def get_output(self, timeout: float | None = None) -> EngineCoreOutputs:
        outputs = self.engine_core.step()
        self.engine_core.post_step()
        return outputs

    def add_requests(self, requests: Sequence[EngineCoreRequest]) -> None:
        for request in requests:
            self.engine_core.add_request(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        if request_ids:
            self.engine_core.abort_requests(request_ids)

    def call_utility(self, method: str, *args: Any, timeout: float | None = None) -> Any:
        return self.engine_core.call_utility(method, args)

    def sleep(self, level: int = 1, mode: str = "abort") -> None:
        if mode == "wait":
            raise ValueError(
                "sleep(mode='wait') needs the multiprocess engine: in one process no scheduler runs "
                "concurrently to wait for idleness. Use mode='abort', or multiprocess_mode=True."
            )
        self.engine_core.sleep(level, mode)

    def shutdown(self) -> None:
        self.engine_core.shutdown()
