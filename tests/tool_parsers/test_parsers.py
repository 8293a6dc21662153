"""Tool-call parsers on the formats their families write, whole and streamed, and detection from templates."""

from __future__ import annotations

import json

import pytest

from nanoserve.tool_parsers import ToolCallStream, detect_parser, get_parser

CASES = [
    (
        "hermes",
        'Let me check.\n<tool_call>\n{"name": "weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "time", "arguments": {}}\n</tool_call>',
        "Let me check.",
    ),
    (
        "llama3_json",
        '{"name": "weather", "parameters": {"city": "Paris"}}; {"name": "time", "parameters": {}}',
        None,
    ),
    (
        "llama3_json",
        '<|python_tag|>{"name": "weather", "parameters": {"city": "Paris"}}; {"name": "time", "parameters": {}}',
        None,
    ),
    (
        "mistral",
        'OK [TOOL_CALLS] [{"name": "weather", "arguments": {"city": "Paris"}}, {"name": "time", "arguments": {}}]',
        "OK",
    ),
    ("mistral", '[TOOL_CALLS]weather[ARGS]{"city": "Paris"}[TOOL_CALLS]time[ARGS]{}', None),
]


@pytest.mark.parametrize("name, text, content", CASES)
def test_parse_whole_and_streamed(name, text, content):
    parser = get_parser(name)
    got_content, calls = parser.parse(text)
    assert got_content == content
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("weather", {"city": "Paris"}),
        ("time", {}),
    ]
    stream = ToolCallStream(parser)
    shown = "".join(stream.feed(text[i : i + 3]) for i in range(0, len(text), 3))
    rest, streamed_calls = stream.finish()
    assert (shown + rest).strip() == (content or "")
    assert [c.name for c in streamed_calls] == ["weather", "time"]


@pytest.mark.parametrize("name", ["hermes", "llama3_json", "mistral"])
def test_text_without_calls_stays_text(name):
    parser = get_parser(name)
    for text in ("Just an answer.", "<tool_call>{not json", '{"a": 1} is an object'):
        assert parser.parse(text) == (text, [])
        stream = ToolCallStream(parser)
        shown = "".join(stream.feed(ch) for ch in text)
        rest, calls = stream.finish()
        assert shown + rest == text and calls == []


def test_a_partial_marker_is_held_back_until_it_is_decided():
    stream = ToolCallStream(get_parser("hermes"))
    assert stream.feed("Hi <tool") == "Hi "
    assert stream.feed("bar>") == "<toolbar>"


def test_detection_from_templates_and_unknown_names():
    assert detect_parser("{% for t in tools %}<tool_call>{% endfor %}").name == "hermes"
    assert detect_parser("[TOOL_CALLS] {{ calls }}").name == "mistral"
    assert detect_parser("<|python_tag|>{{ x }}").name == "llama3_json"
    assert detect_parser("{{ messages }}") is None
    with pytest.raises(ValueError, match="Unknown tool call parser"):
        get_parser("nope")
