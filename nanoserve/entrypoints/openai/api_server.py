"""The OpenAI-compatible HTTP server: a FastAPI app over one AsyncLLM, run by uvicorn.

Routes, one module (an APIRouter) per family: completions.py (/v1/completions), chat.py
(/v1/chat/completions), models.py (/v1/models), tokenize.py (/tokenize, /detokenize), health.py
(/health, /ping, /version), metrics.py (/metrics), with --enable-sleep-endpoints sleep.py (/sleep,
/wake_up, /is_sleeping), and the web page at / with its dashboard data (web.py; off with --no-web).
/v1 routes are behind the API key when one is set. Every error is answered in OpenAI's format, and
/openapi.json says so (openapi.py).

Middleware, outermost first: the access log, CORS (with --allowed-origins), the body limit and API key,
and the last resort that turns an exception no handler took into a 500 without breaking the connection.

Lifecycle: the engine is built before the server listens. SIGTERM (or SIGINT) stops accepting, lets
in-flight requests finish for the grace period, shuts the engine down and exits 0. When the engine
dies, open streams end with an error event, new requests get 503, /health says 503, and the process
exits 1 (so a supervisor restarts it) unless told to stay up. With --engine-restarts the engine core
is restarted instead, while the budget lasts: streams pause and go on, /health answers 200 with
{"status": "restarting"} meanwhile, and /metrics counts restarts by rank. With data parallel, a rank's
death fails only its requests: /health stays 200 with a body saying "degraded" and naming the dead
ranks, until the last rank dies.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import logging
import math
import signal
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from pathlib import Path

import uvicorn
from fastapi import FastAPI
from starlette.middleware.cors import CORSMiddleware

import nanoserve
from nanoserve import envs
from nanoserve.config import EngineOptions
from nanoserve.engine.async_llm import AsyncLLM
from nanoserve.engine.exceptions import EngineStartupError
from nanoserve.entrypoints.openai import chat, completions, health, metrics, models, sleep, tokenize
from nanoserve.entrypoints.openai.errors import add_exception_handlers
from nanoserve.entrypoints.openai.metrics import PrometheusStatLogger, check_metrics_prefix
from nanoserve.entrypoints.openai.middleware import (
    AccessLogMiddleware,
    GuardMiddleware,
    UnhandledErrorMiddleware,
)
from nanoserve.entrypoints.openai.openapi import use_truthful_openapi
from nanoserve.entrypoints.openai.serving import OpenAIServing
from nanoserve.entrypoints.openai.web import STATS_PATH, mount_web
from nanoserve.startup_gc import collector_paused
from nanoserve.tool_parsers import PARSERS, get_parser

logger = logging.getLogger("nanoserve.server")

STREAM_ERRORS_GRACE_S = 0.5
"""After the engine's final death, how long open streams get to send their error events before the
server stops."""


@dataclass
class ServerOptions:
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    served_model_name: str | None = None
    """None: the model's own name (e.g. SmolLM2-135M-Instruct)."""
    max_request_body_bytes: int = 4 * 1024 * 1024
    health_hang_timeout: float = 120.0
    """/health says 503 when requests are in flight but the engine has been silent this long."""
    shutdown_grace_period: float = 30.0
    """Seconds in-flight requests may take to finish after SIGTERM."""
    exit_on_engine_death: bool = True
    log_level: str = "info"
    web: bool = True
    """The chat and dashboard page at / (and its data endpoint)."""
    root_path: str = ""
    """The path prefix a proxy serves us under (and strips), e.g. /nanoserve."""
    access_log: bool = True
    """One line per request on the `nanoserve.access` logger."""
    max_queued_requests: int | None = None
    """Sequences that may wait for a place in the engine's running batch; beyond them, 429. None: no limit."""
    request_timeout: float | None = None
    """Seconds a request may take, from arrival to its last token; then it is aborted (408)."""
    allowed_origins: list[str] = field(default_factory=list)
    """CORS: origins whose browser pages may call the server ("*" for any); none by default."""
    metrics_prefix: str = "nanoserve"
    """Prefix of the Prometheus metric names; "vllm" gives vLLM's exact names."""
    enable_sleep_endpoints: bool = False
    """Mount /sleep, /wake_up and /is_sleeping (for a trusted operator: they stop the engine serving)."""
    chat_template: str | None = None
    """A Jinja chat template, or the path of a file holding one; None: the tokenizer's."""
    tool_call_parser: str | None = None
    """One of nanoserve.tool_parsers.PARSERS; None: the one the chat template's format calls for."""

    def __post_init__(self) -> None:
        if self.root_path and (not self.root_path.startswith("/") or self.root_path.endswith("/")):
            raise ValueError(
                f"root_path must start with '/' and not end with one (e.g. /nanoserve), got {self.root_path!r}."
            )
        if self.max_queued_requests is not None and self.max_queued_requests < 0:
            raise ValueError(f"max_queued_requests must be non-negative, got {self.max_queued_requests}.")
        if self.request_timeout is not None and not self.request_timeout > 0:
            raise ValueError(f"request_timeout must be positive, got {self.request_timeout}.")
        check_metrics_prefix(self.metrics_prefix)
        if self.tool_call_parser is not None and self.tool_call_parser not in PARSERS:
            raise ValueError(
                f"tool_call_parser must be one of {', '.join(sorted(PARSERS))}, got {self.tool_call_parser!r}."
            )

    def chat_template_text(self) -> str | None:
        """The template itself: text with Jinja's braces or newlines is inline, anything else a path."""
        value = self.chat_template
        if value is None or any(c in value for c in "{}\n"):
            return value
        path = Path(value).expanduser()
        if not path.is_file():
            raise FileNotFoundError(f"--chat-template {value!r} is neither a template nor a file.")
        return path.read_text()


