"""The OpenAI API's request and response bodies, as pydantic models (plus vLLM's extra fields).

Every request field is one of three kinds, decided field by field:
- implemented; wrong types and out-of-range values are refused at parse time (400 naming the field);
- known but not implemented, listed in the request's `not_implemented` (or `refused_fields()` for
  conditions of its own): a request that gives it a value with an effect is refused with a 400 naming
  it; null or the default (which has no effect) is accepted;
- accepted because it has no effect on what nanoserve returns by definition (`user`, `metadata` ...).
Fields nanoserve does not know are accepted, so that unmodified clients work, and `unknown_fields()`
names them for a warning in the log.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Mapping
from typing import Annotated, Any, ClassVar, Literal, cast

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from nanoserve.sampling_params import MAX_LOGIT_BIAS, SamplingParams, StructuredOutputsParams

MAX_N = 64
"""Most samples one request may ask for."""
MAX_LOGPROBS = 20
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
"""Integers cross to the engine as msgpack int64 (a seed + sample index stays within uint64)."""

Int64 = Annotated[int, Field(ge=INT64_MIN, le=INT64_MAX)]
TokenId = Annotated[int, Field(ge=0, le=INT64_MAX)]


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


class OpenAIModel(BaseModel):
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)


# -- errors -----------------------------------------------------------------------------------


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int | str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


# -- requests ---------------------------------------------------------------------------------


class StreamOptions(OpenAIModel):
    include_usage: bool = False


class StrictModel(BaseModel):
    """A nested request object whose every field nanoserve implements: anything else is a 400."""

    model_config = ConfigDict(extra="forbid")


class JsonSchemaFormat(StrictModel):
    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] = Field(default_factory=dict, alias="schema")
    strict: bool | None = None


class ResponseFormat(StrictModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("response_format of type json_schema needs json_schema")
        return self


class StructuredOutputsRequest(StrictModel):
    """vLLM's `structured_outputs`: exactly one of these."""

    json_: str | dict[str, Any] | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


LogitBiasValue = Annotated[float, Field(ge=-MAX_LOGIT_BIAS, le=MAX_LOGIT_BIAS)]


class OpenAIRequest(OpenAIModel):
    """A request body: it can say which of its fields nanoserve refuses and which it does not know."""

    model: str | None = None

    not_implemented: ClassVar[dict[str, str]] = {}
    """Field -> why it is refused when given a value with an effect (anything but null or its default)."""

    def refused_fields(self) -> dict[str, str]:
        """Field -> why this request cannot be served as asked (subclasses add conditions of their own)."""
        fields = type(self).model_fields
        refused = {}
        for name, reason in self.not_implemented.items():
            value = getattr(self, name)
            if value is not None and value != fields[name].default:
                refused[name] = reason
        return refused

    def unknown_fields(self) -> list[str]:
        """Dotted paths of the fields nanoserve does not know, nested models included (`messages[].name`)."""
        return sorted(set(_unknown_fields(self, "")))


def _unknown_fields(model: BaseModel, prefix: str) -> list[str]:
    names = [prefix + name for name in model.model_extra or {}]
    for name in type(model).model_fields:
        value = getattr(model, name)
        if isinstance(value, BaseModel):
            names += _unknown_fields(value, f"{prefix}{name}.")
        elif isinstance(value, list):
            for item in value:
                if isinstance(item, BaseModel):
                    names += _unknown_fields(item, f"{prefix}{name}[].")
    return names


