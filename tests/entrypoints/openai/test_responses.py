"""OpenAI's Responses API (``/v1/responses``) through a real ``pagedllm serve`` with the
official ``openai`` SDK (``responses.create / stream / parse / retrieve / delete / cancel``)
and raw HTTP: every reply is checked exactly against the greedy chat completion the same
server gives for the same messages (the Responses API runs on the chat path)."""

from __future__ import annotations

import json
from typing import Literal

import openai
import pydantic
import pytest

from tests.entrypoints.anthropic.test_messages_server import _check_idle
from tests.server_utils import RemoteServer

MODEL = "tiny-responses"
API_KEY = "sk-responses"
INSTRUCTIONS = "Be brief."
QUESTION = "What is the weather in Paris?"
CHAT_MESSAGES = [{"role": "system", "content": INSTRUCTIONS}, {"role": "user", "content": QUESTION}]
GREEDY = {"temperature": 0.0, "max_output_tokens": 8}
WEATHER_TOOL = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city.",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
        "required": ["city"],
        "additionalProperties": False,
    },
}


class Forecast(pydantic.BaseModel):
    sky: Literal["sunny", "cloudy", "rainy"]
    warm: bool


#: Compact JSON under ``text.format`` (free whitespace lets the tiny model run to the limit).
SERVER_FLAGS = ("--served-model-name", MODEL, "--max-model-len", "512",
                "--structured-outputs-config", '{"backend": "auto", "disable_any_whitespace": true}')  # fmt: skip


@pytest.fixture(scope="module")
def server(tiny_llama):
    """The module's server; no request is left in it at the end (``_check_idle``)."""
    remote = RemoteServer(tiny_llama, *SERVER_FLAGS, api_key=API_KEY)
    try:
        yield remote
        _check_idle(remote)
    finally:
        remote.close()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return server.client()


@pytest.fixture(scope="module")
def chat_reply(client):
    """The greedy chat completion of ``CHAT_MESSAGES`` (8 tokens)."""
    return client.chat.completions.create(
        model=MODEL, messages=CHAT_MESSAGES, temperature=0.0, max_completion_tokens=GREEDY["max_output_tokens"]
    )


def test_create_equals_chat_and_is_stored(client, chat_reply):
    response = client.responses.create(model=MODEL, input=QUESTION, instructions=INSTRUCTIONS, **GREEDY)
    choice = chat_reply.choices[0]
    assert choice.finish_reason == "length"  # 8 tokens cut the tiny model's reply
    assert response.id.startswith("resp_") and response.object == "response" and response.model == MODEL
    assert response.output_text == choice.message.content
    (item,) = response.output
    assert item.type == "message" and item.role == "assistant" and item.status == "incomplete"
    assert [part.type for part in item.content] == ["output_text"]
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    usage = response.usage
    assert (usage.input_tokens, usage.output_tokens) == (chat_reply.usage.prompt_tokens, 8)
    assert usage.total_tokens == usage.input_tokens + 8
    assert response.instructions == INSTRUCTIONS and response.max_output_tokens == 8
    assert client.responses.retrieve(response.id) == response
    # The same messages as a list of items, with parts:
    items = [{"role": "system", "content": INSTRUCTIONS},
             {"type": "message", "role": "user", "content": [{"type": "input_text", "text": QUESTION}]}]  # fmt: skip
    again = client.responses.create(model=MODEL, input=items, store=False, **GREEDY)
    assert again.output_text == response.output_text
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(again.id)


def test_stream_events_in_order(client, chat_reply):
    events = list(client.responses.create(model=MODEL, input=QUESTION, instructions=INSTRUCTIONS, stream=True,
                                          **GREEDY))  # fmt: skip
    assert [event.sequence_number for event in events] == list(range(len(events)))
    types = [event.type for event in events]
    num_deltas = types.count("response.output_text.delta")
    assert num_deltas >= 1
    assert types == [
        "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
        *["response.output_text.delta"] * num_deltas, "response.output_text.done", "response.content_part.done",
        "response.output_item.done", "response.incomplete",
    ]  # fmt: skip
    text = "".join(event.delta for event in events if event.type == "response.output_text.delta")
    assert text == chat_reply.choices[0].message.content
    assert events[-4].text == text and events[-3].part.text == text
    item_ids = {event.item_id for event in events if hasattr(event, "item_id")}
    assert item_ids == {events[2].item.id}
    final = events[-1].response
    assert events[0].response.status == "in_progress" and final.status == "incomplete"
    assert final.output_text == text and final.usage.output_tokens == 8
    assert client.responses.retrieve(final.id).output_text == text


