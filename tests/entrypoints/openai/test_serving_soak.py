"""A bounded soak: a few hundred streamed requests at several times what the server holds
(random priorities, deadlines, disconnects; a KV cache small enough to force preemption)
get only 200 (a stream that ends with [DONE], after a timeout error event when its deadline
passed) or 429; afterwards no block is held and the gauges are back to 0 within 1 s."""

from __future__ import annotations

import asyncio
import json
import random
import time

import httpx
import pytest

from tests.entrypoints.openai.conftest import MODEL_NAME
from tests.server_utils import RemoteServer

pytestmark = pytest.mark.serial  # the gauges' return to 0 within 1 s: alone on the machine

GAUGES = ("pagedllm:num_requests_running", "pagedllm:num_requests_waiting", "pagedllm:kv_cache_usage_perc")
NUM_REQUESTS = 240
CONCURRENCY = 24  # 3 x (max-num-seqs 4 + max-num-queued-reqs 4)


@pytest.fixture(scope="module")
def soak_server(tiny_llama):
    remote = RemoteServer(
        tiny_llama, "--served-model-name", MODEL_NAME, "--max-model-len", "256", "--block-size", "16",
        "--num-gpu-blocks-override", "20", "--max-num-seqs", "4", "--scheduling-policy", "priority",
        "--max-num-queued-reqs", "4", "--request-timeout", "2",
    )  # fmt: skip
    try:
        yield remote
    finally:
        remote.close()


async def _sse_events(response: httpx.Response):
    """The ``data:`` payloads of an SSE stream, split on the blank line that ends each event
    (not httpx's ``aiter_lines``, which also splits inside a chunk whose text holds U+2028 or
    U+0085: JSON leaves those unescaped)."""
    buffer = b""
    async for data in response.aiter_bytes():
        buffer += data
        *complete, buffer = buffer.split(b"\n\n")
        for event in complete:
            if event:
                yield event.decode().removeprefix("data: ")


async def _one(http: httpx.AsyncClient, rng: random.Random) -> str:
    """Send one streamed completion; returns "200", "200-timeout", "disconnect" or "429"."""
    body = {"model": MODEL_NAME, "prompt": [rng.randrange(3, 1000) for _ in range(rng.randrange(4, 60))],
            "max_tokens": rng.choice([16, 150, 190]), "ignore_eos": True, "stream": True,
            "priority": rng.randrange(-1, 3)}
    disconnect = rng.random() < 0.15
    async with http.stream("POST", "/v1/completions", json=body) as response:
        if response.status_code == 429:
            assert response.headers["Retry-After"] == "1"
            return "429"
        assert response.status_code == 200, await response.aread()
        events = []
        async for event in _sse_events(response):
            events.append(event)
            if disconnect:
                return "disconnect"
        assert events[-1] == "[DONE]", events[-3:]
        # The error event is the object {"error": ...}; a chunk whose text is the token "error"
        # also holds the substring '"error"', so the event is parsed, not searched.
        last = json.loads(events[-2]) if len(events) > 1 else {}
        if "error" in last:
            assert last["error"]["code"] == "timeout", events[-2]
            return "200-timeout"
        return "200"


def test_soak_ends_clean(soak_server):
    rng = random.Random(0)
    preemptions_before = soak_server.metrics().get("pagedllm:num_preemptions_total", 0)

    async def run() -> list[str]:
        limits = httpx.Limits(max_connections=CONCURRENCY)
        async with httpx.AsyncClient(base_url=soak_server.url, timeout=60, limits=limits) as http:
            slots = asyncio.Semaphore(CONCURRENCY)

            async def bounded() -> str:
                async with slots:
                    return await _one(http, rng)

            return await asyncio.gather(*(bounded() for _ in range(NUM_REQUESTS)))

    outcomes = asyncio.run(run())
    counts = {kind: outcomes.count(kind) for kind in set(outcomes)}
    assert counts.get("429", 0) > 0 and counts.get("200", 0) > 0, counts
    metrics = soak_server.metrics()
    assert metrics["pagedllm:request_rejected_total{reason=max_num_queued_reqs}"] == counts["429"], counts
    assert metrics["pagedllm:num_preemptions_total"] > preemptions_before, f"no preemption: {counts}"
    deadline = time.monotonic() + 1.0
    while any(soak_server.metrics()[name] for name in GAUGES):
        assert time.monotonic() < deadline, f"not idle 1 s after the soak: {counts}"
        time.sleep(0.02)
