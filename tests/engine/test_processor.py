"""Processor: prompt forms, validation errors, max_tokens fitting."""

from __future__ import annotations

import copy

import pytest

from nanoserve.engine.processor import Processor
from nanoserve.sampling_params import SamplingParams

MAX_MODEL_LEN = 32


@pytest.fixture(scope="module")
def tokenizer(tokenizer_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tokenizer_dir)


@pytest.fixture
def processor(tokenizer):
    return Processor(tokenizer, MAX_MODEL_LEN, (tokenizer.eos_token_id, 7))


def test_prompt_forms(processor, tokenizer):
    ids = tokenizer("Hello world").input_ids
    assert ids[0] != tokenizer.bos_token_id  # SmolLM2 adds no BOS
    for prompt, text in [
        ("Hello world", "Hello world"),
        (ids, None),
        ({"prompt_token_ids": ids}, None),
        ({"prompt": "Hello world"}, "Hello world"),
    ]:
        got_text, request = processor.process("r", prompt, SamplingParams())
        assert got_text == text
        assert request.prompt_token_ids == ids
        assert request.request_id == "r"
        assert request.eos_token_ids == [tokenizer.eos_token_id, 7]


@pytest.mark.parametrize("prompt", ["", [], {"prompt_token_ids": []}])
def test_empty_prompt(processor, prompt):
    with pytest.raises(ValueError, match="empty"):
        processor.process("r", prompt, SamplingParams())


def test_prompt_too_long(processor):
    with pytest.raises(ValueError, match="longer than the maximum model length of 32"):
        processor.process("r", [5] * MAX_MODEL_LEN, SamplingParams())


def test_max_tokens_clamped_to_context(processor):
    params = SamplingParams(max_tokens=100, min_tokens=50)
    _, request = processor.process("r", [5] * 20, params)
    assert request.sampling_params.max_tokens == 12
    assert request.sampling_params.min_tokens == 12
    assert params.max_tokens == 100  # the caller's object is untouched
    _, request = processor.process("r", [5] * 20, SamplingParams(max_tokens=None))
    assert request.sampling_params.max_tokens == 12
    _, request = processor.process("r", [5] * 20, SamplingParams(max_tokens=4))
    assert request.sampling_params.max_tokens == 4


@pytest.mark.parametrize("bad", [-1, 49152, 10**9])
def test_token_ids_out_of_vocab(processor, bad):
    with pytest.raises(ValueError, match="out of the vocabulary"):
        processor.process("r", [5, bad], SamplingParams())


@pytest.mark.parametrize(
    "params",
    [{"stop_token_ids": [49152]}, {"allowed_token_ids": [3, 49152]}, {"logit_bias": {49152: 1.0}}],
)
def test_token_id_fields_out_of_vocab(processor, params):
    (name,) = params
    with pytest.raises(ValueError, match=name):
        processor.process("r", [5], SamplingParams(**params))


@pytest.mark.parametrize(
    "params, field",
    [
        ({"logit_bias": {3: 100.5}}, "logit_bias"),
        ({"allowed_token_ids": []}, "allowed_token_ids"),
        ({"bad_words": [" "]}, "bad_words"),
        ({"prompt_logprobs": -1}, "prompt_logprobs"),
    ],
)
def test_sampling_controls_are_range_checked(params, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**params)


def test_bad_words_become_token_sequences(processor, tokenizer):
    _, request = processor.process("r", [5], SamplingParams(bad_words=["Paris", " hello world"]))
    sequences = request.sampling_params.bad_words_token_ids

    def encode(text: str) -> list[int]:
        return tokenizer(text, add_special_tokens=False).input_ids

    assert encode("Paris") in sequences and encode(" Paris") in sequences
    assert encode("hello world") in sequences and encode(" hello world") in sequences


def test_bad_structured_output_spec_is_refused(processor):
    from nanoserve.sampling_params import StructuredOutputsParams

    with pytest.raises(ValueError, match="structured_outputs.json"):
        processor.process("r", [5], SamplingParams(structured_outputs=StructuredOutputsParams(json="{")))


def test_invalid_sampling_values(processor):
    params = SamplingParams()
    params.temperature = -1.0  # msgspec structs do not re-validate on assignment; the processor does
    with pytest.raises(ValueError, match="temperature"):
        processor.process("r", [5], params)


def test_top_k_that_is_not_an_integer_is_refused(processor):
    with pytest.raises(ValueError, match="top_k must be an integer"):
        processor.process("r", [5], SamplingParams(top_k=50.0))  # ty: ignore[invalid-argument-type]


def test_bad_prompt_type(processor):
    with pytest.raises(ValueError, match="prompt"):
        processor.process("r", 42, SamplingParams())
    with pytest.raises(ValueError, match="prompt_token_ids"):
        processor.process("r", {"text": "hi"}, SamplingParams())


def test_render_chat(processor, tokenizer):
    prompt = processor.render_chat([{"role": "user", "content": "Hi"}])
    assert prompt["prompt"].endswith("<|im_start|>assistant\n")
    assert prompt["prompt_token_ids"] == tokenizer(prompt["prompt"], add_special_tokens=False).input_ids
    assert prompt["prompt_token_ids"].count(tokenizer.convert_tokens_to_ids("<|im_start|>")) == 3


def test_special_tokens_added_only_when_asked(tokenizer):
    from tokenizers.processors import TemplateProcessing

    tokenizer = copy.deepcopy(tokenizer)
    bos = tokenizer.convert_tokens_to_ids("<|im_start|>")
    # SmolLM2's tokenizer adds nothing; one that prepends a BOS shows what add_special_tokens does
    tokenizer.backend_tokenizer.post_processor = TemplateProcessing(
        single="<|im_start|> $A", special_tokens=[("<|im_start|>", bos)]
    )
    processor = Processor(tokenizer, MAX_MODEL_LEN, tokenizer.eos_token_id)
    plain = tokenizer("Hello", add_special_tokens=False).input_ids
    assert processor.tokenize("Hello") == ("Hello", [bos, *plain])
    assert processor.tokenize("Hello", add_special_tokens=False) == ("Hello", plain)
    chat = [{"role": "user", "content": "Hi"}]
    rendered = processor.render_chat(chat)["prompt_token_ids"]
    assert processor.render_chat(chat, add_special_tokens=True)["prompt_token_ids"] == [bos, *rendered]


def test_detokenize_checks_the_vocabulary(processor, tokenizer):
    ids = tokenizer("Grüße 🙂").input_ids
    assert processor.detokenize(ids) == "Grüße 🙂"
    for bad in ([-1], [processor.vocab_size]):
        with pytest.raises(ValueError, match="out of the vocabulary"):
            processor.detokenize(bad)


def test_final_output_only_unless_stop_strings_need_each_step(processor):
    for final_output_only, stop, expected in [
        (False, None, False),
        (True, None, True),
        (True, ["\n"], False),
    ]:
        _, request = processor.process("r", [5, 6], SamplingParams(stop=stop), final_output_only)
        assert request.final_output_only is expected
