"""Hermes / Qwen2.5 / Qwen3: `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`, one block
per call."""

from __future__ import annotations

import json
import re

from nanoserve.tool_parsers.base import ToolCall, ToolParser, tool_call

BLOCK = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)


class HermesToolParser(ToolParser):
    name = "hermes"
    marker = "<tool_call>"

    def parse_calls(self, text: str) -> list[ToolCall]:
        calls = []
        for body in BLOCK.findall(text):
            call = json.loads(body.strip())
            calls.append(tool_call(call["name"], call.get("arguments", call.get("parameters", {}))))
        if not calls:
            raise ValueError("no tool call blocks")
        return calls
