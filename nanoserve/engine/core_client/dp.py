"""Data-parallel clients: several engine-core ranks (replicas of the same model) behind one frontend.

`DPLBAsyncMPClient` (asyncio frontends) and `DPLBSyncMPClient` (LLM offline) launch
`data_parallel_size` engine processes on one ROUTER / PULL pair, each engine's identity being its rank
as 2 bytes little-endian, and balance requests between them here. `DPAsyncMPClient` serves the single
rank `data_parallel_rank` and leaves balancing to an external load balancer in front of several
frontends.

Balancing (`DPLoadBalancer`) uses the client's own in-flight accounting, exact for the requests this
frontend sent, plus each engine's reported waiting / running counts and KV-cache usage: from the
`scheduler_stats` on every output it streams, and from the coordinator process (`coordinator.py`),
which publishes every rank's counts at most every 100 ms on change and as a heartbeat; requests an
engine reports beyond this client's are other frontends' work and count at this client's mean cost.
A request weighs what it costs the engine that takes it: the prompt tokens it must prefill plus the KV
tokens it will hold; on an engine that already holds the request's leading full blocks in its prefix
cache those blocks cost nothing, and that engine takes the request unless it is overloaded (its load,
this request included, above `AFFINITY_SLACK` times the lightest engine's). Otherwise the lightest
engine takes it; ties rotate.

A dead rank (death frame or monitor, `BackgroundResources.mark_rank_dead`): its pending utility calls
fail at once; a marker on the output queue becomes, when the frontend next reads outputs, one ERROR
output per request the rank held, carrying the `EngineDeadError` text that names the rank, so every
frontend finishes those requests through its ordinary output path. That batch also carries `death`
(frontend-side only: never on the wire past the reader), so a frontend that raises errors rather than
returning them (AsyncLLM) can tell these requests from ones the engine refused, and raise the rank's
`EngineDeadError` from `dead_rank_errors()`. New requests and utility calls go to the live ranks only.
When the last rank dies the client is dead exactly as with one engine.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import threading
import time
from collections.abc import Callable, Container
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeoutError
from dataclasses import dataclass
from typing import Any

from nanoserve.config import EngineOptions
from nanoserve.engine.core_client.async_mp import AsyncMPClient
from nanoserve.engine.core_client.coordinator import LoadSubscriber, start_coordinator
from nanoserve.engine.core_client.launch import EngineZmqAddresses, engine_identity
from nanoserve.engine.core_client.mp import MPClient, _fail_future, _in_loop
from nanoserve.engine.core_client.sync_mp import SyncMPClient
from nanoserve.engine.exceptions import EngineDeadError
from nanoserve.wire.messages import (
    DPLoadUpdate,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineCoreRequestType,
    EngineCoreUtilityRequest,
    EngineDeathRecord,
    FinishReason,
    SchedulerStats,
)

AFFINITY_MAX_BLOCKS = 8
"""Leading full prompt blocks remembered per request for prefix affinity."""
AFFINITY_MAP_SIZE = 4096
"""Prefix hashes remembered (least recently used dropped first)."""
AFFINITY_SLACK = 2.0
"""The engine holding a request's prefix takes it unless its load (this request included) exceeds this
many times the lightest engine's: beyond that it counts as overloaded."""
DEFAULT_REQUEST_COST = 256
"""Tokens charged for each request another frontend has on a rank, when this client has none there to
take a mean from."""
SINGLE_RANK_UTILITIES = frozenset({"save_sharded_state"})
"""Every rank holds the same weights: one writer, not N writers racing on one path."""


@dataclass
class RankLoad:
    in_flight_cost: int = 0
    num_in_flight: int = 0
    kv_cache_usage: float = 0.0
    """From the engine's latest scheduler stats, as are the two counts below."""
    num_running_reqs: int = 0
    num_waiting_reqs: int = 0


