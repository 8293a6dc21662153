"""What every generating route shares: model and context-length checks, starting engine requests, the
server-sent-events response, usage, and the `OpenAIServing` object the routes get as a dependency.

Everything a request can get wrong is found before the first byte of the response is sent (so a bad
streaming request still gets a 4xx, not a 200 with an error inside). Once streaming has begun, an
error — the engine dying included — ends the stream with one `data: {"error": ...}` event and
`data: [DONE]`. A client that goes away mid-request has its requests aborted in the engine.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Annotated, Any

import msgspec
from fastapi import Depends, Request
from fastapi.responses import StreamingResponse

from nanoserve import structured_output
from nanoserve.engine.async_llm import AsyncLLM, RequestStream
from nanoserve.engine.exceptions import EngineDeadError
from nanoserve.entrypoints.openai.errors import OpenAIError, engine_error
from nanoserve.entrypoints.openai.protocol import SamplingRequest, UsageInfo
from nanoserve.outputs import CompletionOutput
from nanoserve.sampling_params import StructuredOutputsParams
from nanoserve.tool_parsers import ToolParser, detect_parser


class OpenAIServing:
    def __init__(
        self,
        engine: AsyncLLM,
        served_model_name: str,
        chat_template: str | None = None,
        tool_parser: ToolParser | None = None,
    ) -> None:
        """chat_template: overrides the tokenizer's. tool_parser: reads tool calls out of outputs
        (None: the one the chat template's format calls for, if any)."""
        self.engine = engine
        self.served_model_name = served_model_name
        self.chat_template = chat_template
        template = chat_template or str(getattr(engine.tokenizer, "chat_template", None) or "")
        self.renders_tools = "tools" in template
        self.tool_parser = tool_parser or detect_parser(template)

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.served_model_name:
            raise OpenAIError(f"The model `{model}` does not exist.", 404, "not_found_error", "model")

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
            params = request.to_sampling_params(max_tokens)
            if overrides:
                params = msgspec.structs.replace(params, **overrides)
            return await self.engine.add_request(request_id, prompt, params)
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
    the requests behind it are aborted if still running."""

    def __init__(self, body: AsyncIterator[str], engine: AsyncLLM, streams: list[RequestStream]) -> None:
        super().__init__(body, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self.engine, self.streams = engine, streams

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            unfinished = [s.request_id for s in self.streams if not s.finished]
            if unfinished:
                await self.engine.abort(unfinished)


def usage(num_prompt_tokens: int, num_completion_tokens: int) -> UsageInfo:
    return UsageInfo(
        prompt_tokens=num_prompt_tokens,
        completion_tokens=num_completion_tokens,
        total_tokens=num_prompt_tokens + num_completion_tokens,
    )


def raise_on_error(c: CompletionOutput) -> None:
    if c.finish_reason == "error":
        raise OpenAIError(f"The engine failed the request: {c.error}", 500, "internal_server_error")
