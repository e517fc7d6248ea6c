"""``--reasoning-parser`` through the whole OpenAI layer (``build_app``) with the ``openai``
SDK, over the scripted engine of ``test_tool_calling_sdk`` (its replies come in 5-character
pieces when streamed, so tags are split across deltas): reasoning and content apart, tool
calls read from the content only, Qwen3's ``enable_thinking`` switch, gpt-oss's channels
(its requests keep special tokens), and constrained outputs split the same way (the engine
constrains what follows the reasoning)."""

from __future__ import annotations

import asyncio

import pytest

from tests.entrypoints.openai.test_tool_calling_sdk import (  # noqa: F401  (parts: the fixture)
    AUTO_REPLIES,
    CALLS,
    MESSAGES,
    REQUIRED_REPLY,
    TOOLS,
    _client as scripted_client,
    parts,
)

THINKING = "<think>The user wants weather and time.</think>"


def _client(parts, reasoning_parser, tool_parser=None):
    return scripted_client(parts, tool_parser, reasoning_parser=reasoning_parser)


async def _create(client, stream: bool, **kwargs):
    """(reasoning, content, [(name, arguments)], finish_reason) of one choice, streamed or not;
    a stream must send every reasoning piece before the first content piece."""
    model = (await client.models.list()).data[0].id
    if not stream:
        choice = (await client.chat.completions.create(model=model, messages=MESSAGES, **kwargs)).choices[0]
        message = choice.model_dump()["message"]
        assert message.get("reasoning_content") == message.get("reasoning")
        calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or []]
        return message.get("reasoning"), message["content"], calls, choice.finish_reason
    reasoning, content, calls, finish = None, None, [], None
    async for chunk in await client.chat.completions.create(model=model, messages=MESSAGES, stream=True, **kwargs):
        for choice in chunk.choices:
            delta = choice.delta.model_dump()
            assert delta.get("reasoning_content") == delta.get("reasoning")
            if delta.get("reasoning"):
                assert content is None and not calls, "reasoning after content"
                reasoning = (reasoning or "") + delta["reasoning"]
            if delta.get("content"):
                content = (content or "") + delta["content"]
            for call in choice.delta.tool_calls or []:
                if call.index == len(calls):
                    calls.append([call.function.name, ""])
                calls[call.index][1] += call.function.arguments or ""
            finish = choice.finish_reason or finish
    return reasoning, content, [tuple(call) for call in calls], finish


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_tool_calls_are_read_after_the_reasoning_only(parts, stream):
    engine, client = _client(parts, "deepseek_r1", "hermes")
    engine.reply = THINKING + AUTO_REPLIES["hermes"]
    reasoning, content, calls, finish = asyncio.run(_create(client, stream, tools=TOOLS))
    assert (reasoning, content.strip(), calls, finish) == (
        "The user wants weather and time.", "Checking.", CALLS, "tool_calls")

    call_in_thought = AUTO_REPLIES["hermes"].split("Checking.")[1]
    engine.reply = f"<think>{call_in_thought}</think>No call."
    assert asyncio.run(_create(client, stream, tools=TOOLS)) == (call_in_thought, "No call.", [], "stop")
    dropped = asyncio.run(_create(client, stream, tools=TOOLS, extra_body={"include_reasoning": False}))
    assert dropped == (None, "No call.", [], "stop")


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_qwen3_enable_thinking_false_is_all_content(parts, stream):
    engine, client = _client(parts, "qwen3")
    engine.reply = "<think>\nhm\n</think>\n\nSunny."
    assert asyncio.run(_create(client, stream)) == ("\nhm\n", "\n\nSunny.", [], "stop")
    off = {"chat_template_kwargs": {"enable_thinking": False}}
    assert asyncio.run(_create(client, stream, extra_body=off)) == (None, engine.reply, [], "stop")


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_gpt_oss_channels_and_special_tokens(parts, stream):
    engine, client = _client(parts, "gpt_oss")
    engine.reply = (
        "<|channel|>analysis<|message|>Weather first.<|end|>"
        "<|start|>assistant<|channel|>final<|message|>It is sunny.<|return|>"
    )
    assert asyncio.run(_create(client, stream)) == ("Weather first.", "It is sunny.", [], "stop")
    assert engine.requests[-1].sampling_params.skip_special_tokens is False


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_constrained_output_follows_the_reasoning(parts, stream):
    """The engine starts the grammar where the reasoning ends: the reasoning comes apart and
    the content (tool calls, JSON) is what the constraint produced."""
    engine, client = _client(parts, "deepseek_r1")
    engine.reply = THINKING + REQUIRED_REPLY
    reasoning, content, calls, finish = asyncio.run(_create(client, stream, tools=TOOLS, tool_choice="required"))
    assert (reasoning, calls, finish) == ("The user wants weather and time.", CALLS, "tool_calls") and not content
    engine.reply = '<think>{"not": json</think>{"a": 1}'
    json_format = {"type": "json_object"}
    assert asyncio.run(_create(client, stream, response_format=json_format)) == ('{"not": json', '{"a": 1}', [], "stop")


