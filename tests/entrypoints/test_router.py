"""``pagedllm router`` over a prefill and a decode instance, each the whole OpenAI app
(``build_app``) over an in-process engine: completions and chat, streamed and not, answer
as the decode instance alone does; the prefill's response carries the ``kv_transfer_params``
the decode's request takes; a decode request whose KV the prefill instance no longer holds
is a 503 with the reason, and an unreachable prefill instance a 502."""

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
            mounts = {"http://prefill": httpx.ASGITransport(app=_app(prefill)),
                      "http://decode": httpx.ASGITransport(app=_app(decode))}
            backends = httpx.AsyncClient(mounts=mounts, timeout=30)
            proxy = httpx.AsyncClient(transport=httpx.ASGITransport(
                app=router.build_app(["http://prefill/v1"], ["http://decode"], backends)), base_url="http://router")
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
    assert unreachable[0] == 502 and "prefill instance" in unreachable[1]["error"]["message"]
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
    ok = parser.parse_args(["router", "--prefill", "https://p:8100/v1/", "--decode", "http://d:8200"])
    assert (ok.prefill, ok.decode) == (["https://p:8100/v1/"], ["http://d:8200"])
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
            mounts = {"http://prefill": httpx.ASGITransport(app=_app(prefill)),
                      "http://decode": httpx.ASGITransport(app=_app(decode))}
            backends = httpx.AsyncClient(mounts=mounts, timeout=30)
            proxy = httpx.AsyncClient(transport=httpx.ASGITransport(
                app=router.build_app(["http://prefill"], ["http://decode"], backends)), base_url="http://router")
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
