"""``--tool-call-parser llama3_json``: the reply is one or more JSON call objects
``{"name": ..., "parameters": {...}}`` separated by ``;``, optionally after
``<|python_tag|>`` (Llama 3.1 / 3.2 JSON tool calling). Source: vLLM's
``Llama3JsonToolParser``; Meta's Llama 3.1 prompt format."""

from __future__ import annotations

from pagedllm.entrypoints.openai.tool_parsers.abstract_tool_parser import (
    ParsedOutput,
    ParsedToolCall,
    ToolParser,
)
from pagedllm.entrypoints.openai.tool_parsers.json_calls import scan_call_object, skip_whitespace
from pagedllm.entrypoints.openai.tool_parsers.registry import ToolParserManager

PYTHON_TAG = "<|python_tag|>"


@ToolParserManager.register_module("llama3_json")
class Llama3JsonToolParser(ToolParser):
    """Calls only when the reply starts (after whitespace) with ``{`` or ``<|python_tag|>``;
    otherwise it is all content. Text after the last call is content; a reply whose calls
    are not JSON call objects is all content."""

    keeps_special_tokens = True

    def parse_text(self, text: str, final: bool) -> ParsedOutput:
        i = skip_whitespace(text, 0)
        rest = text[i:]
        if not final and (not rest or PYTHON_TAG.startswith(rest)):
            return ParsedOutput("")
        if rest.startswith(PYTHON_TAG):
            i = skip_whitespace(text, i + len(PYTHON_TAG))
        elif not rest.startswith("{"):
            return ParsedOutput(text)
        calls: list[ParsedToolCall] = []
        try:
            while True:
                scan = scan_call_object(text, i)
                call = scan.to_call(text, final)
                if call is not None:
                    calls.append(call)
                if scan.end is None:
                    return ParsedOutput(text[i:] if final and call is None else "", calls)
                i = skip_whitespace(text, scan.end)
                if not text.startswith(";", i):
                    return ParsedOutput(text[i:], calls)
                i = skip_whitespace(text, i + 1)
        except ValueError:
            return ParsedOutput(text)
