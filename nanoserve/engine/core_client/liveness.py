"""EngineLiveness: where each engine rank of a client stands, in one object.

    ALIVE --death, within the restart budget--> RESTARTING --ready again--> ALIVE
    ALIVE or RESTARTING --death past the budget, or shutdown, or a broken output socket--> FINAL

A rank's death is decided once per incarnation (its n-th start). Whoever notices first reports it: the
reader on the death frame, the rank's watcher when the process or actor ends, or the shutdown; a later
report of the same death only adds what it knows (the exit code). Every decision moves the rank to its
next incarnation number, so that messages still in flight from the dead one are recognized and dropped.
The budget: at most `max_restarts` restarts within any `window_s` seconds; a death during a restarted
engine's start-up counts like any other. The client is dead once every rank is FINAL.

Listeners hear of each decision and revival, on the thread that made it, outside the lock. The lock is
also the one under which the client keeps the replay ledger and its sends in step with the ranks'
states (see `MPClient`); it is reentrant so that code holding it may still ask for a rank's state.
"""

from __future__ import annotations

import collections
import enum
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from nanoserve.engine.exceptions import EngineDeadError
from nanoserve.wire.messages import EngineDeathRecord

logger = logging.getLogger(__name__)


class RankState(enum.Enum):
    ALIVE = "alive"
    RESTARTING = "restarting"
    FINAL = "final"


@dataclass
class RankLife:
    state: RankState = RankState.ALIVE
    incarnation: int = 0
    error: EngineDeadError | None = None
    """The death being recovered from (RESTARTING) or the one that ended the rank (FINAL)."""
    deaths: collections.deque[tuple[float, EngineDeadError]] = field(default_factory=collections.deque)
    """Deaths that were followed by a restart, within the window."""
    num_restarts: int = 0
    records: dict[int, EngineDeathRecord] = field(default_factory=dict)
    """Incarnation -> the death record it sent (why it failed, when it could still tell)."""
    last_output_at: float = 0.0
    """time.monotonic() when the dispatch last handed on an output of this rank."""


Listener = Callable[[int, RankState, EngineDeadError | None, int], None]
"""(rank, new state, the death's error or None on revival, the incarnation that ended or started)."""


