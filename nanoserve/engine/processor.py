"""Processor: a user's prompt and SamplingParams -> a validated `EngineCoreRequest`.

Everything a request can get wrong is caught here, in the frontend, with a ValueError naming the
problem, so the engine core only ever sees requests it can serve.
"""

from __future__ import annotations

import time
from typing import Any

import msgspec

from nanoserve import structured_output
from nanoserve.sampling_params import SamplingParams
from nanoserve.wire.messages import EngineCoreReadyResponse, EngineCoreRequest

PromptType = str | list[int] | dict[str, Any]
"""Text, token ids, or {"prompt_token_ids": [...]} / {"prompt": "..."} (both keys allowed)."""

Conversation = list[dict[str, Any]]


class Processor:
    def __init__(
        self,
        tokenizer,
        max_model_len: int,
        eos_token_ids: tuple[int, ...],
        vocab_size: int | None = None,
    ):
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.eos_token_ids = eos_token_ids
        self.vocab_size = vocab_size if vocab_size is not None else len(tokenizer)

    @classmethod
    def for_engine(
        cls, tokenizer, ready: EngineCoreReadyResponse, eos_token_ids: tuple[int, ...]
    ) -> Processor:
        """Validate against the capacity the engine actually computed, not the options asked for."""
        vocab_size = min(len(tokenizer), ready.vocab_size)
        return cls(tokenizer, ready.max_model_len, eos_token_ids, vocab_size=vocab_size)

    def tokenize(self, prompt: PromptType, add_special_tokens: bool = True) -> tuple[str | None, list[int]]:
        """Return (prompt text or None, prompt token ids); add_special_tokens applies to text (e.g. BOS)."""
        if isinstance(prompt, str):
            return prompt, self.tokenizer(prompt, add_special_tokens=add_special_tokens).input_ids
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                return self.tokenize(prompt["prompt"], add_special_tokens)
            raise ValueError(
                f"A prompt dict needs 'prompt' or 'prompt_token_ids', got keys {sorted(prompt)}."
            )
        if isinstance(prompt, list | tuple) and all(isinstance(t, int) for t in prompt):
            return None, list(prompt)
        raise ValueError(
            f"A prompt must be a string, a list of token ids or a dict, got {type(prompt).__name__}."
        )

    def render_chat(
        self,
        conversation: Conversation,
        add_generation_prompt: bool = True,
        *,
        tools: list[dict[str, Any]] | None = None,
        chat_template: str | None = None,
        continue_final_message: bool = False,
        add_special_tokens: bool = False,
    ) -> dict[str, Any]:
        """Apply the chat template (the tokenizer's unless one is given); the template writes its own
        special tokens, so the tokenizer adds none unless asked. continue_final_message leaves the last
        message open for the model to go on."""
        text = self.tokenizer.apply_chat_template(
            conversation,
            tools=tools,
            chat_template=chat_template,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
        )
        ids = self.tokenizer(text, add_special_tokens=add_special_tokens).input_ids
        return {"prompt": text, "prompt_token_ids": ids}

    def detokenize(self, token_ids: list[int]) -> str:
        self._validate_token_ids(token_ids, "Token")
        return self.tokenizer.decode(token_ids)

    def process(
        self, request_id: str, prompt: PromptType, params: SamplingParams, final_output_only: bool = False
    ) -> tuple[str | None, EngineCoreRequest]:
        """Return (prompt text or None, the request for the engine core). final_output_only: the caller
        reads only finished outputs; the engine then sends the first token and then chunks, unless stop
        strings need every step (see EngineCoreRequest.final_output_only)."""
        params.validate()
        text, prompt_token_ids = self.tokenize(prompt)
        self._validate_prompt(prompt_token_ids)
        self._validate_param_token_ids(params)
        if params.structured_outputs is not None:
            structured_output.validate(params.structured_outputs)
        params = self._with_bad_words_token_ids(self._fit_max_tokens(params, len(prompt_token_ids)))
        request = EngineCoreRequest(
            request_id=request_id,
            prompt_token_ids=prompt_token_ids,
            sampling_params=params,
            eos_token_ids=list(self.eos_token_ids),
            arrival_time=time.time(),
            final_output_only=final_output_only and not params.stop,
        )
        return text, request

    def _validate_prompt(self, prompt_token_ids: list[int]) -> None:
        if not prompt_token_ids:
            raise ValueError("The prompt is empty; it must contain at least one token.")
        if len(prompt_token_ids) >= self.max_model_len:
            raise ValueError(
                f"The prompt ({len(prompt_token_ids)} tokens) is longer than the maximum model length of "
                f"{self.max_model_len} tokens minus one generated token; shorten the prompt or raise "
                "max_model_len."
            )
        self._validate_token_ids(prompt_token_ids, "Prompt token")

    def _validate_token_ids(self, token_ids: list[int], what: str) -> None:
        bad = [t for t in token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"{what} id(s) {bad[:5]} are out of the vocabulary [0, {self.vocab_size}).")

    def _validate_param_token_ids(self, params: SamplingParams) -> None:
        for name in ("stop_token_ids", "allowed_token_ids", "logit_bias"):
            self._validate_token_ids(list(getattr(params, name) or ()), name)

    def _with_bad_words_token_ids(self, params: SamplingParams) -> SamplingParams:
        """bad_words as the token sequences to avoid: each word as tokenized at the start of the text
        and after a space. (vLLM keeps the second only when it has as many tokens as the first, which
        suits SentencePiece; with byte-level BPE " word" is often one token where "word" is several.)"""
        if not params.bad_words:
            return params
        sequences: list[list[int]] = []
        for word in params.bad_words:
            alone = self.tokenizer(word.lstrip(), add_special_tokens=False).input_ids
            spaced = self.tokenizer(" " + word.lstrip(), add_special_tokens=False).input_ids
            sequences.append(alone)
            if spaced != alone:
                sequences.append(spaced)
        return msgspec.structs.replace(params, bad_words_token_ids=sequences)

    def _fit_max_tokens(self, params: SamplingParams, prompt_len: int) -> SamplingParams:
        """Clamp max_tokens to the room left in the context; None fills it. Never mutates the caller's params."""
        room = self.max_model_len - prompt_len
        if params.max_tokens is not None and params.max_tokens <= room:
            return params
        return msgspec.structs.replace(params, max_tokens=room, min_tokens=min(params.min_tokens, room))
