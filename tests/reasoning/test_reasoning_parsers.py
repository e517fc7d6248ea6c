"""The reasoning parsers on whole outputs (vLLM's answers) and on streams cut every way:
the joined deltas equal the non-streamed answer, a tag split across deltas included."""

from __future__ import annotations

import pytest

from pagedllm.reasoning import ReasoningParserManager, ReasoningStream

HARMONY = (
    "<|channel|>analysis<|message|>User greets. Reply.<|end|>"
    "<|start|>assistant<|channel|>final<|message|>Hello <there>!<|return|>"
)


def _parser(name: str, **chat_template_kwargs):
    return ReasoningParserManager.get_reasoning_parser(name)(chat_template_kwargs)


@pytest.mark.parametrize(
    "name, kwargs, text, expected",
    [
        ("deepseek_r1", {}, "<think>a < b</think>\n\nYes.", ("a < b", "\n\nYes.")),
        ("deepseek_r1", {}, "opened in the prompt</think>Yes.", ("opened in the prompt", "Yes.")),
        ("deepseek_r1", {}, "cut off by max_tokens", ("cut off by max_tokens", None)),
        ("deepseek_r1", {}, "done</think>", ("done", None)),
        ("qwen3", {}, "<think>\nhmm\n</think>\n\nSure.", ("\nhmm\n", "\n\nSure.")),
        ("qwen3", {"enable_thinking": False}, "Sure.", (None, "Sure.")),
        ("qwen3", {"enable_thinking": False}, "a</think>b", (None, "a</think>b")),
        ("qwen3", {"enable_thinking": True}, "still thinking", ("still thinking", None)),
        ("gpt_oss", {}, HARMONY, ("User greets. Reply.", "Hello <there>!")),
        ("gpt_oss", {}, "<|channel|>analysis<|message|>only thinking", ("only thinking", None)),
        (
            "gpt_oss", {},
            "<|channel|>commentary to=functions.f <|constrain|>json<|message|>{\"x\": 1}<|call|>",
            (None, '{"x": 1}'),
        ),
    ],
)  # fmt: skip
def test_extract_reasoning(name, kwargs, text, expected):
    assert _parser(name, **kwargs).extract_reasoning(text) == expected


@pytest.mark.parametrize(
    "name, text",
    [
        ("deepseek_r1", "<think>x <thin y</thi z</think> a </think> b"),
        ("qwen3", "<think>\nstep\n</think>\n\nanswer <"),
        ("gpt_oss", HARMONY),
    ],
)
def test_every_two_way_cut_streams_the_final_answer(name, text):
    final = _parser(name).parse(text, final=True)
    for cut in range(len(text) + 1):
        stream = ReasoningStream(_parser(name))
        pieces = [stream.feed(text[:cut], False), stream.feed(text[cut:], True)]
        assert "".join(piece[0] for piece in pieces) == final.reasoning, cut
        assert "".join(piece[1] for piece in pieces) == final.content, cut


def test_one_character_deltas_send_reasoning_then_content():
    stream = ReasoningStream(_parser("deepseek_r1"))
    text = "ab</think>cd"
    deltas = [stream.feed(char, index == len(text) - 1) for index, char in enumerate(text)]
    assert deltas == [("a", ""), ("b", "")] + [("", "")] * 8 + [("", "c"), ("", "d")]


def test_tags_split_across_tokens(tokenizer):
    """Token by token through the tiny byte-level tokenizer, where ``</think>`` is several
    tokens (as in any tokenizer without the tag in its vocabulary)."""
    text = "<think>Paris is big.</think>It is in France."
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert len(tokenizer.encode("</think>", add_special_tokens=False)) > 1
    stream = ReasoningStream(_parser("qwen3"))
    pieces, previous = [], ""
    for count in range(1, len(ids) + 1):
        current = tokenizer.decode(ids[:count])
        pieces.append(stream.feed(current[len(previous) :], count == len(ids)))
        previous = current
    assert "".join(p[0] for p in pieces) == "Paris is big."
    assert "".join(p[1] for p in pieces) == "It is in France."
    first_content = next(i for i, p in enumerate(pieces) if p[1])
    assert not any(p[0] for p in pieces[first_content:])


def test_unknown_name_lists_the_known_ones():
    with pytest.raises(KeyError, match=r"invalid reasoning parser: r2 \(chose from \{ deepseek_r1,gpt_oss,qwen3 \}\)"):
        ReasoningParserManager.get_reasoning_parser("r2")


def _first_end(parser, ids, tokenizer) -> int:
    """The definition, token by token: the shortest prefix that has left the reasoning."""
    for count in range(len(ids) + 1):
        if parser.is_reasoning_end(tokenizer.decode(ids[:count], skip_special_tokens=False)):
            return count
    return len(ids)


@pytest.mark.parametrize(
    "name, kwargs, text",
    [
        ("deepseek_r1", {}, "<think>Paris is big, and old.</think>It is in France."),
        ("deepseek_r1", {}, "opened in the prompt</think>Yes."),
        ("deepseek_r1", {}, "cut off by max_tokens, never closed"),
        ("qwen3", {}, "<think>\nhmm\n</think>\n\nSure."),
        ("qwen3", {"enable_thinking": False}, "Sure, at once."),
        ("gpt_oss", {}, HARMONY),
    ],
)  # fmt: skip
def test_reasoning_tokens_are_counted_up_to_where_the_reasoning_ends(tokenizer, name, kwargs, text):
    """``count_reasoning_tokens`` (usage's ``reasoning_tokens``) on the tiny byte-level
    tokenizer, where every tag is several tokens: equal to the token-by-token scan."""
    parser = _parser(name, **kwargs)
    ids = tokenizer.encode(text, add_special_tokens=False)
    count = parser.count_reasoning_tokens(ids, tokenizer)
    assert count == _first_end(parser, ids, tokenizer)
    reasoning = parser.extract_reasoning(text)[0]
    if reasoning is None:
        assert count == 0
    else:
        assert len(tokenizer.encode(reasoning, add_special_tokens=False)) <= count < len(ids) or "</think>" not in text
    assert parser.count_reasoning_tokens([], tokenizer) == 0
