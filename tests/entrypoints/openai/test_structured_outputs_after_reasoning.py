"""``pagedllm serve --reasoning-parser qwen3`` with ``response_format``: the grammar starts where
the reasoning ends (vLLM's gating), on the shipped model with a Qwen3-style chat template (its
``enable_thinking: false`` closes an empty ``<think>`` block in the prompt), greedy.

With thinking off the content is JSON valid by the schema; with thinking on, the model (which
never closes its reasoning) reasons freely: its reasoning is exactly the unconstrained reply,
and there is no content yet.
"""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest

from tests.server_utils import RemoteServer

#: ChatML, plus Qwen3's switch: ``enable_thinking`` false closes an empty reasoning block.
QWEN3_STYLE_TEMPLATE = (
    "{%- for message in messages %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n{% endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n"
    "{%- if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
)
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"], "additionalProperties": False}
RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}}
MESSAGES = [{"role": "user", "content": "Give me a JSON object."}]


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    template = Path(tmp_path_factory.mktemp("template")) / "qwen3_style.jinja"
    template.write_text(QWEN3_STYLE_TEMPLATE)
    remote = RemoteServer(None, "--reasoning-parser", "qwen3", "--chat-template", str(template))
    try:
        yield remote.client()
    finally:
        remote.close()


def _message(client, **kwargs):
    reply = client.chat.completions.create(model="pagedllm-default", messages=MESSAGES, temperature=0, **kwargs)
    return reply.choices[0].message.model_dump()


def test_content_follows_the_schema_once_the_reasoning_has_ended(client):
    off = {"chat_template_kwargs": {"enable_thinking": False}}
    answer = _message(client, max_tokens=48, response_format=RESPONSE_FORMAT, extra_body=off)
    assert answer.get("reasoning") is None
    jsonschema.validate(json.loads(answer["content"]), SCHEMA)

    thinking = _message(client, max_tokens=16, response_format=RESPONSE_FORMAT)
    free = _message(client, max_tokens=16)
    assert free.get("reasoning") and not free["reasoning"].lstrip().startswith("{")
    assert (thinking.get("reasoning"), thinking["content"]) == (free["reasoning"], None)
