"""Sleep mode over HTTP (``--enable-sleep-mode``): ``POST /sleep?level=1|2``, ``POST /wake_up``,
``GET /is_sleeping``; the same greedy text after waking, 503 while asleep, and requests in
flight at ``/sleep`` all finish before it returns."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Iterator

import httpx
import pytest

from tests.entrypoints.openai.conftest import API_KEY, parse_sse
from tests.server_utils import RemoteServer

BODY = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": 12, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def sleepy(tiny_llama: Path) -> Iterator[RemoteServer]:
    remote = RemoteServer(tiny_llama, "--served-model-name", "tiny", "--enable-sleep-mode", api_key=API_KEY)
    try:
        yield remote
    finally:
        remote.close()


def _text(server: RemoteServer, **extra) -> str:
    response = server.post("/v1/completions", json={**BODY, **extra})
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["text"]


def test_asleep_requests_get_503_and_wake_up_gives_the_same_text(sleepy):
    expected = _text(sleepy)
    assert sleepy.get("/is_sleeping").json() == {"is_sleeping": False}
    for level in (1, 2):
        assert sleepy.post(f"/sleep?level={level}").status_code == 200
        assert sleepy.get("/is_sleeping").json() == {"is_sleeping": True}
        for stream in (False, True):
            refused = sleepy.post("/v1/completions", json={**BODY, "stream": stream})
            assert refused.status_code == 503
            error = refused.json()["error"]
            assert error["type"] == "ServiceUnavailableError" and "/wake_up" in error["message"]
        assert sleepy.get("/health").status_code == 200  # asleep is not dead
        assert sleepy.post("/wake_up?tags=kv_cache").status_code == 200
        assert sleepy.get("/is_sleeping").json() == {"is_sleeping": True}  # the weights still sleep
        assert sleepy.post("/wake_up").status_code == 200
        assert sleepy.get("/is_sleeping").json() == {"is_sleeping": False}
        assert _text(sleepy) == expected, f"level {level}"


def test_sleep_routes_check_their_input_and_the_api_key(sleepy):
    assert sleepy.post("/sleep?level=3").status_code == 400
    assert sleepy.post("/wake_up?tags=weight").status_code == 400
    assert httpx.post(sleepy.url + "/sleep").status_code == 401
    assert sleepy.get("/is_sleeping").json() == {"is_sleeping": False}


def test_requests_in_flight_at_sleep_finish(sleepy):
    async def scenario() -> tuple[list[list], int]:
        async with httpx.AsyncClient(headers=sleepy.headers, timeout=120) as http:
            started = [asyncio.Event() for _ in range(4)]

            async def stream(event: asyncio.Event) -> list:
                body = {**BODY, "max_tokens": 96, "stream": True}
                async with http.stream("POST", sleepy.url + "/v1/completions", json=body) as response:
                    assert response.status_code == 200
                    lines = []
                    async for line in response.aiter_lines():
                        event.set()  # its first chunk came: it is running
                        lines.append(line)
                    return parse_sse("\n".join(lines) + "\n")

            streams = [asyncio.create_task(stream(event)) for event in started]
            await asyncio.gather(*(event.wait() for event in started))
            asleep = await http.post(sleepy.url + "/sleep?level=1")
            return await asyncio.gather(*streams), asleep.status_code

    events, status = asyncio.run(scenario())
    assert status == 200
    assert sleepy.get("/is_sleeping").json() == {"is_sleeping": True}
    assert sleepy.post("/wake_up").status_code == 200
    expected = _text(sleepy, max_tokens=96)
    for chunks in events:  # each finished whole, with the text it has awake
        assert chunks[-1] == "[DONE]" and chunks[-2]["choices"][0]["finish_reason"] == "length"
        assert "".join(c["choices"][0]["text"] for c in chunks[:-1]) == expected
