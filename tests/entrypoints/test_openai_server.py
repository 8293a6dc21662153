"""The OpenAI-compatible server, started for real (`nanoserve serve` in a subprocess) on a tiny model and
driven with the official `openai` client and httpx.

One shared server (with an API key) answers the non-destructive tests; tests that kill the engine or
the server start their own. Every server and its engine child are killed by the fixture that made them.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import time

import httpx
import openai
import psutil
import pytest
from servers import API_KEY, Server, auth, metric, wait_for


@pytest.fixture(scope="module")
def server(tiny_gqa_dir, tmp_path_factory):
    srv = Server(tiny_gqa_dir, tmp_path_factory.mktemp("server") / "server.log", "--api-key", API_KEY)
    yield srv
    srv.stop()


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=60)


GREEDY = dict(temperature=0, extra_body={"ignore_eos": True})


# -- basic routes -----------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_models_health_version_metrics(server, client, model_name):
    models = client.models.list()
    assert [m.id for m in models.data] == [model_name]
    assert httpx.get(f"{server.url}/health").status_code == 200
    assert httpx.get(f"{server.url}/version").json()["version"]
    assert httpx.post(f"{server.url}/sleep").status_code == 404  # only with --enable-sleep-endpoints
    text = httpx.get(f"{server.url}/metrics").text
    for name in (
        "nanoserve:num_requests_running",
        "nanoserve:num_requests_waiting",
        "nanoserve:kv_cache_usage_perc",
        "nanoserve:prompt_tokens_total",
        "nanoserve:generation_tokens_total",
        "nanoserve:request_success_total",
        "nanoserve:time_to_first_token_seconds_bucket",
        "nanoserve:inter_token_latency_seconds_bucket",
        "nanoserve:e2e_request_latency_seconds_bucket",
    ):
        assert name in text, name


@pytest.mark.timeout(60)
def test_api_key_enforced(server, model_name):
    body = {"model": model_name, "prompt": "hi", "max_tokens": 1}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
        r = httpx.post(f"{server.url}/v1/completions", json=body, headers=headers)
        assert r.status_code == 401, r.text
        assert r.json()["error"]["type"] == "authentication_error"
    assert httpx.get(f"{server.url}/v1/models").status_code == 401
    assert httpx.get(f"{server.url}/health").status_code == 200  # only /v1 is guarded
    bad = openai.OpenAI(base_url=f"{server.url}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.completions.create(model=model_name, prompt="hi", max_tokens=1)
    assert httpx.post(f"{server.url}/v1/completions", json=body, headers=auth()).status_code == 200


# -- completions ------------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_completion_non_streaming_and_streaming_agree(client, model_name):
    # 40 tokens: without `stream` the engine sends the first token, then chunks of 16 (MAX_HELD_TOKENS)
    full = client.completions.create(model=model_name, prompt="Once upon a time", max_tokens=40, **GREEDY)
    choice = full.choices[0]
    assert choice.finish_reason == "length" and choice.text
    assert full.usage.completion_tokens == 40
    assert full.usage.total_tokens == full.usage.prompt_tokens + 40 and full.usage.prompt_tokens > 0

    chunks = list(
        client.completions.create(
            model=model_name,
            prompt="Once upon a time",
            max_tokens=40,
            stream=True,
            stream_options={"include_usage": True},
            **GREEDY,
        )
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == choice.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 40
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens


@pytest.mark.timeout(60)
def test_completion_prompt_forms_and_echo(client, model_name):
    text = client.completions.create(model=model_name, prompt="The sky is", max_tokens=4, **GREEDY)
    ids = text.usage.prompt_tokens
    tokens = client.completions.create(model=model_name, prompt=[1, 504, 3711, 314], max_tokens=4, **GREEDY)
    assert tokens.usage.prompt_tokens == 4
    batch = client.completions.create(
        model=model_name, prompt=["The sky is", "Hello"], max_tokens=4, **GREEDY
    )
    assert [c.index for c in batch.choices] == [0, 1]
    assert batch.choices[0].text == text.choices[0].text
    assert batch.usage.completion_tokens == 8 and batch.usage.prompt_tokens > ids
    echo = client.completions.create(model=model_name, prompt="The sky is", max_tokens=4, echo=True, **GREEDY)
    assert echo.choices[0].text == "The sky is" + text.choices[0].text
    streamed = client.completions.create(
        model=model_name, prompt=["The sky is", "Hello"], max_tokens=4, stream=True, **GREEDY
    )
    by_index: dict[int, str] = {}
    for chunk in streamed:
        for c in chunk.choices:
            by_index[c.index] = by_index.get(c.index, "") + c.text
    assert by_index == {0: batch.choices[0].text, 1: batch.choices[1].text}


@pytest.mark.timeout(60)
def test_n_greater_than_one(client, model_name):
    out = client.completions.create(
        model=model_name,
        prompt="Once",
        n=3,
        max_tokens=6,
        temperature=1.0,
        seed=7,
        extra_body={"ignore_eos": True},
    )
    assert sorted(c.index for c in out.choices) == [0, 1, 2]
    assert out.usage.completion_tokens == 18
    assert len({c.text for c in out.choices}) > 1  # seeded samples differ (seed + i)
    chat = client.chat.completions.create(
        model=model_name, messages=[{"role": "user", "content": "hi"}], n=2, max_tokens=5, seed=1, **GREEDY
    )
    assert [c.index for c in chat.choices] == [0, 1] and chat.usage.completion_tokens == 10
    stream = client.chat.completions.create(
        model=model_name,
        messages=[{"role": "user", "content": "hi"}],
        n=2,
        max_tokens=5,
        stream=True,
        **GREEDY,
    )
    texts: dict[int, str] = {}
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + (c.delta.content or "")
    assert texts == {0: chat.choices[0].message.content, 1: chat.choices[1].message.content}


@pytest.mark.timeout(60)
def test_logprobs(client, model_name):
    out = client.completions.create(model=model_name, prompt="Once upon", max_tokens=5, logprobs=3, **GREEDY)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    assert "".join(lp.tokens) == out.choices[0].text
    for token_lp, top in zip(lp.token_logprobs, lp.top_logprobs, strict=True):
        assert token_lp <= 0 and 3 <= len(top) <= 4
        assert token_lp == pytest.approx(max(top.values()))  # greedy: the sampled token is the best
    chat = client.chat.completions.create(
        model=model_name,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=4,
        logprobs=True,
        top_logprobs=2,
        **GREEDY,
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == 4 and all(len(t.top_logprobs) == 2 for t in content)
    assert all(t.logprob == pytest.approx(t.top_logprobs[0].logprob) for t in content)


@pytest.mark.timeout(60)
def test_stop_strings_and_stop_token_ids(client, model_name, tiny_gqa_dir):
    base = client.completions.create(model=model_name, prompt="Once upon a time", max_tokens=16, **GREEDY)
    text = base.choices[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    assert stop.strip() and text.index(stop) > 0, text
    out = client.completions.create(
        model=model_name, prompt="Once upon a time", max_tokens=16, stop=[stop], **GREEDY
    )
    assert out.choices[0].finish_reason == "stop"
    assert out.choices[0].text == text[: text.index(stop)]
    assert out.choices[0].model_extra.get("stop_reason") == stop
    kept = client.completions.create(
        model=model_name,
        prompt="Once upon a time",
        max_tokens=16,
        stop=stop,
        temperature=0,
        extra_body={"ignore_eos": True, "include_stop_str_in_output": True},
    )
    assert kept.choices[0].text == text[: text.index(stop) + len(stop)]
    streamed = client.completions.create(
        model=model_name, prompt="Once upon a time", max_tokens=16, stop=[stop], stream=True, **GREEDY
    )
    assert "".join(c.choices[0].text for c in streamed if c.choices) == out.choices[0].text
    # every token id is a stop token: one token, and stop_reason says which
    from transformers import AutoTokenizer

    vocab = len(AutoTokenizer.from_pretrained(str(tiny_gqa_dir)))
    out = client.completions.create(
        model=model_name,
        prompt="Once upon a time",
        max_tokens=16,
        temperature=0,
        extra_body={"ignore_eos": True, "stop_token_ids": list(range(vocab))},
    )
    token_id = out.choices[0].model_extra["stop_reason"]
    assert out.usage.completion_tokens == 1 and out.choices[0].finish_reason == "stop"
    assert isinstance(token_id, int)
    again = client.completions.create(
        model=model_name,
        prompt="Once upon a time",
        max_tokens=16,
        temperature=0,
        extra_body={"ignore_eos": True, "stop_token_ids": [token_id]},
    )
    assert again.usage.completion_tokens == 1 and again.choices[0].model_extra["stop_reason"] == token_id


@pytest.mark.timeout(60)
def test_min_tokens_and_max_completion_tokens(client, model_name):
    out = client.chat.completions.create(
        model=model_name,
        messages=[{"role": "user", "content": "hi"}],
        max_completion_tokens=7,
        temperature=0,
        extra_body={"min_tokens": 7},
    )
    assert out.usage.completion_tokens == 7 and out.choices[0].finish_reason == "length"


# -- chat -------------------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_chat_non_streaming_and_streaming_agree(client, model_name):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 2?"}]
    full = client.chat.completions.create(model=model_name, messages=messages, max_tokens=10, **GREEDY)
    assert full.object == "chat.completion"
    assert full.choices[0].message.role == "assistant" and full.choices[0].message.content
    assert full.usage.completion_tokens == 10 and full.usage.prompt_tokens > 10  # the template adds tokens
    chunks = list(
        client.chat.completions.create(
            model=model_name,
            messages=messages,
            max_tokens=10,
            stream=True,
            stream_options={"include_usage": True},
            **GREEDY,
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert (
        chunks[-1].usage.completion_tokens == 10
        and chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens
    )


@pytest.mark.timeout(120)
def test_32_concurrent_streams_complete_with_right_token_counts(server, model_name):
    async def one(client: openai.AsyncOpenAI, i: int) -> tuple[int, int, str]:
        max_tokens = 8 + i % 9
        stream = await client.completions.create(
            model=model_name,
            prompt=f"Story number {i}:",
            max_tokens=max_tokens,
            stream=True,
            stream_options={"include_usage": True},
            temperature=0.8,
            seed=i,
            extra_body={"ignore_eos": True},
        )
        num_chunks, usage, finish = 0, None, None
        async for chunk in stream:
            if chunk.choices:
                num_chunks += 1
                finish = chunk.choices[0].finish_reason or finish
            if chunk.usage is not None:
                usage = chunk.usage
        assert num_chunks >= 1
        return max_tokens, usage.completion_tokens, finish

    async def main() -> list[tuple[int, int, str]]:
        async with openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0) as client:
            return await asyncio.gather(*(one(client, i) for i in range(32)))

    results = asyncio.run(main())
    assert all(got == want and finish == "length" for want, got, finish in results), results


# -- errors -----------------------------------------------------------------------------------

LONG_PROMPT = "hello " * 600  # over the 512-token context

BAD_REQUESTS = [
    # (id, path, body (dict, or raw bytes), expected status)
    ("malformed_json", "/v1/completions", b'{"prompt": "hi", ', 400),
    ("not_an_object", "/v1/completions", b"[1, 2, 3]", 400),
    ("missing_prompt", "/v1/completions", {"max_tokens": 4}, 400),
    ("missing_messages", "/v1/chat/completions", {"max_tokens": 4}, 400),
    ("empty_messages", "/v1/chat/completions", {"messages": []}, 400),
    ("bad_role", "/v1/chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, 400),
    ("prompt_wrong_type", "/v1/completions", {"prompt": 42}, 400),
    ("max_tokens_wrong_type", "/v1/completions", {"prompt": "hi", "max_tokens": "many"}, 400),
    ("temperature_wrong_type", "/v1/completions", {"prompt": "hi", "temperature": "hot"}, 400),
    ("unknown_model", "/v1/completions", {"model": "gpt-9", "prompt": "hi"}, 404),
    (
        "unknown_model_chat",
        "/v1/chat/completions",
        {"model": "gpt-9", "messages": [{"role": "user", "content": "hi"}]},
        404,
    ),
    ("prompt_too_long", "/v1/completions", {"prompt": LONG_PROMPT, "max_tokens": 4}, 400),
    ("max_tokens_beyond_context", "/v1/completions", {"prompt": "hi", "max_tokens": 100000}, 400),
    (
        "max_completion_tokens_beyond_context",
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 100000},
        400,
    ),
    ("max_tokens_zero", "/v1/completions", {"prompt": "hi", "max_tokens": 0}, 400),
    ("n_too_large", "/v1/completions", {"prompt": "hi", "n": 100000}, 400),
    ("n_zero", "/v1/completions", {"prompt": "hi", "n": 0}, 400),
    ("negative_temperature", "/v1/completions", {"prompt": "hi", "temperature": -1}, 400),
    ("top_p_zero", "/v1/completions", {"prompt": "hi", "top_p": 0}, 400),
    (
        "top_p_above_one",
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "hi"}], "top_p": 1.5},
        400,
    ),
    ("top_k_below_minus_one", "/v1/completions", {"prompt": "hi", "top_k": -5}, 400),
    ("min_p_above_one", "/v1/completions", {"prompt": "hi", "min_p": 2}, 400),
    ("presence_penalty_out_of_range", "/v1/completions", {"prompt": "hi", "presence_penalty": 5}, 400),
    ("repetition_penalty_zero", "/v1/completions", {"prompt": "hi", "repetition_penalty": 0}, 400),
    ("logprobs_too_many", "/v1/completions", {"prompt": "hi", "logprobs": 1000}, 400),
    (
        "top_logprobs_too_many",
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 1000},
        400,
    ),
    (
        "min_tokens_above_max_tokens",
        "/v1/completions",
        {"prompt": "hi", "max_tokens": 2, "min_tokens": 5},
        400,
    ),
    ("empty_stop_string", "/v1/completions", {"prompt": "hi", "stop": [""]}, 400),
    ("stop_token_id_out_of_vocab", "/v1/completions", {"prompt": "hi", "stop_token_ids": [10**9]}, 400),
    ("prompt_token_out_of_vocab", "/v1/completions", {"prompt": [1, 10**9], "max_tokens": 2}, 400),
    ("empty_prompt_list", "/v1/completions", {"prompt": []}, 400),
    ("empty_prompt_string", "/v1/completions", {"prompt": ""}, 400),
    ("streaming_bad_request", "/v1/completions", {"prompt": "hi", "temperature": -1, "stream": True}, 400),
    ("oversized_body", "/v1/completions", {"prompt": "x" * (5 * 1024 * 1024)}, 413),
    ("unknown_route", "/v1/nothing", {"prompt": "hi"}, 404),
]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("path,body,status", [b[1:] for b in BAD_REQUESTS], ids=[b[0] for b in BAD_REQUESTS])
def test_bad_request_answered_in_openai_format(server, path, body, status):
    headers = {**auth(), "Content-Type": "application/json"}
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = httpx.post(f"{server.url}{path}", content=content, headers=headers, timeout=30)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"] and error["type"] and error["code"] == status
    assert httpx.get(f"{server.url}/health").status_code == 200


@pytest.mark.timeout(60)
def test_server_serves_after_bad_requests(server, client, model_name):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=model_name, prompt="hi", max_tokens=100000)
    assert "maximum context length" in str(e.value)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "hi"}])
    out = client.completions.create(model=model_name, prompt="hi", max_tokens=3, **GREEDY)
    assert out.usage.completion_tokens == 3
    assert metric(server.url, "nanoserve:num_requests_running") == 0


# -- disconnects ------------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_disconnect_aborts_request(server, model_name):
    aborted = metric(server.url, "nanoserve:request_success_total", finished_reason="abort")
    body = {
        "model": model_name,
        "prompt": "Tell me a story",
        "max_tokens": 480,
        "ignore_eos": True,
        "stream": True,
    }
    with httpx.Client(timeout=30) as http:
        with http.stream("POST", f"{server.url}/v1/completions", json=body, headers=auth()) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            assert next(line for line in lines if line.startswith("data:"))
    # the stream was closed after one event: the request is aborted and its KV blocks freed
    assert wait_for(
        lambda: metric(server.url, "nanoserve:request_success_total", finished_reason="abort") == aborted + 1
    )
    assert wait_for(lambda: metric(server.url, "nanoserve:num_requests_running") == 0)
    assert wait_for(lambda: metric(server.url, "nanoserve:kv_cache_usage_perc") == 0)

    # a non-streaming request whose client gives up once the server runs it is aborted too
    body = {**body, "stream": False, "n": 8}

    def running_or_done(post: asyncio.Task) -> bool:
        return post.done() or metric(server.url, "nanoserve:num_requests_running") > 0

    async def give_up() -> None:
        async with httpx.AsyncClient(timeout=30) as http:
            post = asyncio.create_task(http.post(f"{server.url}/v1/completions", json=body, headers=auth()))
            await asyncio.sleep(0)  # the request is sent while the metrics are polled from a thread
            assert await asyncio.to_thread(wait_for, lambda: running_or_done(post), 10.0, 0.005)
            assert not post.done(), "8 x 480 tokens finished before the client could give up"
            post.cancel()
            with pytest.raises(asyncio.CancelledError):
                await post

    asyncio.run(give_up())
    assert wait_for(
        lambda: metric(server.url, "nanoserve:request_success_total", finished_reason="abort") == aborted + 2
    )
    assert wait_for(lambda: metric(server.url, "nanoserve:kv_cache_usage_perc") == 0)


# -- engine death and shutdown (own servers) --------------------------------------------------


def open_stream(url: str, model_name: str, max_tokens: int = 480) -> tuple[httpx.Client, httpx.Response]:
    http = httpx.Client(timeout=30)
    body = {
        "model": model_name,
        "prompt": "Tell me a story",
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": True,
    }
    request = http.build_request("POST", f"{url}/v1/completions", json=body)
    response = http.send(request, stream=True)
    assert response.status_code == 200
    return http, response


@pytest.mark.timeout(180)
def test_engine_hang_then_sigkill_mid_stream_health_503_and_stream_error(own_server, model_name):
    srv = own_server("--no-exit-on-engine-death", "--health-hang-timeout", "1")
    http, response = open_stream(srv.url, model_name)
    lines = response.iter_lines()
    assert next(line for line in lines if line.startswith("data:"))
    # hung but alive: work in flight and no output for longer than the hang timeout
    engine_pid = srv.engine_pid()
    os.kill(engine_pid, signal.SIGSTOP)
    try:
        assert wait_for(lambda: httpx.get(f"{srv.url}/health").status_code == 503, timeout=10)
    finally:
        os.kill(engine_pid, signal.SIGCONT)
    assert wait_for(lambda: httpx.get(f"{srv.url}/health").status_code == 200, timeout=10)
    response.close()  # the resumed stream may be done by now: the kill goes into a new one's first tokens
    http.close()
    http, response = open_stream(srv.url, model_name)
    lines = response.iter_lines()
    assert next(line for line in lines if line.startswith("data:"))
    os.kill(engine_pid, signal.SIGKILL)
    killed_at = time.monotonic()
    events = [line for line in lines if line.startswith("data:")]
    elapsed = time.monotonic() - killed_at
    response.close()
    http.close()
    assert elapsed < 10, elapsed  # about 0.1 s when idle; the margin is for a loaded machine
    assert events[-1] == "data: [DONE]"
    error = json.loads(events[-2][len("data: ") :])["error"]
    assert error["code"] == 503 and "killed by SIGKILL" in error["message"]
    r = httpx.get(f"{srv.url}/health")
    assert r.status_code == 503 and r.json()["error"]["code"] == 503
    r = httpx.post(f"{srv.url}/v1/completions", json={"model": model_name, "prompt": "hi"})
    assert r.status_code == 503 and r.json()["error"]["type"] == "service_unavailable"
    assert srv.proc.poll() is None  # told to stay up


@pytest.mark.timeout(180)
def test_engine_death_exits_server_nonzero(own_server, model_name):
    """The engine is killed as the stream's response starts: the tiny engine runs far ahead of the stream,
    and killed after the first event arrived, it had once sent all 480 tokens already."""
    srv = own_server()
    engine_pid = srv.engine_pid()
    http, response = open_stream(srv.url, model_name)
    os.kill(engine_pid, signal.SIGKILL)
    events = [line for line in response.iter_lines() if line.startswith("data:")]
    response.close()
    http.close()
    assert '"error"' in events[-2] and events[-1] == "data: [DONE]"
    assert srv.proc.wait(30) == 1


def restart_stream_body(model_name: str, i: int) -> dict:
    """Greedy and seeded streams alternately; seeded ones draw among a few candidates (the tiny model's
    distribution is nearly flat, see tests/engine/test_engine_restart.py)."""
    body = {
        "model": model_name,
        "prompt": f"Story number {i}:",
        "max_tokens": 400,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    body.update(dict(temperature=0.9, top_k=5, seed=40 + i) if i % 2 else dict(temperature=0))
    return body


async def stream_completion(
    http: httpx.AsyncClient, url: str, body: dict, progress: dict, key: int, started: set | None = None
) -> dict:
    """The streamed text, usage and error event (if any) of one completion; `started` gets `key` once
    the server has sent the request to the engine (its response has begun)."""
    result: dict = {"text": "", "usage": None, "error": None}
    async with http.stream("POST", f"{url}/v1/completions", json=body) as response:
        assert response.status_code == 200
        if started is not None:
            started.add(key)
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[len("data: ") :])
            if "error" in event:
                result["error"] = event["error"]
                continue
            result["usage"] = event.get("usage") or result["usage"]
            for choice in event["choices"]:
                result["text"] += choice["text"]
                progress[key] = progress.get(key, 0) + 1
    return result


async def start_streams(
    http: httpx.AsyncClient, url: str, model_name: str, n: int, generating: bool = True
) -> list[asyncio.Task]:
    """n streams that start generating together (the engine sleeps, holding what it is sent, until all
    are in), returned once each has received an event; or, not `generating`, once all are in and held by
    the sleeping engine (none can finish before whatever the caller does next)."""
    assert (await http.post(f"{url}/sleep")).status_code == 200
    progress: dict[int, int] = {}
    started: set[int] = set()
    tasks = [
        asyncio.create_task(
            stream_completion(http, url, restart_stream_body(model_name, i), progress, i, started)
        )
        for i in range(n)
    ]
    deadline = time.monotonic() + 60
    while len(started) < n:
        assert time.monotonic() < deadline and not [t.result() for t in tasks if t.done()]
        await asyncio.sleep(0.005)
    if not generating:
        return tasks
    assert (await http.post(f"{url}/wake_up")).status_code == 200
    while len(progress) < n:
        assert time.monotonic() < deadline and not [t.result() for t in tasks if t.done()]
        await asyncio.sleep(0.005)
    return tasks


@pytest.mark.timeout(300)
def test_engine_restart_resumes_8_streams_then_a_death_past_the_budget_is_final(own_server, model_name):
    srv = own_server("--engine-restarts", "1", "--enable-sleep-endpoints")

    async def main() -> tuple[int, int]:
        async with httpx.AsyncClient(timeout=120) as http:
            calm = await asyncio.gather(
                *(
                    stream_completion(http, srv.url, restart_stream_body(model_name, i), {}, i)
                    for i in range(8)
                )
            )
            assert all(r["error"] is None and r["usage"]["completion_tokens"] == 400 for r in calm)
            pid = srv.engine_pid()
            tasks = await start_streams(http, srv.url, model_name, 8)
            os.kill(pid, signal.SIGKILL)
            health = []
            while not all(t.done() for t in tasks):  # while it comes back, /health says so
                r = await http.get(f"{srv.url}/health")
                health.append((r.status_code, r.json()))
                await asyncio.sleep(0.02)
            resumed = [t.result() for t in tasks]
            restarting = [body for code, body in health if code == 200 and body["status"] == "restarting"]
            assert restarting and restarting[0]["restarting_ranks"] == [0]
            assert [r["text"] for r in resumed] == [r["text"] for r in calm]
            assert [r["usage"] for r in resumed] == [r["usage"] for r in calm]
            r = await http.get(f"{srv.url}/health")
            assert r.status_code == 200 and r.json()["status"] == "ok"
            new_pid = srv.engine_pid()
            assert new_pid != pid
            assert metric(srv.url, "nanoserve:engine_restarts_total", rank="0") == 1

            # held, not generating: a tiny model's 400 tokens can all be out before a loaded test kills
            tasks = await start_streams(http, srv.url, model_name, 4, generating=False)
            killed_at = time.monotonic()
            os.kill(new_pid, signal.SIGKILL)  # the budget is spent: this death is final
            ended = await asyncio.gather(*tasks)
            # about 2 s on an idle machine; the bound leaves room for a loaded one
            assert time.monotonic() - killed_at < 10
            for r in ended:
                assert r["error"]["code"] == 503 and "killed by SIGKILL" in r["error"]["message"]
                assert "died 2 times" in r["error"]["message"]
            return pid, new_pid

    pids = asyncio.run(main())
    assert srv.proc.wait(30) == 1
    assert all(not psutil.pid_exists(p) or psutil.Process(p).status() == psutil.STATUS_ZOMBIE for p in pids)


@pytest.mark.timeout(180)
def test_sigterm_lets_in_flight_requests_finish_then_exits_zero(own_server, model_name):
    srv = own_server()
    http, response = open_stream(srv.url, model_name, max_tokens=120)
    lines = response.iter_lines()
    assert next(line for line in lines if line.startswith("data:"))
    srv.proc.send_signal(signal.SIGTERM)
    events = [line for line in lines if line.startswith("data:")]
    response.close()
    http.close()
    assert events[-1] == "data: [DONE]"
    assert '"finish_reason":"length"' in events[-2]
    assert srv.proc.wait(60) == 0
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{srv.url}/health")
    assert re.search(r"Shutting down", srv.log())


@pytest.mark.timeout(60)
def test_serve_help_names_every_server_option():
    out = subprocess.run(
        [sys.executable, "-m", "nanoserve.entrypoints.cli", "serve", "--help"],
        capture_output=True,
        text=True,
        timeout=50,
        check=True,
    ).stdout
    for flag in ("--model", "--host", "--port", "--api-key", "--served-model-name", "--max-model-len"):
        assert flag in out
    for flag in ("--max-num-seqs", "--dtype", "--seed", "--shutdown-grace-period", "--exit-on-engine-death"):
        assert flag in out
