"""The chat page at ``/`` (``pagedllm.entrypoints.openai.chat_page``).

Without a browser: the routes over ``build_app`` (public under ``--api-key``, gone with
``--disable-frontend``). In headless Chromium (Debian's ``chromium`` package, driven by
playwright; skipped when it is missing), against the package's shared server (which has an
API key): the page asks for the key, streams the same greedy answer as
``/v1/chat/completions``, and stops a long generation (the server then runs nothing); with a
canned stream, model text renders as markdown without any HTML getting in, and the reasoning
shows apart. A screenshot is saved under the test's tmp dir (its path is printed).
"""

from __future__ import annotations

import asyncio
import json
import os
import time

import httpx
import pytest

from pagedllm.entrypoints.cli import build_parser
from pagedllm.entrypoints.openai.api_server import build_app
from pagedllm.entrypoints.openai.cli_args import FrontendConfig
from tests.entrypoints.openai.conftest import API_KEY, MODEL_NAME
from tests.entrypoints.openai.test_tool_calling_sdk import _ScriptedEngine, parts  # noqa: F401  (the fixture)

CHROMIUM = "/usr/bin/chromium"


def _get(parts, path: str, **frontend_fields) -> httpx.Response:
    engine = _ScriptedEngine(parts.processor, parts.config.model_config, parts.tokenizer)
    app = build_app(engine, FrontendConfig(disable_log_stats=True, disable_log_requests=True, **frontend_fields))

    async def get() -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
            return await client.get(path)

    return asyncio.run(get())


def test_page_routes_are_public_and_disable_frontend_removes_them(parts):
    page = _get(parts, "/", api_key=["k"])
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert '<script src="static/chat.js">' in page.text and "script-src 'self'" in page.headers["content-security-policy"]
    script = _get(parts, "/static/chat.js", api_key=["k"])
    assert script.status_code == 200 and script.headers["content-type"].startswith("text/javascript")
    assert "v1/chat/completions" in script.text
    assert _get(parts, "/static/nothing.js").status_code == 404
    assert _get(parts, "/v1/models", api_key=["k"]).status_code == 401  # the API keeps its key

    args = build_parser().parse_args(["serve", "--disable-frontend"])
    assert FrontendConfig.from_cli_args(args).disable_frontend is True
    assert _get(parts, "/", disable_frontend=True).status_code == 404
    assert _get(parts, "/static/chat.js", disable_frontend=True).status_code == 404


@pytest.fixture(scope="module")
def browser():
    if not os.path.exists(CHROMIUM):
        pytest.skip(f"headless Chromium is not installed at {CHROMIUM} (Debian: apt-get install chromium)")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=CHROMIUM)
        try:
            yield chromium
        finally:
            chromium.close()


def _send(page, text: str) -> None:
    page.fill("#prompt", text)
    page.press("#prompt", "Enter")


def _last_reply(page, outcome: str, timeout_ms: int = 60_000) -> str:
    """The raw text of the last assistant message once its stream ended with ``outcome``."""
    selector = f'.message.assistant:last-child[data-outcome="{outcome}"]'
    page.wait_for_selector(selector, timeout=timeout_ms)
    page.wait_for_selector('body[data-state="idle"]')
    return page.get_attribute(selector, "data-raw")


