"""ReplayLedger: what a restarted engine rank must be told to carry on where the dead one stopped.

Per rank: every unfinished request it was sent, with the output tokens the client has passed on to
the frontend so far; the sleep level it was put in; and the utility calls made while it was
restarting. An entry goes when its request finishes or is aborted, so memory is O(in-flight tokens).
On a restart each request is sent again with those tokens as `resumed_output_token_ids`: the engine
generates what follows them, and the frontend, which already has them, sees the rest and nothing twice.

With restarts disabled (`engine_restarts=0`) nothing is recorded. The ledger is not thread-safe on its
own: the client changes it under the liveness lock, so that what it records agrees with what the ranks'
states and the reader let through (see `MPClient`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import msgspec

from nanoserve.wire.messages import EngineCoreOutputs, EngineCoreRequest, EngineCoreUtilityRequest


@dataclass
class LedgerEntry:
    rank: int
    request: EngineCoreRequest
    token_ids: list[int] = field(default_factory=list)
    """Output tokens passed on to the frontend."""


class ReplayLedger:
    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.entries: dict[str, LedgerEntry] = {}
        self.sleep_levels: dict[int, int] = {}
        self.held_utilities: dict[int, list[EngineCoreUtilityRequest]] = {}

    def add(self, rank: int, request: EngineCoreRequest) -> None:
        if self.enabled:
            self.entries[request.request_id] = LedgerEntry(rank, request)

    def discard(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            self.entries.pop(request_id, None)

    def record(self, outputs: EngineCoreOutputs) -> None:
        """Outputs on their way to the frontend."""
        if not self.entries:
            return
        entries = self.entries
        for output in outputs.outputs:
            entry = entries.get(output.request_id)
            if entry is None:
                continue
            if output.finish_reason is not None:
                del entries[output.request_id]
            else:
                entry.token_ids.extend(output.new_token_ids)
        for request_id in outputs.finished_requests or ():
            entries.pop(request_id, None)

    def resumed_requests(self, rank: int) -> list[EngineCoreRequest]:
        """The rank's unfinished requests, each carrying the tokens already delivered."""
        return [
            msgspec.structs.replace(entry.request, resumed_output_token_ids=list(entry.token_ids) or None)
            for entry in self.entries.values()
            if entry.rank == rank
        ]

    def drop_rank(self, rank: int) -> None:
        """The rank is dead for good: its requests fail, nothing of it will be replayed."""
        self.entries = {rid: entry for rid, entry in self.entries.items() if entry.rank != rank}
        self.held_utilities.pop(rank, None)

    def note_sleep(self, rank: int, level: int) -> None:
        if self.enabled:
            self.sleep_levels[rank] = level

    def hold_utility(self, rank: int, request: EngineCoreUtilityRequest) -> None:
        """A utility call for a rank that is restarting: sent once it is back."""
        self.held_utilities.setdefault(rank, []).append(request)

    def take_held_utilities(self, rank: int) -> list[EngineCoreUtilityRequest]:
        return self.held_utilities.pop(rank, [])
