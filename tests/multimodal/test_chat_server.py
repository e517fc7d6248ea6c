"""Images in ``/v1/chat/completions`` of a real ``pagedllm serve`` of the tiny Llava (one
server for the module), through the openai SDK: ``image_url`` parts as ``data:`` URLs,
``file://`` paths under ``--allowed-local-media-path`` and ``http(s)://`` URLs fetched from a
loopback server (redirects followed) give transformers' greedy reply; every bad image (a
refused path or host, a failing, slow, redirect-looping, non-image, oversized or truncated
one), too many images and untrusted ``mm_processor_kwargs`` are a 400 in OpenAI's error JSON
naming the part and the reason, and the server keeps serving. (An image to a text-only
model: tests/entrypoints/openai/test_errors_auth.py.)"""

from __future__ import annotations

import base64
import http.server
import io
import json
import os
import threading
import time
from typing import Iterator

import openai
import pytest
from PIL import Image

from tests.multimodal.checkpoints import hf_greedy, llava_checkpoint, random_image
from tests.server_utils import RemoteServer

MAX_TOKENS = 5
QUESTION = "What is this?"
#: The chat template's rendering of one user message with one image and ``QUESTION``.
RENDERED = f"<|im_start|>user\n<image>\n{QUESTION}<|im_end|>\n<|im_start|>assistant\n"
MAX_IMAGE_BYTES = 50_000
#: A template that writes ``<image>`` for each image part itself, where the part is (as
#: llava-hf checkpoints' own templates do; vLLM's "openai" content format).
PARTS_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% for p in m['content'] %}"
    "{% if p['type'] == 'image' %}<image>{% else %}{{ p['text'] }}{% endif %}{% endfor %}<|im_end|>\n{% endfor %}"
    "{{ '<|im_start|>assistant\\n' }}"
)