# -- the app ----------------------------------------------------------------------------------

ROUTERS = (
    completions.router,
    chat.router,
    models.router,
    tokenize.router,
    health.router,
    metrics.router,
)


def build_app(engine: AsyncLLM, options: ServerOptions, stat_logger: PrometheusStatLogger) -> FastAPI:
    """The app over a built engine; routes find the engine, options and metrics on `app.state`."""
    served_model_name = options.served_model_name or engine.model_name

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncGenerator[None, None]:
        engine.start()
        yield

    app = FastAPI(title="nanoserve", version=nanoserve.__version__, lifespan=lifespan)
    # add_middleware wraps what is there: the last added is the outermost
    app.add_middleware(UnhandledErrorMiddleware)
    app.add_middleware(
        GuardMiddleware,
        api_key=options.api_key,
        max_body_bytes=options.max_request_body_bytes,
        protected=("/v1", STATS_PATH) if options.web else ("/v1",),
    )
    if options.allowed_origins:
        app.add_middleware(
            CORSMiddleware, allow_origins=options.allowed_origins, allow_methods=["*"], allow_headers=["*"]
        )
    if options.access_log:
        app.add_middleware(AccessLogMiddleware)
    add_exception_handlers(app)
    app.state.engine = engine
    app.state.options = options
    app.state.stat_logger = stat_logger
    parser = get_parser(options.tool_call_parser) if options.tool_call_parser else None
    app.state.serving = OpenAIServing(
        engine,
        served_model_name,
        options.chat_template_text(),
        parser,
        max_queued_requests=options.max_queued_requests,
        request_timeout=options.request_timeout,
    )
    for router in ROUTERS:
        app.include_router(router)
    if options.enable_sleep_endpoints:
        app.include_router(sleep.router)
    use_truthful_openapi(app)
    if options.web:
        mount_web(app, engine, served_model_name)
    return app


# -- running it -------------------------------------------------------------------------------


def run_server(args: argparse.Namespace) -> int:
    """`nanoserve serve`: engine and server options from the parsed command line."""
    from nanoserve.entrypoints.cli import engine_options_from_args

    return serve(engine_options_from_args(args), server_options_from_args(args))


def serve(engine_options: EngineOptions, options: ServerOptions) -> int:
    """Serve until SIGTERM/SIGINT (exit 0) or engine death (exit 1 unless told to stay up)."""
    logging.basicConfig(level=options.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    # the engine drains in-flight requests for as long as the server does (e.g. on Ctrl-C, which it also gets)
    engine_options = dataclasses.replace(
        engine_options, multiprocess_mode=True, shutdown_timeout=options.shutdown_grace_period
    )
    # uvicorn re-raises the signal that stopped it once it is done; a handler here keeps that from killing
    # the process after a clean shutdown, so the exit code is ours
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: None)
    try:
        return asyncio.run(_serve(engine_options, options))
    except (FileNotFoundError, EngineStartupError) as e:
        logger.error("cannot start: %s", e)
        return 1


async def _serve(engine_options: EngineOptions, options: ServerOptions) -> int:
    with collector_paused(freeze=True):  # the client and its tokenizer live as long as the server
        engine = AsyncLLM.from_options(engine_options)
    exit_code = 0
    try:
        stat_logger = PrometheusStatLogger(
            options.served_model_name or engine.model_name, options.metrics_prefix
        )
        stat_logger.count_engine_restarts(lambda: engine.engine_restarts)
        engine.stat_loggers.append(stat_logger)
        app = build_app(engine, options, stat_logger)
        config = uvicorn.Config(
            app,
            host=options.host,
            port=options.port,
            log_level=options.log_level,
            access_log=False,
            timeout_graceful_shutdown=math.ceil(options.shutdown_grace_period),
            timeout_keep_alive=5,
            root_path=options.root_path,
        )
        server = uvicorn.Server(config)
        watchdog = asyncio.create_task(_watch_engine(engine, server, options))
        logger.info(
            "serving %s on http://%s:%d/v1",
            options.served_model_name or engine.model_name,
            options.host,
            options.port,
        )
        if options.web:
            logger.info("chat and dashboard page on http://%s:%d/", options.host, options.port)
        await server.serve()
        if watchdog.done() and not watchdog.cancelled() and watchdog.result():
            exit_code = 1
        watchdog.cancel()
        if not server.started:
            exit_code = 1
    finally:
        engine.shutdown()
    return exit_code


async def _watch_engine(engine: AsyncLLM, server: uvicorn.Server, options: ServerOptions) -> bool:
    """Wait for the engine's final death (a restart is not one); stop the server (returning True)
    unless it is shutting down or told to stay up."""
    await engine.wait_for_death()
    if not engine.errored or server.should_exit or not options.exit_on_engine_death:
        return False
    logger.error("the engine core died; stopping the server (pass --no-exit-on-engine-death to stay up)")
    await asyncio.sleep(STREAM_ERRORS_GRACE_S)
    server.should_exit = True
    return True


def server_options_from_args(args: argparse.Namespace) -> ServerOptions:
    fields = {f.name for f in dataclasses.fields(ServerOptions)}
    kwargs = {name: getattr(args, name) for name in fields if getattr(args, name, None) is not None}
    if kwargs.get("api_key") is None:
        kwargs["api_key"] = envs.api_key()
    return ServerOptions(**kwargs)
