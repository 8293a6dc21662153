"""OutputDispatch: what both multiprocess clients do with each message from the output PULL socket.

The readers (a thread for `SyncMPClient`, an asyncio task for `AsyncMPClient`) only move frames; this
decides what they mean, in arrival order:
  - the single frame `ENGINE_CORE_DEAD`: the rank whose death record came just before has died (a PULL
    socket does not say which peer sent a frame); reported to the liveness at once, before the
    watcher sees the process end;
  - a utility answer: completes the caller's future;
  - a death record: kept by the liveness, for whoever builds the death's error;
  - anything else: outputs for the frontend, passed on (and entered in the replay ledger) only if they
    come from the rank's current incarnation. The check and the hand-over happen under the liveness
    lock, so a restart's replay and what the frontend was given always agree: a message of a dead
    incarnation that arrives late is dropped, and the restarted engine regenerates what it carried.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import zmq

from nanoserve.engine.core_client.launch import EngineManager, dead_error
from nanoserve.engine.core_client.ledger import ReplayLedger
from nanoserve.engine.core_client.liveness import EngineLiveness, RankState
from nanoserve.engine.core_client.utilities import UtilityCalls
from nanoserve.engine.exceptions import EngineDeadError
from nanoserve.wire.codec import MsgpackDecoder
from nanoserve.wire.messages import ENGINE_CORE_DEAD, EngineCoreOutputs, EngineDeathRecord


def is_death_frame(frames: Sequence[Any]) -> bool:
    if len(frames) != 1 or len(frames[0]) != len(ENGINE_CORE_DEAD):
        return False
    frame = frames[0]
    return (frame.bytes if isinstance(frame, zmq.Frame) else bytes(frame)) == ENGINE_CORE_DEAD


class OutputDispatch:
    def __init__(
        self,
        liveness: EngineLiveness,
        ledger: ReplayLedger,
        utilities: UtilityCalls,
        manager: EngineManager,
        deliver: Callable[[EngineCoreOutputs], None],
    ) -> None:
        self.liveness = liveness
        self.ledger = ledger
        self.utilities = utilities
        self.manager = manager
        self.deliver = deliver
        """Hands outputs to the frontend's queue (on the reader's own thread or loop)."""
        self.decoder = MsgpackDecoder(EngineCoreOutputs)
        self._last_record: tuple[int, int, EngineDeathRecord] | None = None

    def __call__(self, frames: Sequence[Any]) -> None:
        if is_death_frame(frames):
            self._on_death_frame()
            return
        outputs: EngineCoreOutputs = self.decoder.decode(frames)
        rank, incarnation = outputs.engine_index, outputs.incarnation
        if outputs.utility_output is not None:
            self.utilities.resolve(outputs.utility_output)
        elif outputs.death is not None:
            self.liveness.record_death(rank, incarnation, outputs.death)
            self._last_record = (rank, incarnation, outputs.death)
        else:
            with self.liveness.lock:
                if self.liveness.accepts(rank, incarnation):
                    self.liveness.output_arrived(rank)
                    self.ledger.record(outputs)
                    self.deliver(outputs)

    def _on_death_frame(self) -> None:
        last, self._last_record = self._last_record, None
        if last is None:
            if len(self.liveness.ranks) > 1:
                return  # cannot tell which rank: its watcher will see it end
            rank = self.liveness.ranks[0]
            incarnation, record = self.liveness.incarnation(rank), None
        else:
            rank, incarnation, record = last
        if self.liveness.state(rank) is RankState.RESTARTING:
            return  # a restart's start-up failed: its watcher, waiting on it, reports that
        error = dead_error(rank, self.manager.exit_code(rank), record)
        self.liveness.report_death(rank, incarnation, error)

    def socket_failed(self, e: Exception) -> None:
        """The output socket itself broke: the engines can no longer be heard, restarts or not."""
        if self.liveness.closing:
            return
        error = EngineDeadError(f"The engine core output socket failed: {type(e).__name__}: {e}")
        error.__cause__ = e
        self.liveness.end(error)