def _png(image: Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


class _MediaHandler(http.server.BaseHTTPRequestHandler):
    """The loopback server's routes (``self.server.png``: the image's bytes)."""

    def do_GET(self) -> None:  # noqa: N802
        png = self.server.png  # type: ignore[attr-defined]
        routes = {
            "/a.png": (200, {"Content-Type": "image/png"}, png),
            "/moved": (302, {"Location": "/a.png"}, b""),
            "/loop": (302, {"Location": "/loop"}, b""),
            "/page": (200, {"Content-Type": "text/html"}, b"<html></html>"),
            "/big.png": (200, {"Content-Type": "image/png"}, b"\0" * (2 * MAX_IMAGE_BYTES)),
            "/cut.png": (200, {"Content-Type": "image/png"}, png[: len(png) // 2]),
        }
        if self.path == "/slow.png":
            time.sleep(2.0)
        status, headers, body = routes.get(self.path, (404, {}, b"not found"))
        self.send_response(status)
        for name, value in {**headers, "Content-Length": str(len(body))}.items():
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:
        pass


@pytest.fixture(scope="module")
def image():
    return random_image(40, 50, seed=1)


@pytest.fixture(scope="module")
def media_url(image) -> Iterator[str]:
    """The loopback media server's base URL."""
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _MediaHandler)
    httpd.png = _png(image)  # type: ignore[attr-defined]
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()


@pytest.fixture(scope="module")
def media_dir(tmp_path_factory, image):
    folder = tmp_path_factory.mktemp("media")
    (folder / "a.png").write_bytes(_png(image))
    return folder


@pytest.fixture(scope="module")
def server(tmp_path_factory, media_dir) -> Iterator[RemoteServer]:
    env = dict(os.environ, PAGEDLLM_IMAGE_FETCH_TIMEOUT="1", PAGEDLLM_MAX_IMAGE_BYTES=str(MAX_IMAGE_BYTES))
    remote = RemoteServer(
        llava_checkpoint(tmp_path_factory), "--served-model-name", "llava", "--allowed-local-media-path", str(media_dir),
        "--allowed-media-domains", "127.0.0.1", "--limit-mm-per-prompt", json.dumps({"image": 2}), env=env,
    )  # fmt: skip
    try:
        yield remote
    finally:
        remote.close()


def _messages(*urls: str) -> list[dict]:
    parts = [{"type": "text", "text": QUESTION}]
    parts += [{"type": "image_url", "image_url": {"url": url, "detail": "low"}} for url in urls]
    return [{"role": "user", "content": parts}]


def _reply(client: openai.OpenAI, messages: list[dict], **extra) -> str:
    response = client.chat.completions.create(model="llava", messages=messages, max_completion_tokens=MAX_TOKENS,
                                              temperature=0.0, extra_body={"ignore_eos": True, **extra})
    return response.choices[0].message.content


def test_image_urls_of_every_kind_give_transformers_reply(server, tmp_path_factory, image, media_url, media_dir):
    from transformers import AutoTokenizer

    path = llava_checkpoint(tmp_path_factory)
    decoded = Image.open(io.BytesIO(_png(image))).convert("RGB")
    expected = AutoTokenizer.from_pretrained(path).decode(hf_greedy(path, RENDERED, [decoded], MAX_TOKENS))
    client = server.client()
    data_url = "data:image/png;base64," + base64.b64encode(_png(image)).decode()
    for url in (data_url, f"file://{media_dir / 'a.png'}", f"{media_url}/a.png", f"{media_url}/moved"):
        assert _reply(client, _messages(url)) == expected, url


def test_a_template_that_renders_image_parts_gets_them(server, tmp_path_factory, image):
    """With a template that renders image parts itself, the prompt is its rendering (the image
    after the question, no newline added), as vLLM and transformers' apply_chat_template make it."""
    from transformers import AutoTokenizer

    path = llava_checkpoint(tmp_path_factory)
    rendered = f"<|im_start|>user\n{QUESTION}<image><|im_end|>\n<|im_start|>assistant\n"
    decoded = Image.open(io.BytesIO(_png(image))).convert("RGB")
    expected = AutoTokenizer.from_pretrained(path).decode(hf_greedy(path, rendered, [decoded], MAX_TOKENS))
    data_url = "data:image/png;base64," + base64.b64encode(_png(image)).decode()
    messages = _messages(data_url)
    tokens = server.post("/tokenize", json={"messages": messages, "chat_template": PARTS_TEMPLATE}).json()["tokens"]
    assert AutoTokenizer.from_pretrained(path).decode(tokens) == rendered
    assert _reply(server.client(), messages, chat_template=PARTS_TEMPLATE) == expected


@pytest.mark.parametrize(("url", "reason"), [
    ("file:///etc/hostname", "outside --allowed-local-media-path"),
    ("MEDIA/missing.png", "HTTP 404"),
    ("MEDIA/page", "'text/html', not an image"),
    ("MEDIA/loop", "redirected more than 3 times"),
    ("MEDIA/big.png", "larger than 50000 bytes"),
    ("MEDIA/cut.png", "could not be decoded"),
    ("MEDIA/slow.png", "timed out"),
    ("http://localhost:1/a.png", "'localhost' is not in --allowed-media-domains"),
    ("data:text/plain;base64,aGk=", "'text/plain', not an image"),
])  # fmt: skip
def test_a_bad_image_is_a_400_naming_the_part(server, media_url, url, reason):
    client = server.client()
    with pytest.raises(openai.BadRequestError) as info:
        _reply(client, _messages(url.replace("MEDIA", media_url)))
    error = info.value.body
    assert error["param"] == "messages" and error["type"] == "invalid_request_error"
    assert error["message"].startswith("messages[0].content[1]: ") and reason in error["message"], error["message"]


def test_limits_and_untrusted_kwargs_are_400s_then_the_server_serves(server, media_url):
    client = server.client()
    url = f"{media_url}/a.png"
    with pytest.raises(openai.BadRequestError, match=r"At most 2 image\(s\)"):
        _reply(client, _messages(url, url, url))
    with pytest.raises(openai.BadRequestError, match="--trust-request-mm-kwargs"):
        _reply(client, _messages(url), mm_processor_kwargs={"do_resize": False})
    assert _reply(client, _messages(url, url))  # two images: within the limit
