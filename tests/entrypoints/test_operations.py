"""What an operator of ``pagedllm serve`` sees (issue 12, parts 6 and 7), on real servers:

- the stats line every ``PAGEDLLM_LOG_STATS_INTERVAL`` seconds while requests run, quiet when
  idle, none with ``--disable-log-stats``;
- aborted requests and 4xx answers logged at INFO with their request id; chat requests
  under the chat module's logger;
- a port in use reported in one line before the model loads;
- SIGTERM with streams in flight: running requests finish within ``--shutdown-timeout``,
  the rest end with an error event and ``[DONE]``, the process exits in time, no traceback;
- a dead engine makes the server log why and exit with code 1.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Optional

import httpx
import psutil
import pytest

from tests.server_utils import RemoteServer

STATS_RE = re.compile(
    r"Avg prompt throughput: (\d+\.\d) tokens/s, Avg generation throughput: (\d+\.\d) tokens/s, "
    r"Running: (\d+) reqs, Waiting: (\d+) reqs, GPU KV cache usage: (\d+\.\d)%, Prefix cache hit rate: (\d+\.\d)%"
)
LONG = {"prompt": "long", "max_tokens": 1500, "ignore_eos": True}


def full_log(server: RemoteServer) -> str:
    server.log.flush()
    return Path(server.log.name).read_text()


def wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


class StreamReader(threading.Thread):
    """Streams one request in a thread; ``events`` are the SSE data fields as they come."""

    def __init__(self, url: str, body: dict[str, Any]) -> None:
        super().__init__(daemon=True)
        self.url, self.body = url, {**body, "stream": True}
        self.events: list[str] = []
        self.first = threading.Event()
        self.error: Optional[BaseException] = None

    def run(self) -> None:
        try:
            with httpx.stream("POST", self.url, json=self.body, timeout=60) as response:
                for line in response.iter_lines():
                    if line.startswith("data: "):
                        self.events.append(line.removeprefix("data: "))
                        self.first.set()
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            self.error = exc
            self.first.set()


# --- part 6: logs ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def logging_server(tiny_llama):
    env = dict(os.environ, PAGEDLLM_LOG_STATS_INTERVAL="0.5")
    remote = RemoteServer(tiny_llama, "--max-model-len", "2048", env=env, log_requests=True)
    try:
        yield remote
    finally:
        remote.close()


def test_stats_line_while_busy_and_quiet_when_idle(logging_server):
    server = logging_server
    response = server.post("/v1/completions", json={"prompt": "hello there", "max_tokens": 300, "ignore_eos": True})
    assert response.status_code == 200
    time.sleep(1.2)  # two intervals: the last busy one, and the one after it
    lines = STATS_RE.findall(full_log(server))
    generation = [float(line[1]) for line in lines]
    assert max(generation) > 0.0, lines
    assert any(float(line[0]) > 0.0 for line in lines), lines  # prompt throughput
    assert all(0.0 <= float(line[4]) <= 100.0 and 0.0 <= float(line[5]) <= 100.0 for line in lines)
    assert lines[-1][:4] == ("0.0", "0.0", "0", "0")  # the interval after the work ended
    time.sleep(1.5)
    assert len(STATS_RE.findall(full_log(server))) == len(lines), "stats lines while idle"


def test_abort_4xx_and_chat_logger(logging_server):
    server = logging_server
    # an aborted stream: the client goes away after the first chunk
    with httpx.stream("POST", server.url + "/v1/completions", json={**LONG, "stream": True}, timeout=60) as response:
        for line in response.iter_lines():
            if line.startswith("data: "):
                break
    wait_for(lambda: re.search(r"Aborted request\(s\) cmpl-\w+-0\.", full_log(server)), 10, "the abort log line")
    # a 400 from the engine's checks carries the endpoint's request id
    bad = server.post("/v1/completions", json={"prompt": "hi", "max_tokens": 5000})
    assert bad.status_code == 400
    request_id = bad.headers["x-request-id"]
    assert request_id.startswith("cmpl-")
    wait_for(lambda: f"Request {request_id} (POST /v1/completions) answered 400: This model's maximum context length is 2048 tokens" in full_log(server), 5, "the 400 log line")
    # a body that does not validate: the client's X-Request-Id
    invalid = server.post("/v1/completions", json={"max_tokens": 3}, headers={"X-Request-Id": "client-id-7"})
    assert invalid.status_code == 400 and invalid.headers["x-request-id"] == "client-id-7"
    wait_for(lambda: "Request client-id-7 (POST /v1/completions) answered 400: Invalid request" in full_log(server), 5, "the validation log line")
    # an unknown model: 404, with a new id
    missing = server.post("/v1/chat/completions", json={"model": "nope", "messages": [{"role": "user", "content": "x"}]})
    assert missing.status_code == 404
    wait_for(lambda: f"Request {missing.headers['x-request-id']} (POST /v1/chat/completions) answered 404" in full_log(server), 5, "the 404 log line")
    # chat requests are logged by the chat module
    chat = server.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    assert chat.status_code == 200
    chat_id = chat.json()["id"]
    wait_for(lambda: f"[pagedllm.entrypoints.openai.serving_chat] Received request {chat_id}" in full_log(server), 5, "the chat log line")


# --- part 7: failures and shutdown -----------------------------------------------------------


def run_serve(*flags: str, timeout: float = 60) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "pagedllm.entrypoints.cli", "serve", *flags]
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout)


def test_port_in_use_is_one_line_before_the_model_loads(tiny_llama):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        started = time.monotonic()
        done = run_serve(str(tiny_llama), "--port", str(port))
        elapsed = time.monotonic() - started
    assert done.returncode == 1
    assert done.stderr.strip().splitlines() == [
        f"pagedllm serve: error: port {port} on 127.0.0.1 is already in use; stop the other server or choose --port"
    ]
    assert elapsed < 15, "the model was loaded before the port was checked"


@pytest.mark.parametrize("flags", [["--shutdown-timeout", "-1"], ["--shutdown-timeout", "soon"]])
def test_bad_shutdown_timeout(flags):
    done = run_serve(*flags)
    assert done.returncode == 2
    assert "argument --shutdown-timeout: invalid value" in done.stderr


def test_bad_log_stats_interval():
    done = subprocess.run(
        [sys.executable, "-m", "pagedllm.entrypoints.cli", "serve"],
        capture_output=True, text=True, timeout=60, env=dict(os.environ, PAGEDLLM_LOG_STATS_INTERVAL="0"),
    )  # fmt: skip
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "pagedllm serve: error: PAGEDLLM_LOG_STATS_INTERVAL must be a positive number of seconds, got '0'."
    ]


def test_sigterm_finishes_short_requests_and_ends_long_streams(tiny_llama):
    grace = 1.0  # the long stream (2000 tokens) cannot finish in it, the short one (12) can
    server = RemoteServer(tiny_llama, "--max-model-len", "2048", "--shutdown-timeout", str(grace))
    try:
        url = server.url + "/v1/completions"
        long_stream = StreamReader(url, {**LONG, "max_tokens": 2000})
        long_stream.start()
        assert long_stream.first.wait(30) and long_stream.error is None
        short_stream = StreamReader(url, {"prompt": "short", "max_tokens": 12, "ignore_eos": True})
        short_stream.start()
        assert short_stream.first.wait(30) and short_stream.error is None
        server.process.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        time.sleep(0.5)
        with pytest.raises(httpx.ConnectError):  # no new connections
            httpx.get(server.url + "/health", timeout=2)
        code = server.process.wait(timeout=30)
        took = time.monotonic() - signalled
        for reader in (long_stream, short_stream):
            reader.join(10)
            assert not reader.is_alive() and reader.error is None
        log = full_log(server)
    finally:
        server.close()
    assert code == 0
    assert took <= grace + 2.0, f"exited {took:.1f} s after SIGTERM"
    # the short stream finished normally within the grace period
    short = [json.loads(e) for e in short_stream.events[:-1]]
    assert short_stream.events[-1] == "[DONE]"
    assert short[-1]["choices"][0]["finish_reason"] == "length"
    # the long one got an error event, then [DONE]
    assert long_stream.events[-1] == "[DONE]"
    error = json.loads(long_stream.events[-2])["error"]
    assert error["code"] == 503 and error["type"] == "ServiceUnavailableError" and "shutting down" in error["message"]
    assert "Traceback" not in log


def test_sigterm_to_every_process_at_once_still_drains(tiny_llama):
    """systemd's default KillMode (also `timeout`, `kill -- -PGID`) sends SIGTERM to every
    process of the service at once: the engine and its workers leave stopping to the server,
    which lets the running stream finish, exits 0 and logs no engine death."""
    server = RemoteServer(tiny_llama, "--max-model-len", "2048", "--shutdown-timeout", "30", "-tp", "2")
    try:
        stream = StreamReader(server.url + "/v1/completions", {"prompt": "short", "max_tokens": 400, "ignore_eos": True})
        stream.start()
        assert stream.first.wait(30) and stream.error is None
        children = psutil.Process(server.process.pid).children(recursive=True)
        assert len(children) >= 3  # the engine core and two workers (and multiprocessing's helpers)
        for process in [*children, psutil.Process(server.process.pid)]:  # the server last: the race it loses
            process.send_signal(signal.SIGTERM)
        code = server.process.wait(timeout=30)
        stream.join(10)
        log = full_log(server)
    finally:
        server.close()
    assert code == 0, log
    assert stream.error is None and stream.events[-1] == "[DONE]"
    events = [json.loads(event) for event in stream.events[:-1]]
    errors = [event for event in events if "choices" not in event]
    assert not errors, f"the stream ended in {errors}; the server's log:\n{log}"
    assert events[-1]["choices"][0]["finish_reason"] == "length"
    assert "engine is dead" not in log and "Traceback" not in log


def test_disable_log_stats_then_a_killed_engine_fails_requests_and_the_server_exits_1(tiny_llama):
    """One server for both (each start costs seconds): no stats line with
    ``--disable-log-stats`` while the metrics still count; then its engine killed."""
    env = dict(os.environ, PAGEDLLM_LOG_STATS_INTERVAL="0.3")
    server = RemoteServer(tiny_llama, "--max-model-len", "2048", "--disable-log-stats", env=env)
    try:
        assert server.post("/v1/completions", json={"prompt": "a", "max_tokens": 200, "ignore_eos": True}).status_code == 200
        time.sleep(0.8)
        assert not STATS_RE.search(full_log(server))
        assert server.metrics()["pagedllm:generation_tokens_total"] == 200  # the metrics still count

        (engine_pid,) = server.engine_pids()
        results: dict[str, Any] = {}

        def non_streaming() -> None:
            results["plain"] = httpx.post(server.url + "/v1/completions", json=LONG, timeout=30)

        plain = threading.Thread(target=non_streaming)
        plain.start()
        chat = StreamReader(server.url + "/v1/chat/completions", {"messages": [{"role": "user", "content": "long"}], "max_tokens": 1500, "ignore_eos": True})
        chat.start()
        assert chat.first.wait(30) and chat.error is None
        os.kill(engine_pid, signal.SIGKILL)
        killed = time.monotonic()
        code = server.process.wait(timeout=30)
        took = time.monotonic() - killed
        plain.join(10)
        chat.join(10)
        log = full_log(server)
    finally:
        server.close()
    assert code == 1
    assert took < 10, f"the server took {took:.1f} s to exit after its engine died"
    assert results["plain"].status_code == 500
    assert results["plain"].json()["error"]["type"] == "InternalServerError"
    assert chat.events[-1] == "[DONE]"
    error = json.loads(chat.events[-2])["error"]
    assert error["code"] == 500 and "engine" in error["message"].lower()
    assert f"The engine core process (pid {engine_pid}) exited with code -9" in log
    assert "The engine is dead" in log and "stopping the API server (exit code 1)" in log
