"""Structured outputs, sampling controls and prompt logprobs through the real server and the official
`openai` client, on a tiny random Llama: outputs validate at temperature 1 across seeds, streaming and
not; bad specs are 400s; logit_bias, allowed_token_ids and bad_words steer the sampler; echo with
logprobs scores the prompt as lm-eval's loglikelihood requests expect."""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import openai
import pytest
import torch

from tests.entrypoints.test_openai_server import Server

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 8},
        "population": {"type": "integer", "minimum": 0, "maximum": 10**6},
        "capital": {"type": "boolean"},
    },
    "required": ["city", "population", "capital"],
    "additionalProperties": False,
}
SEEDS = range(4)


@pytest.fixture(scope="module")
def server(tiny_gqa_dir, tmp_path_factory):
    srv = Server(tiny_gqa_dir, tmp_path_factory.mktemp("structured") / "server.log")
    yield srv
    srv.stop()


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def tokenizer(tokenizer_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tokenizer_dir)


def chat_text(client, stream: bool, **kwargs) -> str:
    messages = [{"role": "user", "content": "Describe a city."}]
    if not stream:
        return (
            client.chat.completions.create(model=None, messages=messages, **kwargs).choices[0].message.content
        )
    chunks = client.chat.completions.create(model=None, messages=messages, stream=True, **kwargs)
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


@pytest.mark.parametrize("stream", [False, True])
def test_json_schema_outputs_validate_across_seeds(client, stream):
    response_format = {"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA}}
    for seed in SEEDS:
        text = chat_text(
            client, stream, response_format=response_format, temperature=1.0, seed=seed, max_tokens=80
        )
        jsonschema.validate(json.loads(text), SCHEMA)


def test_json_object_and_completions(client):
    """Any object: a random model writes keys that may run past max_tokens, so only the finished ones parse."""
    for seed in SEEDS:
        choice = client.chat.completions.create(
            model=None,
            messages=[{"role": "user", "content": "An object:"}],
            response_format={"type": "json_object"},
            temperature=1.0,
            seed=seed,
            max_tokens=60,
        ).choices[0]
        assert choice.message.content.startswith("{")
        if choice.finish_reason == "stop":
            assert isinstance(json.loads(choice.message.content), dict)
    completion = client.completions.create(
        model=None,
        prompt="A city:",
        max_tokens=80,
        temperature=1.0,
        seed=1,
        extra_body={"response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA}}},
    )
    jsonschema.validate(json.loads(completion.choices[0].text), SCHEMA)


@pytest.mark.parametrize(
    "structured_outputs, check",
    [
        ({"regex": r"[a-z]{2,5}-\d{3}"}, lambda t: re.fullmatch(r"[a-z]{2,5}-[0-9]{3}", t)),
        ({"choice": ["red", "green", "blue"]}, lambda t: t in ("red", "green", "blue")),
        (
            {"grammar": 'start: "(" NUM ("+" NUM)* ")"\nNUM: /[0-9]/'},
            lambda t: re.fullmatch(r"\(\d(\+\d)*\)", t),
        ),
        ({"grammar": 'root ::= "x=" [0-9] [0-9]?'}, lambda t: re.fullmatch(r"x=\d\d?", t)),
    ],
)
def test_regex_choice_and_grammar(client, structured_outputs, check):
    for seed in SEEDS:
        text = chat_text(
            client,
            seed % 2 == 1,
            temperature=1.0,
            seed=seed,
            max_tokens=30,
            extra_body={"structured_outputs": structured_outputs},
        )
        assert check(text), text


@pytest.mark.parametrize(
    "body, param",
    [
        ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "nope"}}}}, None),
        ({"structured_outputs": {"regex": "(unclosed"}}, None),
        ({"structured_outputs": {"grammar": "start: missing_rule"}}, None),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, None),
        ({"structured_outputs": {"regex": "a", "disable_fallback": True}}, "structured_outputs"),
        ({"structured_outputs": {"regex": "a"}, "response_format": {"type": "json_object"}}, None),
        ({"response_format": {"type": "json_schema"}}, "response_format"),
        ({"logit_bias": {"5": 101}}, "logit_bias"),
        ({"logit_bias": {"dog": 1}}, "logit_bias"),
        ({"logit_bias": {"99999999": 1}}, None),
        ({"allowed_token_ids": [10**9]}, None),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),
        ({"continue_final_message": True}, "continue_final_message"),
    ],
)
def test_bad_fields_are_400s_naming_the_problem(server, body, param):
    payload = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **body}
    response = httpx.post(f"{server.url}/v1/chat/completions", json=payload, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    named = param or next(iter(body))
    assert named in (error.get("param") or "") + error["message"], error
    ok = httpx.post(
        f"{server.url}/v1/chat/completions",
        json={k: v for k, v in payload.items() if k not in body},
        timeout=60,
    )
    assert ok.status_code == 200, ok.text


def greedy_tokens(client, prompt: list[int], n: int = 1, **extra) -> list[str]:
    out = client.completions.create(
        model=None,
        prompt=prompt,
        max_tokens=n,
        temperature=0,
        logprobs=0,
        extra_body={"ignore_eos": True, **extra},
    )
    return out.choices[0].logprobs.tokens


def test_logit_bias_changes_and_forces_the_greedy_token(client, tokenizer):
    prompt = tokenizer("The weather today", add_special_tokens=False).input_ids
    (top,) = greedy_tokens(client, prompt)
    (top_id,) = tokenizer(top, add_special_tokens=False).input_ids
    lowered = client.completions.create(
        model=None, prompt=prompt, max_tokens=1, temperature=0, logit_bias={str(top_id): -100}
    )
    assert lowered.choices[0].text != top
    forced = client.completions.create(
        model=None, prompt=prompt, max_tokens=3, temperature=1.0, logit_bias={"1234": 100}
    )
    assert forced.choices[0].text == tokenizer.decode([1234] * 3)


def test_allowed_token_ids_and_bad_words(client, tokenizer):
    cat, dog = (tokenizer(w, add_special_tokens=False).input_ids[0] for w in (" cat", " dog"))
    text = (
        client.completions.create(
            model=None,
            prompt="Pets:",
            max_tokens=6,
            temperature=1.0,
            seed=3,
            extra_body={"allowed_token_ids": [cat, dog], "ignore_eos": True},
        )
        .choices[0]
        .text
    )
    assert re.fullmatch(r"( cat| dog){6}", text), text
    prompt = tokenizer("Once upon a time", add_special_tokens=False).input_ids
    first = greedy_tokens(client, prompt, 4)
    assert len(tokenizer(first[0], add_special_tokens=False).input_ids) == 1
    avoided = greedy_tokens(client, prompt, 4, bad_words=[first[0]])
    assert avoided[0] != first[0] and first[0] not in avoided, (first, avoided)


def hf_logprobs(model_dir, prompt: list[int]) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([prompt])).logits[0].float(), dim=-1)


