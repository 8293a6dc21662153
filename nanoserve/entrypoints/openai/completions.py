"""POST /v1/completions: one engine request per prompt (text or token ids), n samples each."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncGenerator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from nanoserve.engine.async_llm import RequestStream
from nanoserve.entrypoints.openai.errors import OpenAIError, engine_error
from nanoserve.entrypoints.openai.protocol import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
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
from nanoserve.entrypoints.openai.streams import collect, merge, run_until_disconnect
from nanoserve.outputs import CompletionOutput, RequestOutput

router = APIRouter()


@router.post("/v1/completions", responses=generation_responses(CompletionResponse))
async def create_completion(request: CompletionRequest, raw_request: Request, serving: Serving) -> Response:
    deadline = serving.deadline()
    serving.check_request(request)
    engine = serving.engine
    try:
        prompts = [await engine.tokenize(p, request.add_special_tokens) for p in request.prompts()]
        if request.echo:
            for p in prompts:
                if p["prompt"] is None:
                    p["prompt"] = await engine.detokenize(p["prompt_token_ids"])
    except ValueError as e:
        raise OpenAIError(f"prompt: {e}", param="prompt") from e
    request_id = request.response_id("cmpl")
    serving.admit(len(prompts) * request.n)
    overrides = {"prompt_logprobs": request.logprobs} if request.echo and request.logprobs is not None else {}
    streams = await serving.start_all(request_id, prompts, request, **overrides)
    usage = track_usage(raw_request, sum(len(p["prompt_token_ids"]) for p in prompts))
    if request.stream:
        body = completion_stream(serving, request_id, request, prompts, streams, usage)
        return SSEResponse(body, engine, streams, deadline)
    finals = await run_until_disconnect(raw_request, collect(engine, streams), deadline)
    choices = []
    for i, (prompt, final) in enumerate(zip(prompts, finals, strict=True)):
        for c in final.outputs:
            raise_on_error(c)
            c = scored_only(c) if request.max_tokens == 0 else c
            usage.add_completion_tokens(len(c.token_ids))
            text = (prompt["prompt"] if request.echo else "") + c.text
            logprobs = None
            if request.logprobs is not None:
                logprobs = (
                    echoed_logprobs(engine.tokenizer, final, c) if request.echo else completion_logprobs(c, 0)
                )
            choices.append(
                CompletionChoice(
                    index=i * request.n + c.index,
                    text=text,
                    logprobs=logprobs,
                    finish_reason=c.finish_reason,
                    stop_reason=c.stop_reason,
                )
            )
    response = CompletionResponse(
        id=request_id, model=serving.served_model_name, choices=choices, usage=usage
    )
    return JSONResponse(response.model_dump())


async def completion_stream(
    serving: OpenAIServing,
    request_id: str,
    request: CompletionRequest,
    prompts: list[dict[str, Any]],
    streams: list[RequestStream],
    usage: UsageInfo,
) -> AsyncGenerator[str, None]:
    text_offsets: dict[int, int] = {}
    try:
        async for i, output in merge(serving.engine, streams):
            chunk_choices = []
            for c in output.outputs:
                raise_on_error(c)
                index = i * request.n + c.index
                text = c.text
                echo_now = request.echo and index not in text_offsets
                if echo_now:
                    text = prompts[i]["prompt"] + text
                c = scored_only(c) if request.max_tokens == 0 else c
                usage.add_completion_tokens(len(c.token_ids))
                logprobs = None
                if request.logprobs is not None:
                    if echo_now:
                        logprobs = echoed_logprobs(serving.engine.tokenizer, output, c)
                    else:
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
                    id=request_id, model=serving.served_model_name, choices=chunk_choices
                )
                yield sse(chunk.model_dump_json(exclude={"usage"}))
        if request.stream_options is not None and request.stream_options.include_usage:
            chunk = CompletionResponse(
                id=request_id, model=serving.served_model_name, choices=[], usage=usage
            )
            yield sse(chunk.model_dump_json())
    except Exception as e:
        yield sse(engine_error(e).response().model_dump_json())
    yield sse("[DONE]")


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


def scored_only(c: CompletionOutput) -> CompletionOutput:
    """A max_tokens 0 choice: the one token generated to finish the request is not part of the answer."""
    return dataclasses.replace(c, text="", token_ids=[], logprobs=[] if c.logprobs is not None else None)


def echoed_logprobs(tokenizer, output: RequestOutput, c: CompletionOutput) -> CompletionLogprobs:
    """OpenAI's echo with logprobs: every prompt token first (the first one's logprob is null), then the
    generated tokens; text offsets run over the echoed prompt and the completion."""
    result = CompletionLogprobs()
    offset = 0
    for token_id, step in zip(output.prompt_token_ids, output.prompt_logprobs or [], strict=True):
        token = tokenizer.decode([token_id])
        result.tokens.append(token)
        result.token_logprobs.append(None if step is None else step[token_id].logprob)
        result.top_logprobs.append(
            None if step is None else {lp.decoded_token or "": lp.logprob for lp in step.values()}
        )
        result.text_offset.append(offset)
        offset += len(token)
    generated = completion_logprobs(c, offset)
    result.tokens += generated.tokens
    result.token_logprobs += generated.token_logprobs
    result.top_logprobs += generated.top_logprobs
    result.text_offset += generated.text_offset
    return result
