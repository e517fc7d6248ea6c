"""The client-side event-stream reader of ``pagedllm chat`` and ``bench serve``: events end at
a blank line, ``data:`` lines of one event join with newlines, comments and other fields carry
no data, a last event without a blank line after still counts."""

import asyncio
import json

from pagedllm.entrypoints.openai.serving_engine import sse
from pagedllm.entrypoints.sse_client import DONE, asse_events, sse_events


def _lines(text: str) -> list[str]:
    return text.split("\n")  # what iter_lines gives for "\n" breaks (no splitlines: see below)


def test_events_of_a_stream():
    stream = (": keep-alive\n\nevent: delta\ndata: {\"a\": 1}\n\ndata:{\"b\": 2}\nid: 7\n\n"
              "data: first line\ndata:  second, indented\n\nretry: 10\n\ndata: [DONE]")
    assert list(sse_events(_lines(stream))) == ['{"a": 1}', '{"b": 2}', "first line\n second, indented", DONE]


def test_the_servers_own_events_round_trip_with_line_separators_in_the_text():
    """``sse()`` escapes U+2028 / U+2029 / U+0085, so even a reader that splits on them
    (Python's ``splitlines``, httpx's ``iter_lines``) gets the event whole."""
    texts = ["plain", "one\u2028two", "para\u2029graph", "next\x85line", "new\nline"]
    stream = "".join(sse(json.dumps({"text": t}, ensure_ascii=False)) for t in texts) + sse(DONE)
    assert "\u2028" in json.dumps({"text": texts[1]}, ensure_ascii=False)  # raw in the JSON sse() gets
    events = list(sse_events(stream.splitlines()))
    assert [json.loads(e)["text"] for e in events[:-1]] == texts and events[-1] == DONE


def test_async_events():
    async def lines():
        for line in _lines("data: 1\n\ndata: 2\n\n"):
            yield line

    async def collect():
        return [data async for data in asse_events(lines())]

    assert asyncio.run(collect()) == ["1", "2"]
