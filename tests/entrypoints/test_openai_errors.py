"""The server's last resort for exceptions no handler took: a 500 in OpenAI's format over a connection
that stays usable. Run on a small app with the server's error handling under a real uvicorn (in a
thread), since no nanoserve route fails on purpose."""

from __future__ import annotations

import threading
import time

import httpx
import pytest
import uvicorn
from fastapi import FastAPI
from servers import free_port

from nanoserve.entrypoints.openai.errors import add_exception_handlers
from nanoserve.entrypoints.openai.middleware import UnhandledErrorMiddleware


@pytest.fixture
def failing_app_url():
    app = FastAPI()
    app.add_middleware(UnhandledErrorMiddleware)
    add_exception_handlers(app)

    @app.get("/fails")
    async def fails() -> dict:
        raise RuntimeError("something nobody expected")

    @app.get("/works")
    async def works() -> dict:
        return {"ok": True}

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="critical"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "uvicorn did not start"
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(30)


def client_port(response: httpx.Response) -> int:
    return response.extensions["network_stream"].get_extra_info("client_addr")[1]


@pytest.mark.timeout(60)
def test_unexpected_exception_is_a_json_500_and_the_connection_stays_usable(failing_app_url):
    with httpx.Client(base_url=failing_app_url, timeout=10) as http:
        first = http.get("/works")
        failed = http.get("/fails")
        assert failed.status_code == 500
        error = failed.json()["error"]
        assert error["type"] == "internal_server_error" and error["code"] == 500
        assert "RuntimeError: something nobody expected" in error["message"]
        assert failed.headers.get("connection") != "close"
        after = http.get("/works")
        assert after.status_code == 200 and after.json() == {"ok": True}
        # one keep-alive connection carried all three
        assert client_port(first) == client_port(failed) == client_port(after)
