"""Reading a server-sent event stream on the client side (``pagedllm chat``, ``bench serve``).

The event-stream rules (WHATWG HTML, "Server-sent events"), as OpenAI-style streams use them:
an event is the ``data:`` lines up to a blank line, joined with newlines (one space after the
colon dropped); comment lines (``:``) and the other fields (``event:``, ``id:``, ``retry:``)
carry no data. Lines come without their line break, as httpx's ``iter_lines`` gives them.
"""

from __future__ import annotations

from typing import AsyncIterable, AsyncIterator, Iterable, Iterator, Optional

#: The data of the event that ends an OpenAI stream.
DONE = "[DONE]"


class SSEDecoder:
    """Turns a stream's lines into its events' data, one ``feed`` per line."""

    def __init__(self) -> None:
        self._data: list[str] = []

    def feed(self, line: str) -> Optional[str]:
        """The data of the event that ``line`` ends (a blank line after ``data:`` lines),
        else None."""
        if not line:
            return self.flush()
        if line.startswith("data:"):
            value = line[len("data:"):]
            self._data.append(value[1:] if value.startswith(" ") else value)
        return None

    def flush(self) -> Optional[str]:
        """The data of an event the stream ended without a blank line after (None: none)."""
        if not self._data:
            return None
        data, self._data = "\n".join(self._data), []
        return data


def sse_events(lines: Iterable[str]) -> Iterator[str]:
    """Each event's data in a stream of ``lines`` (the last one even without a blank line after)."""
    decoder = SSEDecoder()
    for line in lines:
        data = decoder.feed(line)
        if data is not None:
            yield data
    data = decoder.flush()
    if data is not None:
        yield data


async def asse_events(lines: AsyncIterable[str]) -> AsyncIterator[str]:
    """``sse_events`` of an async stream of lines (httpx's ``aiter_lines``)."""
    decoder = SSEDecoder()
    async for line in lines:
        data = decoder.feed(line)
        if data is not None:
            yield data
    data = decoder.flush()
    if data is not None:
        yield data
