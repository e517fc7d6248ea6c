"""Tool-call parsers (``pagedllm.entrypoints.openai.tool_parsers``), without a server: for
every parser, output with no call, one call, parallel calls, text around calls and
malformed calls (kept as content); streamed in random pieces, the joined deltas equal the
non-streamed reply exactly."""

from __future__ import annotations

import json
import random

import pytest

from pagedllm.entrypoints.openai.protocol import ChatCompletionRequest
from pagedllm.entrypoints.openai.tool_calls import ToolCallStream, reply_tool_calls
from pagedllm.entrypoints.openai.tool_parsers import (
    NamedToolParser,
    ParsedToolCall,
    RequiredToolParser,
    ToolParserManager,
)

W = ParsedToolCall("get_weather", '{"city": "Paris", "days": [1, 2]}')
T = ParsedToolCall("get_time", "{}")
WEATHER_JSON = '{"name": "get_weather", "arguments": {"city": "Paris", "days": [1, 2]}}'
TIME_JSON = '{"name": "get_time", "arguments": {}}'

#: parser -> case -> (model text, expected content, expected calls)
CASES = {
    "hermes": {
        "none": ("The weather is nice.", "The weather is nice.", []),
        "one": (f"<tool_call>\n{WEATHER_JSON}\n</tool_call>", "", [W]),
        "parallel": (f"<tool_call>\n{WEATHER_JSON}\n</tool_call>\n<tool_call>\n{TIME_JSON}\n</tool_call>", "", [W, T]),
        "around": (f"Let me check. <tool_call>{WEATHER_JSON}</tool_call> Done.", "Let me check.  Done.", [W]),
        "malformed": ("Hi <tool_call>not json</tool_call> bye", "Hi <tool_call>not json</tool_call> bye", []),
        "unicode": ('<tool_call>{"name": "say", "arguments": {"text": "h\\u00e9 \\"x\\" }"}}</tool_call>', "",
                    [ParsedToolCall("say", '{"text": "h\\u00e9 \\"x\\" }"}')]),
    },
    "mistral": {
        "none": ("Plain [text] here.", "Plain [text] here.", []),
        "one": (f"[TOOL_CALLS] [{WEATHER_JSON}]", "", [W]),
        "parallel": (f"[TOOL_CALLS][{WEATHER_JSON}, {TIME_JSON}]", "", [W, T]),
        "around": (f"Sure.[TOOL_CALLS][{WEATHER_JSON}] ok", "Sure. ok", [W]),
        "malformed": ("[TOOL_CALLS] oops", "[TOOL_CALLS] oops", []),
    },
    "llama3_json": {
        "none": ("It is sunny {maybe}.", "It is sunny {maybe}.", []),
        "one": ('{"name": "get_weather", "parameters": {"city": "Paris", "days": [1, 2]}}', "", [W]),
        "parallel": (f'<|python_tag|>{WEATHER_JSON}; {{"name": "get_time", "parameters": {{}}}}', "", [W, T]),
        "around": (f"  {WEATHER_JSON}\nThat is all.", "That is all.", [W]),
        "malformed": ('{"name": 3, "parameters": {}}', '{"name": 3, "parameters": {}}', []),
    },
    "pythonic": {
        "none": ("Lists like [1, 2] stay text.", "Lists like [1, 2] stay text.", []),
        "one": ('[get_weather(city="Paris", days=[1, 2])]', "", [W]),
        "parallel": ("[get_weather(city='Paris', days=[1, 2]), get_time()]", "", [W, T]),
        "around": ('Checking: [get_weather(city="Paris", days=[1, 2])] done', "Checking:  done", [W]),
        "malformed": ("[get_weather(1, 2)]", "[get_weather(1, 2)]", []),
    },
}
PARAMS = [(parser, case, *CASES[parser][case]) for parser in CASES for case in CASES[parser]]
IDS = [f"{parser}-{case}" for parser, case, *_ in PARAMS]


def _request(tool_choice="auto", parallel_tool_calls=True) -> ChatCompletionRequest:
    tools = [{"type": "function", "function": {"name": name}} for name in ("get_weather", "get_time", "say")]
    return ChatCompletionRequest(
        messages=[{"role": "user", "content": "hi"}],
        tools=tools,
        tool_choice=tool_choice,
        parallel_tool_calls=parallel_tool_calls,
    )


def _pieces(text: str, seed: int) -> list[str]:
    """``text`` cut at random places (seed 0: one character at a time)."""
    if seed == 0:
        return list(text)
    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 12))))
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]


