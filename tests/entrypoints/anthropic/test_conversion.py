"""The Messages API's pieces without a server: a Messages request -> its chat request, and
the stream's content-block events for deltas of every kind."""

from __future__ import annotations

import json

import pytest

from pagedllm.entrypoints.anthropic.conversion import chat_request
from pagedllm.entrypoints.anthropic.protocol import AnthropicMessagesRequest
from pagedllm.entrypoints.anthropic.serving_messages import _BlockEvents
from pagedllm.entrypoints.openai.errors import OpenAIServingError
from pagedllm.entrypoints.openai.protocol import (
    ChatCompletionNamedToolChoiceParam,
    ChatCompletionResponseStreamChoice,
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
)

TOOL = {"name": "capital", "input_schema": {"type": "object", "properties": {"country": {"type": "string"}}}}


def _request(**fields) -> AnthropicMessagesRequest:
    return AnthropicMessagesRequest.model_validate({"model": "m", "max_tokens": 5, **fields})


def test_messages_become_chat_messages():
    request = _request(
        system=[{"type": "text", "text": "Be brief."}, {"type": "text", "text": "Be kind."}],
        messages=[
            {"role": "user", "content": "Capital of France?"},
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "Look it up.", "signature": "s"},
                {"type": "tool_use", "id": "toolu_1", "name": "capital", "input": {"country": "France"}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "Paris"}]},
                {"type": "text", "text": "Thanks."}]},
        ],
        tools=[TOOL], tool_choice={"type": "tool", "name": "capital", "disable_parallel_tool_use": True},
        stop_sequences=["\n\n"], temperature=0.5, top_k=3, stream=True,
    )  # fmt: skip
    chat = chat_request(request)
    assert [m.model_dump(exclude_none=True) for m in chat.messages] == [
        {"role": "system", "content": "Be brief.\nBe kind."},
        {"role": "user", "content": "Capital of France?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "toolu_1", "type": "function", "function": {"name": "capital", "arguments": '{"country": "France"}'}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "Paris"},
        {"role": "user", "content": [{"type": "text", "text": "Thanks."}]},
    ]  # fmt: skip
    assert isinstance(chat.tool_choice, ChatCompletionNamedToolChoiceParam) and chat.tool_choice.function.name == "capital"
    assert chat.tools[0].function.parameters == TOOL["input_schema"] and chat.parallel_tool_calls is False
    assert (chat.max_tokens, chat.stop, chat.temperature, chat.top_k, chat.stream, chat.include_usage) == (
        5, ["\n\n"], 0.5, 3, True, True)


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"tools": [TOOL], "tool_choice": {"type": "tool", "name": "other"}}, "does not match any of the specified"),
        ({"messages": [{"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "t", "content": [{"type": "image"}]}]}]}, "type 'image'"),
    ],
)  # fmt: skip
def test_bad_requests_are_400s(fields, message):
    request = _request(**{"messages": [{"role": "user", "content": "hi"}], **fields})
    with pytest.raises(OpenAIServingError, match=message) as error:
        chat_request(request)
    assert error.value.status_code == 400


def _events(blocks: _BlockEvents, **delta) -> list[dict]:
    choice = ChatCompletionResponseStreamChoice(index=0, delta=DeltaMessage(**delta))
    return [json.loads(event.split("data: ", 1)[1]) for event in blocks.feed(choice)]


def test_deltas_open_and_close_blocks_in_order():
    blocks = _BlockEvents()
    events = _events(blocks, reasoning="Hm")
    events += _events(blocks, reasoning=".", content="Yes")
    call = DeltaToolCall(index=0, id="call_1", type="function", function=DeltaFunctionCall(name="f", arguments='{"a'))
    events += _events(blocks, tool_calls=[call])
    events += _events(blocks, tool_calls=[DeltaToolCall(index=0, function=DeltaFunctionCall(arguments='": 1}'))])
    events += [json.loads(event.split("data: ", 1)[1]) for event in blocks.finish()]
    summary = [(e["type"], e["index"], e.get("delta") or e.get("content_block")) for e in events]
    assert summary[:7] == [
        ("content_block_start", 0, {"type": "thinking", "thinking": "", "signature": ""}),
        ("content_block_delta", 0, {"type": "thinking_delta", "thinking": "Hm"}),
        ("content_block_delta", 0, {"type": "thinking_delta", "thinking": "."}),
        ("content_block_stop", 0, None),
        ("content_block_start", 1, {"type": "text", "text": ""}),
        ("content_block_delta", 1, {"type": "text_delta", "text": "Yes"}),
        ("content_block_stop", 1, None),
    ]
    assert summary[7][:2] == ("content_block_start", 2) and summary[7][2]["name"] == "f"
    assert summary[8:] == [
        ("content_block_delta", 2, {"type": "input_json_delta", "partial_json": '{"a'}),
        ("content_block_delta", 2, {"type": "input_json_delta", "partial_json": '": 1}'}),
        ("content_block_stop", 2, None),
    ]
    assert blocks.called


def test_a_stream_without_content_has_one_empty_text_block():
    events = [json.loads(event.split("data: ", 1)[1]) for event in _BlockEvents().finish()]
    assert [e["type"] for e in events] == ["content_block_start", "content_block_stop"]
    assert events[0]["content_block"] == {"type": "text", "text": ""}
