"""EngineLiveness alone: the restart budget over its window, one decision per incarnation, the crash-loop
error, listeners, and the end of the client."""

from __future__ import annotations

import pytest

from nanoserve.engine.core_client import liveness as liveness_module
from nanoserve.engine.core_client.liveness import EngineLiveness, RankState
from nanoserve.engine.exceptions import EngineDeadError


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch) -> Clock:
    clock = Clock()
    monkeypatch.setattr(liveness_module.time, "monotonic", clock)
    return clock


def killed(rank: int = 0) -> EngineDeadError:
    return EngineDeadError(None, engine_rank=rank, exit_code=-9)


def crashed(rank: int = 0) -> EngineDeadError:
    return EngineDeadError(None, engine_rank=rank, exit_code=1, exc_type="RuntimeError", exc_message="boom")


def test_no_budget_means_the_first_death_is_final():
    liveness = EngineLiveness([0])
    assert liveness.report_death(0, 0, killed()) is RankState.FINAL
    assert liveness.is_dead and str(liveness.dead_error) == "Engine core 0 is dead; killed by SIGKILL"
    assert liveness.dead_ranks() == {}  # one rank: its death is the client's


def test_budget_restarts_then_a_crash_loop_names_the_first_and_last_cause(clock):
    liveness = EngineLiveness([0], max_restarts=2, window_s=600)
    events = []
    liveness.add_listener(lambda rank, state, error, incarnation: events.append((rank, state, incarnation)))
    assert liveness.report_death(0, 0, killed()) is RankState.RESTARTING
    assert liveness.incarnation(0) == 1 and not liveness.accepts(0, 0) and liveness.accepts(0, 1)
    liveness.revived(0)
    clock.now += 10
    assert liveness.report_death(0, 1, crashed()) is RankState.RESTARTING
    clock.now += 10
    assert liveness.report_death(0, 2, crashed()) is RankState.FINAL  # a death during start-up counts
    error = liveness.dead_error
    assert error is not None and error.exit_code == 1 and error.exc_type == "RuntimeError"
    message = str(error)
    assert "died 3 times within 600 s" in message and "budget of 2 restart(s)" in message
    assert "First death: Engine core 0 is dead; killed by SIGKILL" in message
    assert message.endswith("Last death: Engine core 0 is dead; exit code 1: RuntimeError: boom")
    assert liveness.restart_counts() == {0: 2}
    assert events == [
        (0, RankState.RESTARTING, 0),
        (0, RankState.ALIVE, 1),
        (0, RankState.RESTARTING, 1),
        (0, RankState.FINAL, 2),
    ]


def test_the_window_forgets_old_restarts(clock):
    liveness = EngineLiveness([0], max_restarts=1, window_s=60)
    assert liveness.report_death(0, 0, killed()) is RankState.RESTARTING
    liveness.revived(0)
    clock.now += 61
    assert liveness.report_death(0, 1, killed()) is RankState.RESTARTING
    liveness.revived(0)
    clock.now += 30
    assert liveness.report_death(0, 2, killed()) is RankState.FINAL


def test_a_death_is_decided_once_and_later_reports_add_the_exit_code():
    liveness = EngineLiveness([0], max_restarts=1)
    early = EngineDeadError(None, engine_rank=0, exc_type="RuntimeError", exc_message="boom")  # death frame
    assert liveness.report_death(0, 0, early) is RankState.RESTARTING
    assert liveness.report_death(0, 0, crashed()) is RankState.RESTARTING  # the watcher, later
    assert early.exit_code == 1 and liveness.restart_counts() == {0: 1}
    assert liveness.report_death(0, 5, killed()) is RankState.RESTARTING  # not a current incarnation


def test_shutdown_ends_every_rank_without_restarting():
    liveness = EngineLiveness([0, 1], max_restarts=3)
    liveness.begin_shutdown()
    assert liveness.report_death(1, 0, killed(1)) is RankState.FINAL
    assert not liveness.is_dead and set(liveness.dead_ranks()) == {1}
    liveness.end(EngineDeadError("shut down"), shutting_down=True)
    assert liveness.is_dead and liveness.ranks_in(RankState.FINAL) == [0, 1]
    assert str(liveness.dead_ranks()[1]) == "Engine core 1 is dead; killed by SIGKILL"


def test_death_records_are_kept_per_incarnation():
    from nanoserve.wire.messages import EngineDeathRecord

    liveness = EngineLiveness([0], max_restarts=1)
    record = EngineDeathRecord(0, "RuntimeError", "boom")
    liveness.record_death(0, 0, record)
    assert liveness.death_record(0, 0) is record
    assert liveness.death_record(0, 1, wait_s=0.05) is None
