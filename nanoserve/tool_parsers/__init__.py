"""Tool-call parsers, one module per format, by name (`--tool-call-parser`) or found from the chat
template: hermes (Hermes, Qwen2.5, Qwen3 and others using `<tool_call>` blocks), llama3_json
(Llama 3.1-3.3), mistral (`[TOOL_CALLS]`)."""

from __future__ import annotations

from nanoserve.tool_parsers.base import ToolCall, ToolCallStream, ToolParser, tool_call
from nanoserve.tool_parsers.hermes import HermesToolParser
from nanoserve.tool_parsers.llama3_json import Llama3JsonToolParser
from nanoserve.tool_parsers.mistral import MistralToolParser

PARSERS: dict[str, type[ToolParser]] = {
    p.name: p for p in (HermesToolParser, Llama3JsonToolParser, MistralToolParser)
}

# what a chat template that renders tools writes for a call, in the order tried
_TEMPLATE_SIGNS = (("<tool_call>", "hermes"), ("[TOOL_CALLS]", "mistral"), ("<|python_tag|>", "llama3_json"))


def get_parser(name: str) -> ToolParser:
    if name not in PARSERS:
        raise ValueError(f"Unknown tool call parser {name!r}; known: {', '.join(sorted(PARSERS))}.")
    return PARSERS[name]()


def detect_parser(chat_template: str) -> ToolParser | None:
    """The parser for the tool-call format a chat template writes, or None when it shows none."""
    for sign, name in _TEMPLATE_SIGNS:
        if sign in chat_template:
            return get_parser(name)
    return None


__all__ = ["PARSERS", "ToolCall", "ToolCallStream", "ToolParser", "detect_parser", "get_parser", "tool_call"]
