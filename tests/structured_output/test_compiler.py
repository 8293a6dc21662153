"""Grammars from each kind of spec, their validation, the compiled-grammar cache, matchers advanced over
already generated tokens, and bitmasks, on the bundled model's tokenizer."""

from __future__ import annotations

import json

import pytest
import torch

from nanoserve.sampling_params import StructuredOutputsParams
from nanoserve.structured_output import validate
from nanoserve.structured_output.bitmask import apply_bitmask
from nanoserve.structured_output.compiler import GrammarCompiler

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def tokenizer(tokenizer_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tokenizer_dir)


@pytest.fixture
def compiler(tokenizer):
    loads = []
    compiler = GrammarCompiler(lambda: loads.append(1) or tokenizer, len(tokenizer))
    compiler.loads = loads
    yield compiler
    compiler.shutdown()


def ids(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False).input_ids


@pytest.mark.parametrize(
    "spec",
    [
        StructuredOutputsParams(json={"type": "object", "properties": {"a": {"type": "foo"}}}),
        StructuredOutputsParams(json="{not json"),
        StructuredOutputsParams(regex="a(b"),
        StructuredOutputsParams(grammar="start: undefined_rule"),
        StructuredOutputsParams(grammar='root ::= "a" ('),
    ],
)
def test_bad_specs_are_value_errors(spec):
    with pytest.raises(ValueError, match=f"structured_outputs.{spec.kind}"):
        validate(spec)


def test_spec_needs_exactly_one_constraint():
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams(regex="a", choice=["a"])
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams()


@pytest.mark.parametrize(
    "spec, good, bad",
    [
        (StructuredOutputsParams(json=SCHEMA), '{"name": "Bo", "age": 3}', '{"name": 3}'),
        (StructuredOutputsParams(json_object=True), '{"x": [1, 2]}', "[1, 2]"),
        (StructuredOutputsParams(regex=r"\d{3}-\d{2}"), "123-45", "12-345"),
        (StructuredOutputsParams(choice=["yes", "no"]), "no", "maybe"),
        (StructuredOutputsParams(grammar='start: "a" ("," "a")*'), "a,a,a", "a,,a"),
        (StructuredOutputsParams(grammar='root ::= "x" [0-9]+'), "x42", "y42"),
    ],
)
def test_matcher_accepts_what_the_spec_allows(compiler, tokenizer, spec, good, bad):
    validate(spec)
    matcher = compiler.matcher(spec, []).result(timeout=60)
    assert matcher.accept_all(ids(tokenizer, good)) and not matcher.error
    assert matcher.accept(tokenizer.eos_token_id) or matcher.is_terminated
    rejected = compiler.matcher(spec, []).result(timeout=60)
    assert not rejected.accept_all(ids(tokenizer, bad))


def test_grammars_compile_once_and_the_tokenizer_loads_once(compiler):
    spec = StructuredOutputsParams(json=SCHEMA)
    for _ in range(3):
        compiler.matcher(spec, []).result(timeout=60)
    compiler.matcher(StructuredOutputsParams(json=json.dumps(SCHEMA)), []).result(timeout=60)
    assert compiler.loads == [1]
    assert len(compiler._compiled) == 1


def test_matcher_resumes_after_generated_tokens(compiler, tokenizer):
    spec = StructuredOutputsParams(json=SCHEMA)
    prefix = ids(tokenizer, '{"name": "Al')
    matcher = compiler.matcher(spec, prefix).result(timeout=60)
    assert matcher.accept_all(ids(tokenizer, 'ice", "age": 7}'))
    assert matcher.is_terminated
    with pytest.raises(ValueError, match="do not match the grammar"):
        compiler.matcher(spec, ids(tokenizer, "[1")).result(timeout=60)


def test_bitmask_masks_forbidden_tokens(compiler, tokenizer):
    spec = StructuredOutputsParams(choice=["yes", "no"])
    matchers = [compiler.matcher(spec, []).result(timeout=60) for _ in range(2)]
    matchers[1].accept_all(ids(tokenizer, "n"))
    bitmask = compiler.fill_bitmask([(m, []) for m in matchers]).result(timeout=60)
    logits = torch.zeros(3, len(tokenizer))
    apply_bitmask(logits, [0, 2], bitmask)
    allowed_first = set(torch.isfinite(logits[0]).nonzero().squeeze(1).tolist())
    assert ids(tokenizer, "yes")[0] in allowed_first and ids(tokenizer, "no")[0] in allowed_first
    assert len(allowed_first) < 10
    assert torch.isfinite(logits[1]).all(), "a row without a grammar is left alone"
    assert set(torch.isfinite(logits[2]).nonzero().squeeze(1).tolist()) == set(ids(tokenizer, "o"))


def allowed(bitmask: torch.Tensor, row: int, vocab: int) -> set[int]:
    logits = torch.zeros(1, vocab)
    apply_bitmask(logits, [0], bitmask[row : row + 1])
    return set(torch.isfinite(logits[0]).nonzero().squeeze(1).tolist())


def test_bitmask_rows_follow_the_draft_tokens_and_leave_the_matcher_as_it_was(compiler, tokenizer):
    """Speculative decoding: row j is what the grammar allows after the first j drafts; rows past a
    draft the grammar refuses allow everything (their positions are never kept)."""
    vocab = len(tokenizer)
    spec = StructuredOutputsParams(regex=r"ab(c|d)")
    a, b, c = (ids(tokenizer, x)[0] for x in "abc")
    assert [ids(tokenizer, x) for x in "abc"] == [[a], [b], [c]]
    drafted = compiler.matcher(spec, []).result(timeout=60)
    refused = compiler.matcher(spec, []).result(timeout=60)
    plain = compiler.matcher(spec, []).result(timeout=60)
    bitmask = compiler.fill_bitmask([(drafted, [a, b]), (refused, [b, a]), (plain, [])]).result(timeout=60)
    assert bitmask.shape[0] == 3 + 3 + 1
    rows = [allowed(bitmask, row, vocab) for row in range(7)]
    assert a in rows[0] and b not in rows[0]
    assert b in rows[1] and a not in rows[1]
    assert c in rows[2] and b not in rows[2]
    assert rows[3] == rows[0]  # refused: its first draft b is not allowed at the start
    assert len(rows[4]) == len(rows[5]) == vocab
    assert rows[6] == rows[0]
    assert drafted.accept_all([a, b, c]) and refused.accept(a), "the drafts left no trace"
