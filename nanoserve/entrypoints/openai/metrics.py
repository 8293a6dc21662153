"""GET /metrics: Prometheus metrics with vLLM's names under a prefix (`nanoserve:` by default;
`--metrics-prefix vllm` gives vLLM's exact names, so Grafana dashboards built for vLLM work unchanged).

A `PrometheusStatLogger` is one of AsyncLLM's stat loggers: it is called on the event loop with the
latest scheduler stats and what each batch of outputs did. It owns its registry, so several servers
(or tests) in one process never collide.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Sequence

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse, Response
from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

from nanoserve.engine.async_llm import IterationStats
from nanoserve.wire.messages import SchedulerStats

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

FINISH_REASONS = ("stop", "length", "abort", "error")

METRICS_PREFIX = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")

# bucket bounds as vLLM's, so that quantiles from either server compare
TOKEN_LATENCY_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75]
TOKEN_LATENCY_BUCKETS += [1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0]
REQUEST_LATENCY_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0]
REQUEST_LATENCY_BUCKETS += [60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0]
TOKEN_BUCKETS = [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000]


def check_metrics_prefix(prefix: str) -> None:
    if not METRICS_PREFIX.fullmatch(prefix):
        raise ValueError(f"metrics_prefix must match {METRICS_PREFIX.pattern}, got {prefix!r}.")


class PrometheusStatLogger:
    def __init__(self, model_name: str, prefix: str = "nanoserve") -> None:
        check_metrics_prefix(prefix)
        disable_created_metrics()  # no `_created` series: they double the output and nobody plots them
        self.registry = CollectorRegistry()
        self.prefix, self.model_name = prefix, model_name
        labels = {"model_name": model_name}

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(f"{prefix}:{name}", doc, list(labels), registry=self.registry).labels(**labels)

        def counter(name: str, doc: str) -> Counter:
            return Counter(f"{prefix}:{name}", doc, list(labels), registry=self.registry).labels(**labels)

        def histogram(name: str, doc: str, buckets: Sequence[float]) -> Histogram:
            return Histogram(
                f"{prefix}:{name}", doc, list(labels), buckets=buckets, registry=self.registry
            ).labels(**labels)

        self.num_requests_running = gauge("num_requests_running", "Requests in the engine's running batch.")
        self.num_requests_waiting = gauge("num_requests_waiting", "Requests waiting to be scheduled.")
        self.kv_cache_usage = gauge("kv_cache_usage_perc", "Fraction of KV-cache blocks in use (1 = full).")
        self.num_preemptions = counter(
            "num_preemptions", "Requests preempted (recomputed) for lack of KV blocks."
        )
        self.prefix_cache_queries = counter(
            "prefix_cache_queries", "Prompt tokens looked up in the prefix cache."
        )
        self.prefix_cache_hits = counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.")
        self.spec_decode_num_draft_tokens = counter(
            "spec_decode_num_draft_tokens", "Speculative draft tokens verified."
        )
        self.spec_decode_num_accepted_tokens = counter(
            "spec_decode_num_accepted_tokens", "Speculative draft tokens accepted."
        )
        self.prompt_tokens = counter("prompt_tokens", "Prefilled prompt tokens.")
        self.generation_tokens = counter("generation_tokens", "Generated tokens.")
        success = Counter(
            f"{prefix}:request_success",
            "Finished requests, by finish reason.",
            [*labels, "finished_reason"],
            registry=self.registry,
        )
        self.request_success = {r: success.labels(**labels, finished_reason=r) for r in FINISH_REASONS}
        self.time_to_first_token = histogram(
            "time_to_first_token_seconds",
            "Time from arrival to the first generated token.",
            TOKEN_LATENCY_BUCKETS,
        )
        self.inter_token_latency = histogram(
            "inter_token_latency_seconds",
            "Time between two generated tokens of a request.",
            TOKEN_LATENCY_BUCKETS,
        )
        self.time_per_output_token = histogram(
            "time_per_output_token_seconds",
            "Time per generated token after the first (vLLM's older name for the inter-token latency).",
            TOKEN_LATENCY_BUCKETS,
        )
        self.request_time_per_output_token = histogram(
            "request_time_per_output_token_seconds",
            "Per request: decode time over the generated tokens after the first.",
            TOKEN_LATENCY_BUCKETS,
        )
        self.e2e_request_latency = histogram(
            "e2e_request_latency_seconds",
            "Time from arrival to the end of a request.",
            REQUEST_LATENCY_BUCKETS,
        )
        self.request_queue_time = histogram(
            "request_queue_time_seconds",
            "Time waiting in the engine before first scheduled.",
            REQUEST_LATENCY_BUCKETS,
        )
        self.request_prefill_time = histogram(
            "request_prefill_time_seconds",
            "Time from first scheduled to the first token.",
            REQUEST_LATENCY_BUCKETS,
        )
        self.request_decode_time = histogram(
            "request_decode_time_seconds", "Time from the first token to the last.", REQUEST_LATENCY_BUCKETS
        )
        self.request_inference_time = histogram(
            "request_inference_time_seconds",
            "Time from first scheduled to the last token.",
            REQUEST_LATENCY_BUCKETS,
        )
        self.request_prompt_tokens = histogram(
            "request_prompt_tokens", "Prompt tokens per request.", TOKEN_BUCKETS
        )
        self.request_generation_tokens = histogram(
            "request_generation_tokens", "Generated tokens per request.", TOKEN_BUCKETS
        )
        self._last_totals = (0, 0, 0, 0, 0)  # the engine reports running totals; counters take increments

    def __call__(self, scheduler_stats: SchedulerStats | None, stats: IterationStats) -> None:
        if scheduler_stats is not None:
            self.num_requests_running.set(scheduler_stats.num_running_reqs)
            self.num_requests_waiting.set(scheduler_stats.num_waiting_reqs)
            self.kv_cache_usage.set(scheduler_stats.kv_cache_usage)
            totals = (
                scheduler_stats.num_preemptions,
                scheduler_stats.prefix_cache_queries,
                scheduler_stats.prefix_cache_hits,
                scheduler_stats.num_draft_tokens,
                scheduler_stats.num_accepted_tokens,
            )
            for metric, new, old in zip(
                (
                    self.num_preemptions,
                    self.prefix_cache_queries,
                    self.prefix_cache_hits,
                    self.spec_decode_num_draft_tokens,
                    self.spec_decode_num_accepted_tokens,
                ),
                totals,
                self._last_totals,
                strict=True,
            ):
                if new > old:
                    metric.inc(new - old)
                elif new < old:  # a restarted engine counts from zero again
                    metric.inc(new)
            self._last_totals = totals
        if stats.num_prompt_tokens:
            self.prompt_tokens.inc(stats.num_prompt_tokens)
        if stats.num_generation_tokens:
            self.generation_tokens.inc(stats.num_generation_tokens)
        for ttft in stats.time_to_first_tokens:
            self.time_to_first_token.observe(ttft)
        for itl in stats.inter_token_latencies:
            self.inter_token_latency.observe(itl)
            self.time_per_output_token.observe(itl)
        for finished in stats.finished:
            self.request_success.get(finished.finish_reason, self.request_success["error"]).inc()
            self.e2e_request_latency.observe(finished.e2e_latency)
            self.request_prompt_tokens.observe(finished.num_prompt_tokens)
            self.request_generation_tokens.observe(finished.num_generation_tokens)
            phases = (
                (self.request_queue_time, finished.queue_time),
                (self.request_prefill_time, finished.prefill_time),
                (self.request_decode_time, finished.decode_time),
                (self.request_inference_time, finished.inference_time),
            )
            for histogram, seconds in phases:
                if seconds is not None:
                    histogram.observe(seconds)
            if finished.decode_time is not None and finished.num_generation_tokens > 1:
                self.request_time_per_output_token.observe(
                    finished.decode_time / (finished.num_generation_tokens - 1)
                )

    def count_engine_restarts(self, restarts: Callable[[], dict[int, int]]) -> None:
        """Export `<prefix>:engine_restarts_total` by rank, read from `restarts()` at each scrape."""
        self.registry.register(_EngineRestarts(f"{self.prefix}:engine_restarts", self.model_name, restarts))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _EngineRestarts(Collector):
    """The engine's own restart counts (the client layer keeps them), as a counter per rank."""

    def __init__(self, name: str, model_name: str, restarts: Callable[[], dict[int, int]]) -> None:
        self.name = name
        self.model_name = model_name
        self.restarts = restarts

    def collect(self) -> Iterable[Metric]:
        family = CounterMetricFamily(
            self.name, "Engine-core restarts after a death, by rank.", labels=["model_name", "rank"]
        )
        for rank, count in sorted(self.restarts().items()):
            family.add_metric([self.model_name, str(rank)], count)
        yield family


router = APIRouter()


@router.get("/metrics", response_class=PlainTextResponse)
async def metrics(raw_request: Request) -> Response:
    return Response(raw_request.app.state.stat_logger.render(), media_type=CONTENT_TYPE)
