"""Tool calling through the whole OpenAI layer (``build_app``) with the official ``openai``
SDK, over an engine whose replies are scripted: the model text is chosen by the test, so
every ``tool_choice`` mode and every parser is exercised with real calls, streamed and not.

The engine side of "required" / named (the JSON-schema constraint) is checked on the
engine request the server builds: its ``structured_outputs.json`` is the tool schema.
(Generation under that constraint is tested end to end in ``test_tool_calling_server``.)
"""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import httpx
import jsonschema
import openai
import pytest

from pagedllm.config import EngineArgs
from pagedllm.engine.processor import Processor
from pagedllm.entrypoints.openai.api_server import build_app
from pagedllm.entrypoints.openai.cli_args import FrontendConfig
from pagedllm.outputs import CompletionOutput, RequestOutput
from pagedllm.sampling_params import RequestOutputKind
from pagedllm.tokenizer import get_tokenizer

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "days": {"type": "array", "items": {"type": "integer"}}},
                "required": ["city"],
            },
        },
    },
    {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}},
]
MESSAGES = [{"role": "user", "content": "Weather and time in Paris?"}]
WEATHER_ARGS = '{"city": "Paris", "days": [1, 2]}'
CALLS = [("get_weather", WEATHER_ARGS), ("get_time", "{}")]

#: parser -> model text holding the two calls of ``CALLS`` after "Checking."
AUTO_REPLIES = {
    "hermes": (
        'Checking.<tool_call>\n{"name": "get_weather", "arguments": ' + WEATHER_ARGS + "}\n</tool_call>\n"
        '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
    ),
    "mistral": (
        'Checking.[TOOL_CALLS][{"name": "get_weather", "arguments": ' + WEATHER_ARGS + '}, '
        '{"name": "get_time", "arguments": {}}]'
    ),
    "llama3_json": (
        '{"name": "get_weather", "parameters": ' + WEATHER_ARGS + '}; {"name": "get_time", "parameters": {}}\nChecking.'
    ),
    "pythonic": 'Checking. [get_weather(city="Paris", days=[1, 2]), get_time()]',
}
REQUIRED_REPLY = (
    '[{"name": "get_weather", "parameters": ' + WEATHER_ARGS + '}, {"name": "get_time", "parameters": {}}]'
)


class _ScriptedEngine:
    """What the server uses of an ``AsyncLLM``; every choice's output is ``reply`` (in
    5-character pieces when streaming, each piece's tokens its own encoding), finished with
    ``finish_reason``."""

    errored = False

    def __init__(self, processor: Processor, model_config, tokenizer) -> None:
        self.processor = processor
        self.model_config = model_config
        self.tokenizer = tokenizer
        self.reply = ""
        self.finish_reason = "stop"
        self.requests = []

    def get_tokenizer(self):
        return self.tokenizer

    async def check_health(self) -> None:
        return None

    async def generate(self, request, sampling_params, request_id, prompt_text=None, trace_headers=None):
        self.requests.append(request)
        n = sampling_params.n
        if sampling_params.output_kind == RequestOutputKind.DELTA:
            pieces = [self.reply[i : i + 5] for i in range(0, len(self.reply), 5)] or [""]
        else:
            pieces = [self.reply]
        for k, piece in enumerate(pieces):
            last = k == len(pieces) - 1
            outputs = [
                CompletionOutput(index=i, text=piece, token_ids=self.tokenizer.encode(piece, add_special_tokens=False),
                                 finish_reason=self.finish_reason if last else None)
                for i in range(n)
            ]
            yield RequestOutput(request_id, prompt_text, list(request.prompt_token_ids), None, outputs, last)
            await asyncio.sleep(0)


@pytest.fixture(scope="module")
def parts(tiny_llama):
    config = EngineArgs(model=str(tiny_llama), dtype="float32", max_model_len=512).create_engine_config()
    tokenizer = get_tokenizer(config.model_config.tokenizer_path)
    return SimpleNamespace(config=config, tokenizer=tokenizer, processor=Processor(config.model_config, tokenizer))


def _client(parts, parser=None, **frontend_fields):
    """(scripted engine, SDK client of an app over it); ``frontend_fields``: more server settings."""
    engine = _ScriptedEngine(parts.processor, parts.config.model_config, parts.tokenizer)
    frontend = FrontendConfig(
        disable_log_stats=True, disable_log_requests=True,
        enable_auto_tool_choice=parser is not None, tool_call_parser=parser, **frontend_fields,
    )  # fmt: skip
    transport = httpx.ASGITransport(app=build_app(engine, frontend))
    client = openai.AsyncOpenAI(base_url="http://test/v1", api_key="x", http_client=httpx.AsyncClient(transport=transport))
    return engine, client


