"""Issue 12 part 3: the values vLLM accepts, the same offline and online.

- ``top_k`` 0 means disabled (as -1), in ``SamplingParams`` and on the server.
- Every sampling field has one range rule (``SamplingParams``): a value it refuses
  offline is a 400 naming the field online, and one it accepts is accepted online.
- ``/v1/completions`` with ``max_tokens: null`` generates up to the rest of the context
  (absent: OpenAI's 16), as vLLM.
- Every way of rendering a chat refuses ``continue_final_message`` with
  ``add_generation_prompt`` both true (``/tokenize`` too).
- vLLM fields pagedllm does not act on yet are a 400 naming the field; unknown fields
  are ignored with one debug log line.
"""

from __future__ import annotations

import logging

import pytest

from pagedllm import SamplingParams
from pagedllm.entrypoints.chat_utils import ChatOptionsError, apply_chat_template
from pagedllm.entrypoints.openai.protocol import NOT_SUPPORTED_YET, CompletionRequest, TokenizeChatRequest
from tests.entrypoints.openai.conftest import MAX_MODEL_LEN, MODEL_NAME

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
USER = [{"role": "user", "content": "hi"}]
CONTINUED = USER + [{"role": "assistant", "content": "Hello th"}]

# SamplingParams field -> values it refuses (each must be a 400 naming the field online).
REFUSED = {
    "n": [0, 129],
    "temperature": [-0.5],
    "top_p": [0.0, 1.5],
    "top_k": [-2],
    "min_p": [-0.1, 1.5],
    "presence_penalty": [2.5],
    "frequency_penalty": [-2.5],
    "repetition_penalty": [0.0],
    "seed": [2**64, -(2**63) - 1],
    "min_tokens": [-1],
    "max_tokens": [0],
    "logprobs": [-1],
    "prompt_logprobs": [-1],
    "truncate_prompt_tokens": [0, -2],
    "allowed_token_ids": [[]],
    "bad_words": [[" "]],
}
# SamplingParams field -> edge values it accepts (each must be accepted online).
ACCEPTED = {
    "n": [128],
    "top_k": [0, -1, 1],
    "seed": [2**64 - 1, -(2**63)],
    "temperature": [0.0],
    "min_p": [1.0],
    "logprobs": [20, 0],
    "prompt_logprobs": [0],
    "truncate_prompt_tokens": [-1, 1],
    "allowed_token_ids": [[5]],
    "bad_words": [["hi"]],
}


def _cases(table):
    return [(field, value) for field, values in table.items() for value in values]


def _post(server, path, body):
    return server.post(path, json={"model": MODEL_NAME, **body})


def test_top_k_zero_means_disabled_offline_and_online(server):
    assert SamplingParams(top_k=0).top_k == SamplingParams(top_k=-1).top_k == SamplingParams().top_k == -1
    body = {"prompt": "hello", "max_tokens": 6, "temperature": 0.8, "seed": 11, "ignore_eos": True}
    as_zero = _post(server, COMPLETIONS, {**body, "top_k": 0})
    assert as_zero.status_code == 200, as_zero.text
    assert as_zero.json()["choices"] == _post(server, COMPLETIONS, {**body, "top_k": -1}).json()["choices"]
    chat = _post(server, CHAT, {"messages": USER, "max_tokens": 2, "top_k": 0})
    assert chat.status_code == 200, chat.text


@pytest.mark.parametrize("field, value", _cases(REFUSED))
def test_a_value_refused_offline_is_a_400_naming_the_field_online(server, field, value):
    with pytest.raises(ValueError, match=f"^{field} must be"):
        SamplingParams(**{field: value})
    response = _post(server, COMPLETIONS, {"prompt": "hi", field: value})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == field and error["message"].startswith(f"{field} must be"), error


@pytest.mark.parametrize("field, value", _cases(ACCEPTED))
def test_a_value_accepted_offline_is_accepted_online(server, field, value):
    SamplingParams(**{field: value})
    body = {"prompt": "hi", "max_tokens": 1, field: value}
    if field == "n":
        body["temperature"] = 1.0
    response = _post(server, COMPLETIONS, body)
    assert response.status_code == 200, response.text


