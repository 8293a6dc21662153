"""POST /v1/chat/completions: the conversation through the model's chat template, n samples."""

from __future__ import annotations

from collections.abc import AsyncGenerator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from nanoserve.engine.async_llm import RequestStream
from nanoserve.entrypoints.openai.errors import OpenAIError, engine_error
from nanoserve.entrypoints.openai.protocol import (
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatResponseMessage,
    ChatStreamChoice,
    DeltaMessage,
    TokenLogprob,
    TopLogprob,
    UsageInfo,
)
from nanoserve.entrypoints.openai.serving import (
    OpenAIServing,
    Serving,
    SSEResponse,
    generation_responses,
    raise_on_error,
    sse,
    track_usage,
)
from nanoserve.entrypoints.openai.streams import collect, run_until_disconnect
from nanoserve.entrypoints.openai.tool_calls import ToolChoice, ToolDeltaStream, tool_call_responses
from nanoserve.outputs import CompletionOutput

router = APIRouter()


@router.post("/v1/chat/completions", responses=generation_responses(ChatCompletionResponse))
async def create_chat_completion(
    request: ChatCompletionRequest, raw_request: Request, serving: Serving
) -> Response:
    deadline = serving.deadline()
    serving.check_request(request)
    engine = serving.engine
    tool_choice = ToolChoice.from_request(request, serving.renders_tools, serving.tool_parser)
    try:
        conversation = request.conversation()
    except ValueError as e:
        raise OpenAIError(str(e), param="messages") from e
    try:
        prompt = await engine.render_chat(
            conversation,
            request.add_generation_prompt,
            tools=tool_choice.tools or None,
            chat_template=serving.chat_template,
            continue_final_message=request.continue_final_message,
            add_special_tokens=request.add_special_tokens,
        )
    except Exception as e:  # a template may reject a conversation (e.g. roles out of order)
        raise OpenAIError(f"Cannot apply the chat template: {e}", param="messages") from e
    request_id = request.response_id("chatcmpl")
    serving.admit(request.n)
    overrides: dict[str, Any] = {}
    if tool_choice.constraint() is not None:
        overrides["structured_outputs"] = tool_choice.constraint()
    if tool_choice.needs_special_tokens:
        overrides["skip_special_tokens"] = False
    stream = await serving.start(request_id, prompt, request, **overrides)
    usage = track_usage(raw_request, len(prompt["prompt_token_ids"]))
    if request.stream:
        return SSEResponse(
            chat_stream(serving, request_id, request, tool_choice, stream, usage), engine, [stream], deadline
        )
    (final,) = await run_until_disconnect(raw_request, collect(engine, [stream]), deadline)
    choices = []
    for c in final.outputs:
        raise_on_error(c)
        usage.add_completion_tokens(len(c.token_ids))
        content, calls = tool_choice.parse(c.text)
        choices.append(
            ChatChoice(
                index=c.index,
                message=ChatResponseMessage(content=content, tool_calls=tool_call_responses(calls)),
                logprobs=chat_logprobs(c, request.top_logprobs or 0) if request.logprobs else None,
                finish_reason=tool_choice.finish_reason(calls, c.finish_reason),
                stop_reason=c.stop_reason,
            )
        )
    response = ChatCompletionResponse(
        id=request_id, model=serving.served_model_name, choices=choices, usage=usage
    )
    return JSONResponse(response.model_dump())


async def chat_stream(
    serving: OpenAIServing,
    request_id: str,
    request: ChatCompletionRequest,
    tool_choice: ToolChoice,
    stream: RequestStream,
    usage: UsageInfo,
) -> AsyncGenerator[str, None]:
    def chunk(choices: list[ChatStreamChoice], usage_info: UsageInfo | None = None) -> str:
        body = ChatCompletionChunk(
            id=request_id, model=serving.served_model_name, choices=choices, usage=usage_info
        )
        return sse(body.model_dump_json(exclude_none=usage_info is None))

    try:
        yield chunk(
            [
                ChatStreamChoice(index=i, delta=DeltaMessage(role="assistant", content=""))
                for i in range(request.n)
            ]
        )
        tool_streams = [ToolDeltaStream(tool_choice) for _ in range(request.n)]
        async for output in serving.engine.iterate(stream, output_kind="delta"):
            choices = []
            for c in output.outputs:
                raise_on_error(c)
                usage.add_completion_tokens(len(c.token_ids))
                tools = tool_streams[c.index]
                content, tool_calls = tools.feed(c.text)
                finish_reason = c.finish_reason
                if finish_reason is not None:
                    rest, more_calls = tools.finish()
                    content = (content or "") + (rest or "") or None
                    tool_calls = (tool_calls or []) + (more_calls or []) or None
                    finish_reason = tool_choice.finish_reason(tools.calls, finish_reason)
                if content is None and tool_calls is None and finish_reason is None:
                    continue
                choices.append(
                    ChatStreamChoice(
                        index=c.index,
                        delta=DeltaMessage(content=content, tool_calls=tool_calls),
                        logprobs=chat_logprobs(c, request.top_logprobs or 0) if request.logprobs else None,
                        finish_reason=finish_reason,
                        stop_reason=c.stop_reason,
                    )
                )
            if choices:
                yield chunk(choices)
        if request.stream_options is not None and request.stream_options.include_usage:
            yield chunk([], usage)
    except Exception as e:
        yield sse(engine_error(e).response().model_dump_json())
    yield sse("[DONE]")


def chat_logprobs(c: CompletionOutput, num_top: int) -> ChatLogprobs:
    content = []
    for token_id, step in zip(c.token_ids, c.logprobs or [], strict=False):
        sampled = step.get(token_id)
        ranked = sorted(
            (lp for tid, lp in step.items() if lp.rank is not None and lp.rank <= num_top),
            key=lambda lp: lp.rank or 0,
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
