"""A real ``pagedllm serve`` with ``--reasoning-parser deepseek_r1`` through the ``openai``
SDK (reasoning fields, streamed and not) and the ``anthropic`` SDK (``/v1/messages``,
streamed, ``count_tokens``, errors): every split is checked exactly against the greedy
text the same server gives for the same prompt on ``/v1/completions`` (no parser there).

The checkpoint's tokenizer has ``<think>`` and ``</think>`` as tokens, and its chat
template opens the reasoning in the prompt as DeepSeek-R1's does (``<think>\\n``), so the
tiny model's output is reasoning until it writes ``</think>``; a ``logit_bias`` on that
token makes it close the block part-way (and again later: only the first one counts).
Structured outputs (``response_format``, a forced tool call) start where the reasoning ends.
"""

from __future__ import annotations

import json
import shutil
import time

import anthropic
import jsonschema
import pytest

from tests.server_utils import RemoteServer

MODEL = "tiny-r1"
API_KEY = "sk-r1"
R1_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for part in message['content'] %}{{ part['text'] }}{% endfor %}{% endif %}"
    "{{ '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n<think>\\n' }}"
    "{% if enable_thinking is defined and not enable_thinking %}{{ '</think>\\n\\n' }}{% endif %}{% endif %}"
)
#: The template closes the reasoning in the prompt: the model answers at once (a forced tool call
#: included: the engine starts a grammar where the reasoning ends).
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
END_THINK_ID = 1025
#: Makes the model write ``</think>`` part-way (at 10 it never does, at 12 it does by token 9).
END_THINK_BIAS = {str(END_THINK_ID): 13.0}
MAX_TOKENS = 16
GREEDY = {"temperature": 0.0, "max_tokens": MAX_TOKENS}
#: The anthropic SDK no longer has sampling arguments; the API still takes them.
GREEDY_BODY = {"temperature": 0.0}


