"""SamplingParams: what a caller asks of one request's decoding.

It is a msgspec Struct because it travels inside `EngineCoreRequest` to the engine core unchanged;
it imports nothing else from nanoserve so that the wire schema can embed it.
"""

from __future__ import annotations

from typing import Any

import msgspec

MAX_LOGIT_BIAS = 100.0
"""OpenAI's bound on a logit_bias value."""


class StructuredOutputsParams(msgspec.Struct, omit_defaults=True, kw_only=True):
    """One constraint the output must satisfy (vLLM's `structured_outputs`); exactly one field is set.

    json: a JSON schema (dict or its text); regex; choice: the output is one of these strings;
    grammar: a Lark or GBNF/EBNF grammar; json_object: any JSON object.
    """

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None

    def __post_init__(self) -> None:
        given = [name for name in self.__struct_fields__ if getattr(self, name) not in (None, False)]
        if len(given) != 1:
            raise ValueError(
                "structured_outputs needs exactly one of json, regex, choice, grammar, json_object; "
                f"got {', '.join(given) or 'none'}."
            )
        if self.choice is not None and not self.choice:
            raise ValueError("structured_outputs.choice must list at least one string.")

    @property
    def kind(self) -> str:
        return next(name for name in self.__struct_fields__ if getattr(self, name) not in (None, False))


GREEDY_TEMPERATURE = 1e-5
"""Temperatures under this are greedy, as in vLLM: the softmax at such a temperature is the argmax but for
near ties, and dividing by one under about 3e-39 overflows the logits to infinity (NaN probabilities)."""


class SamplingParams(msgspec.Struct, omit_defaults=True, kw_only=True):
    n: int = 1
    temperature: float = 1.0
    """0, or anything under GREEDY_TEMPERATURE, is greedy."""
    top_p: float = 1.0
    top_k: int = 0
    """0 or -1 disables top-k."""
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    """None means: up to the model's context length."""
    min_tokens: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    """Number of top logprobs to return per generated token (the sampled one is always included)."""
    prompt_logprobs: int | None = None
    """Number of top logprobs to return per prompt token (the prompt's own token is always included)."""
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    logit_bias: dict[int, float] | None = None
    """Token id -> value added to its logit before sampling, in [-100, 100] (OpenAI's logit_bias)."""
    allowed_token_ids: list[int] | None = None
    """Only these tokens may be sampled."""
    bad_words: list[str] | None = None
    """Words whose token sequences must not be generated (vLLM's meaning)."""
    bad_words_token_ids: list[list[int]] | None = None
    """bad_words as token sequences, filled in by the frontend's processor from the tokenizer."""
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.validate()

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1

    def validate(self) -> None:
        """Raise ValueError naming the first bad field; called on construction and by the processor."""
        if self.n < 1:
            raise ValueError(f"n must be at least 1, got {self.n}.")
        if self.temperature < 0.0:
            raise ValueError(f"temperature must be non-negative, got {self.temperature}.")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}.")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool):
            raise ValueError(f"top_k must be an integer, got {self.top_k!r}.")
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1 (disable), 0 (disable) or at least 1, got {self.top_k}.")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}.")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}.")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be non-negative, got {self.min_tokens}.")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens must be less than or equal to max_tokens={self.max_tokens}, got {self.min_tokens}."
            )
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise ValueError(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}.")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise ValueError(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}.")
        if self.repetition_penalty <= 0.0:
            raise ValueError(f"repetition_penalty must be greater than zero, got {self.repetition_penalty}.")
        if self.logprobs is not None and self.logprobs < 0:
            raise ValueError(f"logprobs must be non-negative, got {self.logprobs}.")
        if self.stop_token_ids is not None and any(t < 0 for t in self.stop_token_ids):
            raise ValueError("stop_token_ids must be non-negative token ids.")
        if self.stop is not None and any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty.")
        if self.prompt_logprobs is not None and self.prompt_logprobs < 0:
            raise ValueError(f"prompt_logprobs must be non-negative, got {self.prompt_logprobs}.")
        if self.logit_bias is not None:
            if any(t < 0 for t in self.logit_bias):
                raise ValueError("logit_bias keys must be non-negative token ids.")
            if any(not -MAX_LOGIT_BIAS <= b <= MAX_LOGIT_BIAS for b in self.logit_bias.values()):
                raise ValueError(f"logit_bias values must be in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}].")
        if self.allowed_token_ids is not None:
            if not self.allowed_token_ids:
                raise ValueError("allowed_token_ids must not be empty.")
            if any(t < 0 for t in self.allowed_token_ids):
                raise ValueError("allowed_token_ids must be non-negative token ids.")
        if self.bad_words is not None and any(not w.strip() for w in self.bad_words):
            raise ValueError("bad_words must be non-empty strings.")
