"""The web page at / in a real browser: Debian's headless Chromium, driven by Playwright, against a real
`nanoserve serve` on a tiny model.

`make test-web` installs Chromium when it is missing and runs these tests (marked `browser`); without
/usr/bin/chromium they are skipped. Every test collects the page's console errors and uncaught
exceptions and asserts there are none beyond the failed loads it provoked. Screenshots of the views
are saved under the test's tmp_path.
"""

from __future__ import annotations

import json
import os
import re
import signal
import time
from pathlib import Path

import httpx
import pytest
from servers import Server

playwright_api = pytest.importorskip("playwright.sync_api")
expect = playwright_api.expect

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
MAX_MODEL_LEN = "16384"
LONG_MAX_TOKENS = "16000"
"""A reply that takes far longer than the test needs to stop it."""
WAIT_MS = 60_000
"""How long an expectation waits on the shared, busy machine."""

pytestmark = [
    pytest.mark.browser,
    pytest.mark.skipif(not os.path.exists(CHROMIUM), reason=f"no {CHROMIUM}: `make test-web` installs it"),
]


@pytest.fixture(scope="module")
def browser():
    expect.set_options(timeout=WAIT_MS)
    playwright = playwright_api.sync_playwright().start()
    try:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield browser
        browser.close()
    finally:
        playwright.stop()


@pytest.fixture
def start_server(tiny_long_context_dir, tmp_path):
    """Starts `nanoserve serve` with extra flags; every server is killed at the end of the test."""
    servers: list[Server] = []

    def start(*extra: str) -> Server:
        log = tmp_path / f"server{len(servers)}.log"
        servers.append(Server(tiny_long_context_dir, log, "--max-model-len", MAX_MODEL_LEN, *extra))
        return servers[-1]

    yield start
    for srv in servers:
        srv.stop()