def _streamed(request, parser, pieces: list[str]) -> tuple[str, list[dict]]:
    """(joined content, calls as {id, name, arguments}) of a stream; checks that each
    call's first delta carries index, id, type and name and later ones only arguments."""
    stream = ToolCallStream(request, parser)
    content, calls = "", []
    for i, piece in enumerate(pieces):
        delta = stream.feed(piece, final=i == len(pieces) - 1)
        content += delta.content or ""
        for tool_call in delta.tool_calls or []:
            if tool_call.index == len(calls):
                assert tool_call.id.startswith("call_") and tool_call.type == "function"
                assert tool_call.function.name
                calls.append({"id": tool_call.id, "name": tool_call.function.name, "arguments": ""})
            else:
                assert tool_call.id is None and tool_call.type is None and tool_call.function.name is None
            calls[tool_call.index]["arguments"] += tool_call.function.arguments or ""
    return content, calls


@pytest.mark.parametrize("parser_name, case, text, content, calls", PARAMS, ids=IDS)
def test_parse_final(parser_name, case, text, content, calls):
    parsed = ToolParserManager.get_tool_parser(parser_name)().parse(text, final=True)
    assert parsed.content == content
    assert parsed.tool_calls == calls
    for call in parsed.tool_calls:
        json.loads(call.arguments)


@pytest.mark.parametrize("parser_name, case, text, content, calls", PARAMS, ids=IDS)
@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_streamed_deltas_join_to_the_final_reply(parser_name, case, text, content, calls, seed):
    parser = ToolParserManager.get_tool_parser(parser_name)()
    request = _request()
    streamed_content, streamed_calls = _streamed(request, parser, _pieces(text, seed))
    reply_content, reply_calls = reply_tool_calls(request, parser.parse(text, final=True))
    assert streamed_content == (reply_content or "")
    assert [(c["name"], c["arguments"]) for c in streamed_calls] == [
        (c.function.name, c.function.arguments) for c in reply_calls
    ]
    ids = [c["id"] for c in streamed_calls] + [c.id for c in reply_calls]
    assert len(set(ids)) == len(ids)


def test_partial_snapshots_hold_back_marker_starts_and_unnamed_calls():
    hermes = ToolParserManager.get_tool_parser("hermes")()
    assert hermes.parse("Hello <tool_c", final=False).content == "Hello"
    assert hermes.parse("Hello <tool_c", final=True).content == "Hello <tool_c"
    assert hermes.parse('<tool_call>{"name": "get_wea', final=False).tool_calls == []
    partial = hermes.parse('<tool_call>{"name": "f", "arguments": {"a": 1', final=False)
    assert partial.tool_calls == [ParsedToolCall("f", '{"a": 1')]


def test_a_call_cut_off_keeps_the_arguments_generated_so_far():
    hermes = ToolParserManager.get_tool_parser("hermes")()
    cut = hermes.parse('<tool_call>{"name": "f", "arguments": {"a": "xy ', final=True)
    assert cut.tool_calls == [ParsedToolCall("f", '{"a": "xy ')] and cut.content == ""


def test_parallel_tool_calls_false_keeps_the_first_call():
    text = CASES["hermes"]["parallel"][0]
    parser = ToolParserManager.get_tool_parser("hermes")()
    request = _request(parallel_tool_calls=False)
    content, calls = reply_tool_calls(request, parser.parse(text, final=True))
    assert content is None and [c.function.name for c in calls] == ["get_weather"]
    assert [c["name"] for c in _streamed(request, parser, list(text))[1]] == ["get_weather"]


def test_required_output_is_an_array_of_name_and_parameters():
    text = '[{"name": "get_weather", "parameters": {"city": "Paris", "days": [1, 2]}}, {"name": "get_time", "parameters": {}}]'
    parsed = RequiredToolParser().parse(text, final=True)
    assert parsed.content == "" and parsed.tool_calls == [W, T]
    for seed in range(3):
        content, calls = _streamed(_request("required"), RequiredToolParser(), _pieces(text, seed))
        assert content == "" and [(c["name"], c["arguments"]) for c in calls] == [(W.name, W.arguments), (T.name, T.arguments)]


def test_named_output_is_the_arguments():
    parser = NamedToolParser("get_weather")
    text = '{"city": "Paris", "days": [1, 2]}'
    assert parser.parse(text, final=True).tool_calls == [W]
    request = _request({"type": "function", "function": {"name": "get_weather"}})
    assert [(c["name"], c["arguments"]) for c in _streamed(request, parser, _pieces(text, 1))[1]] == [(W.name, W.arguments)]


def test_registry_names_and_unknown_parser():
    assert ToolParserManager.names() == ["hermes", "llama3_json", "mistral", "pythonic"]
    with pytest.raises(KeyError, match=r"invalid tool call parser: nope \(chose from \{ hermes,llama3_json"):
        ToolParserManager.get_tool_parser("nope")