async def _create(client, stream: bool, **kwargs):
    """(content, [(id, name, arguments)], finish_reason) of one choice, streamed or not."""
    model = (await client.models.list()).data[0].id
    if not stream:
        response = await client.chat.completions.create(model=model, messages=MESSAGES, tools=TOOLS, **kwargs)
        choice = response.choices[0]
        calls = [(c.id, c.function.name, c.function.arguments) for c in choice.message.tool_calls or []]
        assert all(c.type == "function" for c in choice.message.tool_calls or [])
        return choice.message.content, calls, choice.finish_reason
    content, calls, finish = None, [], None
    async for chunk in await client.chat.completions.create(
        model=model, messages=MESSAGES, tools=TOOLS, stream=True, **kwargs
    ):
        for choice in chunk.choices:
            if choice.delta.content:
                content = (content or "") + choice.delta.content
            for delta in choice.delta.tool_calls or []:
                if delta.index == len(calls):
                    assert delta.id and delta.type == "function" and delta.function.name
                    calls.append([delta.id, delta.function.name, delta.function.arguments or ""])
                else:
                    assert delta.id is None and delta.function.name is None
                    calls[delta.index][2] += delta.function.arguments or ""
            finish = choice.finish_reason or finish
    return content, [tuple(call) for call in calls], finish


def _check_calls(calls, expected):
    assert [(name, arguments) for _, name, arguments in calls] == expected
    ids = [call_id for call_id, _, _ in calls]
    assert all(call_id.startswith("call_") for call_id in ids) and len(set(ids)) == len(ids)
    for _, _, arguments in calls:
        json.loads(arguments)


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
@pytest.mark.parametrize("parser", sorted(AUTO_REPLIES))
def test_auto_reads_parallel_calls_and_keeps_the_text(parts, parser, stream):
    engine, client = _client(parts, parser)
    engine.reply = AUTO_REPLIES[parser]
    content, calls, finish = asyncio.run(_create(client, stream, tool_choice="auto"))
    assert content.strip() == "Checking."
    _check_calls(calls, CALLS)
    assert finish == "tool_calls"


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_auto_without_a_call_is_plain_content(parts, stream):
    engine, client = _client(parts, "hermes")
    engine.reply = "No tool needed, it is <b>sunny</b>.\n"
    content, calls, finish = asyncio.run(_create(client, stream))  # tools without tool_choice: "auto"
    assert (content, calls, finish) == ("No tool needed, it is <b>sunny</b>.\n", [], "stop")


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_none_renders_tools_but_reads_no_calls(parts, stream):
    engine, client = _client(parts)
    engine.reply = AUTO_REPLIES["hermes"]
    content, calls, finish = asyncio.run(_create(client, stream, tool_choice="none"))
    assert (content, calls, finish) == (AUTO_REPLIES["hermes"], [], "stop")
    assert engine.requests[-1].sampling_params.structured_outputs is None


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_required_constrains_to_the_tool_array_and_reads_it(parts, stream):
    engine, client = _client(parts)
    engine.reply = REQUIRED_REPLY
    content, calls, finish = asyncio.run(_create(client, stream, tool_choice="required"))
    assert not content and finish == "tool_calls"
    _check_calls(calls, CALLS)
    schema = engine.requests[-1].sampling_params.structured_outputs.json
    assert schema["type"] == "array" and schema["minItems"] == 1
    assert [v["properties"]["name"] for v in schema["items"]["anyOf"]] == [
        {"type": "string", "enum": ["get_weather"]},
        {"type": "string", "enum": ["get_time"]},
    ]
    assert schema["items"]["anyOf"][0]["properties"]["parameters"] == TOOLS[0]["function"]["parameters"]
    jsonschema.validate(json.loads(REQUIRED_REPLY), schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "get_time", "parameters": {"city": 3}}, {"name": "nope", "parameters": {}}], schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([], schema)


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_named_choice_constrains_to_the_parameters_and_finishes_with_stop(parts, stream):
    engine, client = _client(parts)
    engine.reply = WEATHER_ARGS
    choice = {"type": "function", "function": {"name": "get_weather"}}
    content, calls, finish = asyncio.run(_create(client, stream, tool_choice=choice))
    assert not content and finish == "stop"
    _check_calls(calls, [("get_weather", WEATHER_ARGS)])
    assert engine.requests[-1].sampling_params.structured_outputs.json == TOOLS[0]["function"]["parameters"]


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_a_call_cut_off_by_max_tokens_finishes_with_length(parts, stream):
    engine, client = _client(parts)
    engine.reply, engine.finish_reason = '[{"name": "get_weather", "parameters": {"city": "Par', "length"
    content, calls, finish = asyncio.run(_create(client, stream, tool_choice="required", max_tokens=12))
    assert finish == "length"
    assert [(name, arguments) for _, name, arguments in calls] == [("get_weather", '{"city": "Par')]


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_parallel_tool_calls_false_keeps_the_first(parts, stream):
    engine, client = _client(parts, "hermes")
    engine.reply = AUTO_REPLIES["hermes"]
    _, calls, _ = asyncio.run(_create(client, stream, tool_choice="auto", parallel_tool_calls=False))
    _check_calls(calls, CALLS[:1])


def test_n_choices_each_get_their_calls(parts):
    engine, client = _client(parts, "hermes")
    engine.reply = AUTO_REPLIES["hermes"]

    async def run():
        model = (await client.models.list()).data[0].id
        response = await client.chat.completions.create(model=model, messages=MESSAGES, tools=TOOLS, n=2)
        return response.choices

    choices = asyncio.run(run())
    assert [[c.function.name for c in choice.message.tool_calls] for choice in choices] == [["get_weather", "get_time"]] * 2
    ids = [c.id for choice in choices for c in choice.message.tool_calls]
    assert len(set(ids)) == 4
