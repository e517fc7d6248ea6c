"""``pagedllm router`` over a prefill and a decode instance, each the whole OpenAI app
(``build_app``) over an in-process engine: completions and chat, streamed and not, answer
as the decode instance alone does; the prefill's response carries the ``kv_transfer_params``
the decode's request takes; a decode request whose KV the prefill instance no longer holds
is a 503 with the reason, and an unreachable prefill instance a 503 naming it. Failover: an
instance that refuses connections is skipped for the back-off and tried again after it; with
real processes, requests keep succeeding when one of two decode instances is killed."""

from __future__ import annotations

import asyncio
import json

import httpx

from pagedllm.config import EngineArgs
from pagedllm.distributed import get_open_port
from pagedllm.engine.async_llm import AsyncLLM
from pagedllm.entrypoints import router
from pagedllm.entrypoints.openai.api_server import build_app
from pagedllm.entrypoints.openai.frontend_config import FrontendConfig

COMPLETION = {"model": "m", "prompt": "The quick brown fox jumps over the lazy dog " * 3, "max_tokens": 6,
              "temperature": 0, "ignore_eos": True, "logprobs": 2}
CHAT = {"model": "m", "messages": [{"role": "user", "content": "Tell me a story about a dog and a fox."}],
        "max_tokens": 6, "temperature": 0, "ignore_eos": True}


def _engine(path, **kwargs) -> AsyncLLM:
    args = EngineArgs(model=str(path), dtype="float32", kv_cache_memory_bytes=8 << 20, enable_prefix_caching=False,
                      **kwargs)
    return AsyncLLM.from_engine_args(args, multiprocess=False, log_stats=False)


def _app(engine: AsyncLLM):
    frontend = FrontendConfig(disable_log_stats=True, disable_log_requests=True, served_model_name=["m"])
    return build_app(engine, frontend)


def _clients(prefill: AsyncLLM, decode: AsyncLLM, prefill_url: str) -> tuple[httpx.AsyncClient, httpx.AsyncClient]:
    """(a client reaching both instances in-process as http://prefill and http://decode, the
    router's client in front of them; the router knows the prefill instance as ``prefill_url``)."""
    mounts = {"http://prefill": httpx.ASGITransport(app=_app(prefill)),
              "http://decode": httpx.ASGITransport(app=_app(decode))}
    backends = httpx.AsyncClient(mounts=mounts, timeout=30)
    proxy = httpx.AsyncClient(transport=httpx.ASGITransport(
        app=router.build_app([prefill_url], ["http://decode"], backends)), base_url="http://router")
    return backends, proxy