def test_parse_json_schema_streamed_and_not(client):
    chat = client.chat.completions.parse(model=MODEL, messages=CHAT_MESSAGES, response_format=Forecast,
                                         temperature=0.0, max_completion_tokens=64)  # fmt: skip
    expected = chat.choices[0].message.parsed
    assert isinstance(expected, Forecast)
    kwargs = dict(model=MODEL, input=QUESTION, instructions=INSTRUCTIONS, text_format=Forecast, temperature=0.0,
                  max_output_tokens=64)  # fmt: skip
    parsed = client.responses.parse(**kwargs)
    assert parsed.status == "completed" and parsed.output_parsed == expected
    assert parsed.text.format.type == "json_schema" and parsed.text.format.name == "Forecast"
    with client.responses.stream(**kwargs) as stream:
        deltas = [event.delta for event in stream if event.type == "response.output_text.delta"]
        final = stream.get_final_response()  # the SDK's own accumulation of the events
    assert "".join(deltas) == final.output_text == parsed.output_text
    assert final.output_parsed == expected


def test_function_call_round_trip(client):
    named = {"type": "function", "name": "get_weather"}
    first = client.responses.create(model=MODEL, input=QUESTION, tools=[WEATHER_TOOL], tool_choice=named, temperature=0.0)
    (call,) = first.output
    assert call.type == "function_call" and call.name == "get_weather" and call.call_id.startswith("call_")
    assert json.loads(call.arguments)["city"] in ("Paris", "Rome")
    assert first.status == "completed" and first.tools[0].name == "get_weather"
    chat_tool = {"type": "function", "function": {k: WEATHER_TOOL[k] for k in ("name", "description", "parameters")}}
    chat_call = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": QUESTION}], tools=[chat_tool], temperature=0.0,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    ).choices[0].message.tool_calls[0]  # fmt: skip
    assert call.arguments == chat_call.function.arguments
    second = client.responses.create(
        model=MODEL, previous_response_id=first.id, tools=[WEATHER_TOOL], tool_choice="none",
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 25 C."}], **GREEDY,
    )  # fmt: skip
    assert second.previous_response_id == first.id
    messages = [
        {"role": "user", "content": QUESTION},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": call.call_id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}]},
        {"role": "tool", "tool_call_id": call.call_id, "content": "Sunny, 25 C."},
    ]  # fmt: skip
    chat = client.chat.completions.create(model=MODEL, messages=messages, temperature=0.0, max_completion_tokens=8)
    assert second.output_text == chat.choices[0].message.content
    assert second.usage.input_tokens == chat.usage.prompt_tokens


def test_retrieve_delete_cancel_and_unknown_ids(client, server):
    response = client.responses.create(model=MODEL, input=QUESTION, **GREEDY)
    with pytest.raises(openai.BadRequestError, match="background"):
        client.responses.cancel(response.id)
    client.responses.delete(response.id)
    for call in (client.responses.retrieve, client.responses.delete, client.responses.cancel):
        with pytest.raises(openai.NotFoundError, match=response.id):
            call(response.id)
    with pytest.raises(openai.NotFoundError) as info:
        client.responses.create(model=MODEL, input=QUESTION, previous_response_id="resp_nope", **GREEDY)
    assert info.value.body["param"] == "previous_response_id" and info.value.body["type"] == "invalid_request_error"


@pytest.mark.parametrize(
    "body, param, words",
    [
        ({}, "input", "Field required"),
        ({"input": []}, "input", "empty"),
        ({"input": "Hi", "background": True}, "background", "background"),
        ({"input": "Hi", "tools": [{"type": "web_search"}]}, "tools", "web_search"),
        ({"input": [{"role": "user", "content": [{"type": "input_image"}]}]}, "input", "input_image"),
        ({"input": "Hi", "tools": [WEATHER_TOOL], "tool_choice": {"type": "function", "name": "f"}}, None, "'f'"),
        ({"input": "Hi", "max_output_tokens": 0}, "max_output_tokens", "greater than or equal to 1"),
    ],
    ids=["no-input", "empty-input", "background", "built-in-tool", "image-part", "unknown-tool", "zero-tokens"],
)
def test_bad_requests_are_400_naming_the_field(server, body, param, words):
    reply = server.post("/v1/responses", json={"model": MODEL, **body})
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["type"] == "invalid_request_error" and words in error["message"]
    assert error["param"] == param
