"""``--tool-call-parser pythonic``: calls as a Python list of function calls with keyword
arguments, ``[get_weather(city="Paris"), get_time()]`` (Llama 3.2 / Llama 4 pythonic tool
calling). Source: vLLM's ``PythonicToolParser``.

Arguments are Python literals, sent as JSON (``json.dumps`` of the keyword arguments), so
a call is streamed in one piece once its closing parenthesis is generated.
"""

from __future__ import annotations

import ast
import json
import re
from typing import Optional

from pagedllm.entrypoints.openai.tool_parsers.abstract_tool_parser import (
    ParsedOutput,
    ParsedToolCall,
    ToolParser,
)
from pagedllm.entrypoints.openai.tool_parsers.json_calls import MalformedCall, skip_whitespace
from pagedllm.entrypoints.openai.tool_parsers.registry import ToolParserManager

#: A call list starts with ``[`` then a (dotted) function name and ``(``.
LIST_START = re.compile(r"\[\s*[A-Za-z_][\w.]*\s*\(")
#: What may still grow into ``LIST_START`` at the end of the text.
PARTIAL_LIST_START = re.compile(r"\[\s*(?:[A-Za-z_][\w.]*\s*)?$")
CALL_HEAD = re.compile(r"([A-Za-z_][\w.]*)\s*\(")
#: The end of a text cut off before the ``(`` of a call (or before its name).
PARTIAL_HEAD = re.compile(r"(?:[A-Za-z_][\w.]*\s*)?")
_CLOSING = {"(": ")", "[": "]", "{": "}"}


def _closing_paren(text: str, pos: int) -> Optional[int]:
    """Index of the ``)`` closing the ``(`` at ``pos`` (Python strings and brackets
    skipped); None when the text ends first."""
    stack = [")"]
    i = pos + 1
    while i < len(text):
        char = text[i]
        if char in "'\"":
            quote = char * 3 if text.startswith(char * 3, i) else char
            i += len(quote)
            while i < len(text) and not text.startswith(quote, i):
                i += 2 if text[i] == "\\" else 1
            if i >= len(text):
                return None
            i += len(quote)
            continue
        if char in _CLOSING:
            stack.append(_CLOSING[char])
        elif char in ")]}":
            if char != stack.pop():
                raise MalformedCall(f"unbalanced {char!r} at {i}")
            if not stack:
                return i
        i += 1
    return None


def _arguments_json(call_text: str) -> str:
    """The keyword arguments of ``name(k=v, ...)`` as a JSON object text.

    Raises:
        MalformedCall: positional arguments, or values that are not Python literals.
    """
    try:
        node = ast.parse(call_text, mode="eval").body
        if not isinstance(node, ast.Call) or node.args or any(kw.arg is None for kw in node.keywords):
            raise MalformedCall("a call takes keyword arguments only")
        arguments = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords}
    except (SyntaxError, ValueError) as exc:
        raise MalformedCall(str(exc)) from None
    return json.dumps(arguments, ensure_ascii=False)


@ToolParserManager.register_module("pythonic")
class PythonicToolParser(ToolParser):
    """Text before the list and after its ``]`` is content; a list whose calls are not
    name(keyword=literal, ...) is all content."""

    def parse_text(self, text: str, final: bool) -> ParsedOutput:
        match = LIST_START.search(text)
        if match is None:
            partial = None if final else PARTIAL_LIST_START.search(text)
            return ParsedOutput(text[: partial.start()] if partial else text)
        before = text[: match.start()]
        calls: list[ParsedToolCall] = []
        i = match.start() + 1
        try:
            while True:
                i = skip_whitespace(text, i)
                head = CALL_HEAD.match(text, i)
                if head is None:
                    if not PARTIAL_HEAD.fullmatch(text, i):
                        raise MalformedCall(f"expected a call at {i}")
                    return ParsedOutput(before, calls)
                close = _closing_paren(text, head.end() - 1)
                if close is None:  # cut off: a call (no arguments) only in the final answer
                    if final:
                        calls.append(ParsedToolCall(head.group(1), ""))
                    return ParsedOutput(before, calls)
                calls.append(ParsedToolCall(head.group(1), _arguments_json(text[i : close + 1])))
                i = skip_whitespace(text, close + 1)
                if i < len(text) and text[i] == "]":
                    return ParsedOutput(before + text[i + 1 :], calls)
                if i < len(text) and text[i] != ",":
                    raise MalformedCall(f"expected ',' or ']' at {i}")
                i += 1
        except MalformedCall:
            return ParsedOutput(text)
