"""Errors in OpenAI's format: `{"error": {"message", "type", "param", "code"}}` with an HTTP status, the
app's exception handlers that answer every error that way, and their description for /openapi.json."""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from nanoserve.engine.exceptions import EngineDeadError
from nanoserve.entrypoints.openai.protocol import ErrorInfo, ErrorResponse

logger = logging.getLogger("nanoserve.server")

ERROR_STATUSES = {
    400: "Invalid request: malformed JSON, a wrong type, a value out of range, or a field nanoserve does not "
    "implement (`param` names the field)",
    401: "Missing or wrong API key (on /v1 routes, when the server has one)",
    404: "The model is not the one served",
    408: "The request did not finish within --request-timeout and was aborted",
    413: "The request body is larger than --max-request-body-bytes",
    429: "More requests than --max-queued-requests would wait for the engine; retry after Retry-After seconds",
    500: "An unexpected error in the server or the engine",
    503: "The engine is dead (or hung)",
}


def error_responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """The `responses` of a route that can answer these error statuses, for /openapi.json."""
    return {status: {"model": ErrorResponse, "description": ERROR_STATUSES[status]} for status in statuses}


class OpenAIError(Exception):
    """An error answered in OpenAI's format with an HTTP status (and headers, e.g. Retry-After)."""

    def __init__(
        self,
        message: str,
        status: int = 400,
        type: str = "invalid_request_error",
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.message, self.status, self.type, self.param = message, status, type, param
        self.headers = headers

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
        return JSONResponse(e.response().model_dump(), status_code=e.status, headers=e.headers)

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
        loc = [p for p in (errors[0].get("loc", ()) if errors else ()) if p not in REQUEST_PARTS]
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


def internal_error(e: Exception) -> JSONResponse:
    return error_json(f"Internal server error: {type(e).__name__}: {e}", 500, "internal_server_error")


REQUEST_PARTS = ("body", "query", "path", "header")
"""The first element of a validation error's location, left out of the field it names."""


def _describe(err: dict) -> str:
    loc = ".".join(str(p) for p in err.get("loc", ()) if p not in REQUEST_PARTS)
    return f"{loc}: {err.get('msg', 'invalid')}" if loc else str(err.get("msg", "invalid"))
