"""The parsers of ``tool_choice="required"`` and a named ``tool_choice``, whose output the
engine constrains to JSON (``tool_calls.tool_choice_json_schema``); not selectable with
``--tool-call-parser``.

- required: a JSON array of ``{"name": ..., "parameters": {...}}`` objects (vLLM's schema).
- named: the output is the one function's arguments object.
"""

from __future__ import annotations

from pagedllm.entrypoints.openai.tool_parsers.abstract_tool_parser import ParsedOutput, ParsedToolCall, ToolParser
from pagedllm.entrypoints.openai.tool_parsers.mistral_tool_parser import parse_call_array


class RequiredToolParser(ToolParser):
    """The whole output is an array of calls; output that is not (only possible without
    the constraint) is content."""

    def parse_text(self, text: str, final: bool) -> ParsedOutput:
        if not text.lstrip() and not final:
            return ParsedOutput("")
        return parse_call_array(text, 0, "", final)


class NamedToolParser(ToolParser):
    """The whole output is the arguments of the function ``name``."""

    def __init__(self, name: str) -> None:
        self.name = name

    def parse_text(self, text: str, final: bool) -> ParsedOutput:
        if not text and not final:
            return ParsedOutput("")
        return ParsedOutput("", [ParsedToolCall(self.name, text if final else text.rstrip())])
