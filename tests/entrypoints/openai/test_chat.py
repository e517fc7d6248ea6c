"""``/v1/chat/completions``: chat template, usage, streaming (role chunk, finish), logprobs,
max tokens defaults, continue_final_message, text-part content
(``--chat-template-content-format``)."""

from __future__ import annotations

import pytest

from tests.entrypoints.openai.conftest import MAX_MODEL_LEN, MODEL_NAME, parse_sse

MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Name three colours."},
]


def _chat(client, messages=MESSAGES, max_tokens=10, **kwargs):
    return client.chat.completions.create(
        model=MODEL_NAME, messages=messages, max_tokens=max_tokens, temperature=0, **kwargs
    )


def _num_prompt_tokens(tokenizer, messages=MESSAGES, **kwargs) -> int:
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **kwargs)
    return len(tokenizer.encode(text, add_special_tokens=False))


def test_chat_completion_and_exact_usage(client, tokenizer):
    response = _chat(client, extra_body={"ignore_eos": True})
    assert response.object == "chat.completion"
    assert response.id.startswith("chatcmpl-")
    (choice,) = response.choices
    assert choice.message.role == "assistant"
    assert isinstance(choice.message.content, str) and choice.message.content
    assert choice.finish_reason == "length"
    num_prompt = _num_prompt_tokens(tokenizer)
    assert response.usage.prompt_tokens == num_prompt
    assert response.usage.completion_tokens == 10
    assert response.usage.total_tokens == num_prompt + 10


def test_max_completion_tokens_and_default_rest_of_context(client, tokenizer):
    response = _chat(client, max_tokens=None, max_completion_tokens=7, extra_body={"ignore_eos": True})
    assert response.usage.completion_tokens == 7
    # No limit: generation runs to the end of the context.
    tokens_per_word = len(tokenizer.encode(" word" * 100)) / 100
    long_messages = [{"role": "user", "content": " word" * int((MAX_MODEL_LEN - 30) / tokens_per_word)}]
    num_prompt = _num_prompt_tokens(tokenizer, long_messages)
    assert MAX_MODEL_LEN - 40 < num_prompt < MAX_MODEL_LEN
    response = client.chat.completions.create(
        model=MODEL_NAME, messages=long_messages, temperature=0, extra_body={"ignore_eos": True}
    )
    assert response.choices[0].finish_reason == "length"
    assert response.usage.prompt_tokens == num_prompt
    assert response.usage.completion_tokens == MAX_MODEL_LEN - num_prompt