def test_prompt_truncation_allowed_token_ids_and_bad_words_online(server, tokenizer):
    """The engine's fields act online as offline: the prompt is cut to its last tokens
    (usage counts them), only allowed ids are generated, and a one-token bad word gives
    what pushing its tokens down with logit_bias gives."""
    body = {"prompt": "one two three four five six", "max_tokens": 6, "temperature": 0, "ignore_eos": True,
            "logprobs": 0, "return_tokens_as_token_ids": True}

    def ids(extra):
        response = _post(server, COMPLETIONS, {**body, **extra})
        assert response.status_code == 200, response.text
        reply = response.json()
        return reply["usage"]["prompt_tokens"], [int(t.removeprefix("token_id:")) for t in reply["choices"][0]["logprobs"]["tokens"]]

    num_prompt, plain = ids({})
    assert ids({"truncate_prompt_tokens": 3}) == (3, ids({"prompt": tokenizer.encode(body["prompt"])[-3:]})[1])
    assert num_prompt > 3
    assert set(ids({"allowed_token_ids": [7, 8, 9]})[1]) <= {7, 8, 9}
    word = tokenizer.decode(plain[:1])
    params = SamplingParams(bad_words=[word])
    params.update_from_tokenizer(tokenizer)
    assert plain[0] in [w[0] for w in params.bad_words_token_ids] and all(len(w) == 1 for w in params.bad_words_token_ids)
    without = ids({"bad_words": [word]})[1]
    assert without[0] != plain[0]
    assert without == ids({"logit_bias": {str(w[0]): -100 for w in params.bad_words_token_ids}})[1]


def test_chat_top_logprobs_has_the_logprobs_rule_under_its_own_name(server):
    response = _post(server, CHAT, {"messages": USER, "logprobs": True, "top_logprobs": -1})
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "top_logprobs"
    assert "top_logprobs must be non-negative, got -1" in response.json()["error"]["message"]
    # The upper bound is the engine's --max-logprobs (20 by default), offline and online.
    too_many = _post(server, CHAT, {"messages": USER, "logprobs": True, "top_logprobs": 21})
    assert too_many.status_code == 400
    assert "Requested sample logprobs of 21, which is greater than max allowed: 20" in too_many.json()["error"]["message"]


def test_completions_max_tokens_null_is_the_rest_of_the_context(server):
    prompt = [5] * (MAX_MODEL_LEN - 40)
    body = {"prompt": prompt, "ignore_eos": True, "temperature": 0}
    null = _post(server, COMPLETIONS, {**body, "max_tokens": None}).json()
    assert null["usage"]["completion_tokens"] == 40
    assert null["choices"][0]["finish_reason"] == "length"
    absent = _post(server, COMPLETIONS, body).json()
    assert absent["usage"]["completion_tokens"] == 16  # OpenAI's and vLLM's default when absent
    chat_null = _post(server, CHAT, {"messages": USER, "max_tokens": None, "ignore_eos": True}).json()
    assert chat_null["usage"]["completion_tokens"] == MAX_MODEL_LEN - chat_null["usage"]["prompt_tokens"]


@pytest.mark.parametrize("path", [CHAT, "/tokenize"])
def test_continue_final_message_with_add_generation_prompt_is_400_everywhere(server, path):
    both = {"messages": CONTINUED, "continue_final_message": True, "add_generation_prompt": True, "max_tokens": 1}
    response = _post(server, path, both)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "continue_final_message"
    assert "cannot both be true" in error["message"]
    without = {key: value for key, value in both.items() if key != "add_generation_prompt"}
    implied = _post(server, path, without)  # left out: true unless continue_final_message
    assert implied.status_code == 200, implied.text


def test_tokenize_renders_a_continued_message_as_chat_completions_does(server, tokenizer):
    body = {"messages": CONTINUED, "continue_final_message": True, "add_generation_prompt": False}
    tokens = _post(server, "/tokenize", body).json()["tokens"]
    assert tokenizer.decode(tokens).endswith("<|im_start|>assistant\nHello th")
    chat = _post(server, CHAT, {**body, "max_tokens": 1, "ignore_eos": True}).json()
    assert chat["usage"]["prompt_tokens"] == len(tokens)


def test_offline_chat_applies_the_same_rule(tokenizer):
    with pytest.raises(ChatOptionsError, match="cannot both be true"):
        apply_chat_template(tokenizer, CONTINUED, None, True, True)
    with pytest.raises(ChatOptionsError, match="chat_template_kwargs may not set tokenize"):
        apply_chat_template(tokenizer, USER, None, True, False, {"tokenize": True})
    implied = apply_chat_template(tokenizer, CONTINUED, None, None, True)
    assert implied == apply_chat_template(tokenizer, CONTINUED, None, False, True)


