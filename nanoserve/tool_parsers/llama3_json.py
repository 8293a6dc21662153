"""Llama 3.1 / 3.2 JSON tool calls: the output is `{"name": ..., "parameters": {...}}` (optionally after
`<|python_tag|>`), several separated by `;`."""

from __future__ import annotations

import json

from nanoserve.tool_parsers.base import ToolCall, ToolParser, tool_call

PYTHON_TAG = "<|python_tag|>"


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"
    marker = PYTHON_TAG

    def find_start(self, text: str) -> int:
        """A call is the whole output: the tag, or a JSON object opening the text."""
        if text.startswith(PYTHON_TAG):
            return 0
        stripped = text.lstrip()
        return len(text) - len(stripped) if stripped.startswith("{") else -1

    def parse_calls(self, text: str) -> list[ToolCall]:
        text = text.removeprefix(PYTHON_TAG).strip()
        decoder = json.JSONDecoder()
        calls, position = [], 0
        while position < len(text):
            call, position = decoder.raw_decode(text, position)
            calls.append(tool_call(call["name"], call.get("parameters", call.get("arguments", {}))))
            position = _skip(text, position, " \n\t;")
        return calls


def _skip(text: str, position: int, chars: str) -> int:
    while position < len(text) and text[position] in chars:
        position += 1
    return position