def test_streamed_chat_equals_non_streamed(client):
    full = _chat(client, max_tokens=20, extra_body={"ignore_eos": True})
    chunks = list(_chat(client, max_tokens=20, stream=True, extra_body={"ignore_eos": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert all(c.id == chunks[0].id for c in chunks)
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert text == full.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason] == ["length"]


def test_chat_stream_n2_include_usage(server, tokenizer):
    body = {
        "model": MODEL_NAME, "messages": MESSAGES, "n": 2, "max_tokens": 6, "temperature": 0,
        "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
    }  # fmt: skip
    events = parse_sse(server.post("/v1/chat/completions", json=body).text)
    assert events[-1] == "[DONE]"
    *content, usage_chunk = events[:-1]
    roles = [c["choices"][0]["index"] for c in content if c["choices"][0]["delta"].get("role") == "assistant"]
    assert sorted(roles) == [0, 1]
    assert all(c["usage"] is None for c in content)
    finishes = sorted(c["choices"][0]["index"] for c in content if c["choices"][0]["finish_reason"])
    assert finishes == [0, 1]
    texts = ["", ""]
    for chunk in content:
        texts[chunk["choices"][0]["index"]] += chunk["choices"][0]["delta"].get("content") or ""
    assert texts[0] == texts[1] != ""
    assert usage_chunk["choices"] == []
    num_prompt = _num_prompt_tokens(tokenizer)
    assert usage_chunk["usage"] == {
        "prompt_tokens": num_prompt, "completion_tokens": 12, "total_tokens": num_prompt + 12,
        "prompt_tokens_details": {"cached_tokens": usage_chunk["usage"]["prompt_tokens_details"]["cached_tokens"]},
    }  # fmt: skip


@pytest.mark.parametrize("top_logprobs", [0, 5])
def test_chat_logprobs_shapes(client, top_logprobs):
    response = _chat(client, max_tokens=6, logprobs=True, top_logprobs=top_logprobs, extra_body={"ignore_eos": True})
    content = response.choices[0].logprobs.content
    assert len(content) == 6
    for item in content:
        assert item.logprob <= 0.0
        assert isinstance(item.bytes, list)
        assert len(item.top_logprobs) == top_logprobs
        if top_logprobs:  # greedy: the chosen token is the most likely
            assert item.top_logprobs[0].token == item.token
            assert item.top_logprobs[0].logprob == pytest.approx(item.logprob)
            values = [t.logprob for t in item.top_logprobs]
            assert values == sorted(values, reverse=True)
        if "\ufffd" not in item.token:
            assert bytes(item.bytes).decode("utf-8") == item.token


def test_chat_logprobs_without_top(client):
    response = _chat(client, max_tokens=3, logprobs=True)
    assert all(item.top_logprobs == [] for item in response.choices[0].logprobs.content)
    assert _chat(client, max_tokens=3).choices[0].logprobs is None


def _prompt_of(server, messages, **body):
    tokens = server.post("/tokenize", json={"model": MODEL_NAME, "messages": messages, **body}).json()["tokens"]
    return server.post("/detokenize", json={"model": MODEL_NAME, "tokens": tokens}).json()["prompt"], len(tokens)


PARTS_MESSAGES = [
    MESSAGES[0],
    {"role": "user", "content": [{"type": "text", "text": "Name three"}, {"type": "text", "text": "colours."}]},
]


def test_text_parts_reach_a_parts_template_as_a_list(server, client, tokenizer):
    """--chat-template-content-format auto (the default): the tokenizer's template loops over
    a message's parts, so it gets them as a list (the prompt transformers renders from the list;
    the start-up log names the format), and a request template that writes the content as it is
    gets the text parts joined with newlines."""
    assert ("Detected the chat template content format to be 'openai'. You can set "
            "--chat-template-content-format to override this.") in server.log_text(last_chars=None)
    expected = tokenizer.apply_chat_template(PARTS_MESSAGES, add_generation_prompt=True, tokenize=False)
    assert expected.endswith("<|im_start|>user\nName threecolours.<|im_end|>\n<|im_start|>assistant\n")
    prompt, num_tokens = _prompt_of(server, PARTS_MESSAGES)
    assert prompt == expected
    response = _chat(client, PARTS_MESSAGES, max_tokens=1)
    assert response.usage.prompt_tokens == num_tokens
    template = "{% for m in messages %}{{ m['content'] }}|{% endfor %}"
    assert _prompt_of(server, PARTS_MESSAGES, chat_template=template)[0] == "You are terse.|Name three\ncolours.|"


def test_content_format_string_flag_joins_the_parts(tiny_llama, tokenizer):
    """--chat-template-content-format string forces joined contents on a parts template (the
    log names the detected format and warns that it differs); the reply is the one to the
    joined string."""
    from tests.server_utils import RemoteServer

    server = RemoteServer(tiny_llama, "--served-model-name", MODEL_NAME, "--chat-template-content-format", "string")
    try:
        log = server.log_text()
        assert "Detected the chat template content format to be 'openai'." in log
        assert "--chat-template-content-format string differs from the detected format 'openai'." in log
        joined = [MESSAGES[0], {"role": "user", "content": "Name three\ncolours."}]
        expected = tokenizer.apply_chat_template(joined, add_generation_prompt=True, tokenize=False)
        assert _prompt_of(server, PARTS_MESSAGES)[0] == expected
        client = server.client()
        as_parts = _chat(client, PARTS_MESSAGES, extra_body={"ignore_eos": True})
        as_string = _chat(client, joined, extra_body={"ignore_eos": True})
        assert as_parts.choices[0].message.content == as_string.choices[0].message.content
        assert as_parts.usage.prompt_tokens == as_string.usage.prompt_tokens
    finally:
        server.close()


def test_continue_final_message(server, tokenizer):
    messages = MESSAGES + [{"role": "assistant", "content": "Red, green"}]
    body = {"model": MODEL_NAME, "messages": messages, "max_tokens": 1}
    tokenized = server.post(
        "/tokenize", json={**body, "continue_final_message": True, "add_generation_prompt": False}
    ).json()
    text = tokenizer.decode(tokenized["tokens"])
    assert text.endswith("<|im_start|>assistant\nRed, green")
    response = server.post(
        "/v1/chat/completions",
        json={**body, "continue_final_message": True, "add_generation_prompt": False, "ignore_eos": True},
    )
    assert response.status_code == 200
    assert response.json()["usage"]["prompt_tokens"] == tokenized["count"]


def test_echo_puts_the_continued_message_in_front(client):
    """vLLM's chat ``echo``: the last message, when it has the reply's role (an assistant
    message being continued), comes first in each reply, streamed or not; a user message
    is not echoed."""
    messages = MESSAGES + [{"role": "assistant", "content": [{"type": "text", "text": "Red, green"}]}]
    extra = {"continue_final_message": True, "add_generation_prompt": False, "ignore_eos": True}
    plain = _chat(client, messages, max_tokens=4, extra_body=extra).choices[0].message.content
    echoed = _chat(client, messages, max_tokens=4, n=2, extra_body={**extra, "echo": True})
    assert [choice.message.content for choice in echoed.choices] == ["Red, green" + plain] * 2
    stream = _chat(client, messages, max_tokens=4, n=2, stream=True, extra_body={**extra, "echo": True})
    texts = ["", ""]
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
    assert texts == ["Red, green" + plain] * 2
    user_last = _chat(client, max_tokens=4, extra_body={"echo": True, "ignore_eos": True}).choices[0].message.content
    assert user_last == _chat(client, max_tokens=4, extra_body={"ignore_eos": True}).choices[0].message.content


def test_chat_template_kwargs_and_request_template(server):
    template = "{% for m in messages %}{{ m['content'] }}|{% endfor %}{{ extra }}"
    response = server.post(
        "/tokenize",
        json={"messages": MESSAGES, "chat_template": template, "chat_template_kwargs": {"extra": "END"}},
    ).json()
    assert response["count"] > 0
    detok = server.post("/detokenize", json={"tokens": response["tokens"]}).json()
    assert detok["prompt"] == "You are terse.|Name three colours.|END"
