"""POST /tokenize and /detokenize, with vLLM's shapes: the token ids the engine would see for a prompt
or a chat conversation (and how many fit), and the text for token ids."""

from __future__ import annotations

from fastapi import APIRouter

from nanoserve.entrypoints.openai.errors import OpenAIError, error_responses
from nanoserve.entrypoints.openai.protocol import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeChatRequest,
    TokenizeRequest,
    TokenizeResponse,
)
from nanoserve.entrypoints.openai.serving import Serving

router = APIRouter()


@router.post("/tokenize", responses=error_responses(400, 404, 413))
async def tokenize(request: TokenizeRequest, serving: Serving) -> TokenizeResponse:
    if {"prompt", "messages"} <= set(request.model_fields_set) | set(request.model_extra or {}):
        raise OpenAIError("Give either `prompt` or `messages`, not both.", param="messages")
    serving.check_request(request)
    engine = serving.engine
    try:
        if isinstance(request, TokenizeChatRequest):
            rendered = await engine.render_chat(
                request.conversation(),
                request.add_generation_prompt,
                chat_template=serving.chat_template,
                add_special_tokens=request.add_special_tokens,
            )
            ids = rendered["prompt_token_ids"]
        else:
            ids = (await engine.tokenize(request.prompt, request.add_special_tokens))["prompt_token_ids"]
    except Exception as e:  # content the template cannot take, or a template that rejects the conversation
        param = "messages" if isinstance(request, TokenizeChatRequest) else "prompt"
        raise OpenAIError(f"Cannot tokenize: {e}", param=param) from e
    token_strs = engine.tokenizer.convert_ids_to_tokens(ids) if request.return_token_strs else None
    return TokenizeResponse(
        count=len(ids), max_model_len=engine.max_model_len, tokens=ids, token_strs=token_strs
    )


@router.post("/detokenize", responses=error_responses(400, 404, 413))
async def detokenize(request: DetokenizeRequest, serving: Serving) -> DetokenizeResponse:
    serving.check_request(request)
    try:
        return DetokenizeResponse(prompt=await serving.engine.detokenize(request.tokens))
    except ValueError as e:
        raise OpenAIError(f"tokens: {e}", param="tokens") from e
