"""Errors are OpenAI's JSON with the right status (400 / 401 / 404, never 500 for bad input),
the server keeps serving after each, and the API key guards every route but /health and
/metrics. Also: /v1/models, /version, /tokenize, /detokenize."""

from __future__ import annotations

import time

import openai
import pytest

from tests.entrypoints.openai.conftest import API_KEY, MAX_MODEL_LEN, MODEL_ALIAS, MODEL_NAME, OTHER_API_KEY

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
USER = [{"role": "user", "content": "hi"}]

# (id, path, request kwargs, expected param or None, substring of the message or None)
BAD_REQUESTS = [
    ("invalid-json", COMPLETIONS, {"content": b"{not json", "headers": {"Content-Type": "application/json"}}, None, "JSON"),
    ("non-object-json", COMPLETIONS, {"json": [1, 2, 3]}, None, "JSON object"),
    ("no-body", COMPLETIONS, {}, None, "JSON object"),
    ("form-body", COMPLETIONS, {"data": {"prompt": "hi"}}, None, "JSON object"),
    ("missing-prompt", COMPLETIONS, {"json": {"model": MODEL_NAME}}, "prompt", "prompt"),
    ("wrong-type-max-tokens", COMPLETIONS, {"json": {"prompt": "hi", "max_tokens": "many"}}, "max_tokens", None),
    ("wrong-type-prompt", COMPLETIONS, {"json": {"prompt": {"a": 1}}}, "prompt", None),
    ("empty-prompt", COMPLETIONS, {"json": {"prompt": ""}}, None, "empty"),
    ("empty-prompt-list", COMPLETIONS, {"json": {"prompt": []}}, None, "empty"),
    ("empty-token-list", COMPLETIONS, {"json": {"prompt": [[]]}}, None, "empty"),
    ("token-out-of-vocab", COMPLETIONS, {"json": {"prompt": [1, 5000]}}, None, "vocabulary"),
    ("negative-token", COMPLETIONS, {"json": {"prompt": [1, -3]}}, None, "vocabulary"),
    ("logprobs-21", COMPLETIONS, {"json": {"prompt": "hi", "logprobs": 21}}, None, "greater than max allowed: 20"),
    ("logprobs-negative", COMPLETIONS, {"json": {"prompt": "hi", "logprobs": -1}}, "logprobs", None),
    ("stream-options-no-stream", COMPLETIONS, {"json": {"prompt": "hi", "stream_options": {"include_usage": True}}}, None, "stream"),
    ("temperature-negative", COMPLETIONS, {"json": {"prompt": "hi", "temperature": -1}}, "temperature", "temperature"),
    ("top-p-zero", COMPLETIONS, {"json": {"prompt": "hi", "top_p": 0}}, "top_p", None),
    ("n-zero", COMPLETIONS, {"json": {"prompt": "hi", "n": 0}}, "n", None),
    ("max-tokens-zero", COMPLETIONS, {"json": {"prompt": "hi", "max_tokens": 0}}, "max_tokens", None),
    ("logit-bias-key", COMPLETIONS, {"json": {"prompt": "hi", "logit_bias": {"abc": 1}}}, None, "logit_bias"),
    ("logit-bias-token", COMPLETIONS, {"json": {"prompt": "hi", "logit_bias": {"99999": 1}}}, None, "logit_bias"),
    ("presence-penalty", COMPLETIONS, {"json": {"prompt": "hi", "presence_penalty": 3}}, "presence_penalty", None),
    ("suffix", COMPLETIONS, {"json": {"prompt": "hi", "suffix": "x"}}, None, "suffix"),
    ("empty-cache-salt", COMPLETIONS, {"json": {"prompt": "hi", "cache_salt": ""}}, "cache_salt", None),
    ("chat-missing-messages", CHAT, {"json": {"model": MODEL_NAME}}, "messages", None),
    ("chat-messages-string", CHAT, {"json": {"messages": "hi"}}, "messages", None),
    ("chat-messages-empty", CHAT, {"json": {"messages": []}}, "messages", None),
    ("chat-missing-role", CHAT, {"json": {"messages": [{"content": "hi"}]}}, "messages", None),
    ("chat-image-part", CHAT, {"json": {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}}, "messages", "image_url"),
    ("chat-top-logprobs-21", CHAT, {"json": {"messages": USER, "logprobs": True, "top_logprobs": 21}}, None, "max allowed: 20"),
    ("chat-top-logprobs-without-logprobs", CHAT, {"json": {"messages": USER, "top_logprobs": 2}}, None, "logprobs"),
    ("chat-stream-options-no-stream", CHAT, {"json": {"messages": USER, "stream_options": {"include_usage": True}}}, None, "stream"),
    ("chat-reserved-template-kwarg", CHAT, {"json": {"messages": USER, "chat_template_kwargs": {"tokenize": True}}}, "chat_template_kwargs", None),
    ("chat-broken-template", CHAT, {"json": {"messages": USER, "chat_template": "{{ messages[0]['content'] | nosuchfilter }}"}}, "messages", None),
    ("chat-max-tokens-zero", CHAT, {"json": {"messages": USER, "max_completion_tokens": 0}}, "max_completion_tokens", None),
    ("tokenize-wrong-type", "/tokenize", {"json": {"prompt": 5}}, None, None),
    ("lone-surrogate-prompt", COMPLETIONS, {"content": rb'{"prompt": "hi \ud800"}', "headers": {"Content-Type": "application/json"}}, "prompt", "surrogate"),
    ("lone-surrogate-chat", CHAT, {"content": rb'{"messages": [{"role": "user", "content": "\udc00 hi"}]}', "headers": {"Content-Type": "application/json"}}, "messages", "surrogate"),
    ("lone-surrogate-tokenize", "/tokenize", {"content": rb'{"prompt": "\ud83d"}', "headers": {"Content-Type": "application/json"}}, "prompt", "surrogate"),
    ("detokenize-out-of-vocab", "/detokenize", {"json": {"tokens": [1, 99999]}}, "tokens", "vocabulary"),
]  # fmt: skip