async def _post(client: httpx.AsyncClient, url: str, body: dict) -> tuple[int, dict | list]:
    """(status, the JSON answer, or a stream's parsed events)."""
    response = await client.post(url, json=body)
    if not body.get("stream") or response.status_code != 200:
        return response.status_code, response.json()
    events = [line[len("data: "):] for line in response.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return response.status_code, [json.loads(e) for e in events[:-1]]


def _text(answer) -> str:
    if isinstance(answer, list):  # stream events
        return "".join(c.get("text") or (c.get("delta") or {}).get("content") or "" for e in answer
                       for c in e["choices"])
    choice = answer["choices"][0]
    return choice["text"] if "text" in choice else choice["message"]["content"]


def _check_logprobs_close(got, want) -> None:
    """The same tokens and top tokens, log-probabilities equal up to float32 rounding (the
    prompt's attention runs in other shapes on the prefill instance)."""
    if want is None:
        assert got is None
        return
    assert got["tokens"] == want["tokens"]
    assert [list(t) for t in got["top_logprobs"]] == [list(t) for t in want["top_logprobs"]]
    assert all(abs(g - w) < 1e-4 for g, w in zip(got["token_logprobs"], want["token_logprobs"]))


def test_router_splits_requests_and_answers_as_one_server(tiny_llama):
    prefill = _engine(tiny_llama, role="prefill", kv_transfer_config={"kv_port": get_open_port()})
    decode = _engine(tiny_llama, role="decode")
    try:
        async def main():
            backends, proxy = _clients(prefill, decode, "http://prefill/v1")
            results = []
            for route, body in (("/v1/completions", COMPLETION), ("/v1/chat/completions", CHAT)):
                for stream in (False, True):
                    request = {**body, "stream": stream}
                    results.append((await _post(backends, "http://decode" + route, request),
                                    await _post(proxy, route, request)))
            status, prefilled = await _post(backends, "http://prefill/v1/completions",
                                            router.prefill_body(COMPLETION, "/v1/completions"))
            fetched, again = [await _post(backends, "http://decode/v1/completions",
                                          {**COMPLETION, "kv_transfer_params": prefilled["kv_transfer_params"]})
                              for _ in range(2)]
            unreachable = await _post(httpx.AsyncClient(transport=httpx.ASGITransport(
                app=router.build_app([f"http://127.0.0.1:{get_open_port()}"], ["http://decode"], backends)),
                base_url="http://router"), "/v1/completions", COMPLETION)
            bad = [await _post(backends, "http://decode/v1/completions", {**COMPLETION, **fields}) for fields in (
                {"kv_transfer_params": {"do_remote_prefill": True, "remote_host": "h"}},
                {"kv_transfer_params": {"do_remote_decode": True}, "n": 2})]
            return results, (status, prefilled), fetched, again, unreachable, bad

        results, (status, prefilled), fetched, again, unreachable, bad = asyncio.run(main())
    finally:
        prefill.shutdown()
        decode.shutdown()
    for (one_status, one), (split_status, split) in results:
        assert one_status == split_status == 200
        assert _text(split) == _text(one) and _text(one)
        if isinstance(one, dict):
            _check_logprobs_close(split["choices"][0].get("logprobs"), one["choices"][0].get("logprobs"))
            # The decode instance counts the prompt tokens whose KV it loaded as cached (as vLLM).
            num_prompt = one["usage"]["prompt_tokens"]
            cached = {"prompt_tokens_details": {"cached_tokens": num_prompt - 1}}
            assert split["usage"] == {**one["usage"], **cached} and split.get("kv_transfer_params") is None
    assert status == 200 and prefilled["usage"]["completion_tokens"] == 1
    assert prefilled["kv_transfer_params"]["do_remote_prefill"] is True
    assert fetched[0] == 200  # the prefill's KV, never fetched, is loaded
    # Fetched already: the prefill instance no longer holds it (the same answer as a prefill gone).
    assert again[0] == 503 and "no KV kept for request" in again[1]["error"]["message"]
    assert again[1]["error"]["type"] == "ServiceUnavailableError"
    assert unreachable[0] == 503 and "No prefill instance can be reached: http://127.0.0.1:" in \
        unreachable[1]["error"]["message"]
    assert unreachable[1]["error"]["type"] == "ServiceUnavailableError"
    assert [status for status, _ in bad] == [400, 400]
    assert "do_remote_prefill needs remote_port (int" in bad[0][1]["error"]["message"]
    assert "serves n=1 only, got n=2" in bad[1][1]["error"]["message"]


def test_router_passes_on_the_key_request_id_and_trace_context():
    """Both instances get the caller's API key, request id and W3C trace context (their spans
    join the caller's trace); other headers stay with the router."""
    seen: list[tuple[str, dict]] = []

    def answer(request: httpx.Request) -> httpx.Response:
        seen.append((request.url.host, dict(request.headers)))
        body = {"choices": [{"text": "x"}]}
        if request.url.host == "prefill":
            body["kv_transfer_params"] = {"remote_request_id": "r"}
        return httpx.Response(200, json=body)

    upstream = httpx.AsyncClient(transport=httpx.MockTransport(answer))
    app = router.build_app(["http://prefill:1"], ["http://decode:2"], client=upstream)
    sent = {
        "authorization": "Bearer k", "x-request-id": "req-1", "x-other": "no",
        "traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01", "tracestate": "a=1",
    }  # fmt: skip

    async def call() -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://router") as client:
            return await client.post("/v1/completions", json={"model": "m", "prompt": "hi"}, headers=sent)

    assert asyncio.run(call()).status_code == 200
    assert [host for host, _ in seen] == ["prefill", "decode"]
    for _, headers in seen:
        assert {k: headers.get(k) for k in sent} == {**sent, "x-other": None}


def test_router_refuses_an_instance_url_without_scheme_or_host(capsys):
    import argparse

    import pytest

    parser = argparse.ArgumentParser(prog="pagedllm")
    router.register(parser.add_subparsers())
    for flag, url in (("--prefill", "foo"), ("--decode", "localhost:8200"), ("--decode", "http://")):
        args = ["router", "--prefill", "http://p:8100", "--decode", "http://d:8200", flag, url]
        with pytest.raises(SystemExit) as exc:
            parser.parse_args(args)
        assert exc.value.code == 2
        assert f"argument {flag}: an instance's URL must be http://host:port" in capsys.readouterr().err
    for backoff in ("0", "-1", "soon"):
        with pytest.raises(SystemExit):
            parser.parse_args(["router", "--prefill", "http://p:8100", "--decode", "http://d:8200",
                               "--unhealthy-backoff-s", backoff])
        assert "argument --unhealthy-backoff-s: must be a positive number of seconds" in capsys.readouterr().err
    ok = parser.parse_args(["router", "--prefill", "https://p:8100/v1/", "--decode", "http://d:8200"])
    assert (ok.prefill, ok.decode, ok.unhealthy_backoff_s) == (["https://p:8100/v1/"], ["http://d:8200"], 5.0)
    with pytest.raises(ValueError, match="got 'p:8100'"):
        router.build_app(["p:8100"], ["http://d:8200"])


def test_a_decode_instance_of_another_kv_layout_answers_500_naming_the_field(tiny_llama):
    """A float32 prefill instance and a decode instance with an FP8 KV cache: the router's
    answer is the decode instance's 500 (``code`` ``kv_layout_mismatch``, not a retryable
    503) naming kv_cache_dtype with both values."""
    prefill = _engine(tiny_llama, role="prefill", kv_transfer_config={"kv_port": get_open_port()})
    decode = _engine(tiny_llama, role="decode", kv_cache_dtype="fp8")
    try:
        async def main():
            backends, proxy = _clients(prefill, decode, "http://prefill")
            return [await _post(proxy, "/v1/completions", {**COMPLETION, "stream": stream}) for stream in (False, True)]

        answers = asyncio.run(main())
    finally:
        prefill.shutdown()
        decode.shutdown()
    for status, answer in answers:
        assert status == 500 and answer["error"]["code"] == "kv_layout_mismatch"
        assert answer["error"]["type"] == "InternalServerError"
        assert "kv_cache_dtype is float8_e4m3fn on this decode instance (rank 0), float32 on the prefill instance" \
            in answer["error"]["message"]
        assert "Sending the request again does not help." in answer["error"]["message"]


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_instance_pool_skips_an_instance_marked_down_until_its_back_off_ends():
    clock = _Clock()
    pool = router.InstancePool("decode", ["http://a", "http://b", "http://c"], backoff_s=5.0, clock=clock)
    assert [pool.candidates()[0] for _ in range(4)] == ["http://a", "http://b", "http://c", "http://a"]
    pool.mark_down("http://b", "refused")
    assert pool.candidates() == ["http://c", "http://a"]  # round-robin position: b's turn, b skipped
    clock.now += 4.9
    assert pool.candidates() == ["http://a", "http://c"]
    clock.now += 0.2  # back-off over: tried again
    assert pool.candidates() == ["http://b", "http://c", "http://a"]
    for url in ("http://a", "http://c", "http://b"):
        pool.mark_down(url, "refused")
        clock.now += 1.0
    # None healthy: all, the one whose back-off ends first first.
    assert pool.candidates() == ["http://a", "http://c", "http://b"]
    pool.mark_up("http://c")
    assert pool.candidates() == ["http://c"]


def test_router_fails_over_a_refused_connection_and_answers_503_when_all_are_down():
    """Decode instance d1 refuses connections: requests go to d2 (d1 is not asked again
    within the back-off); with d2 down too, a 503 in OpenAI's error JSON names both; an
    instance that fails after the request reached it is a 502 and is not retried."""
    down = {"d1"}
    seen: list[str] = []

    def answer(request: httpx.Request) -> httpx.Response:
        host = request.url.host
        seen.append(host)
        if host in down:
            raise httpx.ConnectError("[Errno 111] Connection refused", request=request)
        if host == "broken":
            raise httpx.RemoteProtocolError("Server disconnected without sending a response.", request=request)
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"object": "list", "data": [{"id": host}]})
        body = {"choices": [{"text": host}]}
        if host == "p":
            body["kv_transfer_params"] = {"remote_request_id": "r"}
        return httpx.Response(200, json=body)

    upstream = httpx.AsyncClient(transport=httpx.MockTransport(answer))
    app = router.build_app(["http://p"], ["http://d1", "http://d2"], client=upstream, unhealthy_backoff_s=60)
    broken = router.build_app(["http://p"], ["http://broken", "http://d2"], client=upstream)

    async def call():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://router") as client, \
                httpx.AsyncClient(transport=httpx.ASGITransport(app=broken), base_url="http://router") as other:
            texts = []
            for _ in range(4):
                response = await client.post("/v1/completions", json={"model": "m", "prompt": "hi"})
                texts.append((response.status_code, response.json()["choices"][0]["text"]))
            models = (await client.get("/v1/models")).json()["data"][0]["id"]
            down.add("d2")
            all_down = await client.post("/v1/completions", json={"model": "m", "prompt": "hi"})
            failed = await other.post("/v1/completions", json={"model": "m", "prompt": "hi"})
            return texts, models, all_down, failed

    texts, models, all_down, failed = asyncio.run(call())
    assert texts == [(200, "d2")] * 4 and models == "d2"
    assert seen[:3] == ["p", "d1", "d2"] and seen.count("d1") == 1  # d1 skipped within its back-off
    assert all_down.status_code == 503
    error = all_down.json()["error"]
    assert error["type"] == "ServiceUnavailableError" and error["code"] == 503
    assert error["message"].startswith("No decode instance can be reached: ")
    # d2 tried; d1 in its back-off, not tried again.
    assert error["message"].endswith("http://d2 ([Errno 111] Connection refused); http://d1 ([Errno 111] "
                                     "Connection refused; tried again in 60 s).")
    assert failed.status_code == 502 and "The decode instance at http://broken failed" in \
        failed.json()["error"]["message"]
    assert seen[-2:] == ["p", "broken"]  # not sent again to d2


