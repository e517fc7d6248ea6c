"""gpt-oss's harmony format read from token ids (as openai_harmony's ``StreamableParser``
reads it, on the model tokenizer's own special tokens instead of the harmony vocabulary):
only the special tokens ``<|start|>``, ``<|channel|>``, ``<|message|>``, ``<|end|>``,
``<|return|>`` and ``<|call|>`` are markers, so ``<|channel|>`` typed by the model as
ordinary tokens stays text.

``HarmonyReader`` cuts an output into ``Piece``s (markers, headers, channel bodies) whose texts
join into the output's decoding; ``reasoning_end_index`` finds where the reasoning ends.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

START = "<|start|>"
CHANNEL = "<|channel|>"
MESSAGE = "<|message|>"
ENDS = ("<|end|>", "<|return|>", "<|call|>")
MARKERS = (START, CHANNEL, MESSAGE, *ENDS)
REASONING_CHANNEL = "analysis"


@dataclass(frozen=True)
class Piece:
    """A run of an output: ``kind`` "marker" (one special token), "header" (a role or channel
    header: ``assistant to=...``, ``analysis``), "reasoning" (an ``analysis`` body) or "content"
    (another channel's body, or text outside messages); ``text`` its decoding."""

    kind: str
    text: str


def harmony_marker_ids(tokenizer: Any) -> Optional[dict[int, str]]:
    """``{token id: marker}`` of the harmony markers that are single tokens of ``tokenizer``
    (decoding to the marker itself); None unless ``<|channel|>`` and ``<|message|>`` both are
    (a tokenizer without the harmony tokens: read the text instead)."""
    found: dict[int, str] = {}
    for marker in MARKERS:
        token_id = tokenizer.convert_tokens_to_ids(marker)
        if isinstance(token_id, int) and token_id != tokenizer.unk_token_id and (
                tokenizer.decode([token_id], skip_special_tokens=False) == marker):
            found[token_id] = marker
    return found if {CHANNEL, MESSAGE} <= set(found.values()) else None


def channel_name(header_text: str) -> str:
    """The channel a channel header names (``commentary to=functions.f json`` -> ``commentary``)."""
    return header_text.strip().split(" ", 1)[0]


class HarmonyReader:
    """One output read token by token (``feed``), its text parsed against the ids (``parse``):
    a body runs from ``<|message|>`` to an end marker or the next ``<|start|>`` /
    ``<|channel|>``; each closed run of ordinary tokens is decoded once (``tokenizer.decode``,
    special tokens kept), and the open one is the rest of the text, so a stream costs O(length).

    Args:
        tokenizer: the output's tokenizer.
        marker_ids: ``harmony_marker_ids(tokenizer)``.
    """

    def __init__(self, tokenizer: Any, marker_ids: dict[int, str]) -> None:
        self.tokenizer = tokenizer
        self.marker_ids = marker_ids
        self.pieces: list[Piece] = []  # closed: markers and the runs they closed
        self.closed_text = ""
        self.closed = {"reasoning": "", "content": ""}
        self.state, self.channel = "outside", ""  # state: outside | header | channel | body
        self.run: list[int] = []  # the open run's ordinary tokens

    def _open_kind(self) -> str:
        if self.state == "outside":
            return "content"
        if self.state == "body":
            return "reasoning" if self.channel == REASONING_CHANNEL else "content"
        return "header"

    def _close(self, piece: Piece) -> None:
        self.pieces.append(piece)
        self.closed_text += piece.text
        if piece.kind in self.closed:
            self.closed[piece.kind] += piece.text

    def feed(self, token_ids: Sequence[int]) -> None:
        """Read the next ``token_ids`` of the output."""
        for token_id in token_ids:
            marker = self.marker_ids.get(token_id)
            if marker is None:
                self.run.append(token_id)
                continue
            text = self.tokenizer.decode(self.run, skip_special_tokens=False) if self.run else ""
            if self.state == "channel":
                self.channel = channel_name(text)
            if text:
                self._close(Piece(self._open_kind(), text))
            self.run = []
            self._close(Piece("marker", marker))
            if marker == START:
                self.state, self.channel = "header", ""
            elif marker == CHANNEL:
                self.state = "channel"
            elif marker == MESSAGE:
                self.state = "body"
            else:
                self.state = "outside"

    def parse(self, text: str) -> Optional[tuple[str, str]]:
        """(reasoning, content) of ``text``, the decoding of the tokens fed so far (perhaps cut
        short by a stop string, or without a partial character at its end): the closed pieces,
        then the rest of ``text`` as the open run's; None when ``text`` is not that decoding."""
        if text.startswith(self.closed_text):
            rest = text[len(self.closed_text):]
            kind = self._open_kind()
            return (self.closed["reasoning"] + (rest if kind == "reasoning" else ""),
                    self.closed["content"] + (rest if kind == "content" else ""))
        if not self.closed_text.startswith(text):
            return None
        found = {"reasoning": "", "content": ""}
        left = len(text)
        for piece in self.pieces:
            part = piece.text[:left]
            left -= len(part)
            if piece.kind in found:
                found[piece.kind] += part
        return found["reasoning"], found["content"]


def reasoning_end_index(token_ids: Sequence[int], marker_ids: dict[int, str], tokenizer: Any) -> Optional[int]:
    """The length of the shortest prefix of ``token_ids`` whose last complete channel header
    (``<|channel|>NAME ...<|message|>``) opens a channel other than ``analysis``; None when
    there is none."""
    header_start = None
    for index, token_id in enumerate(token_ids):
        marker = marker_ids.get(token_id)
        if marker == CHANNEL:
            header_start = index + 1
        elif marker == MESSAGE and header_start is not None:
            name = channel_name(tokenizer.decode(list(token_ids[header_start:index]), skip_special_tokens=False))
            if name != REASONING_CHANNEL:
                return index + 1
            header_start = None
        elif marker is not None:
            header_start = None
    return None
