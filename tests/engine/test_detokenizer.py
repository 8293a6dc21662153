"""IncrementalDetokenizer with the real SmolLM2 tokenizer: multi-byte text and stop strings."""

from __future__ import annotations

import pytest

from nanoserve.engine.detokenizer import IncrementalDetokenizer
from nanoserve.sampling_params import SamplingParams

TEXTS = [
    "Hello 😀 world 🎉🙂",
    "日本語のテキストと中文文本",
    "Café naïve façade — Ærøskøbing, São Paulo",
    "mixed: 한국어 👩‍👩‍👧 ok",
]


@pytest.fixture(scope="module")
def tokenizer(tokenizer_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tokenizer_dir)


def stream(tokenizer, token_ids: list[int], params: SamplingParams, prompt_ids: list[int] | None = None):
    """Feed tokens one at a time; return (deltas, stop string, tokens consumed, detokenizer)."""
    detok = IncrementalDetokenizer(tokenizer, params, prompt_ids or tokenizer("Say:").input_ids)
    deltas, shown, consumed = [], "", 0
    for token_id in token_ids:
        n, stop = detok.update([token_id])
        consumed += n
        text = detok.visible_text(finished=stop is not None)
        assert text.startswith(shown), "streamed text must only grow"
        deltas.append(text[len(shown) :])
        shown = text
        if stop is not None:
            return deltas, stop, consumed, detok
    final = detok.visible_text(finished=True)
    deltas.append(final[len(shown) :])
    return deltas, None, consumed, detok


@pytest.mark.parametrize("text", TEXTS)
def test_multibyte_round_trip_without_replacement_chars(tokenizer, text):
    ids = tokenizer(text).input_ids
    assert len(ids) > len(text.split())  # some characters really are split across tokens
    deltas, stop, _, _ = stream(tokenizer, ids, SamplingParams())
    assert stop is None
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == tokenizer.decode(ids) == text


def test_skip_special_tokens(tokenizer):
    ids = tokenizer("<|im_start|>assistant\nHi there<|im_end|>").input_ids
    deltas, _, _, _ = stream(tokenizer, ids, SamplingParams())
    assert "".join(deltas) == "assistant\nHi there"
    deltas, _, _, _ = stream(tokenizer, ids, SamplingParams(skip_special_tokens=False))
    assert "".join(deltas) == "<|im_start|>assistant\nHi there<|im_end|>"


def test_stop_string_spanning_tokens(tokenizer):
    text = "The answer is 42. END OF STORY and more text"
    ids = tokenizer(text).input_ids
    deltas, stop, consumed, detok = stream(tokenizer, ids, SamplingParams(stop=["END OF STORY"]))
    assert stop == "END OF STORY"
    assert "".join(deltas) == "The answer is 42. "
    assert consumed < len(ids)  # the tokens after the stop are never consumed
    assert tokenizer.decode(detok.token_ids).endswith("END OF STORY")


def test_include_stop_str_in_output(tokenizer):
    ids = tokenizer("one two three four five").input_ids
    deltas, stop, _, _ = stream(
        tokenizer, ids, SamplingParams(stop=["three"], include_stop_str_in_output=True)
    )
    assert stop == "three"
    assert "".join(deltas) == "one two three"


def test_earliest_stop_string_wins_and_cuts_within_token(tokenizer):
    ids = tokenizer("alpha beta gamma").input_ids
    _, stop, _, detok = stream(tokenizer, ids, SamplingParams(stop=["gamma", "et"]))
    assert stop == "et"
    assert detok.output_text == "alpha b"


def test_partial_stop_string_is_held_back(tokenizer):
    ids = tokenizer("go STOX and STOP! then").input_ids
    params = SamplingParams(stop=["STOP!"])
    detok = IncrementalDetokenizer(tokenizer, params, [])
    for token_id in ids:
        _, stop = detok.update([token_id])
        if stop is not None:
            break
        # the last len("STOP!") - 1 characters could begin the stop string: never shown yet
        assert detok.visible_text(finished=False) == detok.output_text[: max(0, len(detok.output_text) - 4)]
        assert "STOP"[:2] not in detok.visible_text(finished=False).replace("STOX", "")
    assert stop == "STOP!"
    assert detok.visible_text(finished=True) == "go STOX and "


def test_held_back_text_is_released_when_finished(tokenizer):
    ids = tokenizer("ends with ST").input_ids
    params = SamplingParams(stop=["STOP"])
    detok = IncrementalDetokenizer(tokenizer, params, [])
    assert detok.update(ids) == (len(ids), None)
    assert detok.visible_text(finished=False) == "ends with ST"[: -len("STOP") + 1]
    assert detok.visible_text(finished=True) == "ends with ST"


def test_min_tokens_defers_stop_strings(tokenizer):
    ids = tokenizer("stop here stop there").input_ids
    assert len(ids) == 4  # "stop", " here", " stop", " there"
    _, stop, _, detok = stream(tokenizer, ids, SamplingParams(stop=["stop"], min_tokens=2))
    assert stop == "stop"
    assert detok.output_text == "stop here "