def _assert_error(response, status: int, err_type: str) -> dict:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"}
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == err_type
    assert isinstance(error["message"], str) and error["message"]
    return error


def _assert_still_serving(server) -> None:
    response = server.post(COMPLETIONS, json={"model": MODEL_NAME, "prompt": "still there?", "max_tokens": 2})
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] >= 1


@pytest.mark.parametrize("path, kwargs, param, fragment", [case[1:] for case in BAD_REQUESTS], ids=[c[0] for c in BAD_REQUESTS])
def test_bad_request_is_400_then_server_keeps_serving(server, path, kwargs, param, fragment):
    error = _assert_error(server.post(path, **kwargs), 400, "invalid_request_error")
    if param is not None:
        assert error["param"] == param, error
    if fragment is not None:
        assert fragment.lower() in error["message"].lower(), error
    _assert_still_serving(server)


@pytest.mark.parametrize("stream", [False, True])
def test_prompt_that_does_not_fit(server, stream):
    too_long = [5] * (MAX_MODEL_LEN + 10)
    error = _assert_error(server.post(COMPLETIONS, json={"prompt": too_long, "stream": stream}), 400, "invalid_request_error")
    assert f"maximum context length is {MAX_MODEL_LEN} tokens" in error["message"]
    assert f"({MAX_MODEL_LEN + 10} in the prompt, 16 in the completion)" in error["message"]
    assert "reduce the length of the prompt or completion" in error["message"]
    assert error["param"] == "prompt" and error["code"] == "context_length_exceeded"
    _assert_still_serving(server)
    fits_alone = [5] * (MAX_MODEL_LEN - 20)
    error = _assert_error(
        server.post(COMPLETIONS, json={"prompt": fits_alone, "max_tokens": 100, "stream": stream}), 400, "invalid_request_error"
    )
    assert (
        f"However, you requested {MAX_MODEL_LEN + 80} tokens ({MAX_MODEL_LEN - 20} in the prompt, "
        f"100 in the completion)"
    ) in error["message"]
    _assert_still_serving(server)
    error = _assert_error(
        server.post(CHAT, json={"messages": USER, "max_completion_tokens": MAX_MODEL_LEN, "stream": stream}),
        400,
        "invalid_request_error",
    )
    assert f"{MAX_MODEL_LEN} in the completion" in error["message"]
    assert "in the messages" in error["message"] and error["param"] == "messages"
    _assert_still_serving(server)


