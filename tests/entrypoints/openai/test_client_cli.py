"""``pagedllm chat`` and ``pagedllm complete`` in a pseudo-terminal (pexpect) against the real
server: the shipped model, made greedy and short by ``--override-generation-config`` (the
commands send no sampling settings, as vLLM's), for replies compared with what the API
answers for the same requests, the conversation kept between turns; the shared server (with
an API key) for ``--api-key`` and for the one-line error of a refused key. Flags are checked
without a server."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pexpect
import pytest

from pagedllm.entrypoints.cli import build_parser
from tests.entrypoints.openai.conftest import API_KEY, MODEL_NAME
from tests.server_utils import RemoteServer

CLI = [sys.executable, "-m", "pagedllm.entrypoints.cli"]
PROMPT = "\r\n> "


@pytest.fixture(scope="module")
def greedy_server():
    remote = RemoteServer(None, "--override-generation-config", '{"temperature": 0, "max_new_tokens": 24}')
    try:
        yield remote
    finally:
        remote.close()


def _spawn(*argv: str) -> pexpect.spawn:
    return pexpect.spawn(CLI[0], [*CLI[1:], *argv], encoding="utf-8", timeout=90, env=dict(os.environ, TERM="dumb"))


def _reply(child: pexpect.spawn) -> str:
    """What the command printed before the next prompt (a reply ends with a new line)."""
    child.expect_exact(PROMPT)
    return child.before.replace("\r\n", "\n").strip("\n")


def test_flags_are_vllms():
    args = build_parser().parse_args(["chat", "--url", "http://h:1/v1", "--model-name", "m", "--api-key", "k",
                                      "--system-prompt", "s", "-q", "hi"])  # fmt: skip
    assert (args.url, args.model_name, args.api_key, args.system_prompt, args.quick) == ("http://h:1/v1", "m", "k", "s", "hi")
    assert build_parser().parse_args(["chat"]).url == "http://localhost:8000/v1"
    args = build_parser().parse_args(["complete", "--max-tokens", "5", "--quick", "x"])
    assert (args.max_tokens, args.quick) == (5, "x")
    with pytest.raises(SystemExit):
        build_parser().parse_args(["complete", "--max-tokens", "0"])


def test_chat_keeps_the_conversation_and_streams_the_api_answer(greedy_server):
    client = greedy_server.client()
    child = _spawn("chat", "--url", greedy_server.url + "/v1", "--system-prompt", "You are terse.")
    child.expect_exact("Using model: pagedllm-default")
    messages = [{"role": "system", "content": "You are terse."}]
    _reply(child)
    for message in ("Hello!", "What is a list?"):
        child.sendline(message)
        child.expect_exact(message + "\r\n")  # the terminal's echo
        printed = _reply(child)
        messages.append({"role": "user", "content": message})
        expected = client.chat.completions.create(model="pagedllm-default", messages=messages).choices[0].message.content
        assert printed == expected.strip("\n") and printed
        messages.append({"role": "assistant", "content": expected})
    child.sendeof()
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0


def test_complete_streams_each_prompt(greedy_server):
    client = greedy_server.client()
    url = greedy_server.url + "/v1"
    expected = client.completions.create(model="pagedllm-default", prompt="def add(a, b):", max_tokens=12).choices[0].text
    child = _spawn("complete", "--url", url, "--max-tokens", "12")
    child.expect_exact("Using model: pagedllm-default")
    _reply(child)
    child.sendline("def add(a, b):")
    child.expect_exact("def add(a, b):\r\n")
    assert _reply(child) == expected.strip("\n")
    child.sendcontrol("c")  # at the prompt: exit
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0
    quick = subprocess.run([*CLI, "complete", "--url", url, "--max-tokens", "12", "-q", "def add(a, b):"],
                           capture_output=True, text=True, timeout=90)  # fmt: skip
    assert quick.returncode == 0 and quick.stdout == f"Using model: pagedllm-default\n{expected}\n"


def test_the_api_key_is_sent_and_a_refused_key_is_one_line(server):
    url = server.url + "/v1"
    quick = subprocess.run([*CLI, "complete", "--url", url, "--api-key", API_KEY, "--model-name", MODEL_NAME,
                            "--max-tokens", "4", "-q", "Hi"], capture_output=True, text=True, timeout=90)  # fmt: skip
    assert quick.returncode == 0, quick.stderr
    assert quick.stdout.startswith(f"Using model: {MODEL_NAME}\n")
    refused = subprocess.run([*CLI, "chat", "--url", url, "--api-key", "wrong", "-q", "Hi"],
                             capture_output=True, text=True, timeout=90)  # fmt: skip
    assert refused.returncode == 1 and refused.stdout == ""
    assert re.fullmatch(r"pagedllm chat: error: 401 from \S+/v1/models: Incorrect API key provided\.\n", refused.stderr)
