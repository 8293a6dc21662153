"""Tool calling for /v1/chat/completions: what a request's tool_choice asks of the engine and how its
output becomes `tool_calls`, whole or as OpenAI's streamed deltas.

- "none": the tools are rendered, the output is text.
- "auto": the output is read by the tool-call parser of the model's format (`nanoserve.tool_parsers`).
- "required" and a named function: structured output forces the calls, so their arguments always
  parse and validate against the function's schema. "required" makes the output a JSON array of
  {"name", "parameters"} (one item when parallel_tool_calls is false); a named function makes it that
  function's arguments.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from nanoserve.entrypoints.openai.errors import OpenAIError
from nanoserve.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    DeltaFunctionCall,
    DeltaToolCall,
    FunctionCall,
    ToolCallResponse,
)
from nanoserve.sampling_params import StructuredOutputsParams
from nanoserve.tool_parsers import ToolCall, ToolCallStream, ToolParser, tool_call

ANY_ARGUMENTS: dict[str, Any] = {"type": "object"}


@dataclass
class ToolChoice:
    """A request's tool_choice, checked against its tools and the server's template and parser."""

    mode: str
    """none, auto, required or named."""
    tools: list[dict[str, Any]] = field(default_factory=list)
    """The tools as the chat template reads them."""
    function: str | None = None
    """The named function."""
    parser: ToolParser | None = None
    parallel: bool = True

    @classmethod
    def from_request(
        cls, request: ChatCompletionRequest, renders_tools: bool, parser: ToolParser | None
    ) -> ToolChoice:
        if not request.tools:
            return cls("none")
        if not renders_tools:
            raise OpenAIError(
                "The chat template does not render tools; start the server with --chat-template "
                "pointing to a template that does.",
                param="tools",
            )
        tools = [t.model_dump(exclude_none=True) for t in request.tools]
        choice = request.tool_choice or "auto"
        if not isinstance(choice, str):
            names = [t.function.name for t in request.tools]
            if choice.function.name not in names:
                raise OpenAIError(
                    f"tool_choice names {choice.function.name!r}, which is not among the tools ({', '.join(names)}).",
                    param="tool_choice",
                )
            if request.structured_spec() is not None:
                raise OpenAIError(
                    "A named tool_choice cannot be combined with response_format or structured_outputs.",
                    param="tool_choice",
                )
            return cls("named", tools, function=choice.function.name)
        if choice == "auto" and parser is None:
            raise OpenAIError(
                'tool_choice "auto" needs a tool call parser, and none matches this chat template; start '
                "the server with --tool-call-parser.",
                param="tool_choice",
            )
        if choice == "required" and request.structured_spec() is not None:
            raise OpenAIError(
                f"tool_choice {choice!r} cannot be combined with response_format or structured_outputs.",
                param="tool_choice",
            )
        return cls(
            choice, tools, parser=parser if choice == "auto" else None, parallel=request.parallel_tool_calls
        )

    def constraint(self) -> StructuredOutputsParams | None:
        """What structured output enforces, for "required" and named choices."""
        parameters = {
            t["function"]["name"]: t["function"].get("parameters") or ANY_ARGUMENTS for t in self.tools
        }
        if self.mode == "named":
            assert self.function is not None
            return StructuredOutputsParams(json=parameters[self.function])
        if self.mode != "required":
            return None
        call = [
            {
                "type": "object",
                "properties": {"name": {"const": name}, "parameters": schema},
                "required": ["name", "parameters"],
                "additionalProperties": False,
            }
            for name, schema in parameters.items()
        ]
        array: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": call}}
        if not self.parallel:
            array["maxItems"] = 1
        return StructuredOutputsParams(json=array)

    @property
    def needs_special_tokens(self) -> bool:
        return self.parser is not None and self.parser.needs_special_tokens

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content, calls) of a finished output."""
        if self.mode == "named":
            assert self.function is not None
            return None, [ToolCall(self.function, text)]
        if self.mode == "required":
            try:
                return None, [tool_call(c["name"], c["parameters"]) for c in json.loads(text)]
            except (ValueError, KeyError, TypeError):
                return text, []  # cut short (max_tokens): the text is all there is
        if self.parser is not None:
            return self.parser.parse(text)
        return text, []

    def finish_reason(self, calls: list[ToolCall], finish_reason: str | None) -> str | None:
        """OpenAI's: "tool_calls" when the model chose to call (a forced named call ends with "stop")."""
        if calls and self.mode in ("auto", "required") and finish_reason == "stop":
            return "tool_calls"
        return finish_reason


def tool_call_responses(calls: list[ToolCall]) -> list[ToolCallResponse]:
    return [
        ToolCallResponse(id=c.id, function=FunctionCall(name=c.name, arguments=c.arguments)) for c in calls
    ]


class ToolDeltaStream:
    """One choice's streamed output as content deltas and tool-call deltas.

    A named call streams its arguments as they are generated; "required" and "auto" calls are sent
    whole, each as one delta, once the output is complete (auto's text before a call streams as content).
    """

    def __init__(self, choice: ToolChoice) -> None:
        self.choice = choice
        self.named_call = (
            ToolCall(choice.function, "") if choice.mode == "named" and choice.function else None
        )
        self.text_stream = ToolCallStream(choice.parser) if choice.parser is not None else None
        self.text = ""
        self.calls: list[ToolCall] = []

    def feed(self, delta: str) -> tuple[str | None, list[DeltaToolCall] | None]:
        """(content delta, tool-call deltas) for newly generated text."""
        if self.named_call is not None:
            first = not self.text
            self.text += delta
            if not delta and not first:
                return None, None
            call = self.named_call
            function = DeltaFunctionCall(name=call.name if first else None, arguments=delta)
            head = DeltaToolCall(
                index=0, id=call.id if first else None, type="function" if first else None, function=function
            )
            return None, [head]
        if self.choice.mode == "required":
            self.text += delta
            return None, None
        if self.text_stream is not None:
            return self.text_stream.feed(delta) or None, None
        return delta or None, None

    def finish(self) -> tuple[str | None, list[DeltaToolCall] | None]:
        """What is left to send once the output is complete."""
        if self.named_call is not None:
            self.calls = [ToolCall(self.named_call.name, self.text, self.named_call.id)]
            return None, None
        if self.choice.mode == "required":
            content, self.calls = self.choice.parse(self.text)
        elif self.text_stream is not None:
            content, self.calls = self.text_stream.finish()
        else:
            return None, None
        deltas = [
            DeltaToolCall(
                index=i,
                id=c.id,
                type="function",
                function=DeltaFunctionCall(name=c.name, arguments=c.arguments),
            )
            for i, c in enumerate(self.calls)
        ]
        return content or None, deltas or None
