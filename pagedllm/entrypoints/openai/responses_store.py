"""The responses ``POST /v1/responses`` keeps (``store``, true by default as OpenAI's): in
memory, per server process, the oldest dropped once ``max_entries`` are kept.

Each entry is the response object (JSON-ready dict, updated when a streamed one finishes)
and the conversation that led to it (input items, earlier turns included), which a later
request's ``previous_response_id`` puts in front of its own input.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Optional

#: Responses kept at most; the oldest goes first.
DEFAULT_MAX_ENTRIES = 1024


@dataclass
class StoredResponse:
    """A kept response: ``response`` (the response object as a dict) and ``input_items``
    (the conversation before its output, as input item dicts)."""

    response: dict[str, Any]
    input_items: list[dict[str, Any]]

    def conversation(self) -> list[dict[str, Any]]:
        """The input items and this response's output items: what follows it in a chain."""
        return self.input_items + list(self.response["output"])


class ResponsesStore:
    """Response id -> ``StoredResponse``, bounded (``max_entries``, at least 1)."""

    def __init__(self, max_entries: int = DEFAULT_MAX_ENTRIES) -> None:
        if max_entries < 1:
            raise ValueError(f"max_entries must be at least 1, got {max_entries}.")
        self.max_entries = max_entries
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()

    def put(self, entry: StoredResponse) -> None:
        """Keep ``entry`` under its response's id (replacing an older one of that id)."""
        response_id = entry.response["id"]
        self._entries.pop(response_id, None)
        self._entries[response_id] = entry
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)

    def get(self, response_id: str) -> Optional[StoredResponse]:
        return self._entries.get(response_id)

    def delete(self, response_id: str) -> bool:
        """Drop a response; False when none had that id."""
        return self._entries.pop(response_id, None) is not None

    def __len__(self) -> int:
        return len(self._entries)
