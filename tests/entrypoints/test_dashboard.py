"""The dashboard's stat logger on its own: bounded history, rates, per-rank rows, the snapshot's shape."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, cast

from nanoserve.config import EngineOptions
from nanoserve.engine.async_llm import AsyncLLM, FinishedRequestStats, IterationStats
from nanoserve.engine.exceptions import EngineDeadError
from nanoserve.entrypoints.openai.dashboard import (
    HISTORY_S,
    NUM_RECENT_REQUESTS,
    RATE_WINDOW_S,
    DashboardStatLogger,
)
from nanoserve.wire.messages import SchedulerStats


class Clock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


@dataclass
class FakeEngine:
    """What the snapshot reads of an AsyncLLM."""

    options: EngineOptions
    dead_ranks: dict[int, EngineDeadError] = field(default_factory=dict)
    dead_error: EngineDeadError | None = None
    restarting_ranks: list[int] = field(default_factory=list)
    max_model_len: int = 512

    @property
    def errored(self) -> bool:
        return self.dead_error is not None


def snapshot(logger: DashboardStatLogger, engine: FakeEngine) -> dict[str, Any]:
    return logger.snapshot(cast(AsyncLLM, engine))


def finished(i: int) -> FinishedRequestStats:
    return FinishedRequestStats(f"req-{i}", "stop", 0.5, 0.1, 10, i)


def test_history_is_bounded_and_rates_use_whole_seconds():
    clock = Clock()
    logger = DashboardStatLogger(clock)
    for second in range(HISTORY_S + 60):
        clock.now = 1000 + second + 0.5
        logger(None, IterationStats(num_prompt_tokens=1, num_generation_tokens=second))
        logger(None, IterationStats(num_generation_tokens=1))  # same second: added to it
    assert len(logger.seconds) == HISTORY_S + 1
    prompt, generated = logger.token_series()
    # the second still filling (the last one) is left out of the series and the rates
    assert generated == [second + 1 for second in range(59, HISTORY_S + 59)]
    assert prompt == [1] * HISTORY_S
    tokens = snapshot(logger, FakeEngine(EngineOptions()))["tokens"]
    assert tokens["generation_per_s"] == sum(generated[-RATE_WINDOW_S:]) / RATE_WINDOW_S
    assert tokens["prompt_per_s"] == 1.0

    clock.now += 30  # the second that was filling is whole now; idle seconds count as zeros
    assert logger.token_series()[1][-30:] == [HISTORY_S + 60] + [0] * 29


def test_series_starts_with_the_logger():
    clock = Clock()
    logger = DashboardStatLogger(clock)
    assert logger.token_series() == ([], [])
    clock.now += 5
    assert len(logger.token_series()[0]) == 5


def test_recent_requests_newest_first_and_bounded():
    clock = Clock()
    logger = DashboardStatLogger(clock)
    for i in range(NUM_RECENT_REQUESTS + 5):
        clock.now += 1
        logger(None, IterationStats(finished=[finished(i)]))
    recent = snapshot(logger, FakeEngine(EngineOptions()))["recent_requests"]
    assert len(recent) == NUM_RECENT_REQUESTS
    assert recent[0] == {
        "request_id": f"req-{NUM_RECENT_REQUESTS + 4}",
        "finish_reason": "stop",
        "finished_at": clock.now,
        "num_prompt_tokens": 10,
        "num_generation_tokens": NUM_RECENT_REQUESTS + 4,
        "time_to_first_token": 0.1,
        "e2e_latency": 0.5,
    }
    assert recent[-1]["request_id"] == "req-5"


def test_one_row_per_rank_and_dead_ranks_leave_the_totals():
    logger = DashboardStatLogger(Clock())
    logger(SchedulerStats(2, 1, 0.25, 100, 40), IterationStats(engine_index=0))
    logger(SchedulerStats(3, 0, 0.75, 100, 10), IterationStats(engine_index=1))
    engine = FakeEngine(EngineOptions(data_parallel_size=3, multiprocess_mode=True))
    snap = snapshot(logger, engine)
    assert snap["status"] == "serving" and snap["error"] is None
    assert [r["state"] for r in snap["ranks"]] == ["alive"] * 3
    assert (snap["num_running"], snap["num_waiting"]) == (5, 1)
    assert snap["kv_cache_usage"] == (0.25 + 0.75 + 0.0) / 3  # rank 2 has not reported: empty
    assert snap["prefix_cache_hit_rate"] == 50 / 200

    engine.dead_ranks = {1: EngineDeadError("Engine core 1 is dead; killed by SIGKILL", engine_rank=1)}
    snap = snapshot(logger, engine)
    assert snap["status"] == "degraded"
    dead = snap["ranks"][1]
    assert dead["state"] == "dead" and "SIGKILL" in dead["error"] and dead["num_running"] is None
    assert (snap["num_running"], snap["kv_cache_usage"]) == (2, 0.25 / 2)

    engine.restarting_ranks = [2]  # coming back after a death: out of the totals meanwhile
    snap = snapshot(logger, engine)
    assert snap["status"] == "restarting" and [r["state"] for r in snap["ranks"]] == [
        "alive",
        "dead",
        "restarting",
    ]
    assert snap["num_running"] == 2
    engine.restarting_ranks = []

    engine.dead_error = EngineDeadError("Engine core 0 is dead")
    snap = snapshot(logger, engine)
    assert snap["status"] == "dead" and "Engine core 0" in snap["error"]
    assert [r["state"] for r in snap["ranks"]] == ["dead"] * 3
    assert snap["num_running"] == 0 and snap["kv_cache_usage"] is None


def test_external_lb_frontend_shows_its_one_rank():
    options = EngineOptions(
        data_parallel_size=4, data_parallel_rank=2, data_parallel_external_lb=True, multiprocess_mode=True
    )
    assert [r["rank"] for r in snapshot(DashboardStatLogger(Clock()), FakeEngine(options))["ranks"]] == [2]
