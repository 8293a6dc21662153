"""Errors in OpenAI's format: `{"error": {"message", "type", "param", "code"}}` with an HTTP status."""

from __future__ import annotations

from fastapi.responses import JSONResponse

from nanoserve.engine.exceptions import EngineDeadError
from nanoserve.entrypoints.openai.protocol import ErrorInfo, ErrorResponse


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
