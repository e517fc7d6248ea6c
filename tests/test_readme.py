"""The README's examples, run as written (port aside) against `pagedllm serve` with no MODEL."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from pagedllm.model_paths import default_model_path
from tests.server_utils import RemoteServer

README = Path(__file__).resolve().parents[1] / "README.md"


def code_blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", README.read_text(), flags=re.S)


def test_readme_starts_with_the_two_setup_commands():
    first = code_blocks("bash")[0]
    assert first.splitlines()[0].startswith("make serve")
    assert first.splitlines()[1].startswith("make test")
    ci = (README.parent / ".ci" / "run").read_text()
    assert "make test" in ci


def test_examples_of_flags_not_built_yet_are_refused():
    """The vLLM-flags paragraph's examples of values not built yet stop with exit code 2."""
    text = " ".join(README.read_text().split())
    sentence = re.search(r"A value asking for something not built yet — (.*?) — stops at once", text)
    assert sentence, "the README's sentence on flags not built yet is gone"
    examples = re.findall(r"`([^`]+)`", sentence.group(1))
    assert len(examples) >= 2
    for example in examples:
        result = subprocess.run(
            [sys.executable, "-m", "pagedllm.entrypoints.cli", "serve", *example.split()],
            capture_output=True, text=True, timeout=60, cwd=README.parent,
        )  # fmt: skip
        assert result.returncode == 2 and "is not supported yet" in result.stderr, (example, result.stderr)


@pytest.fixture(scope="module")
def default_server():
    assert (default_model_path() / "config.json").is_file(), "the shipped model is missing"
    server = RemoteServer(None, "--dtype", "auto")  # the README's `make serve`: no --dtype
    try:
        yield server
    finally:
        server.close()


def test_serve_without_model_serves_the_shipped_model(default_server):
    client = default_server.client()
    assert [m.id for m in client.models.list().data] == ["pagedllm-default"]
    reply = client.chat.completions.create(
        model="pagedllm-default", messages=[{"role": "user", "content": "Hello!"}], max_tokens=8
    )
    assert reply.choices[0].message.content and reply.usage.completion_tokens >= 1


def test_start_up_choices_are_logged_once(default_server):
    """The front end and the engine process both resolve the arguments; one logs them."""
    log = Path(default_server.log.name).read_text()
    assert log.count("--dtype auto: ") == 1, log


def test_curl_example(default_server):
    curl = next(b for b in code_blocks("bash") if b.lstrip().startswith("curl"))
    result = subprocess.run(
        ["bash", "-c", curl.replace("127.0.0.1:8000", f"127.0.0.1:{default_server.port}")],
        capture_output=True, text=True, timeout=60, check=True,
    )
    body = json.loads(result.stdout)
    assert body["model"] == "pagedllm-default"
    assert body["choices"][0]["text"]
    assert body["usage"]["completion_tokens"] == 32 or body["choices"][0]["finish_reason"] == "stop"


def test_chat_page_and_terminal_chat_examples(default_server):
    """The newcomer's path after `make serve`: the page at /, then the `-q` lines of "Chat from
    the terminal" (pointed at the test's port with --url)."""
    page = default_server.get("/")
    assert page.status_code == 200 and "<title>pagedllm chat</title>" in page.text
    block = next(b for b in code_blocks("bash") if b.lstrip().startswith(".venv/bin/pagedllm chat"))
    commands = [shlex.split(line.split("#")[0])[1:] for line in block.splitlines() if " -q " in line]
    assert [argv[0] for argv in commands] == ["chat", "complete"]
    for argv in commands:
        result = subprocess.run(
            [sys.executable, "-m", "pagedllm.entrypoints.cli", *argv, "--url", f"{default_server.url}/v1"],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert result.returncode == 0, result.stderr
        model_line, *reply = result.stdout.splitlines()
        assert model_line == "Using model: pagedllm-default" and "".join(reply).strip()


def test_openai_example(default_server):
    example = next(b for b in code_blocks("python") if "OpenAI(" in b)
    code = example.replace("127.0.0.1:8000", f"127.0.0.1:{default_server.port}")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert result.stdout.strip()


def test_tool_calling_example(default_server):
    example = next(b for b in code_blocks("python") if 'tool_choice="required"' in b)
    code = example.replace("127.0.0.1:8000", f"127.0.0.1:{default_server.port}")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    lines = result.stdout.strip().splitlines()
    assert lines and all(line.startswith("call_") and " get_weather " in line for line in lines), lines


def test_llm_generate_example():
    example = next(b for b in code_blocks("python") if "from pagedllm import LLM" in b)
    env = dict(os.environ, PAGEDLLM_LOGGING_LEVEL="WARNING")
    result = subprocess.run([sys.executable, "-c", example], capture_output=True, text=True, timeout=300, check=True, env=env)
    lines = result.stdout.strip().splitlines()
    assert len(lines) == 2 and lines[0].startswith("'Once upon a time' -> '")


def test_structured_outputs_example():
    example = next(b for b in code_blocks("python") if "StructuredOutputsParams" in b)
    env = dict(os.environ, PAGEDLLM_LOGGING_LEVEL="WARNING")
    result = subprocess.run([sys.executable, "-c", example], capture_output=True, text=True, timeout=300, check=True, env=env)
    pet, sentiment = result.stdout.strip().splitlines()
    assert re.fullmatch(r"kind='(cat|dog|fish)' legs=[0-4]", pet) and sentiment in ("positive", "negative")
