"""``/v1/completions`` through the official ``openai`` client and raw HTTP: usage, streaming,
n x prompts, logprobs, echo, stop strings, include_usage."""

from __future__ import annotations

import openai
import pytest

from tests.entrypoints.openai.conftest import MODEL_ALIAS, MODEL_NAME, parse_sse

PROMPTS = ["The quick brown fox", "def main(argv):"]


def _greedy(client, prompt, max_tokens=12, **kwargs):
    return client.completions.create(
        model=MODEL_NAME, prompt=prompt, max_tokens=max_tokens, temperature=0, **kwargs
    )


def test_completion_text_and_exact_usage(client, tokenizer):
    response = _greedy(client, PROMPTS[0], max_tokens=10, extra_body={"ignore_eos": True})
    num_prompt = len(tokenizer.encode(PROMPTS[0]))
    assert response.object == "text_completion"
    assert response.model == MODEL_NAME
    assert response.id.startswith("cmpl-")
    (choice,) = response.choices
    assert choice.index == 0 and choice.finish_reason == "length"
    assert choice.text and isinstance(choice.text, str)
    assert response.usage.prompt_tokens == num_prompt
    assert response.usage.completion_tokens == 10
    assert response.usage.total_tokens == num_prompt + 10
    assert response.usage.prompt_tokens_details.cached_tokens >= 0


def test_alias_and_default_max_tokens(client):
    response = client.completions.create(
        model=MODEL_ALIAS, prompt=PROMPTS[0], temperature=0, extra_body={"ignore_eos": True}
    )
    assert response.model == MODEL_ALIAS
    assert response.usage.completion_tokens == 16  # OpenAI's default max_tokens (null: test_vllm_values)


def test_prompt_forms_give_the_same_text(client, tokenizer):
    ids = tokenizer.encode(PROMPTS[0])
    as_text = _greedy(client, PROMPTS[0]).choices[0].text
    assert _greedy(client, ids).choices[0].text == as_text
    batch = _greedy(client, [ids, tokenizer.encode(PROMPTS[1])])
    assert [c.text for c in batch.choices] == [as_text, _greedy(client, PROMPTS[1]).choices[0].text]


def test_streamed_equals_non_streamed_greedy(client, tokenizer):
    for prompt in PROMPTS:
        full = _greedy(client, prompt, max_tokens=24, extra_body={"ignore_eos": True})
        chunks = list(_greedy(client, prompt, max_tokens=24, stream=True, extra_body={"ignore_eos": True}))
        assert "".join(c.choices[0].text for c in chunks) == full.choices[0].text
        finishes = [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason]
        assert finishes == ["length"]
        assert all(c.usage is None for c in chunks)


def test_n2_two_prompts_four_choices_in_order(client):
    singles = [_greedy(client, p).choices[0].text for p in PROMPTS]
    response = _greedy(client, PROMPTS, n=2)
    assert [c.index for c in response.choices] == [0, 1, 2, 3]
    assert [c.text for c in response.choices] == [singles[0], singles[0], singles[1], singles[1]]
    chunks = list(_greedy(client, PROMPTS, n=2, stream=True))
    texts = {i: "" for i in range(4)}
    finished = {i: 0 for i in range(4)}
    for chunk in chunks:
        (choice,) = chunk.choices
        texts[choice.index] += choice.text
        finished[choice.index] += choice.finish_reason is not None
    assert [texts[i] for i in range(4)] == [singles[0], singles[0], singles[1], singles[1]]
    assert finished == {0: 1, 1: 1, 2: 1, 3: 1}


def test_sampled_n2_with_seed_is_reproducible(client):
    kwargs = dict(model=MODEL_NAME, prompt=PROMPTS[0], max_tokens=12, temperature=1.0, n=2, seed=7)
    first = client.completions.create(**kwargs)
    second = client.completions.create(**kwargs)
    assert [c.text for c in first.choices] == [c.text for c in second.choices]