def test_page_streams_the_greedy_answer_asks_for_the_key_and_stops(server, client, browser, tmp_path):
    page = browser.new_page()
    page.goto(server.url + "/")
    page.wait_for_selector('body[data-state="needs-key"]')
    page.fill("#api-key", API_KEY)
    page.click("#api-key-form button")
    page.wait_for_selector('body[data-state="idle"]')
    assert page.evaluate("localStorage.getItem('pagedllm.apiKey')") == API_KEY
    assert MODEL_NAME in page.eval_on_selector_all("#model option", "options => options.map(o => o.value)")

    page.fill("#system-prompt", "Answer briefly.")
    page.fill("#temperature", "0")
    page.fill("#max-tokens", "24")
    _send(page, "Hello, who are you?")
    streamed = _last_reply(page, "done")
    messages = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Hello, who are you?"}]
    reference = client.chat.completions.create(
        model=page.input_value("#model"), messages=messages, temperature=0, top_p=1, max_tokens=24
    )
    assert streamed and streamed == reference.choices[0].message.content

    page.click("#new-chat")
    page.fill("#max-tokens", "1500")
    _send(page, "Tell me a very long story.")
    page.wait_for_selector('.message.assistant:last-child:not([data-raw=""])')  # the first tokens came
    page.click("#stop")
    stopped = _last_reply(page, "stopped", timeout_ms=10_000)
    assert page.is_visible(".message.assistant:last-child .stopped") and 0 < len(stopped)
    deadline = time.monotonic() + 10
    while (busy := _busy(server)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not busy, "the stopped request still runs in the engine"
    screenshot = tmp_path / "chat-page.png"
    page.screenshot(path=str(screenshot), full_page=True)
    print(f"chat page screenshot: {screenshot}")
    page.close()


def _busy(server) -> float:
    metrics = server.metrics()
    return metrics.get("pagedllm:num_requests_running", 0) + metrics.get("pagedllm:num_requests_waiting", 0)


#: A canned stream: reasoning, then markdown content with HTML that must stay text.
CANNED_DELTAS = [
    {"role": "assistant", "reasoning": "Think <b>hard</b>"},
    {"reasoning": " first."},
    {"content": "# Title\n**bold** and `a<b` "},
    {"content": '<img src=x onerror="window.injected=1"> [x](javascript:alert(1))\n'},
    {"content": "```python\nprint('<script>')\n```\n- one\n- two"},
]


def _canned_stream(route) -> None:
    chunks = [{"choices": [{"index": 0, "delta": delta, "finish_reason": None}]} for delta in CANNED_DELTAS]
    body = "".join(f"data: {json.dumps(chunk)}\n\n" for chunk in chunks) + "data: [DONE]\n\n"
    route.fulfill(status=200, headers={"Content-Type": "text/event-stream"}, body=body)


def test_page_renders_markdown_safely_and_reasoning_apart(server, browser, tmp_path):
    page = browser.new_page()
    page.route("**/v1/models", lambda route: route.fulfill(json={"object": "list", "data": [{"id": "canned"}]}))
    page.route("**/v1/chat/completions", _canned_stream)
    page.goto(server.url + "/")
    page.wait_for_selector('body[data-state="idle"]')
    _send(page, "Show me.")
    raw = _last_reply(page, "done")
    assert raw == "".join(delta.get("content", "") for delta in CANNED_DELTAS)
    reply = ".message.assistant:last-child"
    assert page.inner_text(f"{reply} .reasoning-text") == "Think <b>hard</b> first."
    assert page.eval_on_selector(f"{reply} .reasoning", "e => !e.hidden")
    content = f"{reply} .content"
    assert page.inner_text(f"{content} h1") == "Title"
    assert page.inner_text(f"{content} strong") == "bold"
    assert page.eval_on_selector_all(f"{content} code", "codes => codes.map(c => c.textContent)") == [
        "a<b", "print('<script>')",
    ]  # fmt: skip
    assert page.eval_on_selector_all(f"{content} li", "items => items.map(i => i.textContent)") == ["one", "two"]
    assert page.eval_on_selector_all(f"{reply} img, {reply} script, {reply} a, {reply} b", "found => found.length") == 0
    assert '<img src=x onerror="window.injected=1">' in page.inner_text(content)
    assert page.evaluate("window.injected") is None
    page.screenshot(path=str(tmp_path / "chat-page-markdown.png"), full_page=True)
    print(f"chat page screenshot: {tmp_path / 'chat-page-markdown.png'}")
    page.close()