@pytest.fixture(scope="module")
def web_server(tiny_long_context_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("web") / "server.log"
    srv = Server(tiny_long_context_dir, log, "--max-model-len", MAX_MODEL_LEN)
    yield srv
    srv.stop()


class Console:
    """The page's console errors and uncaught exceptions."""

    def __init__(self, page) -> None:
        self.errors: list[str] = []
        page.on("console", lambda m: self.errors.append(m.text) if m.type == "error" else None)
        page.on("pageerror", lambda e: self.errors.append(f"uncaught: {e}"))

    def assert_clean(self, *failed_statuses: int) -> None:
        """No errors but Chromium's notes on the failed loads the test provoked (by status)."""
        allowed = re.compile(
            rf"Failed to load resource: .* status of ({'|'.join(map(str, failed_statuses))})"
        )
        unexpected = [e for e in self.errors if not (failed_statuses and allowed.search(e))]
        assert not unexpected, unexpected


@pytest.fixture
def open_page(browser):
    """A page in a fresh browser context (its own localStorage), at `url` if given: (page, console)."""
    contexts = []

    def open_(url: str | None = None):
        context = browser.new_context(viewport={"width": 1200, "height": 900})
        contexts.append(context)
        page = context.new_page()
        console = Console(page)
        if url is not None:
            goto(page, url)
        return page, console

    yield open_
    for context in contexts:
        context.close()


def goto(page, url: str) -> None:
    page.goto(url)
    expect(page.locator("body")).to_have_attribute("data-ready", "true")


def wait_for_positive(read, timeout_s: float = 60.0) -> None:
    """Poll until `read()` (text, or a regex match whose group 1 is the number) shows a number above 0.
    Read through locators, not page.wait_for_function: the page's Content-Security-Policy forbids the
    eval that a string predicate needs."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = read()
        text = value.group(1) if isinstance(value, re.Match) else value
        try:
            if float(str(text).split()[0]) > 0:
                return
        except (ValueError, IndexError):
            pass
        assert time.monotonic() < deadline, f"still not positive after {timeout_s} s: {text!r}"
        time.sleep(0.2)


def set_settings(page, **values: str) -> None:
    for field, value in values.items():
        page.fill(f"#{field.replace('_', '-')}", value)


def last_reply(page):
    return page.locator("#messages .message.assistant").last


def start_long_reply(page):
    """Sends a message whose reply runs far longer than any test; returns it once its text shows."""
    set_settings(page, max_tokens=LONG_MAX_TOKENS)
    page.check("#ignore-eos")
    page.fill("#prompt", "Tell me a very long story.")
    page.click("#send")
    reply = last_reply(page)
    expect(reply.locator(".content")).to_have_text(re.compile(r"\S"))
    return reply


# -- chat --------------------------------------------------------------------------------------


@pytest.mark.timeout(240)
def test_chat_streams_a_reply_kept_across_reload(web_server, open_page, tmp_path, tiny_long_context_dir):
    page, console = open_page(web_server.url + "/")
    page.context.grant_permissions(["clipboard-read", "clipboard-write"], origin=web_server.url)
    expect(page.locator("#model-name")).to_have_text(Path(tiny_long_context_dir).name)
    page.fill("#system-prompt", "You are terse.")
    set_settings(page, temperature="0", max_tokens="48")
    page.check("#ignore-eos")
    page.fill("#prompt", "Tell me about the sea.")
    page.press("#prompt", "Enter")  # the keyboard sends

    reply = last_reply(page)
    expect(reply).to_have_attribute("data-status", "done")
    expect(reply.locator(".note")).to_have_text("stopped at max tokens")
    text = reply.locator(".content").text_content()
    # the page shows exactly what the server generates for the same request
    body = {
        "messages": [
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Tell me about the sea."},
        ],
        "temperature": 0,
        "top_p": 1,
        "max_tokens": 48,
        "ignore_eos": True,
    }
    answer = httpx.post(f"{web_server.url}/v1/chat/completions", json=body, timeout=60).json()
    assert text == answer["choices"][0]["message"]["content"] and text
    page.screenshot(path=tmp_path / "chat.png", full_page=True)

    reply.get_by_role("button", name="Copy reply 1").click()
    expect(reply.get_by_role("button", name="Copy reply 1")).to_have_text("Copied")
    assert page.evaluate("navigator.clipboard.readText()") == text

    page.reload()  # the conversation and the settings are kept in the browser
    expect(page.locator("#messages .message")).to_have_count(2)
    expect(last_reply(page).locator(".content")).to_have_text(text)
    expect(page.locator("#system-prompt")).to_have_value("You are terse.")
    expect(page.locator("#max-tokens")).to_have_value("48")
    page.click("#clear")
    expect(page.locator("#messages .message")).to_have_count(0)
    page.reload()
    expect(page.locator("#empty-chat")).to_be_visible()
    console.assert_clean()


@pytest.mark.timeout(240)
def test_stop_aborts_the_request_and_the_dashboard_sees_it(web_server, open_page, tmp_path):
    page, console = open_page(web_server.url + "/")
    reply = start_long_reply(page)
    expect(page.locator("#stop")).to_be_enabled()
    shown = len(reply.locator(".content").text_content() or "")
    page.wait_for_timeout(2500)  # so the charts' last whole second is this reply's alone
    # the reply arrives in pieces: its text grew while it ran (a short one may land in one frame)
    assert len(reply.locator(".content").text_content() or "") > shown
    assert reply.get_attribute("data-status") not in ("done", "stopped")

    page.focus("#tab-chat")
    page.keyboard.press("ArrowRight")  # the tabs work from the keyboard
    expect(page.locator("#tab-dashboard")).to_be_focused()
    expect(page.locator("#view-dashboard")).to_be_visible()
    expect(page.locator("#m-running")).to_have_text("1")
    expect(page.locator("#m-status")).to_have_text("serving")
    # tokens per second in the last whole second (the chart's last point), and over the last 10 s
    chart_label = page.locator("#chart-generation")
    wait_for_positive(lambda: re.search(r"now ([\d.]+)", chart_label.get_attribute("aria-label") or ""))
    wait_for_positive(lambda: page.locator("#m-gen-rate").text_content())
    wait_for_positive(lambda: page.locator("#m-prompt-rate").text_content())
    expect(page.locator("#ranks-body tr")).to_have_count(1)
    expect(page.locator("#ranks-body tr td").nth(1)).to_have_text("alive")
    page.screenshot(path=tmp_path / "dashboard.png", full_page=True)

    page.click("#tab-chat")
    page.click("#stop")
    expect(reply).to_have_attribute("data-status", "stopped")
    expect(page.locator("#send")).to_be_enabled()
    page.click("#tab-dashboard")
    expect(page.locator("#m-running")).to_have_text("0")
    expect(page.locator("#m-kv")).to_have_text("0.0%")
    first = page.locator("#recent-body tr").first.locator("td")
    expect(first.nth(2)).to_have_text("abort")
    generated = int(first.nth(4).text_content())
    assert 0 < generated < int(LONG_MAX_TOKENS)
    # the engine holds nothing for it any more
    stats = httpx.get(f"{web_server.url}/dashboard/stats", timeout=10).json()
    assert stats["num_running"] == 0 and stats["kv_cache_usage"] == 0
    console.assert_clean()


@pytest.mark.timeout(180)
def test_refused_requests_show_the_server_message(web_server, open_page):
    page, console = open_page(web_server.url + "/")
    set_settings(page, max_tokens="100000")
    page.fill("#prompt", "hello")
    page.click("#send")
    expect(page.locator("#error")).to_contain_text("The server refused the request (400)")
    expect(page.locator("#error")).to_contain_text("maximum context length is 16384 tokens")
    expect(page.locator("#prompt")).to_have_value("hello")  # back in the box, to send again
    expect(page.locator("#messages .message")).to_have_count(0)

    # the server sends 429 when it sheds load; the page says so and shows its message
    busy = {"error": {"message": "Too many requests in flight.", "type": "rate_limit", "code": 429}}
    page.route(
        "**/v1/chat/completions",
        lambda route: route.fulfill(status=429, content_type="application/json", body=json.dumps(busy)),
    )
    set_settings(page, max_tokens="8")
    page.click("#send")
    expect(page.locator("#error")).to_contain_text("The server is busy; try again in a moment (429)")
    expect(page.locator("#error")).to_contain_text("Too many requests in flight.")
    page.unroute("**/v1/chat/completions")
    page.click("#send")
    expect(last_reply(page)).to_have_attribute("data-status", "done")
    expect(page.locator("#error")).to_be_hidden()
    console.assert_clean(400, 429)


# -- server options ----------------------------------------------------------------------------


@pytest.mark.timeout(300)
def test_api_key_prompt_under_a_root_path(start_server, open_page, tmp_path, tiny_long_context_dir):
    srv = start_server("--api-key", "web-key", "--root-path", "/nanoserve")

    def strip_prefix(route) -> None:  # the proxy: /nanoserve/... is served by the server's /...
        url = route.request.url
        route.continue_(url=url.replace(f"{srv.url}/nanoserve/", f"{srv.url}/", 1))

    page, console = open_page()
    page.context.route(f"{srv.url}/nanoserve/**", strip_prefix)
    goto(page, f"{srv.url}/nanoserve/")
    expect(page.locator("#key-form")).to_be_visible()
    expect(page.locator("#error")).to_contain_text("This server needs an API key (401)")
    page.fill("#api-key", "wrong")
    page.click("text=Use this key")
    expect(page.locator("#error")).to_contain_text("The server refused the API key (401)")
    expect(page.locator("#key-form")).to_be_visible()
    page.fill("#api-key", "web-key")
    page.click("text=Use this key")
    expect(page.locator("#key-form")).to_be_hidden()
    expect(page.locator("#model-name")).to_have_text(Path(tiny_long_context_dir).name)
    set_settings(page, max_tokens="16")
    page.fill("#prompt", "hi")
    page.click("#send")
    expect(last_reply(page)).to_have_attribute("data-status", "done")
    page.click("#tab-dashboard")
    expect(page.locator("#recent-body tr")).to_have_count(1)
    page.screenshot(path=tmp_path / "dashboard-root-path.png", full_page=True)
    page.reload()  # the key is kept in the browser
    expect(page.locator("#forget-key")).to_be_visible()
    expect(page.locator("#recent-body tr")).to_have_count(1)
    expect(page.locator("#key-form")).to_be_hidden()
    page.click("#forget-key")
    expect(page.locator("#key-form")).to_be_visible()
    expect(page.locator("#error")).to_contain_text("This server needs an API key (401)")
    console.assert_clean(401)

    # the key guards the dashboard data and /v1, also when the server sits under a prefix
    assert httpx.get(f"{srv.url}/").status_code == 200
    assert httpx.get(f"{srv.url}/static/app.js").status_code == 200
    assert httpx.get(f"{srv.url}/dashboard/stats").status_code == 401
    assert httpx.get(f"{srv.url}/v1/models").status_code == 401
    headers = {"Authorization": "Bearer web-key"}
    assert httpx.get(f"{srv.url}/dashboard/stats", headers=headers).json()["num_running"] == 0


@pytest.mark.timeout(300)
def test_data_parallel_ranks_then_a_dead_engine(start_server, open_page, tmp_path):
    srv = start_server("--data-parallel-size", "2", "--num-threads", "1", "--no-exit-on-engine-death")
    page, console = open_page(srv.url + "/#dashboard")
    rows = page.locator("#ranks-body tr")
    expect(rows).to_have_count(2)
    for rank in (0, 1):
        expect(rows.nth(rank).locator("td").nth(1)).to_have_text("alive")

    pids = srv.engine_pids()
    os.kill(pids[1], signal.SIGKILL)
    expect(rows.nth(1).locator("td").nth(1)).to_have_text("dead")
    expect(rows.nth(1).locator("td").nth(5)).to_contain_text("SIGKILL")
    expect(rows.nth(0).locator("td").nth(1)).to_have_text("alive")
    expect(page.locator("#m-status")).to_have_text("degraded")
    page.screenshot(path=tmp_path / "dashboard-degraded.png", full_page=True)

    # the last rank dies mid-reply: the reply ends with the server's error event, then new ones get 503
    page.click("#tab-chat")
    reply = start_long_reply(page)
    os.kill(pids[0], signal.SIGKILL)
    expect(reply).to_have_attribute("data-status", "error")
    expect(reply.locator(".note")).to_contain_text("The engine is not available (503)")
    expect(page.locator("#error")).to_contain_text("Engine core 0")
    page.fill("#prompt", "hello")
    page.click("#send")
    expect(page.locator("#error")).to_contain_text("The engine is not available (503)")
    expect(page.locator("#prompt")).to_have_value("hello")
    page.click("#tab-dashboard")
    expect(page.locator("#m-status")).to_have_text("dead")
    expect(rows.nth(0).locator("td").nth(1)).to_have_text("dead")
    expect(page.locator("#m-error")).to_contain_text("Engine core 0")
    console.assert_clean(503)


@pytest.mark.timeout(180)
def test_no_web_turns_the_page_off(start_server, open_page):
    srv = start_server("--no-web")
    page, _ = open_page()
    assert page.goto(srv.url + "/").status == 404
    for path in ("/static/app.js", "/dashboard/stats"):
        assert httpx.get(srv.url + path).status_code == 404
    assert httpx.get(srv.url + "/v1/models").status_code == 200
