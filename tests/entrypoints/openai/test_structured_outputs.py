"""Structured outputs through the real server with the official ``openai`` SDK and httpx:
``response_format`` (text / json_object / json_schema, and the SDK's ``parse``), vLLM's
``structured_outputs`` and the legacy ``guided_*`` fields, streaming, and bad constraints
answered with a 400 before any generation while the server keeps serving."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Iterator, Literal

import openai
import pydantic
import pytest

from tests.entrypoints.openai.conftest import parse_sse
from tests.server_utils import RemoteServer

USER = [{"role": "user", "content": "Describe a pet."}]


class Pet(pydantic.BaseModel):
    kind: Literal["cat", "dog", "fish"]
    legs: int = pydantic.Field(ge=0, le=4)
    name: str = pydantic.Field(max_length=6)


@pytest.fixture(scope="module")
def so_server(tiny_llama: Path) -> Iterator[RemoteServer]:
    remote = RemoteServer(tiny_llama, "--structured-outputs-config", '{"backend": "auto", "disable_any_whitespace": true}')
    try:
        yield remote
    finally:
        remote.close()


@pytest.fixture(scope="module")
def so_client(so_server: RemoteServer) -> openai.OpenAI:
    return so_server.client()


def _model(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


def test_sdk_parse_returns_the_pydantic_object(so_client):
    completion = so_client.chat.completions.parse(
        model=_model(so_client), messages=USER, response_format=Pet, max_tokens=64, temperature=0.0)
    message = completion.choices[0].message
    assert completion.choices[0].finish_reason == "stop"
    assert isinstance(message.parsed, Pet)
    assert message.parsed == Pet.model_validate_json(message.content)


class ReadmePet(pydantic.BaseModel):
    """The README's example."""

    kind: Literal["cat", "dog", "fish"]
    legs: int = pydantic.Field(ge=0, le=4)


class PlainPet(pydantic.BaseModel):
    """A model with no ``Field`` bounds: an unbounded string and integer."""

    name: str
    kind: str
    legs: int


class PlainPerson(pydantic.BaseModel):
    """A first user's model: on "Give an example." the shipped model's name string runs on
    until the default string bound ends it."""

    name: str
    age: int


@pytest.mark.parametrize("model", [ReadmePet, PlainPet])
def test_sdk_parse_completes_on_the_shipped_model_with_default_bounds(default_model_server, model):
    # Before the default bounds, the shipped model wrote '{"kind"' and newlines, or an
    # integer's digits, until max_tokens.
    client = default_model_server.client()
    completion = client.chat.completions.parse(
        model=_model(client), messages=[{"role": "user", "content": "A pet, as JSON."}], response_format=model,
        max_tokens=256, temperature=0.0)
    choice = completion.choices[0]
    assert choice.finish_reason == "stop", choice.message.content
    assert choice.message.parsed == model.model_validate_json(choice.message.content)
    assert completion.usage.completion_tokens < 100, choice.message.content


def test_sdk_parse_of_a_runaway_string_ends_at_the_default_bound(default_model_server):
    client = default_model_server.client()
    completion = client.chat.completions.parse(
        model=_model(client), messages=[{"role": "user", "content": "Give an example."}], response_format=PlainPerson,
        temperature=0.0)
    choice = completion.choices[0]
    assert choice.finish_reason == "stop", choice.message.content
    person = choice.message.parsed
    assert person == PlainPerson.model_validate_json(choice.message.content)
    assert len(person.name) <= 1024 and completion.usage.completion_tokens < 600


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_response_format_json_schema_and_json_object(so_server, path):
    base = {"messages": USER} if "chat" in path else {"prompt": "A pet:"}
    schema_format = {"type": "json_schema", "json_schema": {"name": "pet", "schema": Pet.model_json_schema(), "strict": True}}
    for response_format in (schema_format, {"type": "json_object"}, {"type": "text"}):
        response = so_server.post(path, json={**base, "max_tokens": 48, "temperature": 1.0, "seed": 1,
                                              "n": 2, "response_format": response_format})
        assert response.status_code == 200, response.text
        for choice in response.json()["choices"]:
            text = choice["message"]["content"] if "chat" in path else choice["text"]
            if response_format["type"] == "json_schema":
                assert choice["finish_reason"] == "stop"
                Pet.model_validate_json(text)
            elif response_format["type"] == "json_object":
                # Any object: its keys are free text, which a random model may not close.
                assert text.startswith("{")
                assert choice["finish_reason"] == "length" or isinstance(json.loads(text), dict)