@pytest.mark.parametrize("num_logprobs", [0, 5])
def test_logprobs_shapes(client, num_logprobs):
    response = _greedy(client, PROMPTS[0], max_tokens=8, logprobs=num_logprobs, extra_body={"ignore_eos": True})
    (choice,) = response.choices
    logprobs = choice.logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.top_logprobs) == 8
    assert len(logprobs.text_offset) == 8
    if "\ufffd" not in "".join(logprobs.tokens):  # a token holding part of a character decodes to U+FFFD
        assert "".join(logprobs.tokens) == choice.text
    offset = 0
    for token, token_logprob, top, text_offset in zip(
        logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs, logprobs.text_offset
    ):
        assert text_offset == offset
        offset += len(token)
        assert token_logprob <= 0.0
        # Greedy: the chosen token is the most likely one, so it is among the top entries.
        # (Fewer entries when two tokens decode to the same text, e.g. U+FFFD: OpenAI's
        # format keys them by text.)
        assert 1 <= len(top) <= max(num_logprobs, 1)
        assert top[token] == pytest.approx(token_logprob)
        assert max(top.values()) == pytest.approx(token_logprob)


def test_streamed_logprobs_match(client):
    full = _greedy(client, PROMPTS[1], max_tokens=8, logprobs=2, extra_body={"ignore_eos": True})
    chunks = list(_greedy(client, PROMPTS[1], max_tokens=8, logprobs=2, stream=True, extra_body={"ignore_eos": True}))
    tokens, offsets, values = [], [], []
    for chunk in chunks:
        lp = chunk.choices[0].logprobs
        if lp is not None:
            tokens += lp.tokens
            offsets += lp.text_offset
            values += lp.token_logprobs
    assert tokens == full.choices[0].logprobs.tokens
    assert offsets == full.choices[0].logprobs.text_offset
    assert values == pytest.approx(full.choices[0].logprobs.token_logprobs, abs=1e-4)


def test_echo(client, tokenizer):
    plain = _greedy(client, PROMPTS[0], max_tokens=6)
    echoed = _greedy(client, PROMPTS[0], max_tokens=6, echo=True)
    assert echoed.choices[0].text == PROMPTS[0] + plain.choices[0].text
    streamed = list(_greedy(client, PROMPTS[0], max_tokens=6, echo=True, stream=True))
    assert streamed[0].choices[0].text.startswith(PROMPTS[0])
    assert "".join(c.choices[0].text for c in streamed) == echoed.choices[0].text
    ids = tokenizer.encode(PROMPTS[0])
    with_logprobs = _greedy(client, ids, max_tokens=6, echo=True, logprobs=1)
    lp = with_logprobs.choices[0].logprobs
    assert with_logprobs.choices[0].text == tokenizer.decode(ids) + plain.choices[0].text
    assert len(lp.tokens) == len(ids) + 6
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None  # nothing precedes token 0
    assert all(v is not None for v in lp.token_logprobs[1:])
    assert "".join(lp.tokens[: len(ids)]) == tokenizer.decode(ids)


def test_echo_with_max_tokens_zero_scores_the_prompt(client, tokenizer):
    """OpenAI's legacy completions and vLLM: echo with max_tokens 0 returns the prompt alone,
    with its logprobs and no completion tokens (how clients score a prompt)."""
    ids = tokenizer.encode(PROMPTS[1])
    with_generation = _greedy(client, PROMPTS[1], max_tokens=3, echo=True, logprobs=1).choices[0].logprobs
    scored = _greedy(client, PROMPTS[1], max_tokens=0, echo=True, logprobs=1)
    (choice,) = scored.choices
    assert choice.text == PROMPTS[1]
    assert choice.logprobs.tokens == with_generation.tokens[: len(ids)]
    assert choice.logprobs.text_offset == with_generation.text_offset[: len(ids)]
    assert choice.logprobs.token_logprobs[0] is None
    assert choice.logprobs.token_logprobs[1:] == pytest.approx(with_generation.token_logprobs[1 : len(ids)], abs=1e-4)
    assert choice.logprobs.top_logprobs == with_generation.top_logprobs[: len(ids)]
    assert (scored.usage.prompt_tokens, scored.usage.completion_tokens) == (len(ids), 0)
    streamed = list(_greedy(client, ids, max_tokens=0, echo=True, stream=True))
    assert "".join(chunk.choices[0].text for chunk in streamed) == tokenizer.decode(ids)
    assert streamed[-1].choices[0].finish_reason == "length"
    with pytest.raises(openai.BadRequestError, match="max_tokens must be at least 1"):
        _greedy(client, PROMPTS[1], max_tokens=0)


