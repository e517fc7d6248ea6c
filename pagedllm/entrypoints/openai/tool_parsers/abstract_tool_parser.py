"""The contract of a tool-call parser: model text -> content and tool calls.

A parser is a pure function of the text generated so far. ``parse(text, final=True)`` is
the non-streamed answer. ``parse(text, final=False)`` is the part of the answer that no
continuation of ``text`` can change: its content and every call's ``arguments`` are
prefixes of the final ones, and its calls are a prefix of the final calls. That is what
makes streaming exact: the server streams the growth of successive snapshots
(``tool_calls.ToolCallStream``), so the joined deltas equal the non-streamed answer.

To keep that promise a partial snapshot holds back what may still turn out otherwise:
a possible start of a call marker (``<tool_c``), trailing whitespace, and a call until its
name is complete. The final content keeps its trailing whitespace only when there are no
calls (a reply without calls is the model's text unchanged). Malformed call text
is kept as content (vLLM's parsers do the same); a call cut off by the end of the output
(``max_tokens``) stays a call with the arguments generated so far, as OpenAI returns it
with ``finish_reason "length"``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field


@dataclass
class ParsedToolCall:
    """One call: the function's name and its arguments as JSON text (possibly cut off)."""

    name: str
    arguments: str


@dataclass
class ParsedOutput:
    """What a parser found: ``content`` (the text outside calls, in order) and the calls."""

    content: str
    tool_calls: list[ParsedToolCall] = field(default_factory=list)


class ToolParser(ABC):
    """A tool-call format (vLLM's ``ToolParser``, one subclass per ``--tool-call-parser``).

    ``keeps_special_tokens``: the format's markers may be special tokens, so requests using
    it are decoded with ``skip_special_tokens=False`` (vLLM's parsers' ``adjust_request``).
    """

    keeps_special_tokens: bool = False

    def parse(self, text: str, final: bool) -> ParsedOutput:
        """The content and calls of ``text`` (see the module docstring for ``final``)."""
        parsed = self.parse_text(text, final)
        if parsed.tool_calls or not final:
            parsed.content = parsed.content.rstrip()
        return parsed

    @abstractmethod
    def parse_text(self, text: str, final: bool) -> ParsedOutput:
        """``parse`` before the whitespace rule: content is the text outside calls, less
        (when not ``final``) a possible start of a call marker at its end."""


def held_back(text: str, marker: str) -> int:
    """How many characters at the end of ``text`` may be the start of ``marker`` (0 when
    none): a partial snapshot must not send them as content yet."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:size]):
            return size
    return 0

