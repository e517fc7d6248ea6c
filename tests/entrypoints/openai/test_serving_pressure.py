"""Serving under pressure: the ``priority`` extra body field orders queued requests, a
request over ``--max-num-queued-reqs`` is answered 429 (OpenAI's body, ``Retry-After``),
one past ``--request-timeout`` is aborted (504; streamed: an error event, then [DONE]), and
the counters of both are in /metrics. One server (one request runs at a time)."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from tests.entrypoints.openai.conftest import MODEL_NAME, parse_sse
from tests.server_utils import RemoteServer

pytestmark = pytest.mark.serial  # deadlines and the gauges' return to 0: alone on the machine

#: The timeout server's deadline: 2,000 tokens of the tiny model take well over it (about 6 s
#: on an idle 2-core AVX2 machine, 1.5-2 s on a Zen 4 one; a step costs more than 0.25 ms).
TIMEOUT_S = 0.5
GAUGES = ("pagedllm:num_requests_running", "pagedllm:num_requests_waiting", "pagedllm:kv_cache_usage_perc")


def _server(tiny_llama, *flags):
    return RemoteServer(
        tiny_llama, "--served-model-name", MODEL_NAME, "--max-model-len", "2048", "--max-num-seqs", "1", *flags,
    )  # fmt: skip


@pytest.fixture(scope="module")
def pressure_server(tiny_llama):
    remote = _server(tiny_llama, "--scheduling-policy", "priority", "--max-num-queued-reqs", "2")
    try:
        yield remote
    finally:
        remote.close()


@pytest.fixture(scope="module")
def timeout_server(tiny_llama):
    remote = _server(tiny_llama, "--request-timeout", str(TIMEOUT_S))
    try:
        yield remote
    finally:
        remote.close()


def _body(max_tokens, **extra):
    return {"model": MODEL_NAME, "prompt": "Tell me a story", "max_tokens": max_tokens, "ignore_eos": True,
            "temperature": 0, **extra}


def _wait_for(server, name, value, timeout_s=10.0):
    deadline = time.monotonic() + timeout_s
    while server.metrics().get(name) != value:
        assert time.monotonic() < deadline, f"{name} never reached {value}: {server.metrics().get(name)}"
        time.sleep(0.02)


def _post_in_thread(server, body, results, key):
    def run():
        response = server.post("/v1/completions", json=body, timeout=60)
        results[key] = (response.status_code, response.json(), time.monotonic())

    thread = threading.Thread(target=run)
    thread.start()
    return thread


def test_priority_orders_the_queue_and_the_queue_limit_answers_429(pressure_server):
    server, results = pressure_server, {}
    with httpx.Client(timeout=60) as http:
        with http.stream("POST", server.url + "/v1/completions", json=_body(2000, stream=True)) as running:
            lines = running.iter_lines()
            assert next(line for line in lines if line).startswith("data: ")  # it runs: the one slot is taken
            threads = [_post_in_thread(server, _body(4, priority=5), results, "low")]
            _wait_for(server, "pagedllm:num_requests_waiting", 1)
            threads.append(_post_in_thread(server, _body(4, priority=-1), results, "high"))
            _wait_for(server, "pagedllm:num_requests_waiting", 2)
            over = server.post("/v1/completions", json=_body(4))
            assert over.status_code == 429
            assert over.headers["Retry-After"] == "1"
            error = over.json()["error"]
            assert error["code"] == "rate_limit_exceeded" and error["type"] == "requests"
            assert "--max-num-queued-reqs" in error["message"]
        # leaving the block disconnects the running stream: its slot goes to the queued ones
    for thread in threads:
        thread.join()
    assert results["high"][0] == results["low"][0] == 200
    assert results["high"][2] < results["low"][2], "priority -1 runs before priority 5"
    assert server.metrics()["pagedllm:request_rejected_total{reason=max_num_queued_reqs}"] == 1


def test_request_timeout_aborts_and_frees_the_blocks(timeout_server):
    server, results = timeout_server, {}
    before = server.metrics().get("pagedllm:request_timeout_total", 0)
    # The first runs past the deadline (TIMEOUT_S); the streamed one waits behind it all the time.
    thread = _post_in_thread(server, _body(2000), results, "long")
    _wait_for(server, "pagedllm:num_requests_running", 1)
    started = time.monotonic()
    streamed = server.post("/v1/completions", json=_body(2000, stream=True), timeout=60)
    thread.join()
    assert TIMEOUT_S - 0.2 < time.monotonic() - started < TIMEOUT_S + 5
    status, body, _ = results["long"]
    assert status == 504 and body["error"]["code"] == "timeout", body
    events = parse_sse(streamed.text)
    assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == "timeout", events
    assert server.metrics()["pagedllm:request_timeout_total"] == before + 2
    deadline = time.monotonic() + 1.0
    while any(server.metrics()[name] for name in GAUGES):
        assert time.monotonic() < deadline, "requests left in the engine after their deadline"
        time.sleep(0.02)
