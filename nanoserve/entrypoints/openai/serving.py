"""The completion and chat-completion handlers: an OpenAI request -> AsyncLLM requests -> a response.

Everything a request can get wrong is found before the first byte of the response is sent (so a bad
streaming request still gets a 4xx, not a 200 with an error inside). Once streaming has begun, an
error — the engine dying included — ends the stream with one `data: {"error": ...}` event and
`data: [DONE]`. A client that goes away mid-request has its requests aborted in the engine.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from nanoserve.engine.async_llm import AsyncLLM, RequestStream
from nanoserve.engine.exceptions import EngineDeadError
from nanoserve.entrypoints.openai.errors import OpenAIError, engine_error
from nanoserve.entrypoints.openai.protocol import (
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatResponseMessage,
    ChatStreamChoice,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    DeltaMessage,
    SamplingRequest,
    TokenLogprob,
    TopLogprob,
    UsageInfo,
    random_id,
)
from nanoserve.entrypoints.openai.streams import collect, merge, run_until_disconnect
from nanoserve.outputs import CompletionOutput


def sse(payload: str) -> str:
    return f"data: {payload}\n\n"


class OpenAIServing:
    def __init__(self, engine: AsyncLLM, served_model_name: str) -> None:
        self.engine = engine
        self.served_model_name = served_model_name

    # -- shared checks ------------------------------------------------------------------------

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

    async def start(self, request_id: str, prompt: dict[str, Any], request: SamplingRequest) -> RequestStream:
        max_tokens = self.fit_max_tokens(request, len(prompt["prompt_token_ids"]))
        try:
            params = request.to_sampling_params(max_tokens, self.engine.generation_defaults)
            return await self.engine.add_request(request_id, prompt, params)
        except (ValueError, EngineDeadError) as e:
            raise engine_error(e) from e

    async def start_all(
        self, request_id: str, prompts: list[dict[str, Any]], request: SamplingRequest
    ) -> list[RequestStream]:
        """One engine request per prompt; none of them is left running if one is refused."""
        streams: list[RequestStream] = []
        try:
            for i, prompt in enumerate(prompts):
                streams.append(await self.start(f"{request_id}-{i}", prompt, request))
        except BaseException:
            await self.engine.abort([s.request_id for s in streams])
            raise
        return streams

    # -- /v1/completions ------------------------------------------------------------------------

    async def create_completion(self, request: CompletionRequest, raw_request: Request) -> Response:
        self.check_model(request.model)
        if request.suffix:
            raise OpenAIError("suffix is not supported.", param="suffix")
        if request.echo and request.logprobs is not None:
            raise OpenAIError("echo together with logprobs is not supported.", param="echo")
        try:
            prompts = [await self.engine.tokenize(p) for p in request.prompts()]
            if request.echo:
                for p in prompts:
                    if p["prompt"] is None:
                        p["prompt"] = self.engine.tokenizer.decode(p["prompt_token_ids"])
        except ValueError as e:
            raise OpenAIError(str(e), param="prompt") from e
        request_id = random_id("cmpl")
        streams = await self.start_all(request_id, prompts, request)
        if request.stream:
            return streaming_response(
                self.completion_stream(request_id, request, prompts, streams), self.engine, streams
            )
        finals = await run_until_disconnect(raw_request, collect(self.engine, streams))
        choices, num_prompt_tokens, num_completion_tokens = [], 0, 0
        for i, (prompt, final) in enumerate(zip(prompts, finals, strict=True)):
            num_prompt_tokens += len(prompt["prompt_token_ids"])
            for c in final.outputs:
                raise_on_error(c)
                num_completion_tokens += len(c.token_ids)
                text = (prompt["prompt"] if request.echo else "") + c.text
                logprobs = completion_logprobs(c, 0) if request.logprobs is not None else None
                choices.append(
                    CompletionChoice(
                        index=i * request.n + c.index,
                        text=text,
                        logprobs=logprobs,
                        finish_reason=c.finish_reason,
                        stop_reason=c.stop_reason,
                    )
                )
        return JSONResponse(
            CompletionResponse(
                id=request_id,
                model=self.served_model_name,
                choices=choices,
                usage=usage(num_prompt_tokens, num_completion_tokens),
            ).model_dump()
        )

    async def completion_stream(
        self,
        request_id: str,
        request: CompletionRequest,
        prompts: list[dict[str, Any]],
        streams: list[RequestStream],
    ) -> AsyncGenerator[str, None]:
        num_prompt_tokens = sum(len(p["prompt_token_ids"]) for p in prompts)
        num_completion_tokens = 0
        text_offsets: dict[int, int] = {}
        try:
            async for i, output in merge(self.engine, streams):
                chunk_choices = []
                for c in output.outputs:
                    raise_on_error(c)
                    index = i * request.n + c.index
                    text = c.text
                    if request.echo and index not in text_offsets:
                        text = prompts[i]["prompt"] + text
                    num_completion_tokens += len(c.token_ids)
                    logprobs = None
                    if request.logprobs is not None:
                        logprobs = completion_logprobs(c, text_offsets.get(index, 0))
                    text_offsets[index] = text_offsets.get(index, 0) + len(text)
                    if text or c.finish_reason is not None or c.token_ids:
                        chunk_choices.append(
                            CompletionChoice(
                                index=index,
                                text=text,
                                logprobs=logprobs,
                                finish_reason=c.finish_reason,
                                stop_reason=c.stop_reason,
                            )
                        )
                if chunk_choices:
                    chunk = CompletionResponse(
                        id=request_id, model=self.served_model_name, choices=chunk_choices
                    )
                    yield sse(chunk.model_dump_json(exclude={"usage"}))
            if request.stream_options is not None and request.stream_options.include_usage:
                chunk = CompletionResponse(
                    id=request_id,
                    model=self.served_model_name,
                    choices=[],
                    usage=usage(num_prompt_tokens, num_completion_tokens),
                )
                yield sse(chunk.model_dump_json())
        except Exception as e:
            yield sse(engine_error(e).response().model_dump_json())
        yield sse("[DONE]")

    # -- /v1/chat/completions -------------------------------------------------------------------

    async def create_chat_completion(self, request: ChatCompletionRequest, raw_request: Request) -> Response:
        self.check_model(request.model)
        try:
            prompt = await self.engine.render_chat(request.conversation(), request.add_generation_prompt)
        except Exception as e:  # a template may reject a conversation (e.g. roles out of order)
            raise OpenAIError(f"Cannot apply the chat template: {e}", param="messages") from e
        request_id = random_id("chatcmpl")
        stream = await self.start(request_id, prompt, request)
        num_prompt_tokens = len(prompt["prompt_token_ids"])
        if request.stream:
            return streaming_response(
                self.chat_stream(request_id, request, num_prompt_tokens, stream), self.engine, [stream]
            )
        (final,) = await run_until_disconnect(raw_request, collect(self.engine, [stream]))
        choices, num_completion_tokens = [], 0
        for c in final.outputs:
            raise_on_error(c)
            num_completion_tokens += len(c.token_ids)
            choices.append(
                ChatChoice(
                    index=c.index,
                    message=ChatResponseMessage(content=c.text),
                    logprobs=chat_logprobs(c, request.top_logprobs or 0) if request.logprobs else None,
                    finish_reason=c.finish_reason,
                    stop_reason=c.stop_reason,
                )
            )
        return JSONResponse(
            ChatCompletionResponse(
                id=request_id,
                model=self.served_model_name,
                choices=choices,
                usage=usage(num_prompt_tokens, num_completion_tokens),
            ).model_dump()
        )

    async def chat_stream(
        self, request_id: str, request: ChatCompletionRequest, num_prompt_tokens: int, stream: RequestStream
    ) -> AsyncGenerator[str, None]:
        def chunk(choices: list[ChatStreamChoice], usage_info: UsageInfo | None = None) -> str:
            body = ChatCompletionChunk(
                id=request_id, model=self.served_model_name, choices=choices, usage=usage_info
            )
            return sse(body.model_dump_json(exclude_none=usage_info is None))

        num_completion_tokens = 0
        try:
            yield chunk(
                [
                    ChatStreamChoice(index=i, delta=DeltaMessage(role="assistant", content=""))
                    for i in range(request.n)
                ]
            )
            async for output in self.engine.iterate(stream, output_kind="delta"):
                choices = []
                for c in output.outputs:
                    raise_on_error(c)
                    num_completion_tokens += len(c.token_ids)
                    if not c.text and c.finish_reason is None:
                        continue
                    choices.append(
                        ChatStreamChoice(
                            index=c.index,
                            delta=DeltaMessage(content=c.text or None),
                            logprobs=chat_logprobs(c, request.top_logprobs or 0)
                            if request.logprobs
                            else None,
                            finish_reason=c.finish_reason,
                            stop_reason=c.stop_reason,
                        )
                    )
                if choices:
                    yield chunk(choices)
            if request.stream_options is not None and request.stream_options.include_usage:
                yield chunk([], usage(num_prompt_tokens, num_completion_tokens))
        except Exception as e:
            yield sse(engine_error(e).response().model_dump_json())
        yield sse("[DONE]")


# -- helpers ----------------------------------------------------------------------------------


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


def streaming_response(
    body: AsyncIterator[str], engine: AsyncLLM, streams: list[RequestStream]
) -> SSEResponse:
    return SSEResponse(body, engine, streams)


def usage(num_prompt_tokens: int, num_completion_tokens: int) -> UsageInfo:
    return UsageInfo(
        prompt_tokens=num_prompt_tokens,
        completion_tokens=num_completion_tokens,
        total_tokens=num_prompt_tokens + num_completion_tokens,
    )


def raise_on_error(c: CompletionOutput) -> None:
    if c.finish_reason == "error":
        raise OpenAIError(f"The engine failed the request: {c.error}", 500, "internal_server_error")


def completion_logprobs(c: CompletionOutput, text_offset: int) -> CompletionLogprobs:
    result = CompletionLogprobs()
    for token_id, step in zip(c.token_ids, c.logprobs or [], strict=False):
        sampled = step.get(token_id)
        token = (sampled.decoded_token if sampled else None) or ""
        result.tokens.append(token)
        result.token_logprobs.append(sampled.logprob if sampled else None)
        result.top_logprobs.append({lp.decoded_token or "": lp.logprob for lp in step.values()})
        result.text_offset.append(text_offset)
        text_offset += len(token)
    return result


def chat_logprobs(c: CompletionOutput, num_top: int) -> ChatLogprobs:
    content = []
    for token_id, step in zip(c.token_ids, c.logprobs or [], strict=False):
        sampled = step.get(token_id)
        ranked = sorted(
            (lp for tid, lp in step.items() if lp.rank is not None and lp.rank <= num_top),
            key=lambda lp: lp.rank,
        )
        content.append(
            TokenLogprob(
                token=(sampled.decoded_token if sampled else "") or "",
                logprob=sampled.logprob if sampled else float("-inf"),
                bytes=list((sampled.decoded_token or "").encode()) if sampled else None,
                top_logprobs=[
                    TopLogprob(
                        token=lp.decoded_token or "",
                        logprob=lp.logprob,
                        bytes=list((lp.decoded_token or "").encode()),
                    )
                    for lp in ranked
                ],
            )
        )
    return ChatLogprobs(content=content)
