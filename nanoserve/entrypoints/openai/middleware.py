"""ASGI middleware in front of every route: the access log, the request-body limit and the API key,
and the last resort for exceptions no handler took."""

from __future__ import annotations

import hmac
import logging
import time

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from nanoserve.entrypoints.openai.errors import OpenAIError, error_json, internal_error

logger = logging.getLogger("nanoserve.server")
access_logger = logging.getLogger("nanoserve.access")


class AccessLogMiddleware:
    """One line per request, once its response is sent: client, method, path, status, prompt and
    completion tokens (for the routes that generate), latency."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.monotonic()
        status = 0

        async def send_and_note_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_and_note_status)
        finally:
            usage = scope.get("state", {}).get("usage")
            tokens = (
                ""
                if usage is None
                else f" prompt_tokens={usage.prompt_tokens} completion_tokens={usage.completion_tokens}"
            )
            client = scope.get("client")
            access_logger.info(
                '%s "%s %s" %d%s %.3fs',
                f"{client[0]}:{client[1]}" if client else "-",
                scope["method"],
                scope["path"],
                status,
                tokens,
                time.monotonic() - start,
            )


class UnhandledErrorMiddleware:
    """Answers an exception that no handler took with a 500 in OpenAI's format, so it never reaches
    uvicorn, which closes the (keep-alive) connection when an exception escapes after a response. An
    exception after the response began (a broken stream) can only close the connection: it is re-raised."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def send_and_note_start(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, send_and_note_start)
        except Exception as e:
            if started:
                raise
            logger.exception("unhandled error in %s %s", scope["method"], scope["path"])
            await internal_error(e)(scope, receive, send)


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
