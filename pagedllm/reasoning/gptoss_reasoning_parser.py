"""``--reasoning-parser gpt_oss``: gpt-oss's harmony format, read from the text (its markers
are special tokens, so the request keeps them: ``keeps_special_tokens``).

An assistant turn is a run of messages, each ``[<|start|>assistant[ to=...]]<|channel|>NAME[
header]<|message|>BODY`` ended by ``<|end|>``, ``<|return|>`` or ``<|call|>``. The bodies of
the ``analysis`` channel are the reasoning, those of any other channel (``final``, and
``commentary``: preambles and tool calls) the content, in order. Text outside any message
is content, less role headers. Source: vLLM's ``GptOssReasoningParser`` (analysis ->
reasoning, final -> content) and OpenAI's harmony format description.

Given the output's token ids and a tokenizer with the harmony special tokens (gpt-oss's own),
the markers are read from the ids (``harmony_tokens``), as vLLM reads gpt-oss output with
openai_harmony: a ``<|channel|>`` the model typed as ordinary tokens is text of its message.
Without those tokens in the tokenizer, or when the text is not the ids' decoding, the text is
read.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

from pagedllm.reasoning.abs_reasoning_parsers import (
    REASONING_END_WINDOW_TOKENS,
    ParsedReasoning,
    ReasoningParser,
    ReasoningParserManager,
    TokenReader,
    partial_marker_length,
)
from pagedllm.reasoning.harmony_tokens import (
    CHANNEL,
    ENDS,
    MARKERS,
    MESSAGE,
    REASONING_CHANNEL,
    START,
    HarmonyReader,
    harmony_marker_ids,
    reasoning_end_index,
)


@ReasoningParserManager.register_module("gpt_oss")
class GptOssReasoningParser(ReasoningParser):
    """Harmony channels -> reasoning / content (see the module docstring)."""

    keeps_special_tokens = True
    #: (tokenizer, its ``harmony_marker_ids``) of the last lookup.
    _markers: Optional[tuple[Any, Optional[dict[int, str]]]] = None

    def _marker_ids(self, tokenizer: Any) -> Optional[dict[int, str]]:
        """``harmony_marker_ids`` of ``tokenizer``, looked up once per tokenizer."""
        if self._markers is None or self._markers[0] is not tokenizer:
            self._markers = (tokenizer, harmony_marker_ids(tokenizer))
        return self._markers[1]

    def token_reader(self, tokenizer: Any) -> Optional["_HarmonyTokenReader"]:
        """A reader of the channels from the token ids with ``tokenizer``'s harmony special
        tokens; None (read the text) without them."""
        marker_ids = self._marker_ids(tokenizer)
        return _HarmonyTokenReader(self, HarmonyReader(tokenizer, marker_ids)) if marker_ids else None

    def ends_reasoning(self, token_ids: Sequence[int], tokenizer: Any) -> bool:
        """Whether the last complete channel header of the window's tokens opens a channel
        other than ``analysis``, read from the ids with the harmony tokens (else the text's
        ``is_reasoning_end``)."""
        marker_ids = self._marker_ids(tokenizer)
        if not marker_ids:
            return super().ends_reasoning(token_ids, tokenizer)
        tail = list(token_ids[-REASONING_END_WINDOW_TOKENS:])
        messages = [i for i, token_id in enumerate(tail) if marker_ids.get(token_id) == MESSAGE]
        channels = [i for i, token_id in enumerate(tail) if marker_ids.get(token_id) == CHANNEL]
        if not messages or not channels or channels[0] > messages[-1]:
            return False
        last_header = max(i for i in channels if i < messages[-1])
        return reasoning_end_index(tail[last_header:], marker_ids, tokenizer) is not None

    def count_reasoning_tokens(self, token_ids: Sequence[int], tokenizer: Any) -> int:
        """The tokens up to (with) the ``<|message|>`` of the first channel other than
        ``analysis``, read from the ids with the harmony tokens (else the text's count); all
        of them when there is none."""
        marker_ids = self._marker_ids(tokenizer)
        if not marker_ids:
            return super().count_reasoning_tokens(token_ids, tokenizer)
        end = reasoning_end_index(token_ids, marker_ids, tokenizer)
        return len(token_ids) if end is None else end

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


class _HarmonyTokenReader(TokenReader):
    """``HarmonyReader``'s channels, or the parser's text reading when the text is not the
    ids' decoding."""

    def __init__(self, parser: GptOssReasoningParser, reader: HarmonyReader) -> None:
        self.parser = parser
        self.reader = reader

    def feed(self, token_ids: Sequence[int]) -> None:
        self.reader.feed(token_ids)

    def parse(self, text: str, final: bool) -> ParsedReasoning:
        found = self.reader.parse(text)
        if found is None:
            return self.parser.parse(text, final)
        return ParsedReasoning(reasoning=found[0], content=found[1])


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