class SamplingRequest(OpenAIRequest):
    """Fields shared by completions and chat completions."""

    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: Int64 | None = Field(default=None, ge=-1)
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    seed: Int64 | None = None
    stop: str | list[str] | None = None
    n: int = Field(default=1, ge=1, le=MAX_N)
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(default=1.0, gt=0.0)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    """An end-user id for the caller's own abuse tracking: no effect by definition."""
    # vLLM's extra fields (sent through the openai client's extra_body)
    ignore_eos: bool = False
    min_tokens: int = Field(default=0, ge=0)
    include_stop_str_in_output: bool = False
    stop_token_ids: list[TokenId] | None = None
    skip_special_tokens: bool = True
    request_id: str | None = Field(default=None, min_length=1, max_length=256)
    """vLLM's: the id the response carries (`cmpl-<request_id>`) instead of a random one."""
    use_beam_search: bool = False
    length_penalty: float = 1.0
    spaces_between_special_tokens: bool = True
    truncate_prompt_tokens: int | None = None
    priority: int = 0
    cache_salt: str | None = None
    logits_processors: list[Any] | None = None
    return_tokens_as_token_ids: bool = False
    return_token_ids: bool = False
    # structured outputs and hard sampling controls
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsRequest | None = None
    logit_bias: dict[str, LogitBiasValue] | None = None
    """OpenAI's: token id (as a string) -> bias."""
    allowed_token_ids: list[TokenId] | None = None
    bad_words: list[str] | None = None
    prompt_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)

    not_implemented: ClassVar[dict[str, str]] = {
        "use_beam_search": "beam search is not implemented",
        "length_penalty": "length_penalty only applies to beam search, which is not implemented",
        "spaces_between_special_tokens": "special tokens are always decoded with the tokenizer's spacing",
        "truncate_prompt_tokens": "prompts are never truncated; a prompt too long is refused",
        "priority": "requests are scheduled first come, first served",
        "cache_salt": "the prefix cache is shared by all requests",
        "logits_processors": "custom logits processors are not implemented",
        "return_tokens_as_token_ids": "tokens are returned as text",
        "return_token_ids": "token ids are not returned",
    }

    @model_validator(mode="after")
    def _one_constraint_and_stream_options(self) -> SamplingRequest:
        if (
            self.response_format is not None
            and self.response_format.type != "text"
            and self.structured_outputs
        ):
            raise ValueError("response_format and structured_outputs cannot be used together")
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options can only be set when stream is true")
        return self

    @field_validator("logit_bias")
    @classmethod
    def _token_id_keys(cls, bias: dict[str, float] | None) -> dict[str, float] | None:
        if bias is not None and not all(k.isdigit() for k in bias):
            raise ValueError("logit_bias keys must be token ids (non-negative integers)")
        return bias

    @field_validator("stop")
    @classmethod
    def _non_empty_stops(cls, stop: str | list[str] | None) -> str | list[str] | None:
        stops = [stop] if isinstance(stop, str) else stop or []
        if any(not s for s in stops):
            raise ValueError("stop strings must be non-empty")
        return stop

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    def requested_logprobs(self) -> int | None:
        return None

    def response_id(self, prefix: str) -> str:
        return f"{prefix}-{self.request_id}" if self.request_id else random_id(prefix)

    def to_sampling_params(
        self, max_tokens: int | None, defaults: Mapping[str, Any] | None = None
    ) -> SamplingParams:
        """max_tokens: the value to use (None: up to the context length). defaults: the model's generation
        config (nanoserve.model_files.generation_defaults), for the sampling fields this request leaves out."""
        stop = [self.stop] if isinstance(self.stop, str) else self.stop

        def field(name: str, fallback: Any) -> Any:
            """The client's value, else the model's default, else OpenAI's."""
            value = getattr(self, name)
            if name in self.model_fields_set and value is not None:
                return value
            return (defaults or {}).get(name, fallback)

        return SamplingParams(
            n=self.n,
            temperature=field("temperature", 1.0),
            top_p=field("top_p", 1.0),
            top_k=field("top_k", 0),
            min_p=field("min_p", 0.0),
            seed=self.seed,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=field("repetition_penalty", 1.0),
            stop=stop or None,
            stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos,
            logprobs=self.requested_logprobs(),
            include_stop_str_in_output=self.include_stop_str_in_output,
            skip_special_tokens=self.skip_special_tokens,
            logit_bias={int(k): v for k, v in self.logit_bias.items()} if self.logit_bias else None,
            allowed_token_ids=self.allowed_token_ids,
            bad_words=self.bad_words,
            prompt_logprobs=self.prompt_logprobs,
            structured_outputs=self.structured_spec(),
        )

    def structured_spec(self) -> StructuredOutputsParams | None:
        """The constraint response_format or structured_outputs asks for (ValueError when malformed)."""
        if self.structured_outputs is not None:
            return StructuredOutputsParams(
                **self.structured_outputs.model_dump(exclude_none=True, by_alias=True)
            )
        fmt = self.response_format
        if fmt is None or fmt.type == "text":
            return None
        if fmt.type == "json_object":
            return StructuredOutputsParams(json_object=True)
        assert fmt.json_schema is not None
        return StructuredOutputsParams(json=fmt.json_schema.schema_ or {"type": "object"})