def test_default_max_tokens_is_cut_to_the_context(server):
    nearly_full = [5] * (MAX_MODEL_LEN - 4)
    response = server.post(COMPLETIONS, json={"prompt": nearly_full, "ignore_eos": True, "temperature": 0})
    assert response.status_code == 200
    assert response.json()["usage"]["completion_tokens"] == 4


@pytest.mark.parametrize("path", [COMPLETIONS, CHAT, "/tokenize", "/detokenize"])
def test_unknown_model_is_404(server, path):
    body = {"model": "no-such-model", "prompt": "hi", "messages": USER, "tokens": [1]}
    error = _assert_error(server.post(path, json=body), 404, "NotFoundError")
    assert error["code"] == 404 and error["param"] == "model"
    assert error["message"] == "The model `no-such-model` does not exist."
    _assert_still_serving(server)


def test_unknown_route_and_model_card_404(server):
    error = _assert_error(server.get("/v1/no-such-route"), 404, "NotFoundError")
    assert error["message"] == "Invalid URL (GET /v1/no-such-route)" and error["code"] == 404
    error = _assert_error(server.post("/v1/chat/completion", json={"messages": USER}), 404, "NotFoundError")
    assert error["message"] == "Invalid URL (POST /v1/chat/completion)"
    _assert_error(server.get("/v1/models/no-such-model"), 404, "NotFoundError")
    _assert_still_serving(server)


def test_a_known_route_with_another_method_is_405(server):
    response = server.get(COMPLETIONS)
    error = _assert_error(response, 405, "MethodNotAllowedError")
    assert error["message"] == "Method Not Allowed (GET /v1/completions); this route accepts POST"
    assert error["code"] == 405 and response.headers["allow"] == "POST"


def test_a_message_role_outside_openais_is_400(server, client):
    messages = [{"role": "system", "content": "be brief"}, {"role": "robot", "content": "hi"}]
    error = _assert_error(server.post(CHAT, json={"messages": messages}), 400, "invalid_request_error")
    assert error["param"] == "messages"
    assert "messages.1.role: invalid role 'robot'; supported roles are 'system', 'developer', 'user'" in error["message"]
    with pytest.raises(openai.BadRequestError, match="invalid role 'robot'"):
        client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=1)
    for role in ("developer", "system"):
        reply = client.chat.completions.create(
            model=MODEL_NAME, messages=[{"role": role, "content": "be brief"}, *USER], max_tokens=1
        )
        assert reply.choices[0].message.role == "assistant"


def test_unknown_fields_are_ignored_with_one_warning_per_request(server, client):
    body = {"model": MODEL_NAME, "prompt": "hi", "max_tokens": 1, "zz_unknown_a": 1, "aa_unknown_b": {"x": 2}}
    assert server.post(COMPLETIONS, json=body).status_code == 200
    line = "The following fields were present in the request but ignored: {'aa_unknown_b', 'zz_unknown_a'}"
    client.chat.completions.create(model=MODEL_NAME, messages=USER, max_tokens=1, extra_body={"chat_unknown_c": True})
    chat_line = "The following fields were present in the request but ignored: {'chat_unknown_c'}"
    deadline = time.monotonic() + 5
    while chat_line not in server.log_text():
        assert time.monotonic() < deadline, server.log_text()
        time.sleep(0.05)
    log = server.log_text()
    assert log.count(line) == 1 and log.count(chat_line) == 1
    assert [entry for entry in log.splitlines() if line in entry][0].startswith("WARNING")