def _tokens_until_reasoning_ends(parser_name, token_ids, tokenizer) -> int:
    """Usage's ``reasoning_tokens`` by its definition, token by token: the shortest prefix of
    the output that has left the reasoning."""
    from pagedllm.reasoning import ReasoningParserManager

    parser = ReasoningParserManager.get_reasoning_parser(parser_name)({})
    return next((k for k in range(len(token_ids) + 1)
                 if parser.is_reasoning_end(tokenizer.decode(token_ids[:k], skip_special_tokens=False))),
                len(token_ids))  # fmt: skip


def test_usage_counts_the_reasoning_tokens(parts):
    """``usage.completion_tokens_details.reasoning_tokens`` (OpenAI's field, vLLM's count) in a
    response and in a stream's usage chunk, and ``output_tokens_details.reasoning_tokens`` of
    the Responses API; absent without ``--reasoning-parser``."""
    engine, client = _client(parts, "deepseek_r1")
    engine.reply = THINKING + "Sunny, 21 degrees."
    tokenizer = parts.tokenizer
    whole = tokenizer.encode(engine.reply, add_special_tokens=False)
    pieces = [i for k in range(0, len(engine.reply), 5)
              for i in tokenizer.encode(engine.reply[k : k + 5], add_special_tokens=False)]  # fmt: skip

    async def run(client):
        model = (await client.models.list()).data[0].id
        response = await client.chat.completions.create(model=model, messages=MESSAGES)
        chunks = [c async for c in await client.chat.completions.create(
            model=model, messages=MESSAGES, stream=True, stream_options={"include_usage": True})]
        responses = await client.responses.create(model=model, input="Weather?")
        return response.usage, chunks[-1].usage, responses.usage

    usage, streamed, responses = asyncio.run(run(client))
    assert (usage.completion_tokens, streamed.completion_tokens) == (len(whole), len(pieces))
    expected = _tokens_until_reasoning_ends("deepseek_r1", whole, tokenizer)
    assert len(tokenizer.encode("The user wants weather and time.", add_special_tokens=False)) < expected < len(whole)
    assert usage.completion_tokens_details.reasoning_tokens == expected
    assert streamed.completion_tokens_details.reasoning_tokens == _tokens_until_reasoning_ends(
        "deepseek_r1", pieces, tokenizer)
    assert responses.output_tokens_details.reasoning_tokens == expected

    engine, plain = scripted_client(parts, None)
    engine.reply = THINKING + "Sunny."
    usage, streamed, responses = asyncio.run(run(plain))
    assert usage.completion_tokens_details is None and streamed.completion_tokens_details is None
    assert responses.output_tokens_details.reasoning_tokens == 0


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_gpt_oss_reads_the_channels_from_token_ids(parts, stream):
    """With gpt-oss's special tokens in the tokenizer, the channels come from the token ids
    (the engine's real ids, 3 tokens a piece when streamed): a "<|channel|>" or "<|end|>" the
    model typed as ordinary tokens is text of its message."""
    import types

    from pagedllm.engine.processor import Processor
    from pagedllm.outputs import CompletionOutput, RequestOutput
    from pagedllm.reasoning.harmony_tokens import MARKERS
    from pagedllm.sampling_params import RequestOutputKind
    from tests.fixtures.checkpoints import build_tokenizer
    from tests.reasoning.test_harmony_tokens import CONTENT, REASONING, _ids

    tokenizer = build_tokenizer()  # the tiny checkpoints' vocabulary, a new instance
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>", *MARKERS]})
    harmony_parts = types.SimpleNamespace(config=parts.config, tokenizer=tokenizer,
                                          processor=Processor(parts.config.model_config, tokenizer))
    engine, client = _client(harmony_parts, "gpt_oss")
    reply_ids = _ids(tokenizer, "<|channel|>", "analysis", "<|message|>", REASONING, "<|end|>", "<|start|>",
                     "assistant", "<|channel|>", "final", "<|message|>", CONTENT, "<|return|>")
    generate = engine.generate

    async def token_pieces(request, sampling_params, request_id, prompt_text=None, trace_headers=None):
        step = 3 if sampling_params.output_kind == RequestOutputKind.DELTA else len(reply_ids)
        sent = ""
        async for output in generate(request, sampling_params, request_id, prompt_text, trace_headers):
            if not output.finished:
                continue  # the scripted pieces are replaced by the token pieces below
            for start in range(0, len(reply_ids), step):
                ids = reply_ids[start : start + step]
                last = start + step >= len(reply_ids)
                text = tokenizer.decode(reply_ids[: start + len(ids)], skip_special_tokens=False).rstrip("\ufffd")
                pieces = [CompletionOutput(index=i, text=text[len(sent):], token_ids=ids,
                                           finish_reason="stop" if last else None) for i in range(sampling_params.n)]
                sent = text
                yield RequestOutput(request_id, prompt_text, output.prompt_token_ids, None, pieces, last)

    engine.generate = token_pieces
    engine.reply = "x"
    assert asyncio.run(_create(client, stream)) == (REASONING, CONTENT, [], "stop")
    assert engine.requests[-1].sampling_params.skip_special_tokens is False
