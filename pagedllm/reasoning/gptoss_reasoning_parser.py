"""``--reasoning-parser gpt_oss``: gpt-oss's harmony format, read from the text (its markers
are special tokens, so the request keeps them: ``keeps_special_tokens``).

An assistant turn is a run of messages, each ``[<|start|>assistant[ to=...]]<|channel|>NAME[
header]<|message|>BODY`` ended by ``<|end|>``, ``<|return|>`` or ``<|call|>``. The bodies of
the ``analysis`` channel are the reasoning, those of any other channel (``final``, and
``commentary``: preambles and tool calls) the content, in order. Text outside any message
is content, less role headers. Source: vLLM's ``GptOssReasoningParser`` (analysis ->
reasoning, final -> content) and OpenAI's harmony format description.
"""

from __future__ import annotations

from pagedllm.reasoning.abs_reasoning_parsers import (
    ParsedReasoning,
    ReasoningParser,
    ReasoningParserManager,
    partial_marker_length,
)

START = "<|start|>"
CHANNEL = "<|channel|>"
MESSAGE = "<|message|>"
ENDS = ("<|end|>", "<|return|>", "<|call|>")
MARKERS = (START, CHANNEL, MESSAGE, *ENDS)
REASONING_CHANNEL = "analysis"


@ReasoningParserManager.register_module("gpt_oss")
class GptOssReasoningParser(ReasoningParser):
    """Harmony channels -> reasoning / content (see the module docstring)."""

    keeps_special_tokens = True

    def parse(self, text: str, final: bool) -> ParsedReasoning:
        reasoning: list[str] = []
        content: list[str] = []
        pos = 0
        while pos < len(text):
            header = text.find(CHANNEL, pos)
            if header < 0:
                content.append(_outside(text[pos:], final))
                break
            content.append(_outside(text[pos:header], True))
            body_start = text.find(MESSAGE, header)
            if body_start < 0:  # the header is still being written
                break
            channel = _channel_name(text, header, body_start)
            body_start += len(MESSAGE)
            body_end, next_pos = _body_end(text, body_start)
            body = text[body_start:body_end]
            if next_pos < 0 and not final:
                body = body[: len(body) - partial_marker_length(body, MARKERS)]
            (reasoning if channel == REASONING_CHANNEL else content).append(body)
            if next_pos < 0:
                break
            pos = next_pos
        return ParsedReasoning(reasoning="".join(reasoning), content="".join(content))

    def is_reasoning_end(self, text: str) -> bool:
        """Whether the last complete channel header of ``text`` opens a channel other than
        ``analysis`` (``final`` or ``commentary``)."""
        body_start = text.rfind(MESSAGE)
        header = text.rfind(CHANNEL, 0, body_start) if body_start >= 0 else -1
        if header < 0:
            return False
        return _channel_name(text, header, body_start) != REASONING_CHANNEL


def _channel_name(text: str, header: int, body_start: int) -> str:
    """The channel a header names: ``text[header:body_start]`` is ``<|channel|>NAME[ ...]``."""
    return text[header + len(CHANNEL) : body_start].split(" ", 1)[0].split("<|", 1)[0].strip()


def _body_end(text: str, start: int) -> tuple[int, int]:
    """(end of the body that starts at ``start``, where the next message may start; -1 when
    the body is not ended yet)."""
    ends = [(found, marker) for marker in (*ENDS, START) if (found := text.find(marker, start)) >= 0]
    if not ends:
        return len(text), -1
    found, marker = min(ends)
    return found, found + (0 if marker == START else len(marker))


def _outside(segment: str, complete: bool) -> str:
    """The content of text outside messages: nothing of a role header (``<|start|>...``),
    and (``complete`` false) nothing that may become a marker."""
    header = segment.find(START)
    if header >= 0:
        return segment[:header]
    return segment if complete else segment[: len(segment) - partial_marker_length(segment, MARKERS)]
