"""ASGI middleware in front of every route: the request-body limit and the API key."""

from __future__ import annotations

import hmac

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from nanoserve.entrypoints.openai.errors import OpenAIError, error_json


class GuardMiddleware:
    """Refuses oversized bodies (413) and, for /v1 routes, requests without the bearer token (401)."""

    def __init__(self, app: ASGIApp, api_key: str | None, max_body_bytes: int) -> None:
        self.app = app
        self.api_key = api_key
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        if self.api_key is not None and scope["path"].startswith("/v1"):
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
