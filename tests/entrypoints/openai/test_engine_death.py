"""When the engine process dies, /health turns 503 within 5 s, in-flight requests fail with
a 500 (streams: an error event, then [DONE]) instead of hanging, and so do new ones."""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import httpx
import pytest

from tests.server_utils import RemoteServer


@pytest.fixture(scope="module")
def doomed_server(tiny_llama):
    remote = RemoteServer(tiny_llama, "--max-model-len", "2048")
    try:
        yield remote
    finally:
        remote.close()


def test_killed_engine_makes_health_503_and_fails_requests(doomed_server):
    server = doomed_server
    assert server.get("/health").status_code == 200
    (engine_pid,) = server.engine_pids()
    results: dict[str, object] = {}
    first_chunk = threading.Event()

    def non_streaming() -> None:
        body = {"prompt": "long", "max_tokens": 2000, "ignore_eos": True}
        results["plain"] = server.post("/v1/completions", json=body, timeout=30)

    def streaming() -> None:
        body = {"messages": [{"role": "user", "content": "long"}], "max_tokens": 2000, "ignore_eos": True, "stream": True}
        events = []
        with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=30) as response:
            for line in response.iter_lines():
                if line:
                    events.append(line.removeprefix("data: "))
                    first_chunk.set()
        results["stream"] = (response.status_code, events)

    threads = [threading.Thread(target=non_streaming), threading.Thread(target=streaming)]
    for thread in threads:
        thread.start()
    assert first_chunk.wait(30)
    os.kill(engine_pid, signal.SIGKILL)
    killed_at = time.monotonic()
    while server.get("/health").status_code != 503:
        assert time.monotonic() - killed_at < 5.0, "/health still 200 five seconds after the engine died"
        time.sleep(0.05)
    for thread in threads:
        thread.join(timeout=10)
        assert not thread.is_alive(), "an in-flight request hangs after the engine died"

    plain = results["plain"]
    assert plain.status_code == 500
    assert plain.json()["error"]["type"] == "InternalServerError"
    status, events = results["stream"]
    assert status == 200 and events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["code"] == 500 and "engine" in error["message"].lower()

    after = server.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
    assert after.status_code == 500
    assert server.get("/health").status_code == 503
    assert server.get("/metrics").status_code == 200
