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

All of this is the `BalancedRouter` the clients below are composed with; each client is its sync or
asyncio base with that router, nothing more.

A rank that restarts (`engine_restarts`) keeps its requests: they resume on it once it is back, while
new requests go to the ranks that are alive. A rank dead for good: its pending utility calls fail at
once; a marker on the output queue becomes, when the frontend next reads outputs, one ERROR output per
request the rank held, carrying the `EngineDeadError` text that names the rank, so every frontend
finishes those requests through its ordinary output path. That batch also carries `death`
(frontend-side only: never on the wire past the reader), so a frontend that raises errors rather than
returning them (AsyncLLM) can tell these requests from ones the engine refused, and raise the rank's
`EngineDeadError` from `dead_rank_errors()`. New requests and utility calls go to the live ranks only.
When the last rank dies the client is dead exactly as with one engine.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Container
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from nanoserve.config import EngineOptions
from nanoserve.engine.core_client.async_mp import AsyncMPClient
from nanoserve.engine.core_client.coordinator import LoadSubscriber, start_coordinator
from nanoserve.engine.core_client.liveness import EngineLiveness, RankState
from nanoserve.engine.core_client.router import RankDeath
from nanoserve.engine.core_client.sync_mp import SyncMPClient
from nanoserve.engine.exceptions import EngineDeadError
from nanoserve.wire.messages import (
    DPLoadUpdate,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineDeathRecord,
    FinishReason,
    SchedulerStats,
)

if TYPE_CHECKING:
    from nanoserve.engine.core_client.launch import EngineZmqAddresses, SocketHost
    from nanoserve.engine.core_client.mp import BackgroundResources

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

    def release(self, request_ids: list[str]) -> None:
        """Forget requests no engine will report finished."""
        with self._lock:
            for request_id in request_ids:
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


class BalancedRouter:
    """The `EngineRouter` of the balancing clients: every rank of `data_parallel_size`, requests placed by
    a `DPLoadBalancer` fed by the coordinator and by the engines' own outputs."""

    def __init__(self, options: EngineOptions) -> None:
        self.options = options
        self.ranks = list(range(options.data_parallel_size))
        self.balancer = DPLoadBalancer(self.ranks, options.block_size)
        self.load_subscriber: LoadSubscriber | None = None

    def start(self, resources: BackgroundResources, host: SocketHost, addresses: EngineZmqAddresses) -> None:
        """Start the coordinator before the engines: they connect to its stats socket."""
        keys = addresses.keys
        proc, stats_address, publish_address = start_coordinator(
            self.ranks,
            host.transport,
            self.options.engine_start_method,
            host.bind,
            None if keys is None else keys.server_side(),
        )
        resources.coordinator = proc
        resources.ipc_paths += [
            a.removeprefix("ipc://") for a in (stats_address, publish_address) if a.startswith("ipc://")
        ]
        addresses.stats = host.endpoint(stats_address)
        self.load_subscriber = LoadSubscriber(
            resources.ctx,
            publish_address,
            self.balancer.apply_update,
            lambda: resources.closed,
            None if keys is None else keys.frontend_client(),
        )
        resources.own(self.load_subscriber.thread)

    def choose(self, request: EngineCoreRequest, liveness: EngineLiveness) -> int:
        """The lightest alive rank; a restarting one only when none is alive (it gets it on its return)."""
        final = set(liveness.ranks_in(RankState.FINAL))
        restarting = set(liveness.ranks_in(RankState.RESTARTING))
        if len(final) + len(restarting) < len(self.ranks):
            return self.balancer.choose(request, final | restarting)
        return self.balancer.choose(request, final)

    def owners(self, request_ids: list[str]) -> dict[int, list[str]]:
        groups: dict[int, list[str]] = {}
        for request_id in request_ids:
            rank = self.balancer.owner(request_id)
            if rank is not None:  # unknown: finished already
                groups.setdefault(rank, []).append(request_id)
        return groups

    def released(self, request_ids: list[str]) -> None:
        self.balancer.release(request_ids)

    def utility_targets(self, method: str, liveness: EngineLiveness) -> list[int]:
        live = [rank for rank in self.ranks if liveness.state(rank) is not RankState.FINAL]
        if method in ("reset_prefix_cache", "sleep"):
            self.balancer.forget_prefixes()
        return live[:1] if method in SINGLE_RANK_UTILITIES else live

    def combine(self, method: str, results: dict[int, Any]) -> Any:
        return combine_utility_results(method, results)

    def consume(self, item: EngineCoreOutputs | RankDeath) -> EngineCoreOutputs:
        if isinstance(item, RankDeath):
            ids = self.balancer.release_rank(item.rank)
            message = str(item.error)
            outputs = [EngineCoreOutput(i, [], finish_reason=FinishReason.ERROR, error=message) for i in ids]
            death = EngineDeathRecord(
                item.rank, type(item.error).__name__, message, item.error.traceback_tail
            )
            return EngineCoreOutputs(item.rank, outputs, finished_requests=set(ids) or None, death=death)
        self.balancer.update(item.engine_index, item.scheduler_stats, item.finished_requests)
        return item


class DPLBSyncMPClient(SyncMPClient):
    """Several engine ranks balanced by this synchronous client (LLM offline)."""

    def __init__(self, options: EngineOptions) -> None:
        router = BalancedRouter(options)
        super().__init__(options, router)
        self.balancer = router.balancer


class DPLBAsyncMPClient(AsyncMPClient):
    """Several engine ranks balanced by this asyncio client (AsyncLLM, the HTTP server)."""

    def __init__(self, options: EngineOptions) -> None:
        router = BalancedRouter(options)
        super().__init__(options, router)
        self.balancer = router.balancer


class DPAsyncMPClient(AsyncMPClient):
    """One rank (`data_parallel_rank`) of a data-parallel deployment; an external load balancer spreads
    requests over the frontends. Its engine carries the rank's identity; otherwise it is AsyncMPClient."""
