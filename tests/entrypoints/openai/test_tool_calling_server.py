"""Tool calling on a real ``pagedllm serve`` with the official ``openai`` SDK: the shipped
model (its chat template renders tools Hermes-style) with ``--enable-auto-tool-choice
--tool-call-parser hermes``; the errors on the shared test server (no auto tool choice).

The shipped model was never trained on tools, so "auto" is checked against the parser
applied to the same (greedy) text; "required" and named choice need the engine's
constrained decoding, which turns any model's output into valid calls.
"""

from __future__ import annotations

import json

import jsonschema
import pytest
from transformers import AutoTokenizer

from pagedllm.entrypoints.openai.tool_parsers import ToolParserManager
from pagedllm.model_paths import default_model_path

UNIT = {"type": "string", "enum": ["celsius", "fahrenheit"]}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The current weather in a city.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}, "unit": UNIT},
                "required": ["city", "unit"],
                "additionalProperties": False,
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "parameters": {
                "type": "object",
                "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
                "required": ["zone"],
                "additionalProperties": False,
            },
        },
    },
]
PARAMETERS = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
#: A multi-turn conversation: an assistant tool call and its result.
CONVERSATION = MESSAGES + [
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "22 degrees, sunny"},
]
GREEDY = {"temperature": 0.0, "max_tokens": 24}


@pytest.fixture(scope="module")
def tool_client(default_model_server):
    return default_model_server.client()


def _model(client) -> str:
    return client.models.list().data[0].id


def _streamed(client, **kwargs):
    """(content, [(name, arguments)], finish_reason) of a streamed request, each call's
    header checked (index, id, type, name in its first delta)."""
    content, calls, ids, finish = "", [], set(), None
    for chunk in client.chat.completions.create(model=_model(client), stream=True, **kwargs):
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for delta in choice.delta.tool_calls or []:
                if delta.index == len(calls):
                    assert delta.id.startswith("call_") and delta.type == "function" and delta.function.name
                    ids.add(delta.id)
                    calls.append([delta.function.name, delta.function.arguments or ""])
                else:
                    calls[delta.index][1] += delta.function.arguments or ""
            finish = choice.finish_reason or finish
    assert len(ids) == len(calls)
    return content, [tuple(call) for call in calls], finish


def test_tools_and_tool_messages_reach_the_chat_template(tool_client):
    tokenizer = AutoTokenizer.from_pretrained(default_model_path())
    # transformers' convention: arguments as a dict (the server decodes the JSON string)
    call = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}}
    conversation = [CONVERSATION[0], {**CONVERSATION[1], "tool_calls": [call]}, CONVERSATION[2]]
    expected = tokenizer.apply_chat_template(conversation, tools=TOOLS, add_generation_prompt=True, tokenize=False)
    assert "<tools>" in expected and "<tool_response>\n22 degrees, sunny\n</tool_response>" in expected
    assert '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}' in expected
    response = tool_client.chat.completions.create(
        model=_model(tool_client), messages=CONVERSATION, tools=TOOLS, tool_choice="none", max_tokens=1
    )
    assert response.usage.prompt_tokens == len(tokenizer.encode(expected, add_special_tokens=False))


def test_none_and_auto_read_the_same_text(tool_client):
    kwargs = dict(model=_model(tool_client), messages=MESSAGES, tools=TOOLS, **GREEDY)
    # the hermes parser decodes with special tokens kept (vLLM's adjust_request): so does "none" here
    none = tool_client.chat.completions.create(
        tool_choice="none", extra_body={"skip_special_tokens": False}, **kwargs
    ).choices[0]
    assert none.message.tool_calls in (None, []) and none.finish_reason in ("stop", "length")
    auto = tool_client.chat.completions.create(tool_choice="auto", **kwargs).choices[0]
    parsed = ToolParserManager.get_tool_parser("hermes")().parse(none.message.content, final=True)
    assert [(c.function.name, c.function.arguments) for c in auto.message.tool_calls or []] == [
        (c.name, c.arguments) for c in parsed.tool_calls
    ]
    assert (auto.message.content or "") == parsed.content
    content, calls, finish = _streamed(tool_client, messages=MESSAGES, tools=TOOLS, tool_choice="auto", **GREEDY)
    assert (content, calls) == (parsed.content, [(c.name, c.arguments) for c in parsed.tool_calls])
    assert finish == auto.finish_reason


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_required_makes_the_model_call_tools(tool_client, stream):
    kwargs = dict(messages=MESSAGES, tools=TOOLS, tool_choice="required", temperature=0.0, max_tokens=200)
    if stream:
        _, calls, finish = _streamed(tool_client, **kwargs)
    else:
        choice = tool_client.chat.completions.create(model=_model(tool_client), **kwargs).choices[0]
        calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls]
        finish = choice.finish_reason
    assert calls and finish in ("tool_calls", "length")
    for name, arguments in calls if finish == "tool_calls" else calls[:-1]:
        jsonschema.validate(json.loads(arguments), PARAMETERS[name])


def test_named_choice_calls_that_function_streamed_or_not(tool_client):
    choice = {"type": "function", "function": {"name": "get_time"}}
    kwargs = dict(messages=MESSAGES, tools=TOOLS, tool_choice=choice, temperature=0.0, max_tokens=100)
    reply = tool_client.chat.completions.create(model=_model(tool_client), **kwargs).choices[0]
    assert reply.finish_reason == "stop" and not reply.message.content
    (call,) = reply.message.tool_calls
    assert call.function.name == "get_time" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), PARAMETERS["get_time"])
    _, calls, finish = _streamed(tool_client, **kwargs)
    assert calls == [("get_time", call.function.arguments)] and finish == "stop"


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}],
                         ids=["required", "named"])
def test_one_call_allowed_ends_the_output_after_it(tool_client, choice):
    # No max_tokens: the grammar itself must end after the one call (before, "required"
    # went on writing a second call that was thrown away, until max_model_len).
    reply = tool_client.chat.completions.create(
        model=_model(tool_client), messages=MESSAGES, tools=TOOLS, tool_choice=choice, parallel_tool_calls=False,
        temperature=0.0)
    (call,) = reply.choices[0].message.tool_calls
    assert choice == "required" or call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), PARAMETERS[call.function.name])
    assert reply.choices[0].finish_reason == ("tool_calls" if choice == "required" else "stop")
    assert reply.usage.completion_tokens < 60, reply.usage


@pytest.mark.parametrize(
    "extra, message",
    [
        ({"tool_choice": "required"}, "When using `tool_choice`, `tools` must be set."),
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "does not match any of the specified `tools`",
        ),
        ({"tools": TOOLS, "tool_choice": "sometimes"}, "Invalid value for `tool_choice`"),
        ({"tools": TOOLS}, '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set'),
        ({"tools": TOOLS, "tool_choice": "auto"}, '"auto" tool choice requires --enable-auto-tool-choice'),
    ],
    ids=["choice-without-tools", "unknown-function", "bad-choice", "default-auto", "auto"],
)
def test_tool_choice_errors_are_400(server, extra, message):
    response = server.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 1, **extra})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and message in error["message"], error