@pytest.mark.parametrize("max_tokens", [0, 1])
def test_echo_logprobs_score_the_prompt_like_lm_eval(server, tiny_gqa_dir, tokenizer, max_tokens):
    """lm-eval's loglikelihood request: token-id prompts, echo, logprobs 1, max_tokens 0 or 1."""
    context = tokenizer("Question: what is two plus two? Answer:", add_special_tokens=False).input_ids
    continuation = tokenizer(" four", add_special_tokens=False).input_ids
    prompts = [context + continuation, context[:5]]
    payload = {
        "model": None,
        "prompt": prompts,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "logprobs": 1,
        "echo": True,
        "seed": 1234,
    }
    response = httpx.post(f"{server.url}/v1/completions", json=payload, timeout=120)
    assert response.status_code == 200, response.text
    choices = response.json()["choices"]
    for choice, prompt in zip(choices, prompts, strict=True):
        logprobs = choice["logprobs"]
        assert len(logprobs["token_logprobs"]) == len(prompt) + max_tokens
        assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
        assert choice["text"].startswith(tokenizer.decode(prompt))
        expected = hf_logprobs(tiny_gqa_dir, prompt)
        for p in range(1, len(prompt)):
            assert logprobs["token_logprobs"][p] == pytest.approx(expected[p - 1, prompt[p]].item(), abs=1e-3)
            assert max(logprobs["top_logprobs"][p].values()) == pytest.approx(
                expected[p - 1].max().item(), abs=1e-3
            )
    # lm-eval's parse_logprobs on the first choice: the continuation's logprob and whether it is greedy
    first = choices[0]["logprobs"]
    end = len(prompts[0])
    scored = first["token_logprobs"][len(context) : end]
    assert sum(scored) < 0 and len(scored) == len(continuation)
    assert all(isinstance(top, dict) for top in first["top_logprobs"][len(context) : end])


def test_echo_logprobs_stream(client, tokenizer):
    prompt = tokenizer("one two three", add_special_tokens=False).input_ids
    chunks = list(
        client.completions.create(
            model=None, prompt=prompt, max_tokens=2, logprobs=0, echo=True, stream=True, temperature=0
        )
    )
    first = chunks[0].choices[0]
    assert first.text.startswith("one two three")
    assert first.logprobs.token_logprobs[0] is None and len(first.logprobs.token_logprobs) >= len(prompt)


def test_continue_final_message(client):
    out = client.chat.completions.create(
        model=None,
        messages=[{"role": "user", "content": "Say hi"}, {"role": "assistant", "content": "Hi there, I am"}],
        max_tokens=3,
        temperature=0,
        extra_body={"continue_final_message": True, "add_generation_prompt": False},
    )
    assert out.choices[0].message.content is not None
