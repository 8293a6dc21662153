"""What the web page's dashboard shows: the engine's last minutes, kept in bounded ring buffers.

A `DashboardStatLogger` is one of AsyncLLM's stat loggers (like the Prometheus one): it is called on the
event loop after each batch of engine outputs and keeps, per second, the prompt and generated tokens of
the last `HISTORY_S` seconds, each rank's latest scheduler stats, and the last finished requests.
`snapshot(engine)` turns that into the JSON the page polls; it runs on the same loop, so no locks.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from nanoserve.engine.async_llm import AsyncLLM, IterationStats
from nanoserve.wire.messages import SchedulerStats

HISTORY_S = 300
"""Seconds of token counts the charts show."""
RATE_WINDOW_S = 10
"""The tok/s figures are averages over this many of the last whole seconds."""
NUM_RECENT_REQUESTS = 50


@dataclass
class RecentRequest:
    request_id: str
    finish_reason: str
    finished_at: float
    """Unix time, for the page to show in local time."""
    num_prompt_tokens: int
    num_generation_tokens: int
    time_to_first_token: float | None
    e2e_latency: float


class DashboardStatLogger:
    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self.clock = clock
        self.start_second = int(clock())
        self.seconds: collections.deque[list[int]] = collections.deque(maxlen=HISTORY_S + 1)
        """[second, prompt tokens, generated tokens], one entry per second that had any (the last
        HISTORY_S whole seconds and the one still filling)."""
        self.rank_stats: dict[int, SchedulerStats] = {}
        self.recent: collections.deque[RecentRequest] = collections.deque(maxlen=NUM_RECENT_REQUESTS)

    def __call__(self, scheduler_stats: SchedulerStats | None, stats: IterationStats) -> None:
        now = self.clock()
        if scheduler_stats is not None:
            self.rank_stats[stats.engine_index] = scheduler_stats
        if stats.num_prompt_tokens or stats.num_generation_tokens:
            second = int(now)
            if not self.seconds or self.seconds[-1][0] != second:
                self.seconds.append([second, 0, 0])
            self.seconds[-1][1] += stats.num_prompt_tokens
            self.seconds[-1][2] += stats.num_generation_tokens
        for f in stats.finished:
            self.recent.appendleft(
                RecentRequest(
                    f.request_id,
                    f.finish_reason,
                    now,
                    f.num_prompt_tokens,
                    f.num_generation_tokens,
                    f.time_to_first_token,
                    f.e2e_latency,
                )
            )

    def token_series(self) -> tuple[list[int], list[int]]:
        """Prompt and generated tokens in each whole second of the last HISTORY_S (or since the start),
        oldest first."""
        end = int(self.clock())  # the current second is still filling: left out
        by_second = {second: (prompt, generated) for second, prompt, generated in self.seconds}
        start = max(end - HISTORY_S, self.start_second)
        rows = [by_second.get(second, (0, 0)) for second in range(start, end)]
        return [p for p, _ in rows], [g for _, g in rows]

    def snapshot(self, engine: AsyncLLM) -> dict[str, Any]:
        states = rank_states(engine)
        alive = [
            self.rank_stats.get(rank, SchedulerStats()) for rank, state in states.items() if state == "alive"
        ]
        every = list(self.rank_stats.values())
        queries = sum(s.prefix_cache_queries for s in every)
        prompt, generated = self.token_series()
        dead = engine.dead_ranks
        return {
            "max_model_len": engine.max_model_len,
            "status": "dead"
            if engine.errored
            else "restarting"
            if engine.restarting_ranks
            else "degraded"
            if dead
            else "serving",
            "error": str(engine.dead_error) if engine.dead_error is not None else None,
            "num_running": sum(s.num_running_reqs for s in alive),
            "num_waiting": sum(s.num_waiting_reqs for s in alive),
            "kv_cache_usage": sum(s.kv_cache_usage for s in alive) / len(alive) if alive else None,
            "prefix_cache_hit_rate": sum(s.prefix_cache_hits for s in every) / queries if queries else None,
            "tokens": {
                "interval_s": 1,
                "prompt": prompt,
                "generation": generated,
                "prompt_per_s": sum(prompt[-RATE_WINDOW_S:]) / RATE_WINDOW_S,
                "generation_per_s": sum(generated[-RATE_WINDOW_S:]) / RATE_WINDOW_S,
            },
            "ranks": [
                self._rank_row(rank, state, str(dead[rank]) if rank in dead else None)
                for rank, state in states.items()
            ],
            "recent_requests": [asdict(r) for r in self.recent],
        }

    def _rank_row(self, rank: int, state: str, error: str | None) -> dict[str, Any]:
        stats = self.rank_stats.get(rank, SchedulerStats()) if state == "alive" else None
        return {
            "rank": rank,
            "state": state,
            "num_running": stats.num_running_reqs if stats else None,
            "num_waiting": stats.num_waiting_reqs if stats else None,
            "kv_cache_usage": stats.kv_cache_usage if stats else None,
            "error": error,
        }


def rank_states(engine: AsyncLLM) -> dict[int, str]:
    """Each engine rank this frontend serves -> its state: "alive", "restarting" or "dead" (a string the
    page shows as given, so new states need no change there)."""
    options = engine.options
    if options.data_parallel_external_lb and options.data_parallel_rank is not None:
        ranks = [options.data_parallel_rank]
    else:
        ranks = list(range(options.data_parallel_size))
    dead, restarting = engine.dead_ranks, engine.restarting_ranks
    return {
        rank: "dead" if engine.errored or rank in dead else "restarting" if rank in restarting else "alive"
        for rank in ranks
    }