def test_prompt_logprobs_extra(client, tokenizer):
    response = _greedy(client, PROMPTS[0], max_tokens=2, extra_body={"prompt_logprobs": 2})
    prompt_logprobs = response.choices[0].model_extra["prompt_logprobs"]
    assert len(prompt_logprobs) == len(tokenizer.encode(PROMPTS[0]))
    assert prompt_logprobs[0] is None
    assert all(2 <= len(position) <= 3 for position in prompt_logprobs[1:])


def _stop_string_case(client, prompt):
    """A stop string that spans two tokens and starts in the middle of the first."""
    full = _greedy(client, prompt, max_tokens=40, logprobs=0, extra_body={"ignore_eos": True})
    tokens = full.choices[0].logprobs.tokens
    text = full.choices[0].text
    for k in range(4, len(tokens) - 1):
        first, second = tokens[k], tokens[k + 1]
        if len(first) >= 2 and second.strip() and "\ufffd" not in first + second:
            stop = first[-2:] + second
            return text, stop
    pytest.fail("no suitable multi-token stop string in this output: choose another prompt")


def test_multi_token_stop_string_never_leaks_into_stream(client):
    for prompt in PROMPTS:
        text, stop = _stop_string_case(client, prompt)
        expected = text[: text.index(stop)]
        chunks = list(_greedy(client, prompt, max_tokens=40, stop=[stop], stream=True, extra_body={"ignore_eos": True}))
        pieces = [c.choices[0].text for c in chunks]
        assert "".join(pieces) == expected
        assert chunks[-1].choices[0].finish_reason == "stop"
        assert chunks[-1].choices[0].model_extra["stop_reason"] == stop
        non_streamed = _greedy(client, prompt, max_tokens=40, stop=stop, extra_body={"ignore_eos": True})
        assert non_streamed.choices[0].text == expected
        kept = _greedy(
            client, prompt, max_tokens=40, stop=stop,
            extra_body={"ignore_eos": True, "include_stop_str_in_output": True},
        )  # fmt: skip
        assert kept.choices[0].text == expected + stop


def test_include_usage_semantics(server, tokenizer):
    body = {"model": MODEL_NAME, "prompt": PROMPTS, "n": 2, "max_tokens": 5, "temperature": 0, "ignore_eos": True}
    with_usage = parse_sse(
        server.post("/v1/completions", json={**body, "stream": True, "stream_options": {"include_usage": True}}).text
    )
    assert with_usage[-1] == "[DONE]"
    *content, usage_chunk = with_usage[:-1]
    assert content and all("usage" in chunk and chunk["usage"] is None for chunk in content)
    assert all(len(chunk["choices"]) == 1 for chunk in content)
    assert usage_chunk["choices"] == []
    num_prompt = sum(len(tokenizer.encode(p)) for p in PROMPTS)
    assert usage_chunk["usage"]["prompt_tokens"] == num_prompt
    assert usage_chunk["usage"]["completion_tokens"] == 4 * 5
    assert usage_chunk["usage"]["total_tokens"] == num_prompt + 20

    without = parse_sse(server.post("/v1/completions", json={**body, "stream": True}).text)
    assert without[-1] == "[DONE]"
    assert all("usage" not in chunk for chunk in without[:-1])
    assert all(chunk["choices"] for chunk in without[:-1])


def test_sampling_extras_are_accepted(client):
    response = client.completions.create(
        model=MODEL_NAME,
        prompt=PROMPTS[0],
        max_tokens=6,
        temperature=0.8,
        top_p=0.9,
        seed=3,
        presence_penalty=0.5,
        frequency_penalty=0.5,
        logit_bias={"5": 1.0},
        user="someone",
        extra_body={
            "top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1, "min_tokens": 2,
            "stop_token_ids": [0], "skip_special_tokens": False, "cache_salt": "abc",
        },
    )  # fmt: skip
    assert response.usage.completion_tokens >= 2


def test_logit_bias_forces_a_token(client, tokenizer):
    token_id = tokenizer.encode(" the")[0]
    response = _greedy(client, PROMPTS[0], max_tokens=4, logit_bias={str(token_id): 100})
    assert response.choices[0].text == tokenizer.decode([token_id] * 4)


def test_prefix_cache_hits_reported(client, tokenizer):
    prompt = "A long shared prefix " * 12  # several full blocks
    _greedy(client, prompt, max_tokens=2)
    second = _greedy(client, prompt, max_tokens=2)
    num_prompt = len(tokenizer.encode(prompt))
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached == (num_prompt - 1) // 16 * 16  # full blocks; the last prompt token is always computed
