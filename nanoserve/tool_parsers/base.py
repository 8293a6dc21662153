"""ToolParser: a model family's tool-call format, read out of generated text.

A parser knows the marker that opens a tool call in its format. `parse` splits a finished output into
the text before the calls and the calls. `ToolCallStream` applies one to streamed text: text is passed
on until a marker begins (a possible marker prefix is held back), and everything from the marker on is
parsed once the output is finished.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any


@dataclass
class ToolCall:
    name: str
    arguments: str
    """The arguments as JSON text, as OpenAI sends them."""
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")


def tool_call(name: Any, arguments: Any) -> ToolCall:
    """A call from a parsed name and arguments (an object, or JSON text of one)."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"a tool call needs a function name, got {name!r}")
    if isinstance(arguments, str):
        arguments = json.loads(arguments)
    if not isinstance(arguments, dict):
        raise ValueError(f"tool call arguments must be an object, got {type(arguments).__name__}")
    return ToolCall(name, json.dumps(arguments, ensure_ascii=False))


class ToolParser:
    name = ""
    marker = ""
    """Text that opens the tool calls of this format."""
    needs_special_tokens = False
    """True when the marker is a special token, so the output must be decoded with special tokens."""

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(the text before the calls or None when empty, the calls); text that does not hold
        well-formed calls comes back whole as text with no calls."""
        start = self.find_start(text)
        if start < 0:
            return text or None, []
        try:
            calls = self.parse_calls(text[start:])
        except (ValueError, KeyError, TypeError):
            return text or None, []
        content = text[:start].strip()
        return content or None, calls

    def find_start(self, text: str) -> int:
        return text.find(self.marker)

    def parse_calls(self, text: str) -> list[ToolCall]:
        """The calls in `text`, which starts at the marker; ValueError when they are malformed."""
        raise NotImplementedError


class ToolCallStream:
    """Streams content until a tool call begins; `finish` parses what followed."""

    def __init__(self, parser: ToolParser) -> None:
        self.parser = parser
        self.text = ""
        self.num_sent = 0
        self.in_call = False

    def feed(self, delta: str) -> str:
        """Add generated text; return the content that can be shown now."""
        self.text += delta
        if self.in_call:
            return ""
        start = self.parser.find_start(self.text)
        if start >= 0:
            self.in_call = True
            return self._send(start)
        return self._send(len(self.text) - _held_back(self.text, self.parser.marker))

    def finish(self) -> tuple[str, list[ToolCall]]:
        """(the content not yet shown, the calls) once the output is complete."""
        content, calls = self.parser.parse(self.text)
        if not calls:
            return self._send(len(self.text)), []
        before = content or ""
        return before[self.num_sent :] if len(before) > self.num_sent else "", calls

    def _send(self, end: int) -> str:
        chunk = self.text[self.num_sent : max(end, self.num_sent)]
        self.num_sent = max(end, self.num_sent)
        return chunk


def _held_back(text: str, marker: str) -> int:
    """Length of the longest end of `text` that is a proper prefix of `marker`."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0