def test_structured_outputs_field_and_legacy_guided_fields(so_server, so_client):
    model = _model(so_client)
    out = so_client.completions.create(model=model, prompt="x", max_tokens=16,
                                       extra_body={"structured_outputs": {"regex": "[a-c]{2}-[0-9]"}})
    assert re.fullmatch("[a-c]{2}-[0-9]", out.choices[0].text)
    for _ in range(2):
        response = so_server.post("/v1/chat/completions", json={"messages": USER, "max_tokens": 8,
                                                                "guided_choice": ["yes", "no"]})
        assert response.status_code == 200 and response.json()["choices"][0]["message"]["content"] in ("yes", "no")
    response = so_server.post("/v1/completions", json={"prompt": "x", "max_tokens": 16, "guided_regex": "[0-9]{3}",
                                                       "guided_decoding_backend": "xgrammar"})
    assert re.fullmatch("[0-9]{3}", response.json()["choices"][0]["text"])
    response = so_server.post("/v1/completions", json={
        "prompt": "x", "max_tokens": 32, "guided_json": {"type": "object", "properties": {"a": {"enum": [1, 2]}},
                                                          "required": ["a"], "additionalProperties": False},
        "guided_whitespace_pattern": "[ ]?"})
    choice = response.json()["choices"][0]
    assert choice["finish_reason"] == "stop" and json.loads(choice["text"])["a"] in (1, 2)
    response = so_server.post("/v1/completions", json={"prompt": "x", "max_tokens": 16,
                                                       "guided_grammar": 'root ::= "a" [0-9] "b"'})
    assert re.fullmatch("a[0-9]b", response.json()["choices"][0]["text"])
    log = so_server.log_text()
    assert log.count("guided_choice is deprecated") == 1, "one warning line per field"
    assert "guided_decoding_backend is ignored" in log


def test_streamed_choice(so_server):
    response = so_server.post("/v1/chat/completions", json={
        "messages": USER, "max_tokens": 16, "stream": True, "structured_outputs": {"choice": ["alpha", "beta"]}})
    events = parse_sse(response.text)
    assert events[-1] == "[DONE]"
    text = "".join(e["choices"][0]["delta"].get("content") or "" for e in events[:-1] if e["choices"])
    assert text in ("alpha", "beta")
    assert [e["choices"][0]["finish_reason"] for e in events[:-1] if e["choices"]][-1] == "stop"


@pytest.mark.parametrize("body, message", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
     "Invalid structured outputs json: .*nope"),
    ({"structured_outputs": {"regex": "a("}}, "Invalid structured outputs regex: .*parenthesis"),
    ({"guided_grammar": 'root ::= "a" missing'}, "Invalid structured outputs grammar: .*missing"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "exactly one of .*got regex, choice"),
    ({"structured_outputs": {"regexp": "a"}}, "structured_outputs: .*regexp"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "one way only"),
    ({"response_format": {"type": "xml"}}, "response_format"),
])
def test_bad_constraints_are_a_400_and_the_server_keeps_serving(so_server, body, message):
    response = so_server.post("/v1/chat/completions", json={"messages": USER, "max_tokens": 4, **body})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and re.search(message, error["message"]), error
    ok = so_server.post("/v1/chat/completions", json={"messages": USER, "max_tokens": 2})
    assert ok.status_code == 200