def test_models_with_a_trailing_slash_is_the_list(server):
    response = server.get("/v1/models/")
    assert response.status_code == 200, response.text
    assert [card["id"] for card in response.json()["data"]] == [MODEL_NAME, MODEL_ALIAS]


PROTECTED = [("POST", COMPLETIONS), ("POST", CHAT), ("GET", "/v1/models"), ("GET", f"/v1/models/{MODEL_NAME}"),
             ("POST", "/tokenize"), ("POST", "/detokenize"), ("GET", "/version"), ("GET", "/docs"),
             ("GET", "/server_info")]  # fmt: skip


@pytest.mark.parametrize("method, path", PROTECTED)
@pytest.mark.parametrize(
    "authorization", [None, f"Bearer {API_KEY}x", "Bearer", f"Basic {API_KEY}", API_KEY], ids=["missing", "wrong", "empty", "basic", "no-scheme"]
)
def test_missing_or_wrong_key_is_401(server, method, path, authorization):
    headers = {"Authorization": authorization} if authorization is not None else {}
    import httpx

    response = httpx.request(method, server.url + path, headers=headers, json={"prompt": "hi", "messages": USER, "tokens": [1]})
    error = _assert_error(response, 401, "invalid_request_error")
    assert error["code"] == "invalid_api_key"
    _assert_still_serving(server)


def test_any_of_several_api_keys_is_accepted(server):
    """vLLM's ``--api-key`` takes several keys (the shared server has two); a request may
    use any of them."""
    import httpx

    for key, status in ((API_KEY, 200), (OTHER_API_KEY, 200), ("key-three", 401)):
        response = httpx.get(server.url + "/v1/models", headers={"Authorization": f"Bearer {key}"})
        assert response.status_code == status, (key, response.text)


def test_health_and_metrics_need_no_key(server):
    import httpx

    assert httpx.get(server.url + "/health").status_code == 200
    metrics = httpx.get(server.url + "/metrics")
    assert metrics.status_code == 200
    assert "pagedllm:num_requests_running" in metrics.text
    assert metrics.headers["content-type"].startswith("text/plain")


def test_openai_client_raises_typed_errors(server):
    client = server.client()
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL_NAME, prompt="hi", logprobs=21)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-model", prompt="hi")
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0).models.list()
    assert client.completions.create(model=MODEL_NAME, prompt="hi", max_tokens=1).choices


def test_401_is_logged_with_its_request_id(server):
    import httpx

    response = httpx.get(server.url + "/v1/models", headers={"Authorization": "Bearer wrong", "X-Request-Id": "auth-7"})
    assert response.status_code == 401 and response.headers["x-request-id"] == "auth-7"
    deadline = time.monotonic() + 5
    while "Request auth-7 (GET /v1/models) answered 401: Incorrect API key provided." not in server.log_text():
        assert time.monotonic() < deadline, server.log_text()
        time.sleep(0.05)


def test_models_and_version(server, client):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL_NAME, MODEL_ALIAS]
    assert all(m.owned_by == "pagedllm" for m in models.data)
    card = client.models.retrieve(MODEL_ALIAS)
    assert card.id == MODEL_ALIAS and card.model_extra["max_model_len"] == MAX_MODEL_LEN
    version = server.get("/version")
    assert version.status_code == 200 and version.json()["version"]


def test_tokenize_detokenize_roundtrip(server, tokenizer):
    text = "Hello, tokenizer! 你好"
    response = server.post("/tokenize", json={"model": MODEL_NAME, "prompt": text, "return_token_strs": True}).json()
    assert response["tokens"] == tokenizer.encode(text)
    assert response["count"] == len(response["tokens"]) and response["max_model_len"] == MAX_MODEL_LEN
    assert len(response["token_strs"]) == response["count"]
    assert server.post("/detokenize", json={"tokens": response["tokens"]}).json() == {"prompt": text}
    chat = server.post("/tokenize", json={"messages": USER}).json()
    expected = tokenizer.apply_chat_template(USER, add_generation_prompt=True, tokenize=False)
    assert chat["tokens"] == tokenizer.encode(expected, add_special_tokens=False)
