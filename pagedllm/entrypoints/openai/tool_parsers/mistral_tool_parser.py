"""``--tool-call-parser mistral``: ``[TOOL_CALLS]`` then a JSON array of call objects
(Mistral 7B v0.3, Mistral Nemo and their chat templates). Source: vLLM's
``MistralToolParser``; Mistral's function-calling docs."""

from __future__ import annotations

from pagedllm.entrypoints.openai.tool_parsers.abstract_tool_parser import (
    ParsedOutput,
    ToolParser,
    held_back,
)
from pagedllm.entrypoints.openai.tool_parsers.json_calls import calls_of, scan_call_array, skip_whitespace
from pagedllm.entrypoints.openai.tool_parsers.registry import ToolParserManager

BOT = "[TOOL_CALLS]"


def parse_call_array(text: str, start: int, before: str, final: bool) -> ParsedOutput:
    """Content ``before``, then the array of calls at ``start`` (after whitespace), then
    content. An array that is not one of call objects leaves all the text as content."""
    i = skip_whitespace(text, start)
    if i >= len(text):
        return ParsedOutput(before + (text[len(before) :] if final else ""))
    try:
        scans, end = scan_call_array(text, i)
    except ValueError:
        return ParsedOutput(text)
    after = text[end:] if end is not None else ""
    return ParsedOutput(before + after, calls_of(scans, text, final))


@ToolParserManager.register_module("mistral")
class MistralToolParser(ToolParser):
    """Text before ``[TOOL_CALLS]`` and after the array is content."""

    keeps_special_tokens = True

    def parse_text(self, text: str, final: bool) -> ParsedOutput:
        start = text.find(BOT)
        if start < 0:
            return ParsedOutput(text if final else text[: len(text) - held_back(text, BOT)])
        return parse_call_array(text, start + len(BOT), text[:start], final)
