"""Scanning JSON tool calls that may still be growing: ``{"name": ..., "arguments": ...}``
objects, alone or in an array.

The scanner finds where values start and end without decoding them, so the arguments of a
call are the exact text the model wrote (a streamed prefix of it is a prefix of the final
one). A finished object is checked with ``json.loads``; a structure that cannot be JSON, or
a finished call without a string ``name``, raises ``MalformedCall``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Optional

from pagedllm.entrypoints.openai.tool_parsers.abstract_tool_parser import ParsedToolCall

WHITESPACE = " \t\r\n"
#: Keys of a call's arguments: "arguments" (OpenAI, Hermes, Mistral) or "parameters"
#: (Llama 3, and vLLM's schema for ``tool_choice="required"``).
ARGUMENT_KEYS = ("arguments", "parameters")
_SCALAR_CHARS = frozenset("0123456789+-.eEtrufalsn")


class MalformedCall(ValueError):
    """Text that cannot be a tool call."""


def skip_whitespace(text: str, pos: int) -> int:
    while pos < len(text) and text[pos] in WHITESPACE:
        pos += 1
    return pos


def string_end(text: str, pos: int) -> Optional[int]:
    """End (exclusive) of the JSON string starting at ``text[pos] == '"'``; None when the
    text ends inside it."""
    i = pos + 1
    while i < len(text):
        if text[i] == "\\":
            i += 2
        elif text[i] == '"':
            return i + 1
        else:
            i += 1
    return None


def value_end(text: str, pos: int) -> Optional[int]:
    """End (exclusive) of the JSON value starting at ``pos``; None when the text ends
    first (a number at the very end may still grow, so it counts as unfinished).

    Raises:
        MalformedCall: ``text[pos]`` cannot start a JSON value.
    """
    if pos >= len(text):
        return None
    first = text[pos]
    if first == '"':
        return string_end(text, pos)
    if first in "{[":
        depth, i = 0, pos
        while i < len(text):
            char = text[i]
            if char == '"':
                end = string_end(text, i)
                if end is None:
                    return None
                i = end
                continue
            if char in "{[":
                depth += 1
            elif char in "}]":
                depth -= 1
                if depth == 0:
                    return i + 1
            i += 1
        return None
    if first in _SCALAR_CHARS:
        i = pos
        while i < len(text) and text[i] in _SCALAR_CHARS:
            i += 1
        return i if i < len(text) else None
    raise MalformedCall(f"unexpected {first!r} at {pos}")


@dataclass
class CallScan:
    """What is known of one call object: its ``name`` once complete, the span of its
    arguments (end None while unfinished) and ``end`` (after ``}``; None while unfinished)."""

    start: int
    name: Optional[str] = None
    arguments_start: Optional[int] = None
    arguments_end: Optional[int] = None
    end: Optional[int] = None

    def to_call(self, text: str, final: bool) -> Optional[ParsedToolCall]:
        """The call as known so far (None while its name is not): arguments are the exact
        text of the value, "{}" for a finished call without any, "" before they start."""
        if self.name is None:
            return None
        if self.arguments_start is None:
            return ParsedToolCall(self.name, "{}" if self.end is not None else "")
        if self.arguments_end is not None:
            return ParsedToolCall(self.name, text[self.arguments_start : self.arguments_end])
        partial = text[self.arguments_start :]
        return ParsedToolCall(self.name, partial if final else partial.rstrip())


def _expect(text: str, pos: int, allowed: str) -> None:
    if text[pos] not in allowed:
        raise MalformedCall(f"expected one of {allowed!r} at {pos}, found {text[pos]!r}")


def scan_call_object(text: str, pos: int) -> CallScan:
    """Scan the call object starting at ``pos`` (``text[pos]`` is its ``{`` or the text
    ends there).

    Raises:
        MalformedCall: not an object, not JSON, or a finished object without a string
            ``name``.
    """
    scan = CallScan(start=pos)
    if pos >= len(text):
        return scan
    _expect(text, pos, "{")
    i = pos + 1
    while True:
        i = skip_whitespace(text, i)
        if i >= len(text):
            return scan
        if text[i] == "}":
            return _finish(text, scan, i + 1)
        _expect(text, i, '"')
        key_end = string_end(text, i)
        if key_end is None:
            return scan
        key = json.loads(text[i:key_end])
        i = skip_whitespace(text, key_end)
        if i >= len(text):
            return scan
        _expect(text, i, ":")
        i = skip_whitespace(text, i + 1)
        end = value_end(text, i)
        if key in ARGUMENT_KEYS and scan.arguments_start is None:
            scan.arguments_start, scan.arguments_end = i, end
        if end is None:
            return scan
        if key == "name":
            name = json.loads(text[i:end])
            if not isinstance(name, str):
                raise MalformedCall("the call's name is not a string")
            scan.name = name
        i = skip_whitespace(text, end)
        if i >= len(text):
            return scan
        _expect(text, i, ",}")
        if text[i] == "}":
            return _finish(text, scan, i + 1)
        i += 1


def _finish(text: str, scan: CallScan, end: int) -> CallScan:
    try:
        call = json.loads(text[scan.start : end])
    except ValueError:
        raise MalformedCall("the call is not valid JSON") from None
    if scan.name is None or not isinstance(call, dict):
        raise MalformedCall("the call has no name")
    scan.end = end
    return scan


def scan_call_array(text: str, pos: int) -> tuple[list[CallScan], Optional[int]]:
    """Scan a JSON array of call objects starting at ``pos`` (``text[pos] == '['``).

    Returns the calls seen so far and the array's end (after ``]``; None while unfinished).

    Raises:
        MalformedCall: see ``scan_call_object``; also an element that is not an object.
    """
    _expect(text, pos, "[")
    scans: list[CallScan] = []
    i = skip_whitespace(text, pos + 1)
    if i < len(text) and text[i] == "]":
        return scans, i + 1
    while True:
        i = skip_whitespace(text, i)
        scan = scan_call_object(text, i)
        if i < len(text):
            scans.append(scan)
        if scan.end is None:
            return scans, None
        i = skip_whitespace(text, scan.end)
        if i >= len(text):
            return scans, None
        _expect(text, i, ",]")
        if text[i] == "]":
            return scans, i + 1
        i += 1


def calls_of(scans: list[CallScan], text: str, final: bool) -> list[ParsedToolCall]:
    """The calls of ``scans`` whose names are known, in order (a call without a name yet
    can only be the last one)."""
    calls = [scan.to_call(text, final) for scan in scans]
    return [call for call in calls if call is not None]
