"""The OpenAI-compatible HTTP server: a FastAPI app over one AsyncLLM, run by uvicorn.

Routes: /v1/completions, /v1/chat/completions, /v1/models (behind the API key when one is set),
/health, /version, /metrics, and the web page at / with its dashboard data (`web.py`; off with
--no-web). Every error is answered in OpenAI's format.

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
import hmac
import logging
import math
import signal
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

import nanoserve
from nanoserve import envs
from nanoserve.config import EngineOptions
from nanoserve.engine.async_llm import AsyncLLM
from nanoserve.engine.exceptions import EngineDeadError, EngineStartupError
from nanoserve.entrypoints.openai.errors import OpenAIError, engine_error, error_json
from nanoserve.entrypoints.openai.metrics import CONTENT_TYPE, PrometheusStatLogger
from nanoserve.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    ModelCard,
    ModelList,
)
from nanoserve.entrypoints.openai.serving import OpenAIServing
from nanoserve.entrypoints.openai.web import STATS_PATH, mount_web

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

    def __post_init__(self) -> None:
        if self.root_path and (not self.root_path.startswith("/") or self.root_path.endswith("/")):
            raise ValueError(
                f"root_path must start with '/' and not end with one (e.g. /nanoserve), got {self.root_path!r}."
            )


# -- middleware -------------------------------------------------------------------------------


class GuardMiddleware:
    """Refuses oversized bodies (413) and, on protected routes, requests without the bearer token (401)."""

    def __init__(
        self, app: ASGIApp, api_key: str | None, max_body_bytes: int, protected: tuple[str, ...]
    ) -> None:
        self.app = app
        self.api_key = api_key
        self.max_body_bytes = max_body_bytes
        self.protected = protected
        """Path prefixes behind the API key."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        if self.api_key is not None and route_path(scope).startswith(self.protected):
            token = headers.get("authorization", "")
            scheme, _, value = token.partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(
                value.strip().encode(), self.api_key.encode()
            ):
                response = error_json("Invalid or missing API key.", 401, "authentication_error")
                await response(scope, receive, send)
                return
        length = headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body_bytes:
            response = error_json(
                f"The request body ({length} bytes) is larger than the limit of {self.max_body_bytes} bytes.",
                413,
                "invalid_request_error",
            )
            await response(scope, receive, send)
            return
        num_bytes = 0

        async def limited_receive() -> Message:
            nonlocal num_bytes
            message = await receive()
            if message["type"] == "http.request":
                num_bytes += len(message.get("body", b""))
                if num_bytes > self.max_body_bytes:
                    raise OpenAIError(
                        f"The request body is larger than the limit of {self.max_body_bytes} bytes.", 413
                    )
            return message

        await self.app(scope, limited_receive, send)


def route_path(scope: Scope) -> str:
    """The path the routes see: behind --root-path the server receives the prefix as part of the path."""
    path, root = scope["path"], scope.get("root_path", "")
    return path[len(root) :] if root and path.startswith(root + "/") else path


# -- the app ----------------------------------------------------------------------------------


def build_app(engine: AsyncLLM, options: ServerOptions, stat_logger: PrometheusStatLogger) -> FastAPI:
    served_model_name = options.served_model_name or engine.model_name
    serving = OpenAIServing(engine, served_model_name)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncGenerator[None]:
        engine.start()
        yield

    app = FastAPI(title="nanoserve", version=nanoserve.__version__, lifespan=lifespan)
    app.add_middleware(
        GuardMiddleware,
        api_key=options.api_key,
        max_body_bytes=options.max_request_body_bytes,
        protected=("/v1", STATS_PATH) if options.web else ("/v1",),
    )
    app.state.engine = engine
    app.state.serving = serving

    @app.exception_handler(OpenAIError)
    async def on_openai_error(request: Request, e: OpenAIError) -> JSONResponse:
        return JSONResponse(e.response().model_dump(), status_code=e.status)

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(request: Request, e: RequestValidationError) -> JSONResponse:
        errors = e.errors()
        if errors and errors[0].get("type") == "json_invalid":
            position = errors[0].get("loc", ("body", "?"))[-1]
            reason = errors[0].get("ctx", {}).get("error", "invalid JSON")
            return error_json(
                f"The request body is not valid JSON ({reason} at character {position}).",
                400,
                "invalid_request_error",
            )
        loc = [p for p in (errors[0].get("loc", ()) if errors else ()) if p != "body"]
        message = "; ".join(_describe(err) for err in errors[:5]) or "Invalid request."
        return error_json(message, 400, "invalid_request_error", str(loc[0]) if loc else None)

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return error_json(str(e.detail), e.status_code, kind)

    @app.exception_handler(EngineDeadError)
    async def on_engine_dead(request: Request, e: EngineDeadError) -> JSONResponse:
        error = engine_error(e)
        return JSONResponse(error.response().model_dump(), status_code=error.status)

    @app.exception_handler(Exception)
    async def on_internal_error(request: Request, e: Exception) -> JSONResponse:
        logger.exception("unhandled error")
        return error_json(f"Internal server error: {type(e).__name__}: {e}", 500, "internal_server_error")

    @app.get("/health")
    async def health() -> Response:
        try:
            await engine.check_health(options.health_hang_timeout)
        except EngineDeadError as e:
            return error_json(f"The engine is not healthy: {e}", 503, "service_unavailable")
        dead, restarting = engine.dead_ranks, engine.restarting_ranks
        if restarting:  # within its restart budget: coming back, not gone
            body: dict[str, Any] = {"status": "restarting", "restarting_ranks": restarting}
            if dead:
                body["dead_ranks"] = sorted(dead)
            return JSONResponse(body)
        if dead:  # some data-parallel ranks still serve: healthy enough to keep, but say what is lost
            return JSONResponse(
                {
                    "status": "degraded",
                    "dead_ranks": sorted(dead),
                    "errors": {str(rank): str(error) for rank, error in sorted(dead.items())},
                }
            )
        return Response(status_code=200)

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": nanoserve.__version__}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(stat_logger.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return ModelList(
            data=[ModelCard(id=served_model_name, max_model_len=engine.max_model_len)]
        ).model_dump()

    @app.post("/v1/completions")
    async def completions(request: CompletionRequest, raw_request: Request) -> Response:
        return await serving.create_completion(request, raw_request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: ChatCompletionRequest, raw_request: Request) -> Response:
        return await serving.create_chat_completion(request, raw_request)

    if options.web:
        mount_web(app, engine, served_model_name)
    return app


def _describe(err: dict) -> str:
    loc = ".".join(str(p) for p in err.get("loc", ()) if p != "body")
    return f"{loc}: {err.get('msg', 'invalid')}" if loc else str(err.get("msg", "invalid"))


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
    engine = AsyncLLM.from_options(engine_options)
    exit_code = 0
    try:
        stat_logger = PrometheusStatLogger(options.served_model_name or engine.model_name)
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