class CompletionRequest(SamplingRequest):
    prompt: str | list[str] | list[TokenId] | list[list[TokenId]]
    max_tokens: int | None = Field(default=16, ge=0)
    """0 (with echo) scores the prompt without generating, as lm-eval's loglikelihood requests do."""
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = Field(default=None, ge=1, le=MAX_N)
    add_special_tokens: bool = True
    """vLLM's: whether the tokenizer adds its special tokens (e.g. BOS) to a text prompt."""

    not_implemented: ClassVar[dict[str, str]] = {
        **SamplingRequest.not_implemented,
        "suffix": "insertion (text after the completion) is not implemented",
    }

    @field_validator("best_of")
    @classmethod
    def _best_of_at_least_n(cls, best_of: int | None, info: ValidationInfo) -> int | None:
        if best_of is not None and best_of < info.data.get("n", 1):
            raise ValueError("best_of must be at least n")
        return best_of

    def refused_fields(self) -> dict[str, str]:
        refused = super().refused_fields()
        if self.best_of is not None and self.best_of > self.n:
            refused["best_of"] = (
                "best_of greater than n (returning the best n of more samples) is not implemented"
            )
        return refused

    @model_validator(mode="after")
    def _zero_tokens_need_echo(self) -> CompletionRequest:
        if self.max_tokens == 0 and not self.echo:
            raise ValueError("max_tokens 0 is only meaningful with echo (to score the prompt)")
        return self

    @field_validator("prompt")
    @classmethod
    def _non_empty_prompt(cls, prompt: Any) -> Any:
        if isinstance(prompt, list) and not prompt:
            raise ValueError("prompt must not be an empty list")
        return prompt

    def prompts(self) -> list[str | list[int]]:
        """The prompt as a list of prompts (text or token ids)."""
        if isinstance(self.prompt, str):
            return [self.prompt]
        if all(isinstance(p, int) for p in self.prompt):
            return [cast(list[int], list(self.prompt))]
        return cast(list[str | list[int]], list(self.prompt))

    def requested_logprobs(self) -> int | None:
        return self.logprobs

    def requested_max_tokens(self) -> int | None:
        return 1 if self.max_tokens == 0 else self.max_tokens  # the one token is generated, then dropped


class FunctionCallMessage(OpenAIModel):
    name: str
    arguments: str
    """JSON text, as OpenAI sends it."""