class EngineLiveness:
    def __init__(self, ranks: list[int], max_restarts: int = 0, window_s: float = 600.0) -> None:
        self.ranks = list(ranks)
        self.max_restarts = max_restarts
        self.window_s = window_s
        self.lock = threading.RLock()
        self.lives = {rank: RankLife() for rank in ranks}
        self.closing = False
        """Set by shutdown: deaths from now on are final and nobody restarts."""
        self.dead_error: EngineDeadError | None = None
        """Once every rank is FINAL: why (the last rank's error)."""
        self.revived_at = 0.0
        """time.monotonic() of the last revival (a hang clock must not count the restart)."""
        self._records_changed = threading.Condition(self.lock)
        self._listeners: list[Listener] = []

    def add_listener(self, listener: Listener) -> None:
        self._listeners.append(listener)

    # -- reading -------------------------------------------------------------------------------

    def state(self, rank: int) -> RankState:
        return self.lives[rank].state

    def incarnation(self, rank: int) -> int:
        return self.lives[rank].incarnation

    def accepts(self, rank: int, incarnation: int) -> bool:
        """Whether a message from this incarnation of the rank is current (else: from a dead one)."""
        life = self.lives.get(rank)
        return life is not None and life.incarnation == incarnation and life.state is not RankState.FINAL

    @property
    def is_dead(self) -> bool:
        return self.dead_error is not None

    def ranks_in(self, state: RankState) -> list[int]:
        return [rank for rank, life in self.lives.items() if life.state is state]

    def dead_ranks(self) -> dict[int, EngineDeadError]:
        """With several ranks: those dead for good, with why. Empty with one rank (its death is the
        client's, `dead_error`)."""
        if len(self.ranks) == 1:
            return {}
        return {
            r: life.error for r, life in self.lives.items() if life.state is RankState.FINAL and life.error
        }

    def restart_counts(self) -> dict[int, int]:
        return {rank: life.num_restarts for rank, life in self.lives.items()}

    def error(self, rank: int) -> EngineDeadError | None:
        return self.lives[rank].error

    # -- death records -------------------------------------------------------------------------

    def record_death(self, rank: int, incarnation: int, record: EngineDeathRecord) -> None:
        """The engine's own account of its death, from the output socket."""
        with self.lock:
            life = self.lives.get(rank)
            if life is not None:
                life.records[incarnation] = record
                self._records_changed.notify_all()

    def death_record(self, rank: int, incarnation: int, wait_s: float = 0.0) -> EngineDeathRecord | None:
        """The record that incarnation sent, waiting up to `wait_s` for it to arrive."""
        deadline = time.monotonic() + wait_s
        with self.lock:
            life = self.lives[rank]
            while incarnation not in life.records and (remaining := deadline - time.monotonic()) > 0:
                self._records_changed.wait(remaining)
            return life.records.get(incarnation)

    def output_arrived(self, rank: int) -> None:
        """Called by the dispatch (under the lock) for each output it hands on."""
        self.lives[rank].last_output_at = time.monotonic()

    def wait_for_quiet_outputs(self, rank: int, quiet_s: float, limit_s: float) -> None:
        """Wait, up to `limit_s`, until the rank's outputs have stopped arriving for `quiet_s`.

        A process that exited has sent its last outputs, but they may still be on their way through
        the output socket; a death reported first would make them stale (dropped), so a drained
        request's last tokens would be lost behind the EngineDeadError.
        """
        deadline = time.monotonic() + limit_s
        while (now := time.monotonic()) < deadline:
            with self.lock:
                silent_for = now - self.lives[rank].last_output_at
            if silent_for >= quiet_s:
                return
            time.sleep(min(quiet_s - silent_for, deadline - now))

    # -- transitions ---------------------------------------------------------------------------

    def report_death(self, rank: int, incarnation: int, error: EngineDeadError) -> RankState:
        """Decide what this incarnation's death means: a restart while the budget lasts, else the end.
        Returns the rank's state after the report (an old or repeated report decides nothing)."""
        with self.lock:
            life = self.lives[rank]
            if incarnation != life.incarnation or life.state is RankState.FINAL:
                if incarnation == life.incarnation - 1 or life.state is RankState.FINAL:
                    _add_exit_code(life.error, error.exit_code)
                return life.state
            life.records.pop(incarnation - 1, None)  # what older incarnations sent is not needed now
            now = time.monotonic()
            while life.deaths and now - life.deaths[0][0] > self.window_s:
                life.deaths.popleft()
            if not self.closing and len(life.deaths) < self.max_restarts:
                life.deaths.append((now, error))
                life.num_restarts += 1
                state = RankState.RESTARTING
            else:
                state = RankState.FINAL
                if life.deaths:
                    error = self._crash_loop_error(rank, life.deaths[0][1], error, len(life.deaths) + 1)
            life.state, life.error = state, error
            life.incarnation += 1
            if state is RankState.FINAL and all(
                other.state is RankState.FINAL for other in self.lives.values()
            ):
                self.dead_error = error
            closing = self.closing
        if state is RankState.RESTARTING:
            logger.warning("%s; restarting it (restart %d of %d)", error, len(life.deaths), self.max_restarts)
        elif not closing:
            others = "; the other engine ranks keep serving" if self.dead_error is None else ""
            logger.error("%s%s", error, others)
        self._notify(rank, state, error, incarnation)
        return state

    def revived(self, rank: int) -> None:
        """A restarted rank is ready and has been sent what it must resume."""
        with self.lock:
            life = self.lives[rank]
            if life.state is not RankState.RESTARTING:
                return
            life.state = RankState.ALIVE
            self.revived_at = time.monotonic()
        logger.info("engine core %d is back (incarnation %d)", rank, life.incarnation)
        self._notify(rank, RankState.ALIVE, None, life.incarnation)

    def end(self, error: EngineDeadError, *, shutting_down: bool = False) -> None:
        """Every rank dead for good: the client is being shut down, or can no longer hear its engines."""
        with self.lock:
            self.closing = self.closing or shutting_down
            ended = [rank for rank, life in self.lives.items() if life.state is not RankState.FINAL]
            for rank in ended:
                life = self.lives[rank]
                life.state, life.error = RankState.FINAL, error
                life.incarnation += 1
            if self.dead_error is None:
                self.dead_error = error
        if ended and not shutting_down:
            logger.error("%s", error)
        for rank in ended:
            self._notify(rank, RankState.FINAL, error, self.lives[rank].incarnation - 1)

    def begin_shutdown(self) -> None:
        """From now on a death is final: nobody restarts an engine the client is stopping."""
        with self.lock:
            self.closing = True

    def _notify(self, rank: int, state: RankState, error: EngineDeadError | None, incarnation: int) -> None:
        for listener in self._listeners:
            try:
                listener(rank, state, error, incarnation)
            except Exception:
                logger.exception("engine liveness listener failed")

    def _crash_loop_error(
        self, rank: int, first: EngineDeadError, last: EngineDeadError, num_deaths: int
    ) -> EngineDeadError:
        return EngineDeadError(
            f"Engine core {rank} died {num_deaths} times within {self.window_s:g} s, past its budget of "
            f"{self.max_restarts} restart(s). First death: {first}. "
            f"Last death: {last.base_message or f'Engine core {rank} is dead'}",
            engine_rank=rank,
            exit_code=last.exit_code,
            exc_type=last.exc_type,
            exc_message=last.exc_message,
            traceback_tail=last.traceback_tail,
        )


def _add_exit_code(error: EngineDeadError | None, exit_code: int | None) -> None:
    """A later report of a death knows the exit code the first one could not."""
    if error is not None and error.exit_code is None and exit_code is not None:
        error.exit_code = exit_code
