"""OutputProcessor driven by fake engine-core outputs."""

from __future__ import annotations

import pytest

from nanoserve.engine.output_processor import OutputProcessor
from nanoserve.sampling_params import SamplingParams
from nanoserve.wire.messages import EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest, FinishReason


@pytest.fixture(scope="module")
def tokenizer(tokenizer_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tokenizer_dir)


def make_request(tokenizer, request_id: str, **params) -> EngineCoreRequest:
    return EngineCoreRequest(request_id, tokenizer("Tell me:").input_ids, SamplingParams(**params), [2])


def step(*outputs: EngineCoreOutput) -> EngineCoreOutputs:
    return EngineCoreOutputs(outputs=list(outputs))


def test_single_request_streams_cumulative_text(tokenizer):
    proc = OutputProcessor(tokenizer)
    request = make_request(tokenizer, "a")
    assert proc.add_request(request, "Tell me:") == [request]
    ids = tokenizer(" Hello 😀 world").input_ids
    texts = []
    for i, token_id in enumerate(ids):
        last = i == len(ids) - 1
        outs, to_abort = proc.process_outputs(
            step(EngineCoreOutput("a", [token_id], finish_reason=FinishReason.LENGTH if last else None))
        )
        assert to_abort == []
        (out,) = outs
        assert out.request_id == "a" and out.prompt == "Tell me:" and out.finished == last
        texts.append(out.outputs[0].text)
    assert texts[-1] == " Hello 😀 world"
    assert all("\ufffd" not in t for t in texts)
    completion = out.outputs[0]
    assert completion.token_ids == ids and completion.finish_reason == "length"
    assert completion.logprobs is None and completion.cumulative_logprob is None
    assert not proc.has_unfinished_requests()
    # late outputs for a request no longer tracked are ignored
    assert proc.process_outputs(step(EngineCoreOutput("a", [5]))) == ([], [])


def test_n_gathers_samples_into_one_output(tokenizer):
    proc = OutputProcessor(tokenizer)
    engine_requests = proc.add_request(make_request(tokenizer, "r", n=3, seed=7), None)
    assert [r.request_id for r in engine_requests] == ["0_r", "1_r", "2_r"]
    assert [r.sampling_params.seed for r in engine_requests] == [7, 8, 9]
    assert all(r.sampling_params.n == 1 for r in engine_requests)
    assert proc.get_num_unfinished_requests() == 1

    hi, yo = tokenizer(" hi").input_ids, tokenizer(" yo").input_ids
    outs, _ = proc.process_outputs(
        step(
            EngineCoreOutput("0_r", hi, finish_reason=FinishReason.STOP, stop_reason=2),
            EngineCoreOutput("1_r", yo),
        )
    )
    (out,) = outs
    assert not out.finished
    assert [o.index for o in out.outputs] == [0, 1, 2]
    assert [o.text for o in out.outputs] == [" hi", " yo", ""]
    assert out.outputs[0].finish_reason == "stop" and out.outputs[0].stop_reason == 2

    outs, _ = proc.process_outputs(
        step(
            EngineCoreOutput("1_r", hi, finish_reason=FinishReason.LENGTH),
            EngineCoreOutput("2_r", yo, finish_reason=FinishReason.LENGTH),
        )
    )
    (out,) = outs
    assert out.finished
    assert [o.text for o in out.outputs] == [" hi", " yo hi", " yo"]
    assert not proc.has_unfinished_requests()


def test_stop_string_finishes_in_frontend_and_asks_engine_to_abort(tokenizer):
    proc = OutputProcessor(tokenizer)
    proc.add_request(make_request(tokenizer, "s", stop=["world"]), None)
    ids = tokenizer(" hello world and more").input_ids
    outs, to_abort = proc.process_outputs(step(EngineCoreOutput("s", ids)))
    assert to_abort == ["s"]
    (out,) = outs
    assert out.finished
    assert out.outputs[0].text == " hello "
    assert out.outputs[0].finish_reason == "stop" and out.outputs[0].stop_reason == "world"
    # tokens after the one completing the stop string are dropped
    assert tokenizer.decode(out.outputs[0].token_ids) == " hello world"
    assert proc.process_outputs(step(EngineCoreOutput("s", [5], finish_reason=FinishReason.ABORT))) == (
        [],
        [],
    )


def test_stop_string_on_engine_finished_output_needs_no_abort(tokenizer):
    proc = OutputProcessor(tokenizer)
    proc.add_request(make_request(tokenizer, "s", stop=["world"]), None)
    ids = tokenizer(" hello world").input_ids
    outs, to_abort = proc.process_outputs(step(EngineCoreOutput("s", ids, finish_reason=FinishReason.LENGTH)))
    assert to_abort == []
    assert outs[0].outputs[0].finish_reason == "stop"


def test_error_output_surfaces_as_error(tokenizer):
    proc = OutputProcessor(tokenizer)
    proc.add_request(make_request(tokenizer, "e"), None)
    outs, _ = proc.process_outputs(
        step(
            EngineCoreOutput(
                "e", [], finish_reason=FinishReason.ERROR, error="prompt does not fit the KV cache"
            )
        )
    )
    (out,) = outs
    assert out.finished
    assert out.outputs[0].finish_reason == "error"
    assert out.error == out.outputs[0].error == "prompt does not fit the KV cache"


def test_engine_abort_surfaces_as_abort(tokenizer):
    proc = OutputProcessor(tokenizer)
    proc.add_request(make_request(tokenizer, "x"), None)
    (out,), _ = proc.process_outputs(step(EngineCoreOutput("x", [], finish_reason=FinishReason.ABORT)))
    assert out.finished and out.outputs[0].finish_reason == "abort"


def test_abort_requests_returns_running_engine_ids(tokenizer):
    proc = OutputProcessor(tokenizer)
    proc.add_request(make_request(tokenizer, "r", n=2), None)
    proc.add_request(make_request(tokenizer, "q"), None)
    proc.process_outputs(step(EngineCoreOutput("0_r", [5], finish_reason=FinishReason.LENGTH)))
    assert proc.abort_requests(["r", "unknown"]) == ["1_r"]
    assert proc.get_num_unfinished_requests() == 1
    assert proc.process_outputs(step(EngineCoreOutput("1_r", [5]))) == ([], [])


def test_duplicate_request_id(tokenizer):
    proc = OutputProcessor(tokenizer)
    proc.add_request(make_request(tokenizer, "d"), None)
    with pytest.raises(ValueError, match="already running"):
        proc.add_request(make_request(tokenizer, "d"), None)


def test_logprobs(tokenizer):
    proc = OutputProcessor(tokenizer)
    proc.add_request(make_request(tokenizer, "l", logprobs=2), None)
    a, b, c = tokenizer(" a b c").input_ids
    # per token: [(sampled, lp), top1, top2]; the second sampled token is outside the top 2
    new_logprobs = [[(a, -0.1), (a, -0.1), (b, -2.0)], [(c, -3.0), (a, -0.5), (b, -1.0)]]
    (out,), _ = proc.process_outputs(step(EngineCoreOutput("l", [a, c], new_logprobs=new_logprobs)))
    completion = out.outputs[0]
    assert completion.cumulative_logprob == pytest.approx(-3.1)
    first, second = completion.logprobs
    assert set(first) == {a, b} and first[a].rank == 1 and first[b].rank == 2
    assert first[a].decoded_token == " a"
    assert set(second) == {a, b, c} and second[c].rank == 3 and second[c].logprob == -3.0
