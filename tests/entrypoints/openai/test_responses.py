"""OpenAI's Responses API (``/v1/responses``) through the package's real ``pagedllm serve``
with the official ``openai`` SDK (``responses.create / stream / parse / retrieve / delete /
cancel``) and raw HTTP: every reply is checked exactly against the greedy chat completion
the same server gives for the same messages (the Responses API runs on the chat path).
Reasoning and tool-call items (which the tiny model does not write) are checked over a
scripted engine, as ``test_tool_calling_sdk`` does."""

from __future__ import annotations

import asyncio
import json
from typing import Literal

import openai
import pydantic
import pytest

from pagedllm.entrypoints.openai.responses_store import ResponsesStore, StoredResponse
from tests.entrypoints.anthropic.test_messages_server import _check_idle
from tests.entrypoints.openai.conftest import MODEL_NAME as MODEL
from tests.entrypoints.openai.test_tool_calling_sdk import _client, parts  # noqa: F401 (a fixture)

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


@pytest.fixture(scope="module", autouse=True)
def idle_at_the_end(server):
    """No request is left in the shared server after this module (``_check_idle``)."""
    yield
    _check_idle(server)


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
    tools = {"tools": [WEATHER_TOOL], "tool_choice": {"type": "function", "name": "get_weather"}}
    first = client.responses.create(model=MODEL, input=QUESTION, temperature=0.0, **tools)
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


#: A scripted reply with reasoning (deepseek_r1), text, and a hermes call.
SCRIPTED_REPLY = (
    '<think>Which city?</think>Checking.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
    "</tool_call>"
)
ITEM_EVENTS = {
    "reasoning": ["response.output_item.added", "response.content_part.added", "response.reasoning_text.delta",
                  "response.reasoning_text.done", "response.content_part.done", "response.output_item.done"],
    "message": ["response.output_item.added", "response.content_part.added", "response.output_text.delta",
                "response.output_text.done", "response.content_part.done", "response.output_item.done"],
    "function_call": ["response.output_item.added", "response.function_call_arguments.delta",
                      "response.function_call_arguments.done", "response.output_item.done"],
}  # fmt: skip


async def _scripted_items(client):
    """(the response, the streamed events, the stream's final response) of one request."""
    model = (await client.models.list()).data[0].id
    kwargs = dict(model=model, input=QUESTION, tools=[WEATHER_TOOL])
    response = await client.responses.create(**kwargs)
    async with client.responses.stream(**kwargs) as stream:
        events = [event async for event in stream]
        final = await stream.get_final_response()
    return response, events, final


def test_reasoning_text_and_calls_are_items_streamed_and_not(parts):  # noqa: F811
    engine, client = _client(parts, "hermes", reasoning_parser="deepseek_r1")
    engine.reply = SCRIPTED_REPLY
    response, events, final = asyncio.run(_scripted_items(client))
    for result in (response, final):
        reasoning, message, call = result.output
        assert [part.text for part in reasoning.content] == ["Which city?"] and reasoning.summary == []
        assert message.content[0].text == "Checking." and result.output_text == "Checking."
        assert (call.name, json.loads(call.arguments), call.call_id[:5]) == ("get_weather", {"city": "Paris"}, "call_")
        assert result.status == "completed" and all(item.status == "completed" for item in result.output)
    expected = ["response.created", "response.in_progress"]
    for item in final.output:
        expected += ITEM_EVENTS[item.type]
    # (several deltas of one kind count as one here; the engine sends 5-character pieces)
    types = [t for k, t in enumerate(e.type for e in events) if k == 0 or events[k - 1].type != t]
    assert types == expected + ["response.completed"]
    assert [event.sequence_number for event in events] == list(range(len(events)))
    arguments = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert arguments == final.output[2].arguments


def test_store_keeps_the_newest_responses():
    store = ResponsesStore(max_entries=2)
    for name in ("a", "b", "a", "c"):  # "a" again is newer than "b"
        store.put(StoredResponse({"id": name, "output": [{"type": "message"}]}, [{"role": "user"}]))
    assert (len(store), store.get("b")) == (2, None)
    assert store.get("a").conversation() == [{"role": "user"}, {"type": "message"}]
    assert store.delete("c") and not store.delete("c")
    with pytest.raises(ValueError, match="max_entries"):
        ResponsesStore(max_entries=0)
