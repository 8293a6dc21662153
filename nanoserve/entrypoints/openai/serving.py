"""What every route over the engine shares: request checks (model, refused and unknown fields),
admission (the queue limit), context-length fitting, starting engine requests, the server-sent-events
response, usage, and the `OpenAIServing` object the routes get as a dependency.

Everything a request can get wrong is found before the first byte of the response is sent (so a bad
streaming request still gets a 4xx, not a 200 with an error inside). Once streaming has begun, an
error — the engine dying or the request timeout included — ends the stream with one
`data: {"error": ...}` event and `data: [DONE]`. A client that goes away mid-request has its requests
aborted in the engine, and so has a request that outlives its deadline.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator
from typing import Annotated, Any

import msgspec
from fastapi import Depends, Request
from fastapi.responses import StreamingResponse

from nanoserve import structured_output
from nanoserve.engine.async_llm import AsyncLLM, RequestStream
from nanoserve.engine.exceptions import EngineDeadError
from nanoserve.entrypoints.openai.errors import OpenAIError, engine_error, error_responses
from nanoserve.entrypoints.openai.protocol import OpenAIRequest, SamplingRequest, UsageInfo
from nanoserve.entrypoints.openai.streams import Deadline
from nanoserve.outputs import CompletionOutput
from nanoserve.sampling_params import StructuredOutputsParams
from nanoserve.tool_parsers import ToolParser, detect_parser

logger = logging.getLogger("nanoserve.server")

RETRY_AFTER_S = 1
"""What a 429 tells the client to wait: about the time a short request takes to make room."""


class OpenAIServing:
    def __init__(
        self,
        engine: AsyncLLM,
        served_model_name: str,
        chat_template: str | None = None,
        tool_parser: ToolParser | None = None,
        max_queued_requests: int | None = None,
        request_timeout: float | None = None,
    ) -> None:
        """chat_template: overrides the tokenizer's. tool_parser: reads tool calls out of outputs
        (None: the one the chat template's format calls for, if any)."""
        self.engine = engine
        self.served_model_name = served_model_name
        self.chat_template = chat_template
        template = chat_template or str(getattr(engine.tokenizer, "chat_template", None) or "")
        self.renders_tools = "tools" in template
        self.tool_parser = tool_parser or detect_parser(template)
        self.max_queued_requests = max_queued_requests
        self.request_timeout = request_timeout
        self.warned_fields: set[tuple[str, str]] = set()
        """(request type, field) of the unknown fields already named in the log (each is named once)."""

    def check_request(self, request: OpenAIRequest) -> None:
        """404 for another model, 400 naming the refused fields; unknown fields are logged once each."""
        self.check_model(request.model)
        refused = request.refused_fields()
        if refused:
            reasons = "; ".join(f"`{name}`: {why}" for name, why in refused.items())
            raise OpenAIError(f"Unsupported request field(s): {reasons}.", param=next(iter(refused)))
        kind = type(request).__name__
        unknown = [name for name in request.unknown_fields() if (kind, name) not in self.warned_fields]
        if unknown:
            self.warned_fields.update((kind, name) for name in unknown)
            logger.warning(
                "ignored %s field(s) nanoserve does not know: %s (each named once)", kind, ", ".join(unknown)
            )

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.served_model_name:
            raise OpenAIError(f"The model `{model}` does not exist.", 404, "not_found_error", "model")

    def admit(self, num_seqs: int) -> None:
        """429 when `num_seqs` more sequences would leave more than max_queued_requests of them waiting
        for a place in the engine's running batch; call it just before starting them (no await between)."""
        if self.max_queued_requests is None:
            return
        num_waiting = self.engine.num_unfinished_seqs + num_seqs - self.engine.max_num_seqs
        if num_waiting > self.max_queued_requests:
            raise OpenAIError(
                f"The server is busy: at most {self.max_queued_requests} sequence(s) may wait for the engine, "
                f"and this request's {num_seqs} would make {num_waiting} wait. Retry after {RETRY_AFTER_S} s.",
                429,
                "rate_limit_error",
                headers={"Retry-After": str(RETRY_AFTER_S)},
            )

    def deadline(self) -> Deadline | None:
        """The deadline of a request arriving now (None without --request-timeout)."""
        return Deadline.after(self.request_timeout)

    def fit_max_tokens(self, request: SamplingRequest, num_prompt_tokens: int) -> int:
        """The max_tokens to use: as asked when it fits the context, the room left when not asked."""
        max_model_len = self.engine.max_model_len
        if num_prompt_tokens >= max_model_len:
            raise OpenAIError(
                f"This model's maximum context length is {max_model_len} tokens. However, your prompt has "
                f"{num_prompt_tokens} tokens, which leaves no room for a completion. Please shorten the prompt.",
                param="prompt",
            )
        room = max_model_len - num_prompt_tokens
        asked = request.requested_max_tokens()
        explicit = bool({"max_tokens", "max_completion_tokens"} & request.model_fields_set)
        if not explicit:
            asked = self.engine.generation_defaults.get("max_tokens", asked)
        if asked is None or (not explicit and asked > room):
            return room
        if asked > room:
            raise OpenAIError(
                f"This model's maximum context length is {max_model_len} tokens. However, you requested "
                f"{num_prompt_tokens + asked} tokens ({num_prompt_tokens} in the prompt, {asked} in the "
                "completion). Please reduce the length of the prompt or completion.",
                param="max_tokens",
            )
        return asked

    async def start(
        self, request_id: str, prompt: dict[str, Any], request: SamplingRequest, **overrides: Any
    ) -> RequestStream:
        """overrides: SamplingParams fields a route sets beyond what the request says."""
        max_tokens = self.fit_max_tokens(request, len(prompt["prompt_token_ids"]))
        check_constraint(request, overrides.get("structured_outputs"))
        try:
            params = request.to_sampling_params(max_tokens, self.engine.generation_defaults)
            if overrides:
                params = msgspec.structs.replace(params, **overrides)
            return await self.engine.add_request(
                request_id, prompt, params, final_output_only=not request.stream
            )
        except (ValueError, EngineDeadError) as e:
            raise engine_error(e) from e

    async def start_all(
        self, request_id: str, prompts: list[dict[str, Any]], request: SamplingRequest, **overrides: Any
    ) -> list[RequestStream]:
        """One engine request per prompt; none of them is left running if one is refused."""
        streams: list[RequestStream] = []
        try:
            for i, prompt in enumerate(prompts):
                streams.append(await self.start(f"{request_id}-{i}", prompt, request, **overrides))
        except BaseException:
            await self.engine.abort([s.request_id for s in streams])
            raise
        return streams


def generation_responses(body: type) -> dict[int | str, dict[str, Any]]:
    """A generating route's /openapi.json responses: JSON, or server-sent events with `stream: true`."""
    return {
        200: {
            "model": body,
            "description": "The response as JSON; with `stream: true`, server-sent events instead: "
            "`data: <chunk JSON>` lines, then `data: [DONE]`",
            "content": {"text/event-stream": {"schema": {"type": "string"}}},
        },
        **error_responses(400, 401, 404, 408, 413, 429, 503),
    }


def check_constraint(request: SamplingRequest, from_tools: StructuredOutputsParams | None) -> None:
    """A 400 naming the field when the structured output asked for is not a usable grammar."""
    field = (
        "tools" if from_tools else "structured_outputs" if request.structured_outputs else "response_format"
    )
    try:
        spec = from_tools or request.structured_spec()
        if spec is not None:
            structured_output.validate(spec)
    except ValueError as e:
        raise OpenAIError(str(e), param=field) from e


def get_serving(raw_request: Request) -> OpenAIServing:
    return raw_request.app.state.serving


Serving = Annotated[OpenAIServing, Depends(get_serving)]
"""A route parameter of this type receives the app's OpenAIServing."""


def sse(payload: str) -> str:
    return f"data: {payload}\n\n"


class SSEResponse(StreamingResponse):
    """Server-sent events; whatever ends the response (even a disconnect before the body started),
    the requests behind it are aborted if still running. Past the deadline the body is stopped and the
    stream ends with the timeout error."""

    def __init__(
        self,
        body: AsyncGenerator[str, None],
        engine: AsyncLLM,
        streams: list[RequestStream],
        deadline: Deadline | None = None,
    ) -> None:
        if deadline is not None:
            body = until_deadline(body, deadline)
        super().__init__(body, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self.engine, self.streams = engine, streams

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            unfinished = [s.request_id for s in self.streams if not s.finished]
            if unfinished:
                await self.engine.abort(unfinished)


async def until_deadline(body: AsyncGenerator[str, None], deadline: Deadline) -> AsyncGenerator[str, None]:
    """The body's events until the deadline; then the timeout error event and [DONE]. Cancelling the
    body's pending step ends it (its engine requests are aborted on the way out)."""
    try:
        while True:
            try:
                event = await asyncio.wait_for(anext(body), deadline.remaining())
            except StopAsyncIteration:
                return
            except TimeoutError:
                yield sse(deadline.error().response().model_dump_json())
                yield sse("[DONE]")
                return
            yield event
    finally:
        await body.aclose()


def track_usage(raw_request: Request, num_prompt_tokens: int) -> UsageInfo:
    """The request's usage, counted as its tokens arrive; the access log reads it from the request state."""
    info = UsageInfo(prompt_tokens=num_prompt_tokens, total_tokens=num_prompt_tokens)
    raw_request.state.usage = info
    return info


def raise_on_error(c: CompletionOutput) -> None:
    if c.finish_reason == "error":
        raise OpenAIError(f"The engine failed the request: {c.error}", 500, "internal_server_error")
