"""gpt-oss's harmony format read from token ids (as openai_harmony's ``StreamableParser``
reads it, on the model tokenizer's own special tokens instead of the harmony vocabulary):
only the special tokens ``<|start|>``, ``<|channel|>``, ``<|message|>``, ``<|end|>``,
``<|return|>`` and ``<|call|>`` are markers, so ``<|channel|>`` typed by the model as
ordinary tokens stays text.

``harmony_pieces`` cuts an output into ``Piece``s (markers, headers, channel bodies) whose texts
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


def harmony_pieces(token_ids: Sequence[int], tokenizer: Any, marker_ids: dict[int, str]) -> list[Piece]:
    """The pieces of an output (``Piece``): a body runs from ``<|message|>`` to an end marker
    or the next ``<|start|>`` / ``<|channel|>``; a run of ordinary tokens is decoded whole
    (``tokenizer.decode``, special tokens kept)."""
    pieces: list[Piece] = []
    state, channel, run = "outside", "", []  # state: outside | header | channel | body

    def close_run() -> None:
        nonlocal channel
        if state == "channel":
            channel = channel_name(tokenizer.decode(run, skip_special_tokens=False)) if run else ""
        if run:
            kind = {"outside": "content", "body": "reasoning" if channel == REASONING_CHANNEL else "content"}
            pieces.append(Piece(kind.get(state, "header"), tokenizer.decode(run, skip_special_tokens=False)))
            run.clear()

    for token_id in token_ids:
        marker = marker_ids.get(token_id)
        if marker is None:
            run.append(token_id)
            continue
        close_run()
        pieces.append(Piece("marker", marker))
        if marker == START:
            state, channel = "header", ""
        elif marker == CHANNEL:
            state = "channel"
        elif marker == MESSAGE:
            state = "body"
        else:
            state = "outside"
    close_run()
    return pieces


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