# (path, field, value that asks for the feature)
NOT_YET = [
    (COMPLETIONS, "use_beam_search", True),
    (COMPLETIONS, "length_penalty", 0.5),
    (COMPLETIONS, "logits_processors", ["my.module:Processor"]),
    (CHAT, "vllm_xargs", {"a": 1}),
    (COMPLETIONS, "prompt_embeds", "AAAA"),
    (CHAT, "functions", [{"name": "f"}]),
    (CHAT, "function_call", {"name": "f"}),
    (COMPLETIONS, "suffix", "tail"),
]  # fmt: skip
# Values of the same fields that ask for nothing: accepted.
NEUTRAL = [
    (CHAT, {"response_format": {"type": "text"}, "use_beam_search": False, "guided_json": None, "priority": 0}),
    (CHAT, {"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "none", "echo": False}),
    (COMPLETIONS, {"length_penalty": 1.0, "bad_words": [], "echo": True, "suffix": None}),
]


def _body(path, extra):
    base = {"messages": USER} if path == CHAT else {"prompt": "hi"}
    return {**base, "max_tokens": 1, **extra}


def test_every_not_yet_field_is_tested():
    fields = {field for _, field, _ in NOT_YET}
    assert set(NOT_SUPPORTED_YET) <= fields


@pytest.mark.parametrize("path, field, value", NOT_YET, ids=[f"{p.rsplit('/', 1)[-1]}-{f}" for p, f, _ in NOT_YET])
def test_a_field_not_built_yet_is_a_400_naming_it(server, path, field, value):
    response = _post(server, path, _body(path, {field: value}))
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == field
    assert f"{field} is not supported yet" in error["message"]


def test_priority_needs_the_priority_policy(server):
    """vLLM's rule: under fcfs (the shared server's policy) a priority other than 0 is a 400."""
    response = _post(server, CHAT, _body(CHAT, {"priority": 3}))
    assert response.status_code == 400, response.text
    assert "Priority scheduling is not enabled" in response.json()["error"]["message"]


def test_return_tokens_as_token_ids_per_request(server, tokenizer):
    """vLLM's request field: logprobs name tokens "token_id:{id}" (the server flag's default
    is off here); the ids are the tokens of the same text."""

    def ids_of(tokens):
        assert all(token.startswith("token_id:") for token in tokens), tokens
        return [int(token.removeprefix("token_id:")) for token in tokens]

    body = {"model": MODEL_NAME, "prompt": "hi", "max_tokens": 4, "temperature": 0, "ignore_eos": True, "logprobs": 1}
    plain = _post(server, COMPLETIONS, body).json()["choices"][0]
    as_ids = _post(server, COMPLETIONS, {**body, "return_tokens_as_token_ids": True}).json()["choices"][0]
    assert as_ids["text"] == plain["text"]
    assert tokenizer.decode(ids_of(as_ids["logprobs"]["tokens"]), skip_special_tokens=True) == plain["text"]
    assert all(ids_of(list(top)) for top in as_ids["logprobs"]["top_logprobs"])
    chat = {"model": MODEL_NAME, "messages": USER, "max_tokens": 4, "temperature": 0, "ignore_eos": True,
            "logprobs": True, "top_logprobs": 1, "return_tokens_as_token_ids": True}  # fmt: skip
    choice = _post(server, CHAT, chat).json()["choices"][0]
    content = choice["logprobs"]["content"]
    assert tokenizer.decode(ids_of([e["token"] for e in content]), skip_special_tokens=True) == choice["message"]["content"]
    assert ids_of([top["token"] for entry in content for top in entry["top_logprobs"]])


@pytest.mark.parametrize("path, extra", NEUTRAL)
def test_neutral_values_and_unknown_fields_are_accepted(server, path, extra):
    response = _post(server, path, _body(path, {**extra, "no_such_field": {"x": 1}}))
    assert response.status_code == 200, response.text


def test_unknown_fields_are_one_warning_line(caplog):
    """vLLM's warning, once per request that has unknown fields; none for a request without."""
    with caplog.at_level(logging.DEBUG, logger="pagedllm.entrypoints.openai.protocol"):
        CompletionRequest.model_validate({"prompt": "hi", "frobnicate": 1, "zeta": [2]})
        TokenizeChatRequest.model_validate({"messages": USER})
    records = [(r.levelno, r.message) for r in caplog.records]
    assert records == [
        (logging.WARNING, "The following fields were present in the request but ignored: {'frobnicate', 'zeta'}")
    ]
