"""A StructuredOutputsParams -> llguidance's grammar text, and its validation.

JSON is constrained to json.dumps' layout (", " and ": ", no other whitespace): with free whitespace a
small model can loop on newlines forever and never close the object. Grammars are Lark or GBNF (vLLM
accepts both, per backend); llguidance tells them apart.
"""

from __future__ import annotations

import functools
import json
from typing import Any

import llguidance

from nanoserve.sampling_params import StructuredOutputsParams

# Any: llguidance types this as a TypedDict that only its stub file defines
JSON_LAYOUT: Any = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
ANY_JSON_OBJECT = '{"type": "object"}'


def grammar_text(spec: StructuredOutputsParams) -> str:
    """The grammar in llguidance's serialized form; ValueError when the spec cannot be read."""
    return _grammar_text(spec.kind, _spec_text(spec))


def validate(spec: StructuredOutputsParams) -> None:
    """Raise ValueError naming the problem when the constraint is not a usable grammar."""
    _validate(spec.kind, _spec_text(spec))


def _spec_text(spec: StructuredOutputsParams) -> str:
    if spec.json is not None:
        return spec.json if isinstance(spec.json, str) else json.dumps(spec.json)
    if spec.choice is not None:
        return json.dumps(spec.choice)
    if spec.json_object:
        return ANY_JSON_OBJECT
    text = spec.regex if spec.regex is not None else spec.grammar
    assert text is not None
    return text


@functools.lru_cache(maxsize=256)
def _grammar_text(kind: str, text: str) -> str:
    try:
        if kind in ("json", "json_object"):
            return llguidance.LLMatcher.grammar_from_json_schema(text, defaults=JSON_LAYOUT)
        if kind == "regex":  # \d and \w are ASCII, as in JSON schema patterns, not all of Unicode
            return llguidance.LLMatcher.grammar_from_lark(f"start: /{llguidance.regex_to_lark(text, 'dw')}/")
        return llguidance.grammar_from("choice" if kind == "choice" else "grammar", text)
    except ValueError as e:
        raise ValueError(f"structured_outputs.{kind} is not valid: {e}") from e


@functools.lru_cache(maxsize=256)
def _validate(kind: str, text: str) -> None:
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(_grammar_text(kind, text))
    if is_error:
        raise ValueError(f"structured_outputs.{kind} is not valid: {messages[0]}")
