"""EngineCoreClient: the one interface every frontend talks to, whatever runs the engine core.

Two independent choices hide behind it: in this process or in child processes (over ZMQ), and
synchronous or asyncio. `make_client` picks the variant; the frontend never knows which it got.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any

from nanoserve.config import EngineOptions
from nanoserve.engine.core_client.liveness import EngineLiveness
from nanoserve.engine.exceptions import EngineDeadError
from nanoserve.wire.messages import EngineCoreOutputs, EngineCoreReadyResponse, EngineCoreRequest


class EngineCoreClient(ABC):
    ready_response: EngineCoreReadyResponse
    """Capacity the engine core computed at start-up (KV blocks, block size, fitted max_model_len)."""
    liveness: EngineLiveness
    """Where each engine rank stands (alive, restarting, dead for good); frontends read it, never
    keep their own copy."""

    @staticmethod
    def make_client(multiprocess_mode: bool, asyncio_mode: bool, options: EngineOptions) -> EngineCoreClient:
        if asyncio_mode and not multiprocess_mode:
            raise NotImplementedError(
                "asyncio_mode needs multiprocess_mode: the engine core is not asyncio-friendly, so an asyncio "
                "frontend must drive it in a child process."
            )
        if multiprocess_mode and asyncio_mode:
            return EngineCoreClient.make_async_mp_client(options)
        if multiprocess_mode:
            if options.data_parallel_size > 1 and not options.data_parallel_external_lb:
                from nanoserve.engine.core_client.dp import DPLBSyncMPClient

                return DPLBSyncMPClient(options)
            from nanoserve.engine.core_client.sync_mp import SyncMPClient

            return SyncMPClient(options)
        from nanoserve.engine.core_client.inproc import InprocClient

        return InprocClient(options)

    @staticmethod
    def make_async_mp_client(options: EngineOptions) -> EngineCoreClient:
        """One engine: `AsyncMPClient`. Several, balanced here: `DPLBAsyncMPClient`. One rank of several,
        with an external load balancer in front: `DPAsyncMPClient`. Any of them runs its engines as child
        processes or, with `data_parallel_backend="ray"`, as Ray actors."""
        if options.data_parallel_size > 1:
            from nanoserve.engine.core_client.dp import DPAsyncMPClient, DPLBAsyncMPClient

            if options.data_parallel_external_lb:
                return DPAsyncMPClient(options)
            return DPLBAsyncMPClient(options)
        from nanoserve.engine.core_client.async_mp import AsyncMPClient

        return AsyncMPClient(options)

    @abstractmethod
    def shutdown(self) -> None: ...

    def dead_rank_errors(self) -> dict[int, EngineDeadError]:
        """Data parallel: the ranks that died while others serve on, with why (a frontend fails their
        requests with these errors and reports itself degraded). Empty for a single engine, whose death
        is the client's."""
        return self.liveness.dead_ranks()

    def get_output(self, timeout: float | None = None) -> EngineCoreOutputs:
        raise NotImplementedError

    def add_request(self, request: EngineCoreRequest) -> None:
        self.add_requests([request])

    def add_requests(self, requests: Sequence[EngineCoreRequest]) -> None:
        """Add several requests at once: an engine sees them together, so they enter the same step
        (a batch whose first request started alone would finish a step behind the rest)."""
        raise NotImplementedError

    def abort_requests(self, request_ids: list[str]) -> None:
        raise NotImplementedError

    def call_utility(self, method: str, *args: Any, timeout: float | None = None) -> Any:
        raise NotImplementedError

    def profile(self, is_start: bool = True) -> None:
        self.call_utility("profile", is_start)

    def reset_prefix_cache(self) -> bool:
        return self.call_utility("reset_prefix_cache")

    def sleep(self, level: int = 1, mode: str = "abort") -> None:
        self.call_utility("sleep", level, mode)

    def wake_up(self) -> None:
        self.call_utility("wake_up")

    def is_sleeping(self) -> bool:
        return self.call_utility("is_sleeping")

    def collective_rpc(self, method: str, args: tuple = (), kwargs: dict | None = None) -> list[Any]:
        return self.call_utility("collective_rpc", method, args, kwargs)

    def save_sharded_state(self, path: str) -> None:
        self.call_utility("save_sharded_state", path)

    # asyncio twins: only the asyncio clients implement them (add_request_async wraps add_requests_async).

    async def get_output_async(self, timeout: float | None = None) -> EngineCoreOutputs:
        raise NotImplementedError(f"{type(self).__name__} is synchronous; use get_output().")

    async def add_request_async(self, request: EngineCoreRequest) -> None:
        await self.add_requests_async([request])

    async def add_requests_async(self, requests: Sequence[EngineCoreRequest]) -> None:
        raise NotImplementedError(f"{type(self).__name__} is synchronous; use add_requests().")

    async def abort_requests_async(self, request_ids: list[str]) -> None:
        raise NotImplementedError(f"{type(self).__name__} is synchronous; use abort_requests().")

    async def call_utility_async(self, method: str, *args: Any, timeout: float | None = None) -> Any:
        raise NotImplementedError(f"{type(self).__name__} is synchronous; use call_utility().")

    async def profile_async(self, is_start: bool = True) -> None:
        await self.call_utility_async("profile", is_start)

    async def reset_prefix_cache_async(self) -> bool:
        return await self.call_utility_async("reset_prefix_cache")

    async def sleep_async(self, level: int = 1, mode: str = "abort") -> None:
        await self.call_utility_async("sleep", level, mode)

    async def wake_up_async(self) -> None:
        await self.call_utility_async("wake_up")

    async def is_sleeping_async(self) -> bool:
        return await self.call_utility_async("is_sleeping")

    async def collective_rpc_async(
        self, method: str, args: tuple = (), kwargs: dict | None = None
    ) -> list[Any]:
        return await self.call_utility_async("collective_rpc", method, args, kwargs)

    async def save_sharded_state_async(self, path: str) -> None:
        await self.call_utility_async("save_sharded_state", path)
