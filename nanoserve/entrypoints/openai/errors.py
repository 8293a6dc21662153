"""Errors in OpenAI's format: `{"error": {"message", "type", "param", "code"}}` with an HTTP status, and
the app's exception handlers that answer every error that way."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from nanoserve.engine.exceptions import EngineDeadError
from nanoserve.entrypoints.openai.protocol import ErrorInfo, ErrorResponse

logger = logging.getLogger("nanoserve.server")


class OpenAIError(Exception):
    """An error answered in OpenAI's format with an HTTP status."""

    def __init__(
        self, message: str, status: int = 400, type: str = "invalid_request_error", param: str | None = None
    ):
        super().__init__(message)
        self.message, self.status, self.type, self.param = message, status, type, param

    def response(self) -> ErrorResponse:
        return ErrorResponse(
            error=ErrorInfo(message=self.message, type=self.type, param=self.param, code=self.status)
        )


def error_json(message: str, status: int, type: str, param: str | None = None) -> JSONResponse:
    return JSONResponse(OpenAIError(message, status, type, param).response().model_dump(), status_code=status)


def engine_error(e: BaseException) -> OpenAIError:
    if isinstance(e, OpenAIError):
        return e
    if isinstance(e, EngineDeadError):
        return OpenAIError(f"The engine is not available: {e}", 503, "service_unavailable")
    if isinstance(e, ValueError):
        return OpenAIError(str(e), 400)
    return OpenAIError(f"{type(e).__name__}: {e}", 500, "internal_server_error")


def add_exception_handlers(app: FastAPI) -> None:
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


def _describe(err: dict) -> str:
    loc = ".".join(str(p) for p in err.get("loc", ()) if p != "body")
    return f"{loc}: {err.get('msg', 'invalid')}" if loc else str(err.get("msg", "invalid"))
