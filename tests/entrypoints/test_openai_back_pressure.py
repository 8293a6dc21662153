"""Back-pressure and deadlines through a real server: --max-queued-requests answers 429 beyond the limit
and leaves admitted requests alone; --request-timeout aborts a request and tells the client so.

A sleeping engine holds the requests it is sent (they stay in flight, unfinished), which makes "the queue
is full" and "the request outlives its deadline" certain rather than a race against a fast model.
"""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from servers import metric, wait_for

LONG = {"prompt": "Tell me a story", "max_tokens": 200, "ignore_eos": True}


def data_events(response: httpx.Response) -> list[str]:
    return [line[len("data: ") :] for line in response.iter_lines() if line.startswith("data: ")]


@pytest.mark.timeout(180)
def test_requests_beyond_the_queue_limit_get_429_and_admitted_ones_finish(own_server, model_name):
    srv = own_server("--max-num-seqs", "2", "--max-queued-requests", "1", "--enable-sleep-endpoints")
    statuses = []
    with httpx.Client(base_url=srv.url, timeout=60) as http:
        assert http.post("/sleep").json() == {"is_sleeping": True}
        # two fill the running batch, one waits: all three admitted
        streams = [
            http.send(
                http.build_request("POST", "/v1/completions", json={**LONG, "stream": True}), stream=True
            )
            for _ in range(3)
        ]
        statuses += [s.status_code for s in streams]
        for body in ({**LONG, "stream": True}, LONG, {**LONG, "n": 2}):
            refused = http.post("/v1/completions", json=body)
            statuses.append(refused.status_code)
            assert refused.status_code == 429, refused.text
            assert int(refused.headers["retry-after"]) >= 1
            assert refused.json()["error"]["type"] == "rate_limit_error"
        client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="none", max_retries=0)
        with pytest.raises(openai.RateLimitError):
            client.chat.completions.create(model=model_name, messages=[{"role": "user", "content": "hi"}])
        assert http.post("/wake_up").json() == {"is_sleeping": False}
        for stream in streams:
            events = data_events(stream)
            stream.close()
            assert events[-1] == "[DONE]"
            chunks = [json.loads(e) for e in events[:-1]]
            assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        # room again
        after = http.post("/v1/completions", json=LONG)
        statuses.append(after.status_code)
        assert after.json()["usage"]["completion_tokens"] == 200
    assert set(statuses) == {200, 429}


@pytest.mark.timeout(180)
def test_request_timeout_aborts_the_request_and_says_so(own_server, model_name):
    srv = own_server("--request-timeout", "2", "--enable-sleep-endpoints", "--no-access-log")

    def aborted() -> float:
        return metric(srv.url, "nanoserve:request_success_total", finished_reason="abort")

    with httpx.Client(base_url=srv.url, timeout=60) as http:
        assert http.post("/sleep").json() == {"is_sleeping": True}
        before = aborted()
        r = http.post("/v1/completions", json=LONG)
        assert r.status_code == 408, r.text
        error = r.json()["error"]
        assert error["type"] == "timeout_error" and "2 s" in error["message"]
        with http.stream(
            "POST",
            "/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 200, "stream": True},
        ) as r:
            assert r.status_code == 200
            events = data_events(r)
        assert events[-1] == "[DONE]"
        assert json.loads(events[-2])["error"]["code"] == 408
        assert wait_for(lambda: aborted() == before + 2)
        assert http.post("/wake_up").json() == {"is_sleeping": False}
        fits = http.post("/v1/completions", json={**LONG, "max_tokens": 4})
        assert fits.status_code == 200 and fits.json()["usage"]["completion_tokens"] == 4
    assert "nanoserve.access" not in srv.log_path.read_text()