@pytest.fixture(scope="module")
def think_checkpoint(checkpoint_factory, tmp_path_factory):
    """A tiny Llama whose tokenizer has ``<think>`` (1024) and ``</think>`` (1025)."""
    from transformers import AutoTokenizer

    out = tmp_path_factory.mktemp("tiny-r1")
    shutil.copytree(checkpoint_factory("LlamaForCausalLM", seed=0, vocab_size=1026), out, dirs_exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(out)
    tokenizer.add_tokens(["<think>", "</think>"])
    tokenizer.save_pretrained(out)
    assert tokenizer.convert_tokens_to_ids("</think>") == END_THINK_ID
    return out


@pytest.fixture(scope="module")
def server(think_checkpoint):
    remote = RemoteServer(
        think_checkpoint, "--served-model-name", MODEL, "--max-model-len", "512",
        "--chat-template", R1_TEMPLATE, "--reasoning-parser", "deepseek_r1", api_key=API_KEY,
    )  # fmt: skip
    try:
        yield remote
        _check_idle(remote)
    finally:
        remote.close()


def _check_idle(server: RemoteServer) -> None:
    """No request left running or waiting, no KV-cache block in use (the server's
    block-accounting check)."""
    names = ("pagedllm:num_requests_running", "pagedllm:num_requests_waiting", "pagedllm:kv_cache_usage_perc")
    deadline = time.monotonic() + 2.0
    while any(server.metrics()[name] for name in names):
        assert time.monotonic() < deadline, {name: server.metrics()[name] for name in names}
        time.sleep(0.02)


def _anthropic(server: RemoteServer, api_key: str = API_KEY) -> anthropic.Anthropic:
    """The SDK's client: it sends the key as ``x-api-key``."""
    return anthropic.Anthropic(base_url=server.url, api_key=api_key, max_retries=0)


def _prompt(server: RemoteServer, messages) -> list[int]:
    body = {"model": MODEL, "messages": messages}
    return server.post("/tokenize", json=body).json()["tokens"]


def _raw(server: RemoteServer, messages, **fields) -> str:
    """The greedy text of the chat prompt of ``messages``, without a parser."""
    body = {"model": MODEL, "prompt": _prompt(server, messages), **GREEDY, **fields}
    return server.post("/v1/completions", json=body).json()["choices"][0]["text"]


@pytest.fixture(scope="module")
def biased_raw(server) -> str:
    raw = _raw(server, QUESTION, logit_bias=END_THINK_BIAS)
    reasoning, tag, content = raw.partition("</think>")
    assert tag and reasoning and content, f"the biased greedy text should close the reasoning part-way: {raw!r}"
    return raw


@pytest.fixture(scope="module")
def plain_raw(server) -> str:
    raw = _raw(server, QUESTION)
    assert "</think>" not in raw and len(raw) > 6, raw
    return raw


def test_chat_splits_reasoning_from_content(server, biased_raw):
    reasoning, _, content = biased_raw.partition("</think>")
    client = server.client()
    reply = client.chat.completions.create(model=MODEL, messages=QUESTION, logit_bias=END_THINK_BIAS, **GREEDY)
    message = reply.choices[0].message.model_dump()
    assert (message["reasoning"], message["reasoning_content"], message["content"]) == (reasoning, reasoning, content)

    stream = client.chat.completions.create(
        model=MODEL, messages=QUESTION, logit_bias=END_THINK_BIAS, stream=True, **GREEDY
    )
    deltas = [chunk.choices[0].delta.model_dump() for chunk in stream if chunk.choices]
    kinds = [("reasoning" if d.get("reasoning") else "content") for d in deltas if d.get("reasoning") or d.get("content")]
    assert kinds == sorted(kinds, key=lambda kind: kind == "content")  # reasoning, then content
    assert all(d.get("reasoning") == d.get("reasoning_content") for d in deltas)
    assert "".join(d.get("reasoning") or "" for d in deltas) == reasoning
    assert "".join(d.get("content") or "" for d in deltas) == content


def test_unclosed_reasoning_is_all_reasoning(server, plain_raw):
    reply = server.client().chat.completions.create(model=MODEL, messages=QUESTION, **GREEDY)
    message = reply.choices[0].message
    assert (message.reasoning, message.content, reply.choices[0].finish_reason) == (plain_raw, None, "length")


def test_response_format_constrains_the_content_after_the_reasoning(server, biased_raw, plain_raw):
    """Structured outputs start where the reasoning ends (vLLM's gating): the reasoning is the
    free greedy text up to ``</think>`` (the schema would refuse its first token), the content
    is JSON valid by the schema; a reasoning that never ends leaves the output unconstrained."""
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"], "additionalProperties": False}
    response_format = {"type": "json_schema", "json_schema": {"name": "a", "schema": schema}}
    client = server.client()
    reply = client.chat.completions.create(model=MODEL, messages=QUESTION, logit_bias=END_THINK_BIAS, temperature=0.0,
                                           max_tokens=48, response_format=response_format)  # fmt: skip
    message = reply.choices[0].message.model_dump()
    reasoning = biased_raw.partition("</think>")[0]
    assert message["reasoning"] == reasoning and not reasoning.lstrip().startswith("{")
    jsonschema.validate(json.loads(message["content"]), schema)
    assert reply.choices[0].finish_reason == "stop"
    unended = client.chat.completions.create(model=MODEL, messages=QUESTION, response_format=response_format, **GREEDY)
    assert (unended.choices[0].message.reasoning, unended.choices[0].message.content) == (plain_raw, None)


def test_messages_create_and_stream(server, plain_raw):
    client = _anthropic(server)
    prompt_tokens = len(_prompt(server, QUESTION))
    reply = client.messages.create(model=MODEL, messages=QUESTION, max_tokens=MAX_TOKENS, extra_body=GREEDY_BODY)
    assert [block.model_dump() for block in reply.content] == [
        {"type": "thinking", "thinking": plain_raw, "signature": ""}
    ]
    assert (reply.role, reply.model, reply.stop_reason, reply.stop_sequence) == ("assistant", MODEL, "max_tokens", None)
    assert (reply.usage.input_tokens, reply.usage.output_tokens) == (prompt_tokens, MAX_TOKENS)
    assert client.messages.count_tokens(model=MODEL, messages=QUESTION).input_tokens == prompt_tokens

    with client.messages.stream(model=MODEL, messages=QUESTION, max_tokens=MAX_TOKENS, extra_body=GREEDY_BODY) as stream:
        events = [event.type for event in stream if event.type.startswith(("message", "content_block"))]
        final = stream.get_final_message()
    assert final.model_dump(exclude={"id"}) == reply.model_dump(exclude={"id"})
    assert events[0] == "message_start" and events[-2:] == ["message_delta", "message_stop"]
    blocks = [name for name in events if name in ("content_block_start", "content_block_stop")]
    assert blocks == ["content_block_start", "content_block_stop"]

    stop = plain_raw[4:7]
    cut = client.messages.create(
        model=MODEL, messages=QUESTION, max_tokens=MAX_TOKENS, extra_body=GREEDY_BODY, stop_sequences=[stop]
    )
    assert (cut.stop_reason, cut.stop_sequence) == ("stop_sequence", stop)
    assert cut.content[0].thinking == plain_raw[: plain_raw.index(stop)]


def test_messages_tools_and_tool_results(server):
    client = _anthropic(server)
    tools = [{"name": "capital", "description": "A country's capital.",
              "input_schema": {"type": "object", "properties": {"country": {"enum": ["France", "Italy"]}},
                               "required": ["country"]}}]  # fmt: skip
    request = dict(model=MODEL, messages=QUESTION, max_tokens=40, extra_body={**GREEDY_BODY, **NO_THINKING},
                   tools=tools, tool_choice={"type": "any"})  # fmt: skip
    reply = client.messages.create(**request)
    assert reply.stop_reason == "tool_use"
    (call,) = [block for block in reply.content if block.type == "tool_use"]
    assert call.name == "capital" and call.input["country"] in ("France", "Italy") and call.id.startswith("toolu_")
    with client.messages.stream(**request) as stream:
        streamed = stream.get_final_message()
    assert streamed.model_dump(exclude={"id": True, "content": {0: {"id"}}}) == reply.model_dump(
        exclude={"id": True, "content": {0: {"id"}}}
    )

    turns = [
        *QUESTION,
        {"role": "assistant", "content": [{"type": "text", "text": "Let me look."},
                                          {"type": "tool_use", "id": call.id, "name": "capital", "input": call.input}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "Paris"},
                                     {"type": "text", "text": "Thanks."}]},
    ]  # fmt: skip
    same_turns = [
        *QUESTION,
        {"role": "assistant", "content": "Let me look.", "tool_calls": [
            {"id": call.id, "type": "function", "function": {"name": "capital", "arguments": json.dumps(call.input)}}]},
        {"role": "tool", "tool_call_id": call.id, "content": "Paris"},
        {"role": "user", "content": "Thanks."},
    ]  # fmt: skip
    counted = client.messages.count_tokens(model=MODEL, messages=turns, system=[{"type": "text", "text": "Be brief."}])
    expected = _prompt(server, [{"role": "system", "content": "Be brief."}, *same_turns])
    assert counted.input_tokens == len(expected)


def test_messages_errors_are_anthropic_json(server):
    client = _anthropic(server)
    with pytest.raises(anthropic.NotFoundError) as not_found:
        client.messages.create(model="claude-nope", messages=QUESTION, max_tokens=4)
    assert not_found.value.body == {
        "type": "error", "error": {"type": "not_found_error", "message": "The model `claude-nope` does not exist."}
    }
    missing = server.post("/v1/messages", json={"model": MODEL, "messages": QUESTION})
    assert missing.status_code == 400
    body = missing.json()
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    assert "max_tokens" in body["error"]["message"]
    image = {"role": "user", "content": [{"type": "image", "source": {"type": "url", "url": "http://x"}}]}
    with pytest.raises(anthropic.BadRequestError, match="'image' are not supported"):
        client.messages.create(model=MODEL, messages=[image], max_tokens=4)
    with pytest.raises(anthropic.AuthenticationError) as wrong_key:
        _anthropic(server, "sk-wrong").messages.count_tokens(model=MODEL, messages=QUESTION)
    assert wrong_key.value.body == {
        "type": "error", "error": {"type": "authentication_error", "message": "Incorrect API key provided."}
    }
