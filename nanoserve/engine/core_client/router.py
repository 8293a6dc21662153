"""EngineRouter: which engine rank a multiprocess client talks to, for what.

A client composes one router: `SingleRankRouter` for one engine (or one rank of several, behind an
external load balancer), `BalancedRouter` (dp.py) for several ranks balanced by this client. The
router picks the rank of each new request, groups aborts by the rank that holds them, names the ranks a
utility call goes to and combines their answers, and turns what the reader queued into the outputs the
frontend reads (for several ranks: a `RankDeath` becomes one ERROR output per request the rank held).
The client calls it under the liveness lock wherever a choice must agree with the ranks' states.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from nanoserve.engine.core_client.liveness import EngineLiveness
from nanoserve.engine.exceptions import EngineDeadError
from nanoserve.wire.messages import EngineCoreOutputs, EngineCoreRequest

if TYPE_CHECKING:
    from nanoserve.engine.core_client.launch import EngineZmqAddresses, SocketHost
    from nanoserve.engine.core_client.mp import BackgroundResources


@dataclass
class RankDeath:
    """Queued for the frontend when one rank of several is dead for good: fail what it held."""

    rank: int
    error: EngineDeadError


class EngineRouter(Protocol):
    ranks: list[int]

    def start(self, resources: BackgroundResources, host: SocketHost, addresses: EngineZmqAddresses) -> None:
        """Before the engines start (the balancing router starts its coordinator here)."""
        ...

    def choose(self, request: EngineCoreRequest, liveness: EngineLiveness) -> int: ...

    def owners(self, request_ids: list[str]) -> dict[int, list[str]]:
        """The ranks holding these requests (unknown ids, already finished, are left out)."""
        ...

    def released(self, request_ids: list[str]) -> None:
        """These requests were dropped without the engine hearing of it (aborted while it restarted)."""
        ...

    def utility_targets(self, method: str, liveness: EngineLiveness) -> list[int]: ...

    def combine(self, method: str, results: dict[int, Any]) -> Any: ...

    def consume(self, item: EngineCoreOutputs | RankDeath) -> EngineCoreOutputs: ...


class SingleRankRouter:
    """Everything goes to the one rank."""

    def __init__(self, rank: int) -> None:
        self.ranks = [rank]

    def start(self, resources: BackgroundResources, host: SocketHost, addresses: EngineZmqAddresses) -> None:
        pass

    def choose(self, request: EngineCoreRequest, liveness: EngineLiveness) -> int:
        return self.ranks[0]

    def owners(self, request_ids: list[str]) -> dict[int, list[str]]:
        return {self.ranks[0]: list(request_ids)}

    def released(self, request_ids: list[str]) -> None:
        pass

    def utility_targets(self, method: str, liveness: EngineLiveness) -> list[int]:
        return list(self.ranks)

    def combine(self, method: str, results: dict[int, Any]) -> Any:
        return results[self.ranks[0]]

    def consume(self, item: EngineCoreOutputs | RankDeath) -> EngineCoreOutputs:
        assert not isinstance(item, RankDeath)  # one rank's death is the client's: an error, not a marker
        return item
