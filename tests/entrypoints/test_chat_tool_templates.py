"""Tools in chat templates (``chat_utils``): the shipped model's template renders ``tools``,
assistant ``tool_calls`` and ``tool`` results Hermes-style, exactly as transformers renders it,
and a conversation without tools exactly as plain ChatML."""

from __future__ import annotations

import copy

import pytest
from transformers import AutoTokenizer

from pagedllm.entrypoints.chat_utils import apply_chat_template, template_messages
from pagedllm.model_paths import default_model_path

TOOL = {
    "type": "function",
    "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}},
}
CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris and Rome?"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
            {"id": "call_2", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}},
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "22 C"},
    {"role": "tool", "tool_call_id": "call_2", "content": "25 C"},
]
EXPECTED = (
    "<|im_start|>system\nBe brief.\n\n# Tools\n\nYou may call one or more functions to assist with the user query."
    "\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
    '{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": '
    '{"city": {"type": "string"}}}}}\n</tools>\n\nFor each function call, return a json object with function name '
    "and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
    "<|im_start|>user\nWeather in Paris and Rome?<|im_end|>\n"
    '<|im_start|>assistant\n\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    '\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call><|im_end|>\n'
    "<|im_start|>user\n<tool_response>\n22 C\n</tool_response>\n<tool_response>\n25 C\n</tool_response><|im_end|>\n"
    "<|im_start|>assistant\n"
)


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(default_model_path())


def test_tools_tool_calls_and_results_render_hermes_style(tokenizer):
    original = copy.deepcopy(CONVERSATION)
    assert apply_chat_template(tokenizer, CONVERSATION, None, True, False, None, [TOOL]) == EXPECTED
    assert CONVERSATION == original


def test_without_tools_it_is_plain_chatml(tokenizer):
    messages = CONVERSATION[:2]
    assert apply_chat_template(tokenizer, messages, None, True, False) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWeather in Paris and Rome?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_tool_call_arguments_are_decoded_for_templates():
    messages = template_messages(
        [{"role": "assistant", "tool_calls": [
            {"function": {"name": "f", "arguments": '{"a": [1]}'}},
            {"function": {"name": "g", "arguments": "not json"}},
        ]}]
    )  # fmt: skip
    assert [call["function"]["arguments"] for call in messages[0]["tool_calls"]] == [{"a": [1]}, "not json"]
