"""RankWatcher: one thread per engine rank that waits for the rank to end and carries out what follows.

An end the client did not ask for (anything before shutdown) is a death. The watcher builds its
`EngineDeadError` (exit code or signal, and the engine's death record when it sent one) and reports it
to the liveness. When the answer is RESTARTING it brings the rank back:
  1. respawn it as its next incarnation, on the same rank and sockets (`EngineManager.restart`);
  2. wait for it to be ready, under the same deadline as a first start;
  3. under the liveness lock, send it what the ledger says it must resume: its sleep level first (a
     sleeping engine holds the requests it is sent, as the dead one did), every unfinished request
     with the tokens already delivered, then the utility calls made while it was away; and mark it
     ALIVE in the same critical section, so no request sent meanwhile is missed or sent twice.
A death during that start-up (or a start-up that hangs past the deadline, which is then killed) is a
death like any other: reported, and restarted again while the budget lasts. Once a rank is FINAL its
watcher ends; when it was the last one, the watcher stops whatever is left of the engines.
"""

from __future__ import annotations

import logging
import multiprocessing.connection
import threading
from concurrent.futures import Future

import zmq

from nanoserve.engine.core_client.engine_input import EngineInput
from nanoserve.engine.core_client.launch import (
    DEATH_RECORD_WAIT_S,
    KILL_WAIT_S,
    REAP_WAIT_S,
    EngineManager,
    dead_error,
    wait_for_engine_startup,
)
from nanoserve.engine.core_client.ledger import ReplayLedger
from nanoserve.engine.core_client.liveness import EngineLiveness, RankState
from nanoserve.engine.core_client.utilities import UtilityCalls
from nanoserve.engine.exceptions import EngineDeadError
from nanoserve.wire.messages import EngineCoreRequestType, EngineCoreUtilityRequest

logger = logging.getLogger(__name__)

OUTPUT_QUIET_S = 0.25
"""A dead rank's outputs count as all arrived once none has come for this long..."""
OUTPUT_SETTLE_S = 2.0
"""...or after this long in all (a rank that streamed until its death)."""


class RankWatcher:
    def __init__(
        self,
        rank: int,
        manager: EngineManager,
        liveness: EngineLiveness,
        ledger: ReplayLedger,
        utilities: UtilityCalls,
        engine_input: EngineInput,
    ) -> None:
        self.rank = rank
        self.manager = manager
        self.liveness = liveness
        self.ledger = ledger
        self.utilities = utilities
        self.engine_input = engine_input
        self.thread = threading.Thread(target=self._run, name=f"EngineCoreWatcher_{rank}", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def _run(self) -> None:
        rank, liveness = self.rank, self.liveness
        watched = 0
        """The incarnation whose process (or actor) is running now."""
        while True:
            multiprocessing.connection.wait([self.manager.sentinel(rank)])
            if liveness.closing:
                return
            state = liveness.report_death(rank, watched, self._death_error(watched))
            while state is RankState.RESTARTING:
                watched = liveness.incarnation(rank)
                state = self._revive(watched)
            if state is RankState.FINAL:
                if liveness.is_dead and not liveness.closing:
                    self.manager.shutdown()  # stop whatever is left
                return

    def _death_error(self, incarnation: int) -> EngineDeadError:
        exit_code = self.manager.wait(self.rank, REAP_WAIT_S)
        self.liveness.wait_for_quiet_outputs(self.rank, OUTPUT_QUIET_S, OUTPUT_SETTLE_S)
        # a crash, not a kill: its death record may still be on its way through the output socket
        wait_s = DEATH_RECORD_WAIT_S if exit_code is None or exit_code > 0 else 0.0
        record = self.liveness.death_record(self.rank, incarnation, wait_s) or self.manager.death_record(
            self.rank
        )
        return dead_error(self.rank, exit_code, record)

    def _revive(self, incarnation: int) -> RankState:
        """Start the rank as `incarnation` and hand it its work; the rank's state after the attempt."""
        rank, liveness = self.rank, self.liveness
        try:
            self.manager.restart(rank, incarnation)
            wait_for_engine_startup(
                self.engine_input,
                self.manager,
                {rank: incarnation},
                lambda r: liveness.death_record(r, incarnation, DEATH_RECORD_WAIT_S),
                cancelled=lambda: liveness.closing or liveness.incarnation(rank) != incarnation,
            )
        except TimeoutError as e:
            self.manager.kill(rank)
            self.manager.wait(rank, KILL_WAIT_S)
            return liveness.report_death(rank, incarnation, EngineDeadError(str(e), engine_rank=rank))
        except EngineDeadError as e:
            return liveness.report_death(rank, incarnation, e)
        except Exception as e:  # the launcher itself failed (e.g. Ray could not create the actor)
            self.manager.kill(rank)
            error = EngineDeadError(f"Engine core {rank} could not be restarted: {type(e).__name__}: {e}")
            return liveness.report_death(rank, incarnation, error)
        try:
            self._hand_over(incarnation)
        except zmq.ZMQError:
            pass  # the input socket is closed: the client is shutting down
        return liveness.state(rank)

    def _hand_over(self, incarnation: int) -> None:
        rank, liveness, ledger, send = self.rank, self.liveness, self.ledger, self.engine_input.send
        with liveness.lock:
            if liveness.state(rank) is not RankState.RESTARTING or liveness.incarnation(rank) != incarnation:
                return  # it died again (or the client is closing) while we waited
            level = ledger.sleep_levels.get(rank, 0)
            if level:
                send(rank, EngineCoreRequestType.UTILITY, self._restore_sleep(incarnation, level))
            requests = ledger.resumed_requests(rank)
            if requests:
                send(rank, EngineCoreRequestType.ADD, requests)
            for utility in ledger.take_held_utilities(rank):
                send(rank, EngineCoreRequestType.UTILITY, utility)
            liveness.revived(rank)
        logger.info("engine core %d resumes %d request(s)", rank, len(requests))

    def _restore_sleep(self, incarnation: int, level: int) -> EngineCoreUtilityRequest:
        """sleep(level) for the new engine; it has no requests yet, so mode "abort" aborts nothing."""
        future: Future = Future()
        future.add_done_callback(_log_restore_failure)
        call_id = self.utilities.register(self.rank, incarnation, future)
        return EngineCoreUtilityRequest(call_id, "sleep", (level, "abort"))


def _log_restore_failure(future: Future) -> None:
    error = None if future.cancelled() else future.exception()
    if error is not None and not isinstance(error, EngineDeadError):  # a death speaks for itself
        logger.error("a restarted engine core could not be put back to sleep: %s", error)