def test_router_keeps_serving_when_one_of_two_decode_instances_is_killed(tiny_llama):
    """Two decode instances as real processes (the prefill instance in this process, its KV
    served over TCP); decode instance 2 is killed (SIGKILL) after the first requests; every
    request, before and after, answers what one server answers, and the surviving decode
    instance ends idle with no block held."""
    from concurrent.futures import ThreadPoolExecutor

    from tests.server_utils import RemoteServer

    flags = ("--served-model-name", "m", "--no-enable-prefix-caching", "--max-model-len", "256", "--role", "decode")
    with ThreadPoolExecutor(2) as pool:
        starts = [pool.submit(RemoteServer, tiny_llama, *flags) for _ in range(2)]
        decode1, decode2 = servers = [start.result() for start in starts]
    prefill = _engine(tiny_llama, role="prefill", kv_transfer_config={"kv_port": get_open_port()})
    try:
        async def main():
            mounts = {"http://prefill": httpx.ASGITransport(app=_app(prefill))}
            async with httpx.AsyncClient(mounts=mounts, timeout=60) as http:
                proxy = httpx.AsyncClient(transport=httpx.ASGITransport(app=router.build_app(
                    ["http://prefill"], [decode1.url, decode2.url], http, unhealthy_backoff_s=60)),
                    base_url="http://router")
                want = [await _post(http, decode1.url + "/v1/completions", {**COMPLETION, "stream": stream})
                        for stream in (False, True)]
                got = []
                for i in range(8):
                    if i == 3:
                        decode2.process.kill()
                        decode2.process.wait(timeout=10)
                    got.append(await _post(proxy, "/v1/completions", {**COMPLETION, "stream": i % 2 == 1}))
                return want, got

        want, got = asyncio.run(main())
        assert [status for status, _ in got] == [200] * 8
        assert {_text(answer) for _, answer in got} == {_text(want[0][1])} == {_text(want[1][1])}
        metrics = decode1.metrics()
        assert not any(metrics[name] for name in ("pagedllm:num_requests_running", "pagedllm:num_requests_waiting",
                                                  "pagedllm:kv_cache_usage_perc"))
        # Decode 1: the two reference requests, requests 0 and 2 (round-robin), and all from the
        # kill on (3: decode 2's turn, refused; then decode 2 is in its back-off).
        assert metrics["pagedllm:request_success_total{finished_reason=length}"] == 2 + 2 + 5
    finally:
        prefill.shutdown()
        for server in servers:
            server.close()
