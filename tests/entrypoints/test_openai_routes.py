"""The routes and server options beyond generation, through a real server: /tokenize and /detokenize,
/ping and /health, the sleep endpoints, request fields refused or unknown, range checks, vLLM-named
metrics with the phase histograms and speculative decoding's counters, CORS and the access log.

One server with every option these tests read answers them all (speculative decoding included, so
every route here also runs with it); it is killed at the end of the module.
"""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from servers import API_KEY, Server, auth, metric, wait_for

ORIGIN = "http://page.example"
UNICODE_TEXT = "Grüße, 世界! naïve café — 🙂🚀 ∑x²"


@pytest.fixture(scope="module")
def server(tiny_gqa_dir, tmp_path_factory):
    flags = ["--api-key", API_KEY, "--enable-sleep-endpoints", "--metrics-prefix", "vllm"]
    flags += ["--allowed-origins", ORIGIN, "--speculative", "ngram"]
    srv = Server(tiny_gqa_dir, tmp_path_factory.mktemp("routes") / "server.log", *flags)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def tokenizer(tiny_gqa_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_gqa_dir))


@pytest.fixture
def http(server):
    with httpx.Client(base_url=server.url, headers=auth(), timeout=60) as client:
        yield client


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=60)


def client_port(response: httpx.Response) -> int:
    return response.extensions["network_stream"].get_extra_info("client_addr")[1]


# -- /tokenize, /detokenize -------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_tokenize_detokenize_round_trip_unicode(http, tokenizer):
    r = http.post("/tokenize", json={"prompt": UNICODE_TEXT, "return_token_strs": True})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["tokens"] == tokenizer(UNICODE_TEXT).input_ids
    assert body["count"] == len(body["tokens"]) and body["max_model_len"] == 512
    assert body["token_strs"] == tokenizer.convert_ids_to_tokens(body["tokens"])
    back = http.post("/detokenize", json={"tokens": body["tokens"]})
    assert back.status_code == 200 and back.json() == {"prompt": UNICODE_TEXT}
    plain = http.post("/tokenize", json={"prompt": "hi", "add_special_tokens": False}).json()
    assert plain["tokens"] == tokenizer("hi", add_special_tokens=False).input_ids
    assert plain["token_strs"] is None