class DPLoadBalancer:
    """Picks a rank per request and tracks which rank holds which request. Thread-safe."""

    def __init__(self, ranks: list[int], block_size: int) -> None:
        self.ranks = list(ranks)
        self.block_size = block_size
        self.loads = {rank: RankLoad() for rank in ranks}
        self.owners: dict[str, tuple[int, int]] = {}
        """request id -> (rank, cost charged to it)."""
        self.prefix_ranks: collections.OrderedDict[int, set[int]] = collections.OrderedDict()
        """hash of the first k full prompt blocks -> ranks that were sent such a prompt."""
        self.num_routed = collections.Counter()
        self.num_updates = 0
        """Coordinator publications received, of which heartbeats:"""
        self.num_heartbeats = 0
        self._rotation = 0
        self._lock = threading.Lock()

    def prefix_hashes(self, token_ids: list[int]) -> list[int]:
        """Chained hashes of the leading full blocks (like the engine's prefix cache keys)."""
        bs = self.block_size
        hashes, h = [], 0
        for i in range(min(len(token_ids) // bs, AFFINITY_MAX_BLOCKS)):
            h = hash((h, tuple(token_ids[i * bs : (i + 1) * bs])))
            hashes.append(h)
        return hashes

    def request_cost(self, request: EngineCoreRequest, num_cached_blocks: int = 0) -> int:
        """Prompt tokens to prefill plus KV tokens to hold, less what the prefix cache already holds."""
        num_prompt = len(request.prompt_token_ids)
        max_tokens = request.sampling_params.max_tokens or 0
        kv_tokens = -(-(num_prompt + max_tokens) // self.block_size) * self.block_size
        cached = num_cached_blocks * self.block_size
        return max(1, num_prompt - cached + kv_tokens - cached)

    def score(self, rank: int) -> float:
        """This client's in-flight cost on the rank, plus the requests the rank reports beyond those
        (other frontends' work) at this client's mean cost, scaled up by the rank's KV use."""
        load = self.loads[rank]
        others = max(0, load.num_waiting_reqs + load.num_running_reqs - load.num_in_flight)
        mean_cost = load.in_flight_cost / load.num_in_flight if load.num_in_flight else DEFAULT_REQUEST_COST
        return (load.in_flight_cost + others * mean_cost) * (1.0 + load.kv_cache_usage)

    def choose(self, request: EngineCoreRequest, dead: Container[int]) -> int:
        with self._lock:
            live = [rank for rank in self.ranks if rank not in dead]
            if not live:
                raise EngineDeadError("Every data-parallel engine rank is dead.")
            hashes = self.prefix_hashes(request.prompt_token_ids)
            cached = {rank: self._num_cached_blocks(rank, hashes) for rank in live}
            costs = {rank: self.request_cost(request, cached[rank]) for rank in live}
            totals = {rank: self.score(rank) + costs[rank] for rank in live}
            best = min(totals.values())
            holder = max(live, key=lambda rank: (cached[rank], -totals[rank]))
            if cached[holder] and totals[holder] <= AFFINITY_SLACK * best:
                rank = holder
            else:
                ties = [rank for rank in live if totals[rank] == best]
                rank = ties[self._rotation % len(ties)]
                self._rotation += 1
            self._release(request.request_id)  # a reused id must not be charged twice
            self.owners[request.request_id] = (rank, costs[rank])
            load = self.loads[rank]
            load.in_flight_cost += costs[rank]
            load.num_in_flight += 1
            self.num_routed[rank] += 1
            for h in hashes:
                self.prefix_ranks.setdefault(h, set()).add(rank)
                self.prefix_ranks.move_to_end(h)
            while len(self.prefix_ranks) > AFFINITY_MAP_SIZE:
                self.prefix_ranks.popitem(last=False)
            return rank

    def _num_cached_blocks(self, rank: int, hashes: list[int]) -> int:
        num = 0
        for h in hashes:
            if rank not in self.prefix_ranks.get(h, ()):
                break
            num += 1
        return num

    def owner(self, request_id: str) -> int | None:
        entry = self.owners.get(request_id)
        return None if entry is None else entry[0]

    def update(self, rank: int, stats: SchedulerStats | None, finished: set[str] | None) -> None:
        with self._lock:
            if stats is not None and rank in self.loads:
                load = self.loads[rank]
                load.kv_cache_usage = stats.kv_cache_usage
                load.num_running_reqs = stats.num_running_reqs
                load.num_waiting_reqs = stats.num_waiting_reqs
            for request_id in finished or ():
                self._release(request_id)

    def apply_update(self, update: DPLoadUpdate) -> None:
        """A coordinator publication (on the subscriber thread)."""
        with self._lock:
            for reported in update.loads:
                load = self.loads.get(reported.engine_rank)
                if load is not None:
                    load.num_waiting_reqs = reported.num_waiting_reqs
                    load.num_running_reqs = reported.num_running_reqs
                    load.kv_cache_usage = reported.kv_cache_usage
            self.num_updates += 1
            self.num_heartbeats += update.is_heartbeat

    def _release(self, request_id: str) -> None:
        entry = self.owners.pop(request_id, None)
        if entry is not None:
            load = self.loads[entry[0]]
            load.in_flight_cost -= entry[1]
            load.num_in_flight -= 1

    def release_rank(self, rank: int) -> list[str]:
        """Forget a dead rank's requests and prefixes; returns the ids it held."""
        with self._lock:
            ids = [request_id for request_id, (owner, _) in self.owners.items() if owner == rank]
            for request_id in ids:
                self._release(request_id)
            for ranks in self.prefix_ranks.values():
                ranks.discard(rank)
            return ids

    def forget_prefixes(self) -> None:
        with self._lock:
            self.prefix_ranks.clear()


@dataclass
class _RankDeath:
    """Output-queue marker: this rank died; fail the requests it held when the frontend reads it."""

    rank: int
    error: EngineDeadError


def combine_utility_results(method: str, results: dict[int, Any]) -> Any:
    """One answer from every live rank's answer."""
    values = list(results.values())
    if method == "reset_prefix_cache":
        return all(values)
    if method == "collective_rpc":
        return [item for value in values for item in value]
    if any(value != values[0] for value in values[1:]):
        raise RuntimeError(f"Data-parallel engine ranks disagree on {method}: {results}")
    return values[0]


def _make_on_rank_dead(
    utility_results: dict[int, Any],
    utility_ranks: dict[int, int],
    put_output: Callable[[Any], None],
    deliver: Callable[[Callable[[], None]], None],
) -> Callable[[int, EngineDeadError], None]:
    """Built from the client's parts, not the client: the resources (its finalizer) must not refer to it."""

    def fail_rank(rank: int, error: EngineDeadError) -> None:
        for call_id, owner in list(utility_ranks.items()):
            if owner == rank:
                future = utility_results.pop(call_id, None)
                if future is not None:
                    _fail_future(future, error)
        put_output(_RankDeath(rank, error))

    return lambda rank, error: deliver(lambda: fail_rank(rank, error))


class _DPLBClient(MPClient):
    """What the balancing clients add to SyncMPClient / AsyncMPClient (mixed in before them)."""

    def __init__(self, options: EngineOptions) -> None:
        self.balancer = DPLoadBalancer(list(range(options.data_parallel_size)), options.block_size)
        self.utility_ranks: dict[int, int] = {}
        """call_id -> the rank it was sent to, so a rank's death fails its calls."""
        super().__init__(options)

    def _engine_ranks(self, options: EngineOptions) -> list[int]:
        return list(range(options.data_parallel_size))

    def _start_coordinator(self, addresses: EngineZmqAddresses) -> None:
        options, resources, host = self.options, self.resources, self.engine_host
        proc, stats_address, publish_address = start_coordinator(
            self._engine_ranks(options), host.transport, options.engine_start_method, host.bind
        )
        resources.coordinator = proc
        resources.ipc_paths += [
            a.removeprefix("ipc://") for a in (stats_address, publish_address) if a.startswith("ipc://")
        ]
        addresses.stats = host.endpoint(stats_address)
        self.load_subscriber = LoadSubscriber(
            resources.ctx, publish_address, self.balancer.apply_update, lambda: resources.shutting_down
        )
        resources.thread_idents.add(self.load_subscriber.thread.ident)

    @property
    def dead_ranks(self) -> set[int]:
        return set(self.resources.dead_ranks)

    @property
    def live_ranks(self) -> list[int]:
        dead = self.resources.dead_ranks
        return [rank for rank in self.engine_ranks if rank not in dead]

    @property
    def is_degraded(self) -> bool:
        """Some ranks are dead, others still serve."""
        return bool(self.resources.dead_ranks) and not self.resources.engine_dead

    def dead_rank_errors(self) -> dict[int, EngineDeadError]:
        return dict(self.resources.dead_ranks)

    def _route(self, request: EngineCoreRequest) -> bytes:
        self.ensure_alive()
        return engine_identity(self.balancer.choose(request, self.resources.dead_ranks))

    def _abort_groups(self, request_ids: list[str]) -> dict[bytes, list[str]]:
        groups: dict[bytes, list[str]] = {}
        dead = self.resources.dead_ranks
        for request_id in request_ids:
            rank = self.balancer.owner(request_id)
            if rank is not None and rank not in dead:  # unknown: finished already; dead: failed already
                groups.setdefault(engine_identity(rank), []).append(request_id)
        return groups

    def _consume(self, item: EngineCoreOutputs | _RankDeath) -> EngineCoreOutputs:
        if isinstance(item, _RankDeath):
            ids = self.balancer.release_rank(item.rank)
            message = str(item.error)
            outputs = [EngineCoreOutput(i, [], finish_reason=FinishReason.ERROR, error=message) for i in ids]
            death = EngineDeathRecord(
                item.rank, type(item.error).__name__, message, item.error.traceback_tail
            )
            return EngineCoreOutputs(item.rank, outputs, finished_requests=set(ids) or None, death=death)
        self.balancer.update(item.engine_index, item.scheduler_stats, item.finished_requests)
        return item

    def _utility_targets(self, method: str) -> list[int]:
        self.ensure_alive()
        live = self.live_ranks
        if not live:
            raise self.resources.dead_error or EngineDeadError("Every data-parallel engine rank is dead.")
        if method in ("reset_prefix_cache", "sleep"):
            self.balancer.forget_prefixes()
        return live[:1] if method in SINGLE_RANK_UTILITIES else live

    def _register_utility(self, rank: int, future: Any) -> int:
        call_id = self._next_call_id()
        self.utility_results[call_id] = future
        self.utility_ranks[call_id] = rank
        error = self.resources.dead_ranks.get(rank)
        if error is not None:  # died between choosing targets and registering: nobody else fails it
            _fail_future(future, error)
        return call_id

    def _unregister_utilities(self, call_ids: list[int]) -> None:
        for call_id in call_ids:
            self.utility_results.pop(call_id, None)
            self.utility_ranks.pop(call_id, None)


class DPLBSyncMPClient(_DPLBClient, SyncMPClient):
    """Several engine ranks balanced by this synchronous client (LLM offline)."""

    def _start_output_reader(self) -> None:
        super()._start_output_reader()
        self.resources.on_rank_dead = _make_on_rank_dead(
            self.utility_results, self.utility_ranks, self.outputs_queue.put_nowait, lambda fn: fn()
        )

    def get_output(self, timeout: float | None = None) -> EngineCoreOutputs:
        return self._consume(super().get_output(timeout))

    def add_request(self, request: EngineCoreRequest) -> None:
        self._send_input(EngineCoreRequestType.ADD, request, self._route(request))

    def abort_requests(self, request_ids: list[str]) -> None:
        if self.resources.engine_dead:
            return
        for engine, ids in self._abort_groups(request_ids).items():
            self._send_input(EngineCoreRequestType.ABORT, ids, engine)

    def call_utility(self, method: str, *args: Any, timeout: float | None = None) -> Any:
        futures: dict[int, tuple[int, Future]] = {}
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            for rank in self._utility_targets(method):
                future: Future = Future()
                call_id = self._register_utility(rank, future)
                futures[call_id] = (rank, future)
                request = EngineCoreUtilityRequest(call_id, method, args)
                self._send_input(EngineCoreRequestType.UTILITY, request, engine_identity(rank))
            results = {}
            for rank, future in futures.values():
                remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
                results[rank] = future.result(timeout=remaining)
        except FutureTimeoutError:
            raise TimeoutError(f"Utility call {method!r} got no answer within {timeout} s.") from None
        finally:
            self._unregister_utilities(list(futures))
        return combine_utility_results(method, results)


class DPLBAsyncMPClient(_DPLBClient, AsyncMPClient):
    """Several engine ranks balanced by this asyncio client (AsyncLLM, the HTTP server)."""

    def _start_output_reader(self) -> None:
        super()._start_output_reader()
        resources, queue_box = self.resources, self._queue_box

        def deliver(fn: Callable[[], None]) -> None:
            loop = resources.loop
            if loop is None or _in_loop(loop) or loop.is_closed():
                fn()
            else:
                with contextlib.suppress(RuntimeError):
                    loop.call_soon_threadsafe(fn)

        resources.on_rank_dead = _make_on_rank_dead(
            self.utility_results, self.utility_ranks, lambda item: queue_box[0].put_nowait(item), deliver
        )

    async def get_output_async(self, timeout: float | None = None) -> EngineCoreOutputs:
        return self._consume(await super().get_output_async(timeout))

    async def add_request_async(self, request: EngineCoreRequest) -> None:
        self._send_input(EngineCoreRequestType.ADD, request, self._route(request))

    async def abort_requests_async(self, request_ids: list[str]) -> None:
        if self.resources.engine_dead:
            return
        for engine, ids in self._abort_groups(request_ids).items():
            self._send_input(EngineCoreRequestType.ABORT, ids, engine)

    async def call_utility_async(self, method: str, *args: Any, timeout: float | None = None) -> Any:
        self._ensure_output_task()
        loop = asyncio.get_running_loop()
        futures: dict[int, tuple[int, asyncio.Future]] = {}
        try:
            for rank in self._utility_targets(method):
                future = loop.create_future()
                call_id = self._register_utility(rank, future)
                futures[call_id] = (rank, future)
                request = EngineCoreUtilityRequest(call_id, method, args)
                self._send_input(EngineCoreRequestType.UTILITY, request, engine_identity(rank))
            ranks = [rank for rank, _ in futures.values()]
            gathered = asyncio.gather(*(future for _, future in futures.values()))
            values = await (gathered if timeout is None else asyncio.wait_for(gathered, timeout))
        except TimeoutError:
            raise TimeoutError(f"Utility call {method!r} got no answer within {timeout} s.") from None
        finally:
            self._unregister_utilities(list(futures))
        return combine_utility_results(method, dict(zip(ranks, values, strict=True)))


class DPAsyncMPClient(AsyncMPClient):
    """One rank (`data_parallel_rank`) of a data-parallel deployment; an external load balancer spreads
    requests over the frontends. Its engine carries the rank's identity; otherwise it is AsyncMPClient."""
