"""LLM end to end on a tiny random Llama (real tokenizer, real engine core in this process)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest

from nanoserve.core.scheduler import MAX_HELD_TOKENS
from nanoserve.engine.exceptions import EngineGenerateError
from nanoserve.entrypoints.llm import LLM
from nanoserve.sampling_params import SamplingParams, StructuredOutputsParams

GREEDY = SamplingParams(max_tokens=6, temperature=0.0)


@pytest.fixture(scope="module")
def llm(tiny_gqa_dir):
    with LLM(model=str(tiny_gqa_dir), dtype="float32", max_model_len=128) as llm:
        yield llm


def assert_idle(llm: LLM) -> None:
    assert not llm.llm_engine.has_unfinished_requests()


def test_generate_string(llm):
    (out,) = llm.generate("Hello there", GREEDY, use_tqdm=False)
    assert out.finished and out.prompt == "Hello there"
    assert out.prompt_token_ids == llm.get_tokenizer()("Hello there").input_ids
    (completion,) = out.outputs
    assert completion.finish_reason == "length" and len(completion.token_ids) == 6
    assert completion.text == llm.get_tokenizer().decode(completion.token_ids, skip_special_tokens=True)
    assert_idle(llm)


def test_generate_list_keeps_input_order(llm):
    prompts = ["one", "two two", "three three three", "four"]
    params = [SamplingParams(max_tokens=n, temperature=0.0) for n in (5, 1, 3, 2)]
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.prompt for o in outs] == prompts
    assert [len(o.outputs[0].token_ids) for o in outs] == [5, 1, 3, 2]
    # greedy decoding is deterministic whatever the batch around it
    (again,) = llm.generate("two two", params[1], use_tqdm=False)
    assert again.outputs[0].token_ids == outs[1].outputs[0].token_ids


def test_generate_token_ids(llm):
    ids = llm.get_tokenizer()("Count: 1 2 3").input_ids
    outs = llm.generate([ids, {"prompt_token_ids": ids}], GREEDY, use_tqdm=False)
    assert all(o.prompt is None and o.prompt_token_ids == ids for o in outs)
    assert outs[0].outputs[0].token_ids == outs[1].outputs[0].token_ids
    (single,) = llm.generate(ids, GREEDY, use_tqdm=False)
    assert single.prompt_token_ids == ids


def test_default_params_and_progress_bar(llm):
    (out,) = llm.generate("Hi")
    assert len(out.outputs[0].token_ids) == SamplingParams().max_tokens


def test_chat(llm):
    (out,) = llm.chat([{"role": "user", "content": "Hi!"}], GREEDY, use_tqdm=False)
    assert out.prompt.endswith("<|im_start|>assistant\n") and "Hi!" in out.prompt
    outs = llm.chat(
        [[{"role": "user", "content": "a"}], [{"role": "user", "content": "b"}]], GREEDY, use_tqdm=False
    )
    assert len(outs) == 2 and outs[0].prompt != outs[1].prompt


def test_stop_string(llm):
    (free,) = llm.generate("Once upon", SamplingParams(max_tokens=8, temperature=0.0), use_tqdm=False)
    text = free.outputs[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    assert stop.strip()
    (out,) = llm.generate(
        "Once upon", SamplingParams(max_tokens=8, temperature=0.0, stop=[stop]), use_tqdm=False
    )
    completion = out.outputs[0]
    assert completion.finish_reason == "stop" and completion.stop_reason == stop
    assert completion.text == text[: text.index(stop)]
    assert_idle(llm)


def test_n_samples(llm):
    (out,) = llm.generate("Pick:", SamplingParams(n=3, max_tokens=4, seed=1), use_tqdm=False)
    assert [o.index for o in out.outputs] == [0, 1, 2]
    assert all(len(o.token_ids) == 4 for o in out.outputs)
    assert_idle(llm)


@pytest.mark.parametrize(
    "bad, match",
    [
        ("", "empty"),
        ([5] * 200, "longer than the maximum model length"),
        ([49152], "out of the vocabulary"),
    ],
)
def test_bad_input_raises_and_llm_still_serves(llm, bad, match):
    with pytest.raises(ValueError, match=match):
        llm.generate(["a valid prompt", bad], GREEDY, use_tqdm=False)
    assert_idle(llm)
    (out,) = llm.generate("still alive?", GREEDY, use_tqdm=False)
    assert out.finished and len(out.outputs[0].token_ids) == 6


def test_params_count_must_match(llm):
    with pytest.raises(ValueError, match="sampling params"):
        llm.generate(["a", "b"], [GREEDY], use_tqdm=False)


def test_duplicate_request_id(llm):
    engine = llm.llm_engine
    engine.add_request("dup", "hello", GREEDY)
    try:
        with pytest.raises(ValueError, match="already running"):
            engine.add_request("dup", "hello", GREEDY)
    finally:
        engine.abort_request("dup")
    assert_idle(llm)
    with pytest.raises(ValueError, match="already running"):
        engine.add_requests([("twice", "hello", GREEDY), ("twice", "again", GREEDY)])
    with pytest.raises(ValueError, match="empty"):
        engine.add_requests([("valid", "hello", GREEDY), ("empty", "", GREEDY)])
    assert engine.get_num_unfinished_requests() == 0  # all or none: nothing of either batch was queued
    assert_idle(llm)


def test_engine_step_streams_and_abort(llm):
    engine = llm.llm_engine
    engine.add_request("s", "Stream me", SamplingParams(max_tokens=5, temperature=0.0))
    engine.add_request("x", "Abort me", SamplingParams(max_tokens=50, temperature=0.0))
    assert engine.get_num_unfinished_requests() == 2
    texts = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id == "s":
                texts.append(out.outputs[0].text)
                if out.finished:
                    engine.abort_request(["x"])
    assert len(texts) >= 2 and all(b.startswith(a) for a, b in zip(texts, texts[1:], strict=False))
    assert engine.step() == []


def test_generate_holds_tokens_back_and_matches_a_streamed_request(llm, monkeypatch):
    """generate wants finished outputs only, so the engine sends the first token and then chunks of
    MAX_HELD_TOKENS: 4 engine outputs for 40 tokens where a request streamed through LLMEngine.step gets
    40, and the same result."""
    engine = llm.llm_engine
    client = engine.engine_core
    outputs_per_request: dict[str, int] = {}
    get_output = client.get_output

    def counting_get_output(*args, **kwargs):
        outputs = get_output(*args, **kwargs)
        for o in outputs.outputs:
            if o.request_id in engine.output_processor.requests:  # not an earlier test's late abort
                outputs_per_request[o.request_id] = outputs_per_request.get(o.request_id, 0) + 1
        return outputs

    monkeypatch.setattr(client, "get_output", counting_get_output)
    params = SamplingParams(max_tokens=40, temperature=0.0, logprobs=1)
    engine.add_request("streamed", "Hold on", params)
    streamed = None
    while engine.has_unfinished_requests():
        streamed = next((o for o in engine.step() if o.finished), streamed)
    (held,) = llm.generate("Hold on", params, use_tqdm=False)
    assert streamed is not None and outputs_per_request.pop("streamed") == 40
    assert list(outputs_per_request.values()) == [1 - (-39 // MAX_HELD_TOKENS)]
    want, got = streamed.outputs[0], held.outputs[0]
    assert (got.token_ids, got.text, got.finish_reason) == (want.token_ids, want.text, want.finish_reason)
    assert got.logprobs == want.logprobs and got.cumulative_logprob == want.cumulative_logprob


def test_shutdown_is_idempotent(tiny_gqa_dir):
    llm = LLM(model=str(tiny_gqa_dir), dtype="float32", max_model_len=64, num_kv_blocks=16)
    (out,) = llm.generate("bye", GREEDY, use_tqdm=False)
    assert out.finished
    llm.shutdown()
    llm.shutdown()
    del llm


def test_unknown_option_is_named(tiny_gqa_dir):
    with pytest.raises(TypeError, match="max_num_sequences"):
        LLM(model=str(tiny_gqa_dir), max_num_sequences=4)


def test_logprobs(llm):
    (out,) = llm.generate("Hello", SamplingParams(max_tokens=4, temperature=0.0, logprobs=2), use_tqdm=False)
    completion = out.outputs[0]
    assert len(completion.logprobs) == 4
    for token_id, step in zip(completion.token_ids, completion.logprobs, strict=True):
        assert len(step) == 2 and step[token_id].rank == 1  # greedy picks the top token
        assert step[token_id].decoded_token == llm.get_tokenizer().decode([token_id])
    expected = sum(step[t].logprob for t, step in zip(completion.token_ids, completion.logprobs, strict=True))
    assert completion.cumulative_logprob == pytest.approx(expected)


def test_request_refused_by_engine_raises(llm, monkeypatch):
    # skip the frontend's checks so the engine core refuses the request with an ERROR output
    monkeypatch.setattr(llm.llm_engine.processor, "_validate_prompt", lambda ids: None)
    with pytest.raises(EngineGenerateError, match="empty"):
        llm.generate("", GREEDY, use_tqdm=False)
    monkeypatch.undo()
    assert_idle(llm)
    (out,) = llm.generate("after the error", GREEDY, use_tqdm=False)
    assert out.finished


def test_multiprocess_engine(tiny_gqa_dir):
    with LLM(model=str(tiny_gqa_dir), dtype="float32", multiprocess_mode=True) as llm:
        outs = llm.generate(
            ["Hello", "one two"], SamplingParams(max_tokens=4, temperature=0.0), use_tqdm=False
        )
        assert [o.prompt for o in outs] == ["Hello", "one two"]
        assert all(len(o.outputs[0].token_ids) == 4 for o in outs)
        (stopped,) = llm.generate(
            "Hello",
            SamplingParams(max_tokens=4, temperature=0.0, stop=[outs[0].outputs[0].text[2:4]]),
            use_tqdm=False,
        )
        assert stopped.outputs[0].finish_reason == "stop"


def test_structured_outputs_and_prompt_logprobs_cross_the_process_boundary(tiny_gqa_dir):
    schema = {
        "type": "object",
        "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 999}},
        "required": ["n"],
        "additionalProperties": False,
    }
    with LLM(model=str(tiny_gqa_dir), dtype="float32", multiprocess_mode=True) as llm:
        constrained = [
            SamplingParams(
                max_tokens=40,
                temperature=1.0,
                seed=s,
                structured_outputs=StructuredOutputsParams(json=schema),
            )
            for s in range(4)
        ]
        for out in llm.generate(["Hello"] * 4, constrained, use_tqdm=False):
            assert out.outputs[0].finish_reason == "stop"
            jsonschema.validate(json.loads(out.outputs[0].text), schema)
        choice = SamplingParams(
            max_tokens=8, structured_outputs=StructuredOutputsParams(choice=["alpha", "beta"])
        )
        assert llm.generate("Hi", choice, use_tqdm=False)[0].outputs[0].text in ("alpha", "beta")
        (out,) = llm.generate(
            "one two three",
            SamplingParams(max_tokens=1, prompt_logprobs=0, logit_bias={42: 100.0}),
            use_tqdm=False,
        )
        assert out.outputs[0].token_ids == [42]
        assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(out.prompt_token_ids)
        for token_id, step in zip(out.prompt_token_ids[1:], out.prompt_logprobs[1:], strict=True):
            assert list(step) == [token_id] and step[token_id].logprob < 0


def test_package_exports_stay_light():
    # a fresh interpreter from the repo root, so the check does not depend on how the package is installed
    code = (
        "import sys, nanoserve\n"
        "assert 'torch' not in sys.modules and 'tokenizers' not in sys.modules\n"
        "from nanoserve import LLM, CompletionOutput, EngineOptions, RequestOutput, SamplingParams, __version__\n"
        "from nanoserve.entrypoints.llm import LLM as _LLM\n"
        "assert LLM is _LLM and __version__\n"
    )
    repo_root = Path(__file__).resolve().parents[2]
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=repo_root, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