class ToolCallMessage(OpenAIModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallMessage


class ChatMessage(OpenAIModel):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[ToolCallMessage] | None = None
    tool_call_id: str | None = None

    def to_template(self) -> dict[str, Any]:
        """The message as HF chat templates read it: tool-call arguments as objects, not JSON text."""
        message: dict[str, Any] = {"role": self.role, "content": self.text()}
        if self.name is not None:
            message["name"] = self.name
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        if self.tool_calls:
            calls = []
            for call in self.tool_calls:
                try:
                    arguments = json.loads(call.function.arguments)
                except json.JSONDecodeError as e:
                    raise ValueError(f"tool call {call.id} has arguments that are not JSON: {e}") from e
                calls.append(
                    {
                        "id": call.id,
                        "type": "function",
                        "function": {"name": call.function.name, "arguments": arguments},
                    }
                )
            message["tool_calls"] = calls
        return message

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        parts = []
        for part in self.content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ValueError("only text content parts are supported")
            parts.append(part["text"])
        return "".join(parts)


class FunctionDefinition(StrictModel):
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ChatTool(StrictModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(StrictModel):
    name: str


class NamedToolChoice(StrictModel):
    type: Literal["function"] = "function"
    function: NamedFunction


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: bool = True
    add_special_tokens: bool = False
    """vLLM's: whether the tokenizer adds special tokens on top of those the chat template writes."""
    continue_final_message: bool = False
    """vLLM's: the last message stays open and the model continues it (needs add_generation_prompt false)."""
    tools: list[ChatTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    """None: "auto" with tools, "none" without (OpenAI's default)."""
    parallel_tool_calls: bool = True
    # no effect on what nanoserve returns, by definition
    metadata: dict[str, str] | None = None
    """Tags for stored completions; nothing is stored."""
    store: bool = False
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    """A routing hint for prompt caching; nanoserve's prefix cache finds shared prefixes by itself."""
    prediction: dict[str, Any] | None = None
    """Predicted output, a latency hint: the output is the same without it."""
    service_tier: Literal["auto", "default", "flex", "scale", "priority"] | None = None
    # known, not implemented
    modalities: list[Literal["text", "audio"]] | None = None
    audio: dict[str, Any] | None = None
    functions: list[dict[str, Any]] | None = None
    function_call: str | dict[str, Any] | None = None
    reasoning_effort: str | None = None
    verbosity: str | None = None
    web_search_options: dict[str, Any] | None = None
    echo: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    documents: list[dict[str, Any]] | None = None
    mm_processor_kwargs: dict[str, Any] | None = None

    not_implemented: ClassVar[dict[str, str]] = {
        **SamplingRequest.not_implemented,
        "store": "completions are not stored",
        "audio": "audio output is not implemented",
        "functions": "the deprecated functions API is not implemented",
        "function_call": "the deprecated functions API is not implemented",
        "reasoning_effort": "the served models have no reasoning control",
        "verbosity": "the served models have no verbosity control",
        "web_search_options": "web search is not implemented",
        "echo": "echoing the last message is not implemented",
        "chat_template": "the chat template is the server's (--chat-template), not the request's",
        "chat_template_kwargs": "the chat template takes no extra arguments",
        "documents": "documents for the chat template are not implemented",
        "mm_processor_kwargs": "the served models take text only",
    }

    def refused_fields(self) -> dict[str, str]:
        refused = super().refused_fields()
        if self.modalities is not None and set(self.modalities) - {"text"}:
            refused["modalities"] = "only text output is implemented"
        if self.service_tier in ("flex", "scale", "priority"):
            refused["service_tier"] = "there is one service tier (auto / default)"
        return refused

    @model_validator(mode="after")
    def _consistent_chat_options(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs set to true")
        if self.continue_final_message and self.add_generation_prompt:
            raise ValueError("continue_final_message needs add_generation_prompt set to false")
        if self.tool_choice not in (None, "none") and not self.tools:
            raise ValueError("tool_choice needs tools")
        return self

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def requested_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def conversation(self) -> list[dict[str, Any]]:
        return conversation(self.messages)


def conversation(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """Messages as the chat template takes them; ValueError for content it cannot take."""
    return [m.to_template() for m in messages]


class TokenizeCompletionRequest(OpenAIRequest):
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(OpenAIRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True
    add_special_tokens: bool = False
    return_token_strs: bool = False

    def conversation(self) -> list[dict[str, Any]]:
        return conversation(self.messages)


TokenizeRequest = TokenizeCompletionRequest | TokenizeChatRequest
"""vLLM's /tokenize body: a text `prompt`, or chat `messages` rendered by the chat template."""


class DetokenizeRequest(OpenAIRequest):
    tokens: list[TokenId]


# -- responses --------------------------------------------------------------------------------


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0

    def add_completion_tokens(self, num_tokens: int) -> None:
        self.completion_tokens += num_tokens
        self.total_tokens += num_tokens


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob] | None = None


class FunctionCall(BaseModel):
    name: str
    arguments: str


class ToolCallResponse(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatResponseMessage(BaseModel):
    role: str = "assistant"
    content: str | None = None
    tool_calls: list[ToolCallResponse] = Field(default_factory=list)


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo


class DeltaFunctionCall(BaseModel):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(BaseModel):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall


class DeltaMessage(BaseModel):
    role: str | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeResponse(BaseModel):
    prompt: str


class HealthResponse(BaseModel):
    status: Literal["ok", "restarting", "degraded"]
    restarting_ranks: list[int] = Field(default_factory=list)
    """Engine ranks on their way back after a death (--engine-restarts)."""
    dead_ranks: list[int] = Field(default_factory=list)
    """Data parallel: ranks that died while others still serve."""
    errors: dict[str, str] = Field(default_factory=dict)
    """Rank -> why it died."""


class VersionResponse(BaseModel):
    version: str


class SleepState(BaseModel):
    is_sleeping: bool


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "nanoserve"
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
