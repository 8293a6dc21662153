"""Mistral: `[TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]`, or in newer tokenizers (v11+)
`[TOOL_CALLS]name[ARGS]{...}` once per call. `[TOOL_CALLS]` is a special token."""

from __future__ import annotations

import json

from nanoserve.tool_parsers.base import ToolCall, ToolParser, tool_call

TOOL_CALLS = "[TOOL_CALLS]"
ARGS = "[ARGS]"


class MistralToolParser(ToolParser):
    name = "mistral"
    marker = TOOL_CALLS
    needs_special_tokens = True

    def parse_calls(self, text: str) -> list[ToolCall]:
        calls = []
        decoder = json.JSONDecoder()
        for part in text.split(TOOL_CALLS)[1:]:
            part = part.strip()
            if ARGS in part:
                name, _, arguments = part.partition(ARGS)
                parsed, _ = decoder.raw_decode(arguments.strip())
                calls.append(tool_call(name.strip(), parsed))
                continue
            parsed, _ = decoder.raw_decode(part)
            for call in parsed if isinstance(parsed, list) else [parsed]:
                calls.append(tool_call(call["name"], call.get("arguments", {})))
        if not calls:
            raise ValueError("no tool calls after [TOOL_CALLS]")
        return calls
