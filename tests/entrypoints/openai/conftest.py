"""A real ``pagedllm serve`` process for the OpenAI server tests (``tests.server_utils``).

The ``server`` fixture is one ``RemoteServer`` shared by the whole package (start-up costs
seconds): API keys ``API_KEY`` and ``OTHER_API_KEY``, served names ``MODEL_NAME`` and ``MODEL_ALIAS``,
``max_model_len`` ``MAX_MODEL_LEN`` (given as ``2K``). Tests that kill the engine start their own.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import openai
import pytest

from tests.server_utils import RemoteServer

API_KEY = "sk-pagedllm-test"
#: A second key the shared server accepts (``--api-key`` takes several).
OTHER_API_KEY = "sk-pagedllm-other"
MODEL_NAME = "tiny-llama"
MODEL_ALIAS = "tiny-llama-alias"
MAX_MODEL_LEN = 2048


@pytest.fixture(scope="package")
def server(tiny_llama: Path) -> Iterator[RemoteServer]:
    """The shared server (read-only use: do not kill its engine)."""
    remote = RemoteServer(
        tiny_llama,
        "--served-model-name", MODEL_NAME, MODEL_ALIAS,
        "--max-model-len", "2K",  # = MAX_MODEL_LEN (upper-case suffix: x1024, as vLLM)
        api_key=API_KEY, other_api_keys=(OTHER_API_KEY,),
    )  # fmt: skip
    try:
        yield remote
    finally:
        remote.close()


@pytest.fixture(scope="package")
def client(server: RemoteServer) -> openai.OpenAI:
    return server.client()


@pytest.fixture(scope="package")
def default_model_server() -> Iterator[RemoteServer]:
    """``pagedllm serve`` of the shipped model, as a first user starts it (default
    structured-outputs config), with ``--enable-auto-tool-choice --tool-call-parser hermes``
    (read-only use)."""
    remote = RemoteServer(None, "--enable-auto-tool-choice", "--tool-call-parser", "hermes")
    try:
        yield remote
    finally:
        remote.close()


def parse_sse(body: str) -> list:
    """The JSON events of an SSE body, ``"[DONE]"`` kept as that string."""
    import json

    events = []
    for block in body.split("\n\n"):
        if not block.strip():
            continue
        assert block.startswith("data: "), block
        data = block[len("data: ") :]
        events.append(data if data == "[DONE]" else json.loads(data))
    return events
