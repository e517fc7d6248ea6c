"""Videos in ``/v1/chat/completions`` of a real ``pagedllm serve`` of the tiny Qwen2.5-VL, through
the openai SDK: a ``video_url`` part (an mp4 PyAV writes) as a ``data:`` URL, a ``file://`` path
under ``--allowed-local-media-path`` and an ``http://`` URL from a loopback server, sampled to
``--media-io-kwargs``' 4 frames, gives transformers' greedy reply; unreadable bytes, a wrong
MIME type, a non-video page, one over ``PAGEDLLM_MAX_VIDEO_BYTES`` and two videos past
``--limit-mm-per-prompt`` are 400s in OpenAI's error JSON naming the part, and the server
keeps serving."""

from __future__ import annotations

import base64
import http.server
import json
import os
import threading
from typing import Iterator

import openai
import pytest

from pagedllm.multimodal.video import decode_video
from tests.models.test_qwen_vl_video import RENDERED, QUESTION, hf_greedy, make_mp4, random_frames
from tests.multimodal.checkpoints import make_qwen_vl_checkpoint
from tests.server_utils import RemoteServer

MAX_TOKENS = 5
MAX_VIDEO_BYTES = 200_000


class _VideoHandler(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802
        mp4 = self.server.mp4  # type: ignore[attr-defined]
        routes = {
            "/clip.mp4": ("video/mp4", mp4),
            "/page": ("text/html", b"<html></html>"),
            "/big.mp4": ("video/mp4", b"\0" * (2 * MAX_VIDEO_BYTES)),
        }
        mime, body = routes.get(self.path, ("text/plain", b"not found"))
        self.send_response(200 if self.path in routes else 404)
        self.send_header("Content-Type", mime)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:
        pass


@pytest.fixture(scope="module")
def mp4() -> bytes:
    return make_mp4(random_frames(8, 48, 64, seed=4), fps=4)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_qwen_vl_checkpoint(tmp_path_factory.mktemp("qwen_video"))


@pytest.fixture(scope="module")
def media(tmp_path_factory, mp4) -> Iterator[tuple[str, str]]:
    """(the loopback server's base URL, a folder holding clip.mp4)."""
    folder = tmp_path_factory.mktemp("videos")
    (folder / "clip.mp4").write_bytes(mp4)
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _VideoHandler)
    httpd.mp4 = mp4  # type: ignore[attr-defined]
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}", str(folder)
    httpd.shutdown()


@pytest.fixture(scope="module")
def server(checkpoint, media) -> Iterator[RemoteServer]:
    env = dict(os.environ, PAGEDLLM_MAX_VIDEO_BYTES=str(MAX_VIDEO_BYTES))
    remote = RemoteServer(
        checkpoint, "--served-model-name", "qwen", "--limit-mm-per-prompt", json.dumps({"video": 1}),
        "--media-io-kwargs", json.dumps({"video": {"num_frames": 4}}), "--allowed-local-media-path", media[1],
        "--allowed-media-domains", "127.0.0.1", env=env,
    )  # fmt: skip
    try:
        yield remote
    finally:
        remote.close()


def _reply(client: openai.OpenAI, *urls: str) -> str:
    parts = [{"type": "video_url", "video_url": {"url": url}} for url in urls]
    messages = [{"role": "user", "content": [*parts, {"type": "text", "text": QUESTION}]}]
    response = client.chat.completions.create(model="qwen", messages=messages, max_completion_tokens=MAX_TOKENS,
                                              temperature=0.0, extra_body={"ignore_eos": True})
    return response.choices[0].message.content


def test_video_urls_give_transformers_reply(server, checkpoint, mp4, media):
    from transformers import AutoTokenizer

    tokens, _ = hf_greedy(checkpoint, RENDERED, [], [decode_video(mp4, 4)])
    expected = AutoTokenizer.from_pretrained(checkpoint).decode(tokens)
    client = server.client()
    data_url = "data:video/mp4;base64," + base64.b64encode(mp4).decode()
    for url in (data_url, f"file://{media[1]}/clip.mp4", f"{media[0]}/clip.mp4"):
        assert _reply(client, url) == expected, url


@pytest.mark.parametrize(("url", "reason"), [
    ("data:video/mp4;base64," + base64.b64encode(b"not a video" * 20).decode(), "the video could not be decoded"),
    ("data:image/png;base64,aGk=", "'image/png', not a video/* type"),
    ("MEDIA/page", "'text/html', not a video/* type"),
    ("MEDIA/big.mp4", f"larger than {MAX_VIDEO_BYTES} bytes (PAGEDLLM_MAX_VIDEO_BYTES)"),
])  # fmt: skip
def test_a_bad_video_is_a_400_naming_the_part(server, media, url, reason):
    with pytest.raises(openai.BadRequestError) as info:
        _reply(server.client(), url.replace("MEDIA", media[0]))
    error = info.value.body
    assert error["param"] == "messages" and error["type"] == "invalid_request_error"
    assert error["message"].startswith("messages[0].content[0]: ") and reason in error["message"], error["message"]


def test_too_many_videos_is_a_400_then_the_server_serves(server, media):
    client = server.client()
    url = f"{media[0]}/clip.mp4"
    with pytest.raises(openai.BadRequestError, match=r"At most 1 video\(s\)"):
        _reply(client, url, url)
    assert _reply(client, url)
