"""The contract of a reasoning parser (vLLM's ``ReasoningParser``): model text -> the
reasoning (the model's thinking) and the content (its answer), and the registry of parsers
by ``--reasoning-parser`` name (``ReasoningParserManager``).

A parser is a pure function of the text generated so far, as the tool-call parsers are; a
format whose markers are special tokens may read the token ids too (``parse_output``: the
ids say which marker-looking text is a marker, so text the model merely typed is not one).
``parse(text, final=True)`` is the non-streamed answer. ``parse(text, final=False)`` is
what no continuation of ``text`` can change: its reasoning and its content are prefixes of
the final ones. A partial snapshot therefore holds back a possible start of a tag at its
end (``</thi`` may become ``</think>``). ``ReasoningStream`` streams the growth of
successive snapshots, so the joined deltas equal the non-streamed answer, however the text
is cut into deltas (a tag split across tokens included).

Plain Python (no torch): the engine side may use it as well.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence

from pagedllm.name_registry import NameRegistry


#: Tokens read from the end of a prompt or an output to see whether it has left the reasoning
#: (an end marker is a few tokens). The engine (structured outputs) and the front end read the
#: same window, so they agree on where a reasoning ends.
REASONING_END_WINDOW_TOKENS = 16


@dataclass(frozen=True)
class ParsedReasoning:
    """What a parser found: ``reasoning`` and ``content``, each "" when there is none."""

    reasoning: str = ""
    content: str = ""


class ReasoningParser(ABC):
    """A reasoning format, one subclass per ``--reasoning-parser`` name; one instance per
    request (it may read the request's ``chat_template_kwargs``).

    ``keeps_special_tokens``: the format's markers are special tokens, so requests using it
    are decoded with ``skip_special_tokens=False`` (vLLM's ``adjust_request``).
    """

    keeps_special_tokens: bool = False

    def __init__(self, chat_template_kwargs: Optional[Mapping[str, Any]] = None) -> None:
        self.chat_template_kwargs = dict(chat_template_kwargs or {})

    @abstractmethod
    def parse(self, text: str, final: bool) -> ParsedReasoning:
        """The reasoning and content of ``text`` (see the module docstring for ``final``)."""

    @abstractmethod
    def is_reasoning_end(self, text: str) -> bool:
        """Whether ``text`` (the end of a prompt, or of the output so far) has left the
        reasoning section, so that what comes next is content (vLLM's ``is_reasoning_end``,
        on text rather than token ids). The engine starts a structured-output grammar there
        (``StructuredOutputManager.should_advance``)."""

    def ends_reasoning(self, token_ids: Sequence[int], tokenizer: Any) -> bool:
        """``is_reasoning_end`` of the text of the last ``REASONING_END_WINDOW_TOKENS`` of
        ``token_ids`` (``tokenizer``'s ``decode``, special tokens kept)."""
        tail = list(token_ids[-REASONING_END_WINDOW_TOKENS:])
        return self.is_reasoning_end(tokenizer.decode(tail, skip_special_tokens=False))

    def count_reasoning_tokens(self, token_ids: Sequence[int], tokenizer: Any) -> int:
        """How many of an output's ``token_ids`` are its reasoning (usage's
        ``reasoning_tokens``, as vLLM's ``count_reasoning_tokens``): the length of the shortest
        prefix whose text (``tokenizer``'s ``decode``, special tokens kept) has left the
        reasoning (``is_reasoning_end``; its end marker counted with it), found by bisection;
        all of them when the output never leaves it."""
        decode = lambda k: tokenizer.decode(list(token_ids[:k]), skip_special_tokens=False)  # noqa: E731
        if self.is_reasoning_end(""):
            return 0
        if not token_ids or not self.is_reasoning_end(decode(len(token_ids))):
            return len(token_ids)
        low, high = 0, len(token_ids)  # is_reasoning_end: false at low tokens, true at high
        while high - low > 1:
            middle = (low + high) // 2
            if self.is_reasoning_end(decode(middle)):
                high = middle
            else:
                low = middle
        return high

    def token_reader(self, tokenizer: Any) -> Optional["TokenReader"]:
        """A reader of one output that parses it with its token ids too (``TokenReader``), for a
        format whose markers are ``tokenizer``'s special tokens; None (the default): the text
        alone is read (``parse``)."""
        return None

    def parse_output(self, text: str, token_ids: Sequence[int], tokenizer: Any, final: bool) -> ParsedReasoning:
        """``parse`` of an output given its ``token_ids`` too (``text`` their decoding, special
        tokens kept, perhaps cut short by a stop string or a held-back partial character),
        through ``token_reader`` when the format has one; the same contract on ``final``."""
        reader = self.token_reader(tokenizer)
        if reader is None:
            return self.parse(text, final)
        reader.feed(token_ids)
        return reader.parse(text, final)

    def extract_reasoning(self, text: str, token_ids: Optional[Sequence[int]] = None,
                          tokenizer: Any = None) -> tuple[Optional[str], Optional[str]]:
        """vLLM's non-streamed form: (reasoning, content), each None when empty; with
        ``token_ids`` and ``tokenizer``, ``parse_output``'s."""
        if token_ids is not None and tokenizer is not None:
            parsed = self.parse_output(text, token_ids, tokenizer, final=True)
        else:
            parsed = self.parse(text, final=True)
        return parsed.reasoning or None, parsed.content or None


class TokenReader(ABC):
    """One output's reasoning read with its token ids (``ReasoningParser.token_reader``): ``feed``
    the ids as they come, ``parse`` the text so far (their decoding) under ``parse``'s contract."""

    @abstractmethod
    def feed(self, token_ids: Sequence[int]) -> None:
        """Read the next ``token_ids`` of the output."""

    @abstractmethod
    def parse(self, text: str, final: bool) -> ParsedReasoning:
        """The reasoning and content of ``text``, the decoding of the ids fed so far."""


def partial_marker_length(text: str, markers: Sequence[str]) -> int:
    """The length of the longest end of ``text`` that is a proper start of one of
    ``markers`` (0 when none): what a partial snapshot must hold back."""
    longest = 0
    for marker in markers:
        for size in range(min(len(marker) - 1, len(text)), longest, -1):
            if text.endswith(marker[:size]):
                longest = size
                break
    return longest


class ReasoningStream:
    """The streamed deltas of one choice read by a reasoning parser: each ``feed`` parses
    the text so far (with ``tokenizer``, and its token ids: the parser's ``token_reader``) and
    returns what grew since the last one, (reasoning delta, content delta), each "" when
    nothing grew."""

    def __init__(self, parser: ReasoningParser, tokenizer: Any = None) -> None:
        self.parser = parser
        self.reader = parser.token_reader(tokenizer) if tokenizer is not None else None
        self.text = ""
        self.sent = ParsedReasoning()

    def feed(self, delta_text: str, final: bool, delta_token_ids: Sequence[int] = ()) -> tuple[str, str]:
        """The deltas for ``delta_text`` (and its ``delta_token_ids``), the next piece of the
        output (``final``: the last)."""
        self.text += delta_text
        if self.reader is not None:
            self.reader.feed(delta_token_ids)
            parsed = self.reader.parse(self.text, final)
        else:
            parsed = self.parser.parse(self.text, final)
        reasoning = _growth(self.sent.reasoning, parsed.reasoning)
        content = _growth(self.sent.content, parsed.content)
        self.sent = ParsedReasoning(self.sent.reasoning + reasoning, self.sent.content + content)
        return reasoning, content


def _growth(sent: str, now: str) -> str:
    # NOTE: snapshots only grow (the parsers' contract); a snapshot that does not extend
    # what was sent sends nothing rather than a wrong piece.
    return now[len(sent) :] if now.startswith(sent) else ""


class ReasoningParserManager(NameRegistry):
    """Name -> parser class (vLLM's registry). Parsers register with ``register_module(name)``;
    ``get_reasoning_parser(name)`` (vLLM's name for ``lookup``) raises ``KeyError`` listing the
    known ones."""

    what = "reasoning parser"
    get_reasoning_parser = NameRegistry.__dict__["lookup"]  # the classmethod itself, bound to this class