@pytest.mark.timeout(60)
def test_tokenize_chat_gives_the_chat_completion_prompt(http, client, model_name, tokenizer):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": UNICODE_TEXT}]
    body = http.post("/tokenize", json={"model": model_name, "messages": messages}).json()
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert body["tokens"] == tokenizer(text, add_special_tokens=False).input_ids
    chat = client.chat.completions.create(model=model_name, messages=messages, max_tokens=1)
    assert chat.usage.prompt_tokens == body["count"]
    no_prompt = http.post("/tokenize", json={"messages": messages, "add_generation_prompt": False}).json()
    assert no_prompt["count"] < body["count"]


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "path,body,status,param",
    [
        ("/detokenize", {"tokens": [1, -2]}, 400, "tokens"),
        ("/detokenize", {"tokens": [1, 10**9]}, 400, "tokens"),
        ("/detokenize", {"tokens": [2**70]}, 400, "tokens"),
        ("/tokenize", {"prompt": "hi", "messages": [{"role": "user", "content": "hi"}]}, 400, "messages"),
        ("/tokenize", {}, 400, None),
        ("/tokenize", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400, "messages"),
        ("/tokenize", {"model": "gpt-9", "prompt": "hi"}, 404, "model"),
    ],
    ids=["negative", "beyond_vocab", "beyond_int64", "prompt_and_messages", "neither", "image", "model"],
)
def test_tokenize_errors(http, path, body, status, param):
    r = http.post(path, json=body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["code"] == status and (param is None or error["param"] == param)


# -- /health, /ping, /version, sleep ------------------------------------------------------------


@pytest.mark.timeout(60)
def test_health_ping_version_bodies(server):
    ok = {"status": "ok", "restarting_ranks": [], "dead_ranks": [], "errors": {}}
    assert httpx.get(f"{server.url}/health").json() == ok
    for method in ("GET", "POST"):
        r = httpx.request(method, f"{server.url}/ping")
        assert r.status_code == 200 and r.json()["status"] == "ok"
    assert httpx.get(f"{server.url}/version").json()["version"]


@pytest.mark.timeout(120)
def test_sleep_holds_requests_until_wake_up(server, http, model_name):
    assert http.get("/is_sleeping").json() == {"is_sleeping": False}
    assert http.post("/sleep", params={"level": 1}).json() == {"is_sleeping": True}
    assert http.get("/is_sleeping").json() == {"is_sleeping": True}
    with httpx.Client(base_url=server.url, headers=auth(), timeout=2) as short:
        body = {"model": model_name, "prompt": "hi", "max_tokens": 3, "ignore_eos": True}
        with pytest.raises(httpx.ReadTimeout):  # held by the sleeping engine, aborted when we give up
            short.post("/v1/completions", json=body)
    assert http.post("/sleep", params={"level": 3}).status_code == 400
    assert http.post("/wake_up").json() == {"is_sleeping": False}
    out = http.post("/v1/completions", json=body).json()
    assert out["usage"]["completion_tokens"] == 3


# -- request fields -----------------------------------------------------------------------------

CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
COMPLETION = {"prompt": "hi", "max_tokens": 2}

REFUSED = [
    # (id, path, fields added to a valid body, the field the 400 names)
    ("best_of_above_n", "/v1/completions", {"best_of": 3, "n": 2}, "best_of"),
    ("best_of_below_n", "/v1/completions", {"best_of": 1, "n": 2}, "best_of"),
    ("use_beam_search", "/v1/completions", {"use_beam_search": True}, "use_beam_search"),
    ("use_beam_search_chat", "/v1/chat/completions", {"use_beam_search": True}, "use_beam_search"),
    ("length_penalty", "/v1/completions", {"length_penalty": 0.5}, "length_penalty"),
    ("suffix", "/v1/completions", {"suffix": " the end"}, "suffix"),
    ("priority", "/v1/completions", {"priority": 5}, "priority"),
    ("truncate_prompt_tokens", "/v1/completions", {"truncate_prompt_tokens": 2}, "truncate_prompt_tokens"),
    ("spaces_between_special_tokens", "/v1/completions", {"spaces_between_special_tokens": False}, None),
    ("cache_salt", "/v1/chat/completions", {"cache_salt": "tenant-a"}, "cache_salt"),
    ("store", "/v1/chat/completions", {"store": True}, "store"),
    ("audio_modality", "/v1/chat/completions", {"modalities": ["text", "audio"]}, "modalities"),
    ("audio", "/v1/chat/completions", {"audio": {"voice": "alloy", "format": "wav"}}, "audio"),
    ("functions", "/v1/chat/completions", {"functions": [{"name": "f", "parameters": {}}]}, "functions"),
    ("reasoning_effort", "/v1/chat/completions", {"reasoning_effort": "high"}, "reasoning_effort"),
    ("web_search", "/v1/chat/completions", {"web_search_options": {}}, "web_search_options"),
    ("service_tier_flex", "/v1/chat/completions", {"service_tier": "flex"}, "service_tier"),
    ("chat_template", "/v1/chat/completions", {"chat_template": "{{ messages }}"}, "chat_template"),
    ("chat_echo", "/v1/chat/completions", {"echo": True}, "echo"),
    # range checks at parse time (some of these were 500s)
    ("seed_beyond_int64", "/v1/completions", {"seed": 2**64}, "seed"),
    ("top_k_beyond_int64", "/v1/chat/completions", {"top_k": 2**64}, "top_k"),
    ("stop_token_id_beyond_int64", "/v1/completions", {"stop_token_ids": [2**64]}, "stop_token_ids"),
    ("echo_negative_token", "/v1/completions", {"prompt": [1, -1], "echo": True}, "prompt"),
    ("echo_huge_token", "/v1/completions", {"prompt": [1, 10**12], "echo": True}, "prompt"),
    ("echo_beyond_int64", "/v1/completions", {"prompt": [[1, 2**64]], "echo": True}, "prompt"),
    ("infinite_temperature", "/v1/completions", {"temperature": float("inf")}, "temperature"),
    ("nan_top_p", "/v1/completions", {"top_p": float("nan")}, "top_p"),
]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("path,fields,param", [r[1:] for r in REFUSED], ids=[r[0] for r in REFUSED])
def test_refused_and_out_of_range_fields_get_400_naming_them(http, path, fields, param):
    body = {**(COMPLETION if path == "/v1/completions" else CHAT), **fields}
    # json.dumps writes inf/nan as Infinity/NaN, which the server's JSON parser reads
    r = http.post(path, content=json.dumps(body), headers={"Content-Type": "application/json"})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    name = param or next(iter(fields))
    assert error["param"] == name and name in error["message"]


@pytest.mark.timeout(60)
def test_former_500s_are_400s_and_the_connection_stays_usable(http):
    first = http.post("/v1/completions", json=COMPLETION)
    assert first.status_code == 200
    for fields in (
        {"seed": 2**64},
        {"top_k": 2**64},
        {"prompt": [-1], "echo": True},
        {"prompt": [10**12], "echo": True},
    ):
        r = http.post("/v1/completions", json={**COMPLETION, **fields})
        assert r.status_code == 400 and r.headers.get("connection") != "close", r.text
        assert client_port(r) == client_port(first)
    after = http.post("/v1/completions", json=COMPLETION)
    assert after.status_code == 200 and client_port(after) == client_port(first)


@pytest.mark.timeout(60)
def test_fields_with_no_effect_are_accepted(http):
    no_effect = {"user": "u-1", "best_of": 1, "use_beam_search": False, "priority": 0, "length_penalty": 1.0}
    assert http.post("/v1/completions", json={**COMPLETION, **no_effect}).status_code == 200
    no_effect = {
        "user": "u-1",
        "metadata": {"team": "a"},
        "store": False,
        "safety_identifier": "s-1",
        "prompt_cache_key": "k",
        "service_tier": "auto",
        "modalities": ["text"],
        "prediction": {"type": "content", "content": "hello"},
    }
    assert http.post("/v1/chat/completions", json={**CHAT, **no_effect}).status_code == 200


@pytest.mark.timeout(60)
def test_unknown_fields_are_accepted_and_named_once_in_the_log(server, http):
    body = {**CHAT, "frobnicate_level": 3}
    body["messages"] = [{"role": "user", "content": "hi", "mood": "curious"}]
    for _ in range(2):
        assert http.post("/v1/chat/completions", json=body).status_code == 200

    def warnings() -> list[str]:
        return [line for line in server.log_path.read_text().splitlines() if "frobnicate_level" in line]

    assert wait_for(lambda: len(warnings()) == 1)
    (line,) = warnings()
    assert line.startswith("WARNING") and "messages[].mood" in line


@pytest.mark.timeout(60)
def test_request_id_names_the_response(client, model_name):
    out = client.completions.create(
        model=model_name, prompt="hi", max_tokens=1, extra_body={"request_id": "r-42"}
    )
    assert out.id == "cmpl-r-42"


# -- metrics, CORS, access log -----------------------------------------------------------------


@pytest.mark.timeout(60)
def test_metrics_use_vllm_names_and_export_the_phase_histograms(server, client, model_name):
    def value(name: str) -> float:
        return metric(server.url, name, model_name=model_name)

    phases = ("queue", "prefill", "decode", "inference")
    before = {p: value(f"vllm:request_{p}_time_seconds_sum") for p in phases}
    counts = value("vllm:request_inference_time_seconds_count")
    tpot_count = value("vllm:request_time_per_output_token_seconds_count")
    e2e = value("vllm:e2e_request_latency_seconds_sum")
    client.completions.create(model=model_name, prompt="Once upon a time", max_tokens=12, temperature=0)
    assert wait_for(lambda: value("vllm:request_inference_time_seconds_count") == counts + 1)
    spent = {p: value(f"vllm:request_{p}_time_seconds_sum") - before[p] for p in phases}
    assert all(seconds >= 0 for seconds in spent.values()), spent
    assert spent["decode"] > 0 and spent["inference"] == pytest.approx(spent["prefill"] + spent["decode"])
    assert value("vllm:e2e_request_latency_seconds_sum") - e2e >= spent["inference"]
    assert value("vllm:request_time_per_output_token_seconds_count") == tpot_count + 1
    text = httpx.get(f"{server.url}/metrics").text
    for name in ("vllm:time_per_output_token_seconds_bucket", "vllm:time_to_first_token_seconds_bucket"):
        assert name in text
    assert "nanoserve:" not in text


@pytest.mark.timeout(60)
def test_metrics_count_speculative_draft_and_accepted_tokens(server, client, model_name):
    def value(name: str) -> float:
        return metric(server.url, f"vllm:spec_decode_num_{name}_tokens_total", model_name=model_name)

    drafts = value("draft")
    client.completions.create(model=model_name, prompt="one two " * 12, max_tokens=24, temperature=0)
    assert wait_for(lambda: value("draft") > drafts)
    assert 0 <= value("accepted") <= value("draft")


@pytest.mark.timeout(60)
def test_cors_allows_the_configured_origin_only(server):
    preflight = {"Origin": ORIGIN, "Access-Control-Request-Method": "POST"}
    preflight["Access-Control-Request-Headers"] = "authorization,content-type"
    r = httpx.options(f"{server.url}/v1/chat/completions", headers=preflight)
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == ORIGIN
    r = httpx.options(
        f"{server.url}/v1/chat/completions", headers={**preflight, "Origin": "http://evil.example"}
    )
    assert r.status_code == 400 and "access-control-allow-origin" not in r.headers
    r = httpx.get(f"{server.url}/v1/models", headers={**auth(), "Origin": ORIGIN})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == ORIGIN


@pytest.mark.timeout(60)
def test_access_log_line_per_request_with_tokens(server, client, model_name):
    out = client.completions.create(model=model_name, prompt="The sky is", max_tokens=5, temperature=0)
    stream = client.chat.completions.create(
        model=model_name,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=4,
        stream=True,
        stream_options={"include_usage": True},
        temperature=0,
    )
    chat_usage = [c.usage for c in stream if c.usage is not None][-1]
    wanted = [
        f'"POST /v1/completions" 200 prompt_tokens={out.usage.prompt_tokens} completion_tokens=5 ',
        f'"POST /v1/chat/completions" 200 prompt_tokens={chat_usage.prompt_tokens} '
        f"completion_tokens={chat_usage.completion_tokens} ",
        '"GET /v1/models" 401 ',
    ]
    httpx.get(f"{server.url}/v1/models")

    def logged() -> bool:
        lines = [line for line in server.log_path.read_text().splitlines() if "nanoserve.access" in line]
        return all(any(w in line for line in lines) for w in wanted)

    assert wait_for(logged), server.log()
